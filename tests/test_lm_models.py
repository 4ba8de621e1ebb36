"""Model shape by configuration (issue 21, item 2) and tensor parallelism for the causal LM (issue 24):
model.arch (gpt2 | llama), layers, heads, width, bias, tie_embeddings for gpt2_lm and the BERT tasks
(tasks/lm_models.py). Parameter counts follow the formulas; bias: false trains no bias; llama trains, resumes
exactly, exports, generates, pipelines and splits over a tp group like GPT-2 and BERT do; refusals are one line."""
import os
import random
import re
import shutil
import sys
import types

import pytest
import torch

from conftest import ROOT, assert_test_mode_gives_the_logged_dev_loss, free_port, make_config, spawn

from core import checkpoint

from core import checkpoint_meta
from core import checkpoint_io
import main
from core.errors import CheckpointError, ConfigError
from resilience import resume
from tasks import lm_models
from wiring import build_task

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_sample_text_data as sample  # noqa: E402

TRAIN = {"optimizer": "sgd", "lr": 0.05, "max_steps": 6, "epochs": 0, "batch_size": 8, "eval_every": 3,
         "save_every": 3, "log_every": 1, "clip_grad_norm": 1.0, "keep_last": 5}
LLAMA = {"arch": "llama", "layers": 2, "heads": 4, "width": 32, "dropout": 0.0}
GPT2 = {"arch": "gpt2", "layers": 2, "heads": 4, "width": 32, "dropout": 0.0}
TP2 = {"strategy": "ddp", "tp": 2, "procs_per_node": 2}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return sample.write_gpt2(str(tmp_path_factory.mktemp("lm") / "gpt2"), random.Random(0))


def lm_config(out, data, model=None, dist=None, **train):
    return make_config(out, task="gpt2_lm", data={"data_dir": data, "max_length": 16}, model=model or LLAMA,
                       train={**TRAIN, **train}, dist=dist or {"strategy": "none"})


def build(**model):
    cfg = make_config("/tmp/unused", task="gpt2_lm", data={"max_length": 64}, model=model)
    return lm_models.build_causal_lm(cfg, vocab_size=65, eos_id=0)


def count(model, trainable=False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def state(out, step=6) -> dict:
    return checkpoint_io.model_state_dict(os.path.join(str(out), "checkpoints", f"step-{step}"))


def assert_same(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= tol, worst


def dev_loss(out, step=6) -> float:
    return checkpoint_meta.read(os.path.join(str(out), "checkpoints", f"step-{step}"))["metrics"]["loss"]


def resume_from(source, out, step=3) -> None:
    """`out` starts as a run that stopped after `source`'s step-`step` checkpoint."""
    os.makedirs(out / "checkpoints")
    shutil.copytree(source / "checkpoints" / f"step-{step}", out / "checkpoints" / f"step-{step}")
    shutil.copytree(source / "tokenizer", out / "tokenizer")


# ---- shapes -------------------------------------------------------------------------------------------------
def test_shapes_by_config_give_the_expected_parameter_counts():
    V, P, W, L = 65, 64, 128, 4  # nanoGPT's CPU "baby GPT": 4 layers, 4 heads, 128 wide, context 64
    block = 12 * W * W + 13 * W  # GPT-2: q|k|v, projection, 4W MLP (weights + biases), two LayerNorms
    gpt2 = build(arch="gpt2", layers=L, heads=4, width=W)
    assert count(gpt2) == V * W + P * W + L * block + 2 * W  # tied: the LM head is the token embedding
    assert count(build(arch="gpt2", layers=L, heads=4, width=W, tie_embeddings=False)) == count(gpt2) + V * W
    no_bias = build(arch="gpt2", layers=L, heads=4, width=W, bias=False)
    assert count(no_bias, trainable=True) == V * W + P * W + L * (12 * W * W + 2 * W) + W  # nanoGPT's bias=False
    assert count(no_bias, trainable=True) - P * W == 795_904  # what nanoGPT prints: "number of parameters: 0.80M"

    mlp = lm_models.swiglu_width(W)
    assert mlp == 384 and lm_models.swiglu_width(64) == 192
    llama = build(arch="llama", layers=L, heads=4, width=W)  # no positions table, no biases, RMSNorm weights only
    assert count(llama) == V * W + L * (4 * W * W + 3 * W * mlp + 2 * W) + W
    assert not [n for n, _ in llama.named_parameters() if n.endswith("bias")]
    assert count(build(arch="llama", layers=L, heads=4, width=W, bias=True)) == count(llama) + L * (4 * W + 2 * mlp
                                                                                                     + W)
    untied = build(arch="llama", layers=L, heads=4, width=W, tie_embeddings=False)
    assert count(untied) == count(llama) + V * W and untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert llama.config.num_attention_heads == 4 and llama.config.max_position_embeddings == P

    preset = build(name="tiny", layers=3)  # a key set over model.name's preset
    assert (preset.config.n_layer, preset.config.n_head, preset.config.n_embd) == (3, 2, 64)


def test_bert_tasks_take_the_shape_keys(tmp_path):
    from tasks.bert_pretrain import RANDOM_MODEL
    cfg = make_config(tmp_path, task="bert_pretrain", model={"name": "tiny", "layers": 3, "width": 32, "heads": 4})
    bert = build_task(cfg).build_model().bert
    c = bert.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.hidden_size, c.intermediate_size) == (3, 4, 32, 128)
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    cfg.model.tie_embeddings, cfg.model.bias = False, False
    untied = build_task(cfg).build_model().bert
    assert untied.cls.predictions.decoder.weight is not untied.bert.embeddings.word_embeddings.weight
    biases = [p for n, p in untied.named_parameters() if n.endswith("bias")]
    assert biases and not any(p.requires_grad or p.any() for p in biases)
    assert count(untied) - count(bert) == RANDOM_MODEL.vocab_size * 32 + RANDOM_MODEL.vocab_size  # head + its bias


def test_sst2_random_bart_takes_the_shape_keys(tmp_path):
    data = sample.write_sst2(str(tmp_path / "sst2"), random.Random(0))
    cfg = make_config(tmp_path / "run", task="sst2", data={"data_dir": data, "max_length": 32},
                      model={"name": "tiny", "layers": 1, "width": 32, "heads": 4})
    task = build_task(cfg)
    task.build_datasets()
    c = task.build_model().config
    assert (c.encoder_layers, c.decoder_layers, c.encoder_attention_heads, c.d_model, c.decoder_ffn_dim) == \
        (1, 1, 4, 32, 128)


# ---- refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task, model, dist, expected", [
    ("sst2", {"arch": "llama"}, {}, "`model.arch` is llama, but only gpt2_lm picks its architecture by it; "
                                    "remove it for sst2"),
    ("image", {"layers": 2}, {}, "`model.layers` is for the transformer tasks (gpt2_lm, bert_pretrain, sst2), not "
                                 "image; remove it"),
    ("sst2", {"tie_embeddings": False}, {}, "`model.tie_embeddings` is for models with an output layer over the "
                                            "vocabulary (gpt2_lm, bert_pretrain), not sst2's classifiers"),
    ("gpt2_lm", {"heads": 3, "width": 64}, {}, "`model.heads` (3) must divide model.width (64)"),
    ("gpt2_lm", {"arch": "mamba"}, {}, "`model.arch` must be one of gpt2, llama, resnet18, resnet34, resnet50, "
                                          "resnet101 or null, got 'mamba'"),
        ("gpt2_lm", {"arch": "resnet50"}, {}, "`model.arch` is resnet50, a ResNet of task image_folder; gpt2_lm takes "
                                              "gpt2 or llama"),
])
def test_keys_a_task_does_not_take_are_one_line(tmp_path, task, model, dist, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make_config(tmp_path, task=task, model=model, dist=dist)


def test_model_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("model.heads: 5 heads do not divide the width 768")):
        build(name="gpt2", heads=5)  # the preset's width
    with pytest.raises(ConfigError, match=re.escape("model.name: gpt2_lm builds gpt2, tiny, not 'cnn' (or set all "
                                                    "of model.layers, model.heads and model.width)")):
        build(layers=2)
    folder = str(tmp_path / "llama")
    build(**LLAMA).save_pretrained(folder)
    for model, expected in [({"layers": 3}, "model.layers is 3 but model.pretrained_dir's model has 2; set it to "
                                            "null (the folder's) or 2"),
                            ({"arch": "gpt2"}, "model.arch is gpt2 but model.pretrained_dir holds a llama model; "
                                               "set model.arch to null (or llama)"),
                            ({"bias": True}, "model.bias is True but model.pretrained_dir's model has False")]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            build(pretrained_dir=folder, **model)
    loaded = build(pretrained_dir=folder, layers=2, heads=4)  # keys equal to the folder's are fine
    assert isinstance(loaded, type(build(**LLAMA)))
    with pytest.raises(ConfigError, match=re.escape("dist.tp: 3 does not divide the model's 2 attention heads and "
                                                    "256 MLP units")):
        lm_models.tp_plan(build(name="tiny"), 3)  # GPT-2
    with pytest.raises(ConfigError, match=re.escape("dist.tp: 3 does not divide the model's 4 attention heads")):
        lm_models.tp_plan(build(**LLAMA), 3)


# ---- training -----------------------------------------------------------------------------------------------
def test_gpt2_without_bias_trains_none_and_llama_resumes_exactly(text, tmp_path):
    out = tmp_path / "gpt2"
    assert main.run(lm_config(out, text, {"name": "tiny", "bias": False, "dropout": 0.0}, max_steps=3)) == 0
    biases = {k: v for k, v in state(out, 3).items() if k.endswith("bias")}
    assert biases and all(not v.any() for v in biases.values())  # still zeros after 3 steps

    whole, resumed = tmp_path / "llama", tmp_path / "resumed"
    assert main.run(lm_config(whole, text)) == 0
    resume_from(whole, resumed)
    assert main.run(lm_config(resumed, text)) == 0
    assert "resumed from" in (resumed / "logs" / "rank0.log").read_text()
    assert_same(state(whole), state(resumed), 0.0)


def test_tie_embeddings_null_resumes_as_the_value_it_builds(text, tmp_path, capsys):
    """model.tie_embeddings null builds tied (the random GPT-2 and BERT) or model.pretrained_dir's choice: a resume
    with true over null (and null over true) is the same run, not another one's; false over true still is."""
    tiny = {**GPT2, "layers": 1}
    for saved, now in ((None, True), (True, None)):
        out = tmp_path / f"{saved}-{now}"
        assert main.run(lm_config(out, text, {**tiny, "tie_embeddings": saved}, max_steps=2, save_every=2)) == 0
        assert main.run(lm_config(out, text, {**tiny, "tie_embeddings": now}, max_steps=3, save_every=3)) == 0, \
            capsys.readouterr().err
        assert f"resumed from {out}/checkpoints/step-2" in capsys.readouterr().out
    assert main.run(lm_config(out, text, {**tiny, "tie_embeddings": False}, max_steps=4)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}/checkpoints/step-3: does not fit this model: ") and \
        err[0].endswith("it was saved with model.tie_embeddings=None (now False)"), err  # (an untied head more)
    untied = tmp_path / "untied"  # a pretrained folder's own choice is what null builds there
    build(**LLAMA, tie_embeddings=False).save_pretrained(untied)
    for folder, tied in ((untied, False), (None, True)):
        cfg = make_config(tmp_path, task="gpt2_lm", model={"pretrained_dir": folder and str(folder)})
        assert build_task(cfg).model_built(cfg.to_dict()["model"])["tie_embeddings"] is tied

def test_a_refused_model_change_shows_what_each_config_wrote(tmp_path):
    # Null was compared as the value it builds (right), and shown so too: "model.heads=2 (now 4)" where the saved
    # config said null. The refusal shows the values written; a key written the same in both is left out.
    tiny = {"name": "tiny", "arch": "gpt2"}
    cases = [({**tiny, "heads": None}, {**tiny, "heads": 4}, "model.heads=None (now 4)"),
             ({**tiny, "heads": 4}, {**tiny, "heads": None}, "model.heads=4 (now None)"),
             ({**tiny, "heads": None}, {"name": "gpt2", "arch": "gpt2", "heads": None}, "model.name='tiny' (now 'gpt2')"),
             ({**tiny, "heads": None}, {**tiny, "heads": 2}, None)]  # what null builds: the same run
    for saved, now, shown in cases:
        cfg = make_config(tmp_path, task="gpt2_lm", model=now)
        was = make_config(tmp_path, task="gpt2_lm", model=saved).to_dict()
        trainer = types.SimpleNamespace(cfg=cfg, train_cfg=cfg.train, task=build_task(cfg), batch_sizes=[8])
        if shown is None:
            resume.check_same_run(trainer, "step-2", {"config": was})
            continue
        with pytest.raises(CheckpointError) as e:
            resume.check_same_run(trainer, "step-2", {"config": was})
        assert str(e.value).startswith(f"step-2 was written by another run: {shown}; "), (saved, now, str(e.value))


@pytest.mark.slow
def test_null_model_shape_resumes_as_the_value_it_builds(text, tmp_path, capsys):
    """model.layers, heads, width, bias null build model.name's preset (tiny: 2, 2, 64, with biases): a resume that
    spells those values out (or the reverse) is the same run; it was refused as another run's ("model.layers=None
    (now 2), ..."). Another value is still another run, in one line, as each config wrote it."""
    out, preset = tmp_path / "run", {"name": "tiny", "arch": "gpt2", "dropout": 0.0}
    spelled = {**preset, "layers": 2, "heads": 2, "width": 64, "bias": True, "tie_embeddings": True}
    for step, model in ((2, preset), (3, spelled), (4, preset)):
        assert main.run(lm_config(out, text, model, max_steps=step, save_every=1)) == 0, capsys.readouterr().err
        if step > 2:
            assert f"resumed from {out}/checkpoints/step-{step - 1}" in capsys.readouterr().out
    assert main.run(lm_config(out, text, {**preset, "heads": 4}, max_steps=5)) == 2  # (the same tensors: it loads)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}/checkpoints/step-4 was written by another run: "
                                               "model.heads=None (now 4); "), err  # (as written: null)


@pytest.mark.slow
def test_llama_exports_generates_and_checkpoints_activations(text, tmp_path, capsys):
    """The export is a folder AutoModelForCausalLM reads with our logits; generate.py samples the same text from
    the checkpoint and from the export (past_key_values with rotary positions); activation checkpointing gives
    the same run."""
    import generate
    import yaml
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    cfg = lm_config(out, text, max_steps=3)
    assert main.run(cfg) == 0
    cfg.mode = "export"
    cfg.export.dir = str(tmp_path / "export")
    assert main.run(cfg) == 0
    hf = AutoModelForCausalLM.from_pretrained(cfg.export.dir).eval()
    task = build_task(cfg)
    task.load_tokenizer()
    model = task.build_model().eval()
    checkpoint_io.load_model(model, str(out / "checkpoints" / "step-3"), cfg)
    ids = torch.tensor([task.tokenizer("the cat sat on the mat .")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, model(input_ids=ids).logits)

    params = tmp_path / "params.yml"
    cfg.mode = "train"
    params.write_text(yaml.safe_dump(cfg.to_dict()))
    args = ["--prompt", "the cat", "--max-new-tokens", "24", "--temperature", "0"]  # past the 16-token context
    capsys.readouterr()
    assert generate.main(["--params", str(params), *args]) == 0
    from_checkpoint = capsys.readouterr().out
    assert generate.main(["--export", cfg.export.dir, *args]) == 0
    assert capsys.readouterr().out == from_checkpoint and from_checkpoint.strip().startswith("the cat")

    recomputed = tmp_path / "recomputed"
    assert main.run(lm_config(recomputed, text, {**LLAMA, "activation_checkpointing": True}, max_steps=3)) == 0
    assert_same(state(out, 3), state(recomputed, 3), 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("model", [LLAMA, {**LLAMA, "tie_embeddings": False, "bias": True}])
def test_llama_pipe_with_two_stages_equals_one_process(text, tmp_path, model):
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    assert main.run(lm_config(one, text, model, max_steps=3)) == 0
    assert main.run(lm_config(pipe, text, model, {"strategy": "pipe", "procs_per_node": 2, "pp_schedule": "gpipe"},
                              max_steps=3)) == 0
    a, b = state(one, 3), state(pipe, 3)
    assert_same(a, b, 1e-5)
    if model.get("tie_embeddings") is not False:  # both copies of the tied weight took the same updates
        assert torch.equal(b["lm_head.weight"], b["model.embed_tokens.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    {"strategy": "ddp", "tp": 2, "procs_per_node": 2},
    {"strategy": "fsdp", "tp": 2, "procs_per_node": 4},  # fsdp x tp, 2 x 2
])
def test_llama_tp_ends_where_one_process_does(text, tmp_path, layout):
    one, split = tmp_path / "one", tmp_path / "tp"
    assert main.run(lm_config(one, text)) == 0
    batch = 8 // (layout["procs_per_node"] // layout["tp"])
    assert main.run(lm_config(split, text, dist=layout, batch_size=batch)) == 0
    assert "x tp 2 (rank =" in (split / "logs" / "rank0.log").read_text()
    assert_same(state(one), state(split), 1e-5)
    losses = [checkpoint_meta.read(os.path.join(str(o), "checkpoints", "step-6"))["metrics"]["loss"]
              for o in (one, split)]
    assert abs(losses[0] - losses[1]) <= 1e-4 * losses[0]


@pytest.mark.slow
def test_gpt2_without_bias_under_fsdp_equals_one_process(text, tmp_path):
    """Frozen zero biases inside FSDP2's units: they stay zeros and the rest trains as in one process."""
    model = {"name": "tiny", "bias": False, "dropout": 0.0}
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    assert main.run(lm_config(one, text, model, max_steps=3)) == 0
    assert main.run(lm_config(sharded, text, model, {"strategy": "fsdp", "procs_per_node": 2}, batch_size=4,
                              max_steps=3)) == 0
    assert_same(state(one, 3), state(sharded, 3), 1e-5)


# ---- GPT-2 under tensor parallelism (tasks/gpt2_tp.py: c_attn split by heads) ---------------------------------
@pytest.fixture(scope="module")
def gpt2_one(text, tmp_path_factory):
    """GPT-2 in one process, 6 steps: where every layout must end."""
    out = tmp_path_factory.mktemp("gpt2_one")
    assert main.run(lm_config(out, text, GPT2)) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout, model", [
    (TP2, GPT2),
    ({"strategy": "fsdp", "tp": 2, "procs_per_node": 4}, GPT2),  # fsdp x tp, 2 x 2
    (TP2, {**GPT2, "bias": False}),  # frozen zero biases, c_attn's among them
])
def test_gpt2_tp_ends_where_one_process_does(text, gpt2_one, tmp_path, layout, model):
    one, split = gpt2_one, tmp_path / "tp"
    if model is not GPT2:
        one = tmp_path / "one"
        assert main.run(lm_config(one, text, model)) == 0
    batch = 8 // (layout["procs_per_node"] // layout["tp"])
    assert main.run(lm_config(split, text, model, layout, batch_size=batch)) == 0
    assert "x tp 2 (rank =" in (split / "logs" / "rank0.log").read_text()
    assert_same(state(one), state(split), 1e-5)
    assert abs(dev_loss(one) - dev_loss(split)) <= 1e-4 * dev_loss(one)


@pytest.mark.slow
def test_gpt2_tp_checkpoints_resume_anywhere_and_test_mode_reads_them(text, gpt2_one, tmp_path):
    """A tp=2 run's step-3 checkpoint (q|k|v written in the one-process layout) resumed in one process, under
    fsdp and under tp again (momentum included) ends where the uninterrupted one-process run does."""
    split = tmp_path / "tp"
    assert main.run(lm_config(split, text, GPT2, TP2)) == 0
    for name, layout, batch in [("to-one", None, 8), ("to-fsdp", {"strategy": "fsdp", "procs_per_node": 2}, 4),
                                ("to-tp", TP2, 8)]:
        out = tmp_path / name
        resume_from(split, out)
        assert main.run(lm_config(out, text, GPT2, layout, batch_size=batch)) == 0, name
        assert "resumed from" in (out / "logs" / "rank0.log").read_text()
        assert_same(state(gpt2_one), state(out), 1e-5)
    assert_test_mode_gives_the_logged_dev_loss(lm_config(split, text, GPT2))  # in one process


@pytest.mark.slow
@pytest.mark.parametrize("split, model", [
    ({"sequence_parallel": True}, GPT2),  # tied embeddings: the head stays whole
    ({"sequence_parallel": True, "loss_parallel": True}, {**GPT2, "tie_embeddings": False}),
])
def test_gpt2_sequence_and_loss_parallel_end_where_one_process_does(text, tmp_path, split, model):
    one, out = tmp_path / "one", tmp_path / "tp"
    assert main.run(lm_config(one, text, model)) == 0
    assert main.run(lm_config(out, text, model, {**TP2, **split})) == 0
    line = next(x for x in (out / "logs" / "rank0.log").read_text().splitlines() if "  tp with " in x)
    assert all(k.replace("_", " ") in line for k in split)
    assert_same(state(one), state(out), 1e-5)
    assert abs(dev_loss(one) - dev_loss(out)) <= 1e-4 * dev_loss(one)


def _count_gpt2_worker(rank, port, queue):
    """One rank of a tp=2 group: the collectives of one forward and of its backward, and the gradients' error."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build(**GPT2))
    whole, split = models
    parallelize_module(split, init_device_mesh("cpu", (2,)), lm_models.tp_plan(split, 2))
    ids = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    counts, losses = [], []
    for model in (split, whole):
        with CommDebugMode() as forward:
            loss = model(input_ids=ids, labels=ids).loss
        with CommDebugMode() as backward:
            loss.backward()
        counts.append([{str(k).split(".")[-1]: v for k, v in c.get_comm_counts().items()} for c in (forward, backward)])
        losses.append(loss.item())
    grads = {n: p.grad for n, p in whole.named_parameters()}
    worst = max((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).sub(grads[n]).abs().max().item()
                for n, p in split.named_parameters())
    queue.put((counts[0], abs(losses[0] - losses[1]), worst))
    dist.barrier()
    # Out at once, as main.py's ranks leave (core/process_end.py): gloo's teardown can abort at exit ("terminate
    # called without an active exception", SIGABRT: the clean-clone CI failed on it once), which is not under test.
    os._exit(0)


@pytest.mark.slow
def test_a_gpt2_block_costs_two_all_reduces_each_way_and_a_small_all_gather():
    """c_attn split by heads needs no communication: per block, forward all-reduces the attention and MLP outputs,
    backward the input gradients of c_attn and c_fc, and gathers c_attn's (whole) bias gradient."""
    import torch.multiprocessing as mp
    queue = mp.get_context("spawn").SimpleQueue()
    spawn(_count_gpt2_worker, args=(free_port(), queue), nprocs=2)
    for (forward, backward), loss_error, grad_error in [queue.get() for _ in range(2)]:
        assert forward == {"all_reduce": 2 * GPT2["layers"]}, forward
        assert backward == {"all_reduce": 2 * GPT2["layers"], "all_gather_into_tensor": GPT2["layers"]}, backward
        assert loss_error < 1e-6 and grad_error < 1e-6, (loss_error, grad_error)
