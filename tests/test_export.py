"""mode: export (export.py) and generate.py --export: a checkpoint written as a Hugging Face folder (text tasks) or
as a safetensors state dict and a torch.export program (the CNN), loaded back by the ecosystem's own loaders and
compared with the checkpoint's model. Tiny models, a few training steps each, all in this process.
"""
import dataclasses
import json
import os
import re
import shutil

import pytest
import torch

from conftest import make_config, save_tiny_minilm

from core import checkpoint_hashes
from test_text_tasks import sample, task_config, train, write_nvidia_shard



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Synthetic text data for task_config: test_text_tasks' sst2 and gpt2 texts, and small NVIDIA-layout shards
    written directly (scripts/make_bert_shards.py has its own tests; here it would cost seconds)."""
    import random
    root = tmp_path_factory.mktemp("export_data")
    rng = random.Random(0)
    paths = {"sst2": sample.write_sst2(str(root / "sst2"), rng), "gpt2": sample.write_gpt2(str(root / "gpt2"), rng),
             "bert": str(root / "bert")}
    for seed, (split, n) in enumerate([("training", 32), ("test", 8)]):
        os.makedirs(root / "bert" / split)
        write_nvidia_shard(root / "bert" / split / "shard0.hdf5", n, 64, 10, seed)
    return paths


pytestmark = pytest.mark.usefixtures("hf_offline")  # (conftest.py)


def export(cfg, **export_section) -> int:
    """Run `mode: export` as main.py does; the config is copied (the caller's stays a training config)."""
    import dataclasses
    import main
    cfg = dataclasses.replace(cfg, mode="export", export=dataclasses.replace(cfg.export, **export_section))
    return main.run(cfg)


def checkpoint_model(cfg):
    """The task's model with the best checkpoint's weights, loaded as test mode loads it."""
    from core import checkpoint, checkpoint_meta
    from core import checkpoint_io
    from wiring import build_task
    task = build_task(cfg)
    task.prepare_inference(None)
    model = task.build_model()
    checkpoint_io.load_model(model, checkpoint_meta.best_recorded(cfg.output_dir), cfg)
    return task, model.eval()


def python_blocks(readme: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme, re.S)


# ---------------------------------------------------------------------------------------------------------------
# sst2: the MiniLM classifier through transformers.pipeline
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_minilm(tmp_path_factory):
    return save_tiny_minilm(tmp_path_factory.mktemp("tiny_minilm"))


def test_sst2_minilm_export_gives_test_mode_predictions_through_pipeline(data, tiny_minilm, tmp_path):
    import main
    from transformers import pipeline
    from tasks.sst2 import read_tsv
    cfg = task_config("sst2", data, tmp_path, max_steps=24)
    cfg.model.pretrained_dir = tiny_minilm
    train(cfg, 1)
    test_cfg = task_config("sst2", data, tmp_path)
    test_cfg.model.pretrained_dir, test_cfg.mode, test_cfg.test.splits = cfg.model.pretrained_dir, "test", ["dev"]
    assert main.run(test_cfg) == 0
    tested = json.load(open(tmp_path / "dev_results.json"))["metrics"]

    assert export(cfg) == 0
    folder = tmp_path / "export"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(os.listdir(folder))
    assert not [p for p in os.listdir(tmp_path) if ".part" in p]  # the temporary folder was renamed
    sentences, labels = read_tsv(os.path.join(data["sst2"], "dev.tsv"))
    pipe = pipeline("text-classification", model=str(folder), device="cpu")
    out = pipe(sentences, top_k=None, function_to_apply="none", truncation=True, batch_size=32)
    assert pipe.model.config.id2label == {0: "negative", 1: "positive"}
    exported = torch.tensor([[{s["label"]: s["score"] for s in row}[k] for k in ("negative", "positive")]
                             for row in out])

    task, model = checkpoint_model(cfg)  # the same sentences through our task's own batching
    dev = task.build_datasets()["dev"]
    with torch.no_grad():
        ours = task.logits(model, task.collate([dev[i] for i in range(len(dev))]))
    assert torch.allclose(exported, ours, atol=1e-4), (exported - ours).abs().max()
    preds = exported.argmax(-1)
    assert torch.equal(preds, ours.argmax(-1))
    accuracy = (preds == torch.tensor(labels)).double().mean().item()
    assert accuracy == pytest.approx(tested["accuracy"]) and tested["samples"] == len(sentences)
    assert len(set(preds.tolist())) == 2, "a classifier that says one label for everything proves little"


# ---------------------------------------------------------------------------------------------------------------
# gpt2_lm: AutoModelForCausalLM, generate.py --export, and a sharded (DCP) checkpoint
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, on purpose
def test_gpt2_export_loads_as_causal_lm_with_our_logits_and_generates(data, tmp_path, capsys):
    import generate
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cfg = task_config("gpt2_lm", data, tmp_path, max_steps=8)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, ema_decay=0.5))  # an ema.pt beside (unread)
    train(cfg, 1)
    assert export(cfg) == 0
    folder = str(tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    task, model = checkpoint_model(cfg)
    ids = torch.tensor([tok("the cat sat on the mat .")["input_ids"]])
    assert ids.tolist() == [task.tokenizer("the cat sat on the mat .")["input_ids"]]  # the training tokenizer
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, model(input_ids=ids).logits)

    params = tmp_path / "params.yml"
    params.write_text(yaml.safe_dump(cfg.to_dict()))
    args = ["--prompt", "the cat", "--max-new-tokens", "8", "--temperature", "0"]
    capsys.readouterr()
    assert generate.main(["--params", str(params), *args]) == 0
    from_checkpoint = capsys.readouterr().out
    assert generate.main(["--export", folder, *args]) == 0
    assert capsys.readouterr().out == from_checkpoint and from_checkpoint.strip().startswith("the cat")
    assert generate.main(["--params", str(params), "--set", "test.weights=ema", *args]) == 0
    assert "sampling from the weight average of" in capsys.readouterr().err  # said, as test mode says it
    assert generate.main(["--export", str(tmp_path), *args]) == 2  # not an export folder
    assert generate.main(["--export", folder, "--params", str(params), *args]) == 2  # one or the other
    (tmp_path / "classifier").mkdir()
    (tmp_path / "classifier" / "config.json").write_text('{"architectures": ["BertForSequenceClassification"]}')
    assert generate.main(["--export", str(tmp_path / "classifier"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 3 and "BertForSequenceClassification, not a causal language model" in err, err
    # Issue 40: a checkpoint without its file record is refused before any weight is read, unless on purpose.
    copy = tmp_path / "unrecorded" / "step-8"
    shutil.copytree(tmp_path / "checkpoints" / "step-8", copy)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["files"]
    (copy / "meta.json").write_text(json.dumps(meta))
    assert generate.main(["--params", str(params), "--checkpoint", str(copy), *args]) == 2
    assert capsys.readouterr().err == f"error: {copy}/meta.json: holds no record of the files (`files`: an older " \
        "version saved it), so they cannot be verified; to load it anyway, set allow_unverified: true\n"
    assert generate.main(["--params", str(params), "--checkpoint", str(copy), "--set", "allow_unverified=true",
                          *args]) == 0
    assert capsys.readouterr().out == from_checkpoint

    # A sharded checkpoint (a torch.distributed.checkpoint folder, as fsdp/oss/pipe write) exports the same weights.
    from core import checkpoint, checkpoint_meta
    import torch.distributed.checkpoint as dcp
    sharded = tmp_path / "sharded" / os.path.basename(checkpoint_meta.best_recorded(cfg.output_dir))
    shutil.copytree(checkpoint_meta.best_recorded(cfg.output_dir), sharded)
    dcp.save(torch.load(sharded / "model.pt", weights_only=True), checkpoint_id=str(sharded / "model_dcp"),
             no_dist=True)
    os.remove(sharded / "model.pt")
    meta = json.loads((sharded / "meta.json").read_text())  # made by hand: its record of the files made anew
    (sharded / "meta.json").write_text(json.dumps({**meta, "files": checkpoint_hashes.record(str(sharded))}))
    cfg.test.checkpoint = str(sharded)
    assert export(cfg, dir=str(tmp_path / "export-sharded")) == 0
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export-sharded"))
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), again.state_dict().values()))


# ---------------------------------------------------------------------------------------------------------------
# bert_pretrain: a BertForPreTraining folder
# ---------------------------------------------------------------------------------------------------------------
def test_bert_pretrain_exports_a_bert_for_pretraining(data, tmp_path, capsys):
    from transformers import BertForPreTraining
    cfg = task_config("bert_pretrain", data, tmp_path, max_steps=2)
    train(cfg, 1)
    capsys.readouterr()
    from transformers.utils import logging as hf_logging
    hf_logging.enable_progress_bar()  # as in a fresh process: nothing of a random BERT's loading turned it off
    assert export(cfg) == 0
    out = capsys.readouterr()
    assert "note: no tokenizer" in out.out  # the shards were tokenized elsewhere: said so
    assert "Writing model shards" not in out.err  # transformers' bar is off in an export's output too
    hf = BertForPreTraining.from_pretrained(str(tmp_path / "export"))
    _, model = checkpoint_model(cfg)
    ours = model.bert.state_dict()
    assert hf.state_dict().keys() == ours.keys()
    assert all(torch.equal(v, ours[k]) for k, v in hf.state_dict().items())


# ---------------------------------------------------------------------------------------------------------------
# image: a safetensors state dict with its loading snippet, and a torch.export program
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    """A CNN trained a few steps on digits, in this process."""
    out = tmp_path_factory.mktemp("cnn")
    cfg = make_config(out, train={"max_steps": 6, "epochs": 0, "eval_every": 0, "save_every": 0, "log_every": 3})
    train(cfg, 1)
    return cfg


def test_image_export_state_dict_and_program_give_the_checkpoints_outputs(cnn_run):
    from safetensors.torch import load_file
    assert export(cnn_run) == 0
    folder = os.path.join(cnn_run.output_dir, "export")
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.pt2", "model.safetensors"]
    task, model = checkpoint_model(cnn_run)
    images = task.build_datasets()["dev"].images[:7]
    with torch.no_grad():
        expected = model(images)
        program = torch.export.load(os.path.join(folder, "model.pt2")).module()
        assert torch.allclose(program(images), expected, atol=1e-6)
        assert torch.allclose(program(images[:1]), expected[:1], atol=1e-6)  # any batch size
        weights = load_file(os.path.join(folder, "model.safetensors"))
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
        # The README's snippets, run as a user would (from the trainer's folder), give the same logits.
        for code in python_blocks(open(os.path.join(folder, "README.md")).read()):
            scope = {"FOLDER": folder, "images": images}
            exec(code, scope)
            got = scope["logits"] if "logits" in scope else scope["model"](images)
            assert torch.allclose(got, expected, atol=1e-6)
    assert json.load(open(os.path.join(folder, "config.json")))["init"]["image_size"] == 8


def test_export_user_errors_are_one_line_exit_2(cnn_run, tmp_path, capsys):
    import main
    base = ["--set", f"output_dir={cnn_run.output_dir}", "--set", "mode=export", "--set", "log.progress_bar=false"]
    cases = [
        (["--set", f"output_dir={tmp_path / 'empty'}", "--set", "mode=export"], "no complete checkpoint to export"),
        ([*base, "--set", "export.format=hf"], "export.format: task image cannot export as hf (a Hugging Face "
                                               "folder); it exports as state_dict"),
        ([*base, "--set", "task=gpt2_lm", "--set", "export.format=torch_export"], "task gpt2_lm cannot export as "
                                                                                 "torch_export"),
    ]
    os.makedirs(tmp_path / "taken")
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    cases.append(([*base, "--set", f"export.dir={tmp_path / 'taken'}"], "already exists; an export is never "
                                                                        "overwritten"))
    for argv, message in cases:
        capsys.readouterr()
        assert main.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert os.listdir(tmp_path / "taken") == ["keep.txt"]  # left alone


def test_a_task_without_export_formats_is_a_clear_error(cnn_run, tmp_path, monkeypatch, capsys):
    import main
    from tasks.image import ImageTask
    monkeypatch.setattr(ImageTask, "export_formats", ())  # a new task that did not say how it exports
    assert main.run(make_config(cnn_run.output_dir, mode="export", export={"dir": str(tmp_path / "out")})) == 2
    assert "error: mode: task image cannot be exported yet" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_failed_export_leaves_nothing_behind(cnn_run, tmp_path, monkeypatch):
    import wiring
    from extras import export as exporter

    def fail(folder, task, model):
        raise RuntimeError("disk full, say")
    monkeypatch.setattr(exporter, "write_torch_export", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        wiring.run_export(make_config(cnn_run.output_dir, mode="export", export={"dir": str(tmp_path / "out")}))
    assert os.listdir(tmp_path) == []  # neither the export nor its temporary folder


def test_an_export_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    """Like a checkpoint (checkpoint.durable_rename): every file and folder flushed, then the rename, then its
    parent, so a power loss never leaves an export with empty files under its final name."""
    from extras import export as exporter
    events, real_fsync, real_rename = [], os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a))), real_rename(a, b)))

    def write_files(folder):
        os.makedirs(os.path.join(folder, "sub"))
        for name in ("model.safetensors", "sub/tokenizer.json"):
            with open(os.path.join(folder, name), "w") as f:
                f.write("x")
    exporter.write_atomically(str(tmp_path / "export"), write_files)
    [at] = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    tmp, synced = events[at][1], {path for kind, path in events[:at] if kind == "fsync"}
    for name in ("model.safetensors", "sub/tokenizer.json", "sub", ""):
        assert os.path.normpath(os.path.join(tmp, name)) in synced, name
    assert ("fsync", str(tmp_path)) in events[at:]
    assert (tmp_path / "export" / "sub" / "tokenizer.json").read_text() == "x"
