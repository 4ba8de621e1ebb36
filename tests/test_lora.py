"""LoRA through peft (model.lora_rank, tasks/lora.py): only the adapters and the classifier head train, checkpoints
hold only them plus a reference to the frozen base, resume is exact, none/ddp/fsdp agree, and `mode: export` writes
a merged Hugging Face folder that transformers.pipeline reads with test mode's predictions, and the adapter folder.
Tiny random models saved to temporary folders (MiniLM's real tokenizer), data written by the tests.
"""
import dataclasses
import json
import os
import re
import shutil

import pytest
import torch

from conftest import load_model_state, make_config, max_diff, save_tiny_minilm
from test_export import export  # mode: export as main.py runs it
from test_text_tasks import sample, task_config, train

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import random
    root = tmp_path_factory.mktemp("lora_data")
    rng = random.Random(0)
    return {"sst2": sample.write_sst2(str(root / "sst2"), rng), "gpt2": sample.write_gpt2(str(root / "gpt2"), rng),
            "bert": None}


pytestmark = pytest.mark.usefixtures("hf_offline")  # (conftest.py)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return save_tiny_minilm(tmp_path_factory.mktemp("tiny_bert"))


def lora_config(data, out, base, strategy="none", world=1, **train):
    """sst2 with LoRA on `base`; `data`: the data fixture, or the sst2 folder."""
    if isinstance(data, str):
        data = {"sst2": data, "gpt2": None, "bert": None}
    cfg = task_config("sst2", data, out, world, **{"max_steps": 8, "lr": 1e-2, **train})
    cfg.model.pretrained_dir = base
    for key, value in LORA.items():
        setattr(cfg.model, key, value)
    if strategy == "fsdp":
        cfg.dist.strategy = "fsdp"
    return cfg


def trainable(cfg):
    """The names that train in cfg's LoRA model, as the Trainer builds it."""
    from tasks import lora
    from wiring import build_task
    task = build_task(cfg)
    task.build_datasets()
    model = lora.adapt(task.build_model(), cfg)
    return {n for n, p in model.named_parameters() if p.requires_grad}, model


# ---------------------------------------------------------------------------------------------------------------
# Configuration: refused in one line where LoRA cannot run
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task, sections, match", [
    ("csv_text", {}, "csv_text has no pretrained transformer"),
    ("sst2", {"model": {"pretrained_dir": None}}, "set model.pretrained_dir"),
    ("sst2", {"dist": {"strategy": "pipe", "procs_per_node": 2, "pp_stages": 2}}, "not pipe"),
    ("sst2", {"dist": {"strategy": "oss", "procs_per_node": 2}}, "not oss"),
    ("sst2", {"model": {"lora_dropout": 1.0}}, "model.lora_dropout"),
    ("sst2", {"model": {"lora_targets": []}}, "model.lora_targets"),
])
def test_lora_refused_in_one_line(tmp_path, tiny_bert, task, sections, match):
    from core.errors import ConfigError
    model = {"pretrained_dir": tiny_bert, "lora_rank": 4, **sections.pop("model", {})}
    with pytest.raises(ConfigError, match=match) as e:
        make_config(tmp_path, task=task, model=model, data={"data_dir": str(tmp_path)}, **sections)
    assert "\n" not in str(e.value)


def test_unknown_target_names_the_linear_layers(data, tiny_bert, tmp_path):
    from core.errors import ConfigError
    cfg = lora_config(data, tmp_path, tiny_bert)
    cfg.model.lora_targets = ["query", "qkv"]
    with pytest.raises(ConfigError, match=r"model.lora_targets: qkv is no linear layer of "
                                          r"BertForSequenceClassification; its linear layers: query, key, value"):
        trainable(cfg)


# ---------------------------------------------------------------------------------------------------------------
# Training, checkpoints, exact resume
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_run(data, tiny_bert, tmp_path_factory):
    """8 LoRA steps in one process, checkpoints at 4 and 8."""
    import main
    out = tmp_path_factory.mktemp("lora_full")
    cfg = lora_config(data, out, tiny_bert, save_every=4, keep_last=5)
    assert main.run(cfg) == 0
    return cfg


def test_checkpoint_holds_only_what_trains_and_the_base(full_run, tiny_bert):
    from core import checkpoint
    from core import checkpoint_meta
    names, model = trainable(full_run)
    assert any(".lora_A." in n for n in names) and any(".lora_B." in n for n in names)
    assert {n for n in names if "lora_" not in n} == {"base_model.model.classifier.modules_to_save.default.weight",
                                                      "base_model.model.classifier.modules_to_save.default.bias"}
    saved = load_model_state(full_run.output_dir, 8)
    assert set(saved) == names  # adapters and the head, not the frozen base
    optimizer = torch.load(os.path.join(full_run.output_dir, "checkpoints", "step-8", "optimizer.pt"),
                           weights_only=True)
    assert len(optimizer["state"]) == len(names)  # the optimizer holds only what trains
    meta = checkpoint_meta.read(os.path.join(full_run.output_dir, "checkpoints", "step-8"))
    base = meta["lora_base"]
    assert base["pretrained_dir"] == os.path.abspath(tiny_bert) and base["files"] == ["model.safetensors"]
    assert base["bytes"] == os.path.getsize(os.path.join(tiny_bert, "model.safetensors")) and len(base["sha256"]) == 64
    start = dict(model.named_parameters())  # adapters were trained: lora_B starts at zero, it is not zero now
    assert all(saved[n].abs().sum() > 0 for n in names if ".lora_B." in n)
    assert all(torch.equal(start[n], torch.zeros_like(start[n])) for n in names if ".lora_B." in n)
    log = open(os.path.join(full_run.output_dir, "logs", "rank0.log")).read()
    line = next(x for x in log.splitlines() if "LoRA rank 4" in x)
    assert "on query, value, classifier whole" in line and "trainable parameters" in line, line


def test_resume_equals_the_uninterrupted_run(full_run, tmp_path):
    import main
    resumed = tmp_path / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(os.path.join(full_run.output_dir, "checkpoints", "step-4"), resumed / "checkpoints" / "step-4")
    cfg = lora_config(full_run.data.data_dir, resumed, full_run.model.pretrained_dir, save_every=4)
    assert main.run(cfg) == 0
    a, b = load_model_state(full_run.output_dir, 8), load_model_state(resumed, 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["base_model.model.classifier.modules_to_save.default.weight"],
                           load_model_state(full_run.output_dir, 4)[
                               "base_model.model.classifier.modules_to_save.default.weight"])


def test_a_pretrained_model_trains_with_its_dropout_and_evaluating_changes_nothing(data, tmp_path):
    """from_pretrained returns a model in eval mode: the Trainer must switch it to training (dropout on), and an
    evaluation mid-run must leave it as it was: with LoRA (peft's wrapper trains, the BERT inside was in eval
    mode), the first evaluation used to switch the dropouts on, so the result depended on eval_every."""
    import main
    from wiring import build_task
    from core import process_group
    from wiring import build_trainer
    base = save_tiny_minilm(tmp_path / "base", dropout=0.1)
    cfg = lora_config(data, tmp_path / "probe", base, max_steps=6)
    trainer = build_trainer(cfg, process_group.init(cfg, 0, 1, 0))
    dropouts = [m for m in trainer.strategy.raw_model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.training for m in dropouts)
    ends = []
    for name, every in [("no_eval", 0), ("eval_at_3", 3)]:
        cfg = lora_config(data, tmp_path / name, base, max_steps=6, eval_every=every, save_every=6)
        assert main.run(cfg) == 0
        ends.append(load_model_state(cfg.output_dir, 6))
    assert max_diff(*ends) == 0


def test_another_base_is_refused_in_one_line(full_run, tmp_path):
    """The same folder name with other weights (a re-downloaded or changed base): resume and test mode refuse."""
    import main
    from safetensors.torch import load_file, save_file
    other = tmp_path / "other_base"
    shutil.copytree(full_run.model.pretrained_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    name = next(k for k in weights if k.endswith("query.weight"))
    weights[name] = weights[name] + 0.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "run"
    os.makedirs(out / "checkpoints")
    shutil.copytree(os.path.join(full_run.output_dir, "checkpoints", "step-4"), out / "checkpoints" / "step-4")
    cfg = lora_config(full_run.data.data_dir, out, str(other))
    cfg.train.resume = str(out / "checkpoints" / "step-4")
    from core.errors import CheckpointError
    from wiring import build_task
    from wiring import build_trainer
    from core import process_group
    trainer = build_trainer(cfg, process_group.init(cfg, 0, 1, 0))
    with pytest.raises(CheckpointError, match=r"its LoRA adapters were trained on .*tiny_bert.* holds other "
                                              r"weights") as e:
        trainer.hooks.resume(trainer)
    assert "\n" not in str(e.value)
    cfg.mode, cfg.test.checkpoint = "test", str(out / "checkpoints" / "step-4")
    assert main.run(cfg) == 2  # test mode: the same one line, exit code 2


def test_full_checkpoint_is_refused_by_a_lora_run(data, tiny_bert, tmp_path):
    """A fine-tuning checkpoint (every weight) is not a LoRA one: refused, not half-loaded."""
    import main
    cfg = lora_config(data, tmp_path, tiny_bert, save_every=2, max_steps=2)
    cfg.model.lora_rank = 0
    assert main.run(cfg) == 0
    test_cfg = lora_config(data, tmp_path, tiny_bert)
    test_cfg.mode, test_cfg.test.splits = "test", ["dev"]
    from core import checkpoint_io
    from core.errors import CheckpointError
    _, model = trainable(test_cfg)
    with pytest.raises(CheckpointError, match="holds no LoRA base reference"):
        checkpoint_io.load_model(model, os.path.join(tmp_path, "checkpoints", "step-2"), test_cfg)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp_equal_one_process_and_resume(data, tiny_bert, full_run, tmp_path, strategy):
    """Two ranks of 8 equal one process of 16 (full_run's global batch): the frozen base under DDP, and under FSDP2
    with mixed requires_grad in every block; fsdp's sharded (DCP) checkpoint also resumes to the same end."""
    from core import checkpoint_io
    import main
    cfg = lora_config(data, tmp_path / "two", tiny_bert, strategy, world=2, batch_size=8, save_every=4,
                      keep_last=5)
    if strategy == "fsdp":
        cfg.dist.procs_per_node = 2
    assert main.run(cfg) == 0
    names, _ = trainable(cfg)
    step8 = os.path.join(cfg.output_dir, "checkpoints", "step-8")
    two = checkpoint_io.model_state_dict(step8)
    assert set(two) == names
    assert max_diff(two, load_model_state(full_run.output_dir, 8)) < 1e-5
    if strategy == "fsdp":  # resume the sharded step-4 checkpoint under fsdp
        out = tmp_path / "resumed"
        os.makedirs(out / "checkpoints")
        shutil.copytree(os.path.join(cfg.output_dir, "checkpoints", "step-4"), out / "checkpoints" / "step-4")
        cfg.output_dir = str(out)
        assert main.run(cfg) == 0
        resumed = checkpoint_io.model_state_dict(os.path.join(out, "checkpoints", "step-8"))
        assert max_diff(resumed, two) == 0


# ---------------------------------------------------------------------------------------------------------------
# mode: export: merged folder through transformers.pipeline, and the adapter through peft
# ---------------------------------------------------------------------------------------------------------------
def test_export_merged_folder_gives_test_mode_predictions(full_run, tmp_path):
    import dataclasses
    import main
    from transformers import pipeline
    from tasks.sst2 import read_tsv
    test_cfg = dataclasses.replace(full_run, mode="test", test=dataclasses.replace(full_run.test, splits=["dev"]))
    assert main.run(test_cfg) == 0
    tested = json.load(open(os.path.join(full_run.output_dir, "dev_results.json")))["metrics"]
    dest = tmp_path / "export"
    assert export(full_run, dir=str(dest)) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "adapter"} <= set(os.listdir(dest))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(dest / "adapter"))
    sentences, labels = read_tsv(os.path.join(full_run.data.data_dir, "dev.tsv"))
    pipe = pipeline("text-classification", model=str(dest), device="cpu")
    assert not any("lora" in n or "base_model" in n for n, _ in pipe.model.named_parameters())  # merged, plain
    out = pipe(sentences, top_k=None, function_to_apply="none", truncation=True, batch_size=32)
    exported = torch.tensor([[{s["label"]: s["score"] for s in row}[k] for k in ("negative", "positive")]
                             for row in out])
    preds = exported.argmax(-1)
    accuracy = (preds == torch.tensor(labels)).double().mean().item()
    assert accuracy == pytest.approx(tested["accuracy"]) and tested["samples"] == len(sentences)

    # The adapter folder over its base (named in adapter_config.json) gives the same logits as the merged folder.
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer
    adapted = AutoPeftModelForSequenceClassification.from_pretrained(str(dest / "adapter")).eval()
    tok = AutoTokenizer.from_pretrained(str(dest))
    batch = tok(sentences[:16], padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(adapted(**batch).logits, pipe.model(**batch).logits, atol=1e-5)
    # The README's snippet for it: the class names too (the base's config.json has none: LABEL_0; 3 classes would
    # not even load over its 2-output head).
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", open(dest / "README.md").read(), re.S)
                   if "AutoPeftModelForSequenceClassification" in b)
    scope = {"FOLDER": str(dest)}
    exec(snippet, scope)
    assert scope["model"].config.id2label == {0: "negative", 1: "positive"}
    assert scope["model"].config.label2id == {"negative": 0, "positive": 1}
    with torch.no_grad():
        assert torch.allclose(scope["model"].eval()(**batch).logits, pipe.model(**batch).logits, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# gpt2_lm: a causal LM's attention adapted (GPT-2's Conv1D c_attn), merged for AutoModelForCausalLM
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gpt2(data, tmp_path_factory):
    """A 2-layer GPT-2 of width 32 (random, as if pretrained) with a byte-level BPE trained on the test texts."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from tasks.text_common import train_tokenizer
    folder = tmp_path_factory.mktemp("tiny_gpt2")
    texts = json.load(open(os.path.join(data["gpt2"], "train.json")))
    tok = train_tokenizer(texts, "gpt2")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                               bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_gpt2_lora_trains_and_exports_a_causal_lm(data, tiny_gpt2, tmp_path):
    """peft's default for GPT-2 (c_attn, a Conv1D); the tied LM head stays frozen; the merged export computes the
    checkpoint's logits."""
    from core import checkpoint
    from core import checkpoint_io
    from transformers import AutoModelForCausalLM
    from tasks import lora
    from wiring import build_task
    cfg = task_config("gpt2_lm", data, tmp_path, max_steps=12, lr=1e-2, save_every=12)
    cfg.model.pretrained_dir, cfg.model.lora_rank = tiny_gpt2, 4
    losses = train(cfg, 1)
    assert losses[-1] < losses[0], losses
    saved = load_model_state(cfg.output_dir, 12)
    assert saved and all(".lora_" in k and "c_attn" in k for k in saved)
    assert export(cfg) == 0
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(cfg.output_dir, "export")).eval()
    task = build_task(cfg)
    task.load_tokenizer()
    ours = lora.adapt(task.build_model(), cfg)
    checkpoint_io.load_model(ours, checkpoint.latest(cfg.output_dir), cfg)
    ids = torch.tensor([[5, 9, 13, 2, 7, 30]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, ours.eval()(input_ids=ids).logits, atol=1e-5)


@pytest.mark.slow
def test_gpt2_lora_under_fsdp_saves_only_the_adapters_and_test_mode_reads_them(data, tiny_gpt2, tmp_path):
    # GPT-2's LM head is tied to the frozen token embedding: FSDP2's get_state_dict(ignore_frozen_params) dropped
    # the embedding's name but kept lm_head.weight, so the DCP folder held the whole matrix, and test mode, export
    # and generate.py refused the checkpoint ("holds base_model.model.lm_head.weight ...").
    import main
    from core import checkpoint_io
    cfg = task_config("gpt2_lm", data, tmp_path, max_steps=1, save_every=1, warmup=0)
    cfg.model.pretrained_dir, cfg.model.lora_rank, cfg.dist.strategy = tiny_gpt2, 4, "fsdp"
    assert main.run(cfg) == 0
    saved = checkpoint_io.model_state_dict(os.path.join(cfg.output_dir, "checkpoints", "step-1"))
    assert saved and all(".lora_" in k for k in saved), sorted(saved)
    assert main.run(dataclasses.replace(cfg, mode="test")) == 0
    cfg.train.max_steps = 2  # and fsdp resumes it (the tied head's name is not looked for in the folder)
    assert main.run(cfg) == 0
    assert "resumed from" in open(os.path.join(cfg.output_dir, "logs", "rank0.log")).read()


# ---------------------------------------------------------------------------------------------------------------
# sst2 on BART: peft's default q_proj/v_proj and the new classification_head whole; merged for pipeline
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bart(data, tmp_path_factory):
    """A 1+1-layer BART of width 32 (random, as if pretrained) with a byte-level BPE trained on the sentences."""
    from transformers import BartConfig, BartModel
    from tasks.sst2 import read_tsv
    from tasks.text_common import train_tokenizer
    folder = tmp_path_factory.mktemp("tiny_bart")
    tok = train_tokenizer(read_tsv(os.path.join(data["sst2"], "train.tsv"))[0], "bpe")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    BartModel(BartConfig(vocab_size=len(tok), d_model=32, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                         decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         decoder_start_token_id=tok.eos_token_id)).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow  # ~60 s: the MiniLM path keeps LoRA's export in the quick loop
def test_bart_lora_trains_checkpoints_what_trains_and_exports_for_pipeline(data, tiny_bart, tmp_path):
    import main
    from transformers import pipeline
    from tasks.sst2 import read_tsv
    cfg = lora_config(data, tmp_path / "run", tiny_bart, save_every=8)
    assert main.run(cfg) == 0
    names, model = trainable(cfg)
    assert {n.split(".")[-4] for n in names if ".lora_" in n} == {"q_proj", "v_proj"}
    assert {n for n in names if "lora_" not in n} == {
        f"base_model.model.classification_head.modules_to_save.default.{layer}.{p}"
        for layer in ("dense", "out_proj") for p in ("weight", "bias")}
    saved = load_model_state(cfg.output_dir, 8)
    assert set(saved) == names  # adapters and the head, not the frozen base
    assert all(saved[n].abs().sum() > 0 for n in names if ".lora_B." in n)  # trained (lora_B starts at zero)
    cfg.mode, cfg.test.splits = "test", ["dev"]
    assert main.run(cfg) == 0
    tested = json.load(open(os.path.join(cfg.output_dir, "dev_results.json")))["metrics"]
    cfg.mode = "train"
    dest = tmp_path / "export"
    assert export(cfg, dir=str(dest)) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(dest / "adapter"))
    sentences, labels = read_tsv(os.path.join(cfg.data.data_dir, "dev.tsv"))
    pipe = pipeline("text-classification", model=str(dest), device="cpu")
    assert not any("lora" in n or "base_model" in n for n, _ in pipe.model.named_parameters())  # merged, plain
    out = pipe(sentences, top_k=None, function_to_apply="none", truncation=True, batch_size=32)
    preds = torch.tensor([max(row, key=lambda s: s["score"])["label"] == "positive" for row in out]).long()
    assert (preds == torch.tensor(labels)).double().mean().item() == pytest.approx(tested["accuracy"])
