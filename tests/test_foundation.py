"""The foundation: config checks, training on digits, DDP == one process, resume, crash safety, test mode, IDX."""
import glob
import gzip
import hashlib
import json
import os
import re
import socket
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT, load_model_state, make_config, max_diff, run_ranks

from core import checkpoint

from core import checkpoint_meta
import main
from wiring import checked_config
from core.errors import ConfigError, DataError


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "main.py", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key, words", [
    (["train.lr_rate=0.1"], "train.lr_rate", "did you mean `train.lr`"),
    (["trian.lr=0.1"], "trian", "did you mean `train`"),
    (["train.lr=fast"], "train.lr", "must be a number"),
    (["train.lr=-1"], "train.lr", "must be > 0"),
    (["train.precision=fp8"], "train.precision", "one of fp32, fp16, bf16"),
    (["dist.strategy=dp", "dist.procs_per_node=2"], "dist.strategy", "one process"),
    (["dist.strategy=ddp", "dist.nodes=2"], "dist.master_addr", "must be set"),
    (["dist.strategy=ddp", "dist.nodes=2", "dist.master_addr=10.0.0.1", "dist.node_rank=2"], "dist.node_rank", ""),
    (["dist.strategy=none", "dist.procs_per_node=2"], "dist.strategy", "use ddp"),
    (["train.batch_size=[8, 8, 8]", "dist.strategy=ddp", "dist.procs_per_node=2"], "train.batch_size", "3"),
    (["task=imag"], "task", "did you mean 'image'"),
    (["model.pretrained_dir=pretrained/nope"], "model.pretrained_dir", "download_pretrained.py"),
    (["train=3", "train.lr=0.1"], "train", "is a section; set one of its keys: train.KEY=VALUE"),
])
def test_config_errors_exit_2_naming_the_key(overrides, key, words):
    args = ["--params", "parameters.yml"]
    for o in overrides:
        args += ["--set", o]
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert f"`{key}`" in r.stderr and words in r.stderr, r.stderr
    assert r.stderr.startswith("error: parameters.yml + --set: ") or r.stderr.startswith("error: --set "), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_preset_whose_pretrained_folder_is_missing_names_what_to_download(tmp_path, monkeypatch):
    """configs/sst2_bart.yml without its download said "fetch one with scripts/download_pretrained.py": not which
    model, nor where; the line now gives the command, with the folder the config reads."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        checked_config(os.path.join(ROOT, "configs", "sst2_bart.yml"))
    assert "python scripts/download_pretrained.py HUB_ID pretrained/bart-base" in str(e.value)
    assert "facebook/bart-base" in str(e.value) and len(str(e.value).splitlines()) == 1
    with pytest.raises(ConfigError, match="download_pretrained.py HUB_ID pretrained/gpt2;"):
        checked_config(os.path.join(ROOT, "configs", "gpt2_lm.yml"), ["model.pretrained_dir=pretrained/gpt2"])


def test_yaml_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "p.yml"
    bad.write_text("train:\n  lr: 0.1\n   epochs: 3\n")
    with pytest.raises(ConfigError, match=r"p.yml: line \d+"):
        checked_config(str(bad))
    with pytest.raises(ConfigError, match="missing.yml: file not found"):
        checked_config(str(tmp_path / "missing.yml"))
    with pytest.raises(ConfigError, match="a folder, not a YAML file"):  # --params configs
        checked_config(str(tmp_path))
    with pytest.raises(ConfigError, match="/dev/null: not a regular file"):  # it exists: not "file not found"
        checked_config("/dev/null")
    (tmp_path / "model.pt").write_bytes(b"\x80\x02weights")  # --params given a checkpoint file
    with pytest.raises(ConfigError, match="model.pt: not valid YAML"):
        checked_config(str(tmp_path / "model.pt"))


def test_overrides_are_typed():
    cfg = checked_config(os.path.join(ROOT, "parameters.yml"),
                         ["train.lr=3e-4", "dist.procs_per_node=[2, 1]", "dist.nodes=2", "dist.strategy=ddp",
                          "dist.master_addr=10.1.2.3", "seed=7", "train.resume=false"])
    assert cfg.train.lr == 3e-4 and cfg.dist.procs_per_node == [2, 1] and cfg.seed == 7
    assert cfg.train.resume is False


def test_parameters_yml_documents_every_field():
    from core.config import SECTIONS, Config
    import dataclasses
    text = open(os.path.join(ROOT, "parameters.yml")).read()
    raw = yaml.safe_load(text)
    for f in dataclasses.fields(Config):
        assert f.name in raw, f"parameters.yml lacks `{f.name}`"
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name in raw[section], f"parameters.yml lacks `{section}.{f.name}`"
    for line in text.splitlines():
        if re.match(r"^\s*\w+:\s*\S", line):  # a key with a value: must carry a comment
            assert "#" in line, f"no comment on: {line}"
    checked_config(os.path.join(ROOT, "parameters.yml"))  # and it validates
    from extras import cli_help
    assert "parameters.yml lists every field with its default" in cli_help.epilog()  # --help says so


def test_parameters_yml_values_are_the_defaults_or_say_the_default():
    """--help: "parameters.yml lists every field with its default". Where the default job's value is not the
    schema's (what a params file that leaves the key out gets), its comment says the schema's: `default: X`."""
    from core.config import SECTIONS, Config
    import dataclasses
    comments, section = {}, None
    with open(os.path.join(ROOT, "parameters.yml")) as f:
        text = f.read()
    for line in text.splitlines():
        top = re.match(r"(\w+):", line)
        section = top.group(1) if top else section
        field = re.match(r"\s+(\w+):.*#(.*)", line)
        if field:
            comments[section, field.group(1)] = field.group(2)
    raw, defaults = yaml.safe_load(text), Config()
    unsaid = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            if raw[section][f.name] != default and f"default: {default}" not in comments[section, f.name]:
                unsaid.append(f"{section}.{f.name}: {raw[section][f.name]!r}, the schema's default {default!r}")
    assert not unsaid, "parameters.yml values that are not the defaults, unsaid:\n" + "\n".join(unsaid)


def test_customization_points_are_marked():
    for path in ["trainer.py", "wiring.py", "core/optimizers.py", "tasks/base.py", "tasks/image.py"]:
        text = open(os.path.join(ROOT, path)).read()
        assert re.search(r"# ----->\s*\S", text), f"{path} lost its `# ----->` customization marker"
    base = open(os.path.join(ROOT, "tasks", "base.py")).read()  # the Task methods a new task writes first
    for method in ("build_model", "build_datasets"):
        assert re.search(rf"# ----->.*\n\s*def {method}\(", base), f"tasks/base.py: `{method}` lost its marker"


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def test_default_job_reaches_97_percent(tmp_path):
    """The README's first command, as shipped: parameters.yml on digits."""
    r = run_cli("--params", "parameters.yml", "--set", f"output_dir={tmp_path}", "--set", "log.progress_bar=false")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "world size 1" in r.stdout and "global batch 32" in r.stdout  # the plan
    best = checkpoint_meta.best_recorded(str(tmp_path))
    assert checkpoint_meta.read(best)["metrics"]["accuracy"] >= 0.97
    assert os.path.isfile(tmp_path / "config.yml") and os.path.isfile(tmp_path / "logs" / "rank0.log")
    assert glob.glob(str(tmp_path / "tensorboard" / "events.*"))


def test_loss_falls_and_accuracy_rises(tmp_path):
    from core import process_group
    from wiring import build_task
    from wiring import build_trainer
    cfg = make_config(tmp_path, train={"max_steps": 80, "eval_every": 0, "save_every": 0, "lr": 3e-3})
    trainer = build_trainer(cfg, process_group.init(cfg, 0, 1, 0))
    before = trainer.evaluate("dev")
    after = trainer.train()
    assert after["loss"] < 0.5 * before["loss"]
    assert after["accuracy"] > before["accuracy"] + 0.5 and after["samples"] == before["samples"] == 225


def test_ddp_matches_one_process_on_the_combined_batch(tmp_path):
    common = dict(model={"dropout": 0.0}, train={"max_steps": 8, "eval_every": 0, "save_every": 0, "lr": 3e-3})
    ddp = make_config(tmp_path / "ddp", dist={"strategy": "ddp", "procs_per_node": 2},
                      **{**common, "train": {**common["train"], "batch_size": 16}})
    one = make_config(tmp_path / "one", **{**common, "train": {**common["train"], "batch_size": 32}})
    ranks = run_ranks(ddp, 2, tmp_path / "ddp-params")
    assert max_diff(ranks[0], ranks[1]) == 0.0  # replicas identical
    assert main.run(one) == 0
    single = load_model_state(tmp_path / "one", 8)
    assert max_diff(ranks[0], single) < 1e-5
    assert max_diff(single, load_model_state(tmp_path / "ddp", 8)) < 1e-5  # what rank 0 saved
    torch.manual_seed(42)  # the parameters moved away from their initial values: the check is not vacuous
    from tasks.image import Net
    assert max_diff(single, Net(8, dropout=0.0).state_dict()) > 1e-3


def test_grad_accumulation_equals_the_big_batch(tmp_path):
    common = {"max_steps": 6, "eval_every": 0, "save_every": 0}
    acc = make_config(tmp_path / "acc", model={"dropout": 0.0},
                      train={**common, "batch_size": 8, "grad_accum_steps": 4})
    big = make_config(tmp_path / "big", model={"dropout": 0.0}, train={**common, "batch_size": 32})
    assert main.run(acc) == 0 and main.run(big) == 0
    assert max_diff(load_model_state(tmp_path / "acc", 6), load_model_state(tmp_path / "big", 6)) < 1e-5


def test_an_epoch_limited_run_with_accumulation_ends_with_the_epoch(tmp_path):
    """epochs=1, 20 micro-batches of 64 and accumulation 3: the 7th step took a micro-batch of the next epoch's
    order. Now it takes the epoch's last 2 (weighted by their samples): the run is the 192-sample-batch run, whose
    last batch is the same 120 samples; a resume at step 4 ends on the same parameters."""
    common = {"epochs": 1, "max_steps": 0, "eval_every": 0, "save_every": 4, "keep_last": 5, "log_every": 1}
    acc = make_config(tmp_path / "acc", model={"dropout": 0.0},
                      train={**common, "batch_size": 64, "grad_accum_steps": 3})
    big = make_config(tmp_path / "big", model={"dropout": 0.0}, train={**common, "batch_size": 192})
    assert main.run(acc) == 0 and main.run(big) == 0
    state = checkpoint_meta.read(str(tmp_path / "acc" / "checkpoints" / "step-7"))["state"]
    assert (state["step"], state["epoch"], state["sample_in_epoch"]) == (7, 0, 1272)  # the epoch, no more
    assert max_diff(load_model_state(tmp_path / "acc", 7), load_model_state(tmp_path / "big", 7)) < 1e-5
    os.makedirs(tmp_path / "resumed" / "checkpoints")
    shutil.copytree(tmp_path / "acc" / "checkpoints" / "step-4", tmp_path / "resumed" / "checkpoints" / "step-4")
    assert main.run(make_config(tmp_path / "resumed", model={"dropout": 0.0},
                                train={**common, "batch_size": 64, "grad_accum_steps": 3})) == 0
    a, b = load_model_state(tmp_path / "acc", 7), load_model_state(tmp_path / "resumed", 7)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_an_epoch_limited_run_with_accumulation_under_ddp_is_one_process_run(tmp_path):
    """The shorter last step (above) on 2 ranks of 32: each takes its share of the epoch's last 2 micro-batches
    (the last one 28 + 28 of 56 samples) and ends where one process of 64 ends."""
    common = {"epochs": 1, "max_steps": 0, "eval_every": 0, "save_every": 0, "grad_accum_steps": 3}
    ddp = make_config(tmp_path / "ddp", model={"dropout": 0.0}, dist={"strategy": "ddp", "procs_per_node": 2},
                      train={**common, "batch_size": 32})
    one = make_config(tmp_path / "one", model={"dropout": 0.0}, train={**common, "batch_size": 64})
    ranks = run_ranks(ddp, 2, tmp_path / "ddp-params")
    assert main.run(one) == 0
    state = checkpoint_meta.read(str(tmp_path / "ddp" / "checkpoints" / "step-7"))["state"]
    assert (state["epoch"], state["sample_in_epoch"]) == (0, 1272)
    assert max_diff(ranks[0], load_model_state(tmp_path / "one", 7)) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, precision):
    cfg = make_config(tmp_path, train={"max_steps": 30, "eval_every": 0, "precision": precision, "lr": 3e-3})
    assert main.run(cfg) == 0
    meta = checkpoint_meta.read(checkpoint.latest(str(tmp_path)))
    assert meta["metrics"]["accuracy"] > 0.5
    state = torch.load(tmp_path / "checkpoints" / "step-30" / "state.pt", weights_only=True)
    assert (state["scaler"] is not None) == (precision == "fp16")


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints and resume
# ---------------------------------------------------------------------------------------------------------------
def test_resume_mid_epoch_is_bit_exact(tmp_path):
    """50 steps cross an epoch boundary (40 batches per epoch); resume at step 15, mid-epoch, dropout on."""
    train = {"max_steps": 50, "save_every": 15, "eval_every": 25, "keep_last": 10}
    full = make_config(tmp_path / "full", train=train)
    assert main.run(full) == 0
    resumed_dir = tmp_path / "resumed"
    os.makedirs(resumed_dir / "checkpoints")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-15", resumed_dir / "checkpoints" / "step-15")
    resumed = make_config(resumed_dir, train=train)
    assert main.run(resumed) == 0
    a, b = load_model_state(tmp_path / "full", 50), load_model_state(resumed_dir, 50)
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa = torch.load(tmp_path / "full/checkpoints/step-50/optimizer.pt", weights_only=True)
    ob = torch.load(resumed_dir / "checkpoints/step-50/optimizer.pt", weights_only=True)
    assert all(torch.equal(oa["state"][i]["exp_avg"], ob["state"][i]["exp_avg"]) for i in oa["state"])
    assert not torch.equal(a["fc2.weight"], load_model_state(tmp_path / "full", 15)["fc2.weight"])
    meta = checkpoint_meta.read(str(resumed_dir / "checkpoints" / "step-15"))
    assert meta["state"]["epoch"] == 0 and meta["state"]["batch_in_epoch"] == 15


def test_early_stopping_after_patience_evaluations(tmp_path):
    # A learning rate this small leaves dev accuracy where it is: the 2nd and 3rd evaluations do not improve.
    cfg = make_config(tmp_path, train={"max_steps": 100, "eval_every": 5, "save_every": 0, "patience": 2,
                                       "lr": 1e-12, "schedule": "constant"})
    assert main.run(cfg) == 0
    meta = checkpoint_meta.read(checkpoint.latest(str(tmp_path)))
    assert meta["step"] == 15 and meta["state"]["best_step"] == 5
    assert meta["state"]["evals_without_improvement"] == 2
    assert checkpoint_meta.best_recorded(str(tmp_path)).endswith("step-5")  # kept, and found as the best


def test_unknown_best_metric_is_a_one_line_error(tmp_path, capsys):
    cfg = make_config(tmp_path, train={"max_steps": 4, "eval_every": 2, "best_metric": "acc"})
    assert main.run(cfg) == 2
    err = capsys.readouterr().err.strip()
    assert "`train.best_metric` is 'acc', not among the dev metrics (loss, accuracy" in err
    assert len(err.splitlines()) == 1


# One uninterrupted 2-rank DDP run (dropout on, TensorBoard on), trained once for the module: the resume test
# below resumes a copy of its step-7 and must end on it; the test-mode test evaluates its best checkpoint.
DDP_RUN = {"dist": {"strategy": "ddp", "procs_per_node": 2}, "log": {"tensorboard": True},
           "train": {"max_steps": 20, "save_every": 7, "eval_every": 10, "keep_last": 5, "batch_size": 16}}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp-run")
    assert main.run(make_config(out, **DDP_RUN)) == 0
    return out


def test_ddp_resume_restores_every_ranks_random_stream(ddp_run, tmp_path):
    """Two ranks with dropout on: each rank's RNG must come back, or rank 1's masks (and the result) change."""
    os.makedirs(tmp_path / "resumed" / "checkpoints")
    shutil.copytree(ddp_run / "checkpoints/step-7", tmp_path / "resumed/checkpoints/step-7")
    assert main.run(make_config(tmp_path / "resumed", **DDP_RUN)) == 0
    log = open(tmp_path / "resumed" / "logs" / "rank0.log").read()
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoints' / 'step-7'}" in log  # not trained from scratch
    a, b = load_model_state(ddp_run, 20), load_model_state(tmp_path / "resumed", 20)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rng = torch.load(ddp_run / "checkpoints/step-7/state.pt", weights_only=True)["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])


def test_data_loader_workers_do_not_change_the_run(tmp_path):
    runs = []
    for workers in (0, 2):
        cfg = make_config(tmp_path / f"w{workers}", data={"num_workers": workers},
                          train={"max_steps": 6, "eval_every": 6, "save_every": 0})
        assert main.run(cfg) == 0
        runs.append(load_model_state(tmp_path / f"w{workers}", 6))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_keep_last_and_best(tmp_path):
    cfg = make_config(tmp_path, train={"max_steps": 40, "save_every": 5, "eval_every": 5, "keep_last": 2})
    assert main.run(cfg) == 0
    steps = [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))]
    best_step = checkpoint_meta.read(checkpoint.latest(str(tmp_path)))["state"]["best_step"]
    assert steps[-2:] == [35, 40] and set(steps) == {35, 40, best_step}
    assert checkpoint_meta.best_recorded(str(tmp_path)).endswith(f"step-{best_step}")


def test_crash_during_save_leaves_last_checkpoint_usable(tmp_path, monkeypatch, capsys):
    cfg = make_config(tmp_path, train={"max_steps": 20, "save_every": 10, "eval_every": 0})
    real_save = torch.save

    def failing_save(obj, path, *a, **k):
        if "step-20" in str(path) and str(path).endswith("optimizer.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    assert main.run(cfg) == 1  # a crash, reported with its rank, host and step (not a full disk: no ENOSPC)
    assert capsys.readouterr().err.startswith(f"rank 0 on {socket.gethostname()} failed saving step 20: OSError: "
                                              f"disk full (simulated)\nTraceback")
    monkeypatch.setattr(torch, "save", real_save)
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [10]
    assert glob.glob(str(tmp_path / "checkpoints" / ".tmp-step-20-*" / "model.pt"))  # the half-written one
    assert checkpoint.latest(str(tmp_path)).endswith("step-10")
    assert main.run(cfg) == 0  # resume: auto picks step-10 and finishes
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [10, 20]


def test_unreadable_checkpoint_is_a_clear_error(tmp_path, capsys):
    cfg = make_config(tmp_path, train={"max_steps": 5, "eval_every": 0})
    assert main.run(cfg) == 0
    with open(tmp_path / "checkpoints" / "step-5" / "optimizer.pt", "wb") as f:
        f.write(b"not a checkpoint")
    cfg = make_config(tmp_path, train={"max_steps": 10, "eval_every": 0})
    assert main.run(cfg) == 2
    err = capsys.readouterr().err
    assert "step-5/optimizer.pt: truncated (16 of " in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("change, words", [
    ({"model": {"hidden": 64}, "mode": "train"},
     ["does not fit this model: size mismatch for fc1.weight", "saved with model.hidden=128 (now 64)"]),
    ({"model": {"channels": 8}, "mode": "test"},
     ["does not fit this model: size mismatch for conv1.weight", "saved with model.channels=32 (now 8)"]),
    ({"train": {"optimizer": "sgd"}, "mode": "train"},
     ["holds adamw optimizer state, but train.optimizer is sgd", "train.start_over: true"]),
])
def test_checkpoint_of_another_model_is_a_one_line_error(tmp_path, capsys, change, words):
    """Resume or test with a changed model/optimizer setting: one line naming the checkpoint and the setting,
    not PyTorch's list of every mismatched tensor (or, for the optimizer, a KeyError at the first step)."""
    assert main.run(make_config(tmp_path, train={"max_steps": 3, "eval_every": 0, "optimizer": "adamw"})) == 0
    capsys.readouterr()
    train = {"max_steps": 6, "eval_every": 0, "optimizer": "adamw", **change.get("train", {})}
    assert main.run(make_config(tmp_path, mode=change["mode"], model=change.get("model", {}), train=train)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step-3: " in err and all(w in err for w in words), err


def test_test_mode_on_a_ddp_checkpoint_in_one_process(ddp_run, tmp_path):
    """The 2-rank run's best checkpoint (found in its output_dir, as `--set mode=test` does), in one process;
    the results go to a copy of that output_dir (the run itself stays as trained, for the other tests)."""
    shutil.copytree(ddp_run, tmp_path, dirs_exist_ok=True)
    best = checkpoint_meta.best_recorded(str(tmp_path))
    assert checkpoint_meta.read(best)["metrics"]  # an evaluated checkpoint (step 10 or 20)
    test_cfg = make_config(tmp_path, mode="test", dist={"strategy": "ddp", "procs_per_node": 2})
    assert main.run(test_cfg) == 0
    dev = json.load(open(tmp_path / "dev_results.json"))
    test = json.load(open(tmp_path / "test_results.json"))
    assert dev["checkpoint"] == os.path.abspath(best) and test["metrics"]["samples"] == 300
    # Exact distributed evaluation: 2 ranks during training scored dev exactly as 1 process does now.
    trained = checkpoint_meta.read(best)["metrics"]
    assert dev["metrics"]["samples"] == trained["samples"] == 225
    assert dev["metrics"]["accuracy"] == pytest.approx(trained["accuracy"], abs=1e-12)
    assert dev["metrics"]["loss"] == pytest.approx(trained["loss"], rel=1e-5)
    # (notebooks/inspect_run.ipynb is executed on a real run by tests/test_tutorial.py)


# ---------------------------------------------------------------------------------------------------------------
# MNIST IDX files
# ---------------------------------------------------------------------------------------------------------------
def write_idx(path, array):
    codes = {np.uint8: 0x08, np.int32: 0x0C, np.float32: 0x0D}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    body = array.astype(array.dtype.newbyteorder(">")).tobytes()
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
        f.write(header + body)


def test_idx_reader_on_written_files(tmp_path):
    from tasks.mnist import read_idx
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    floats = rng.standard_normal((3, 4)).astype(np.float32)
    for name, arr in [("a.idx", images), ("b.idx.gz", images), ("c.idx", floats)]:
        write_idx(str(tmp_path / name), arr)
        assert np.array_equal(read_idx(str(tmp_path / name)), arr)
    (tmp_path / "bad.idx").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(DataError, match="bad.idx: not an IDX file"):
        read_idx(str(tmp_path / "bad.idx"))
    (tmp_path / "short.idx").write_bytes((tmp_path / "a.idx").read_bytes()[:-10])
    with pytest.raises(DataError, match="short.idx: IDX header promises"):
        read_idx(str(tmp_path / "short.idx"))


def test_mnist_task_trains_from_idx_files_and_says_what_is_missing(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 400).astype(np.uint8)
    images = (rng.random((400, 28, 28)) * 40).astype(np.uint8)
    images[np.arange(400), labels * 2 + 3, 3:25] = 255  # a learnable stripe per class
    for split, n in [("train", 300), ("t10k", 100)]:
        sl = slice(0, n) if split == "train" else slice(300, 400)
        write_idx(str(tmp_path / f"{split}-images-idx3-ubyte.gz"), images[sl])
        write_idx(str(tmp_path / f"{split}-labels-idx1-ubyte"), labels[sl])
    cfg = make_config(tmp_path / "run", data={"dataset": "mnist", "data_dir": str(tmp_path), "download": False},
                      train={"max_steps": 30, "eval_every": 0, "lr": 3e-3})
    assert main.run(cfg) == 0
    assert checkpoint_meta.read(checkpoint.latest(str(tmp_path / "run")))["metrics"]["accuracy"] > 0.8
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = make_config(tmp_path / "run2", data={"dataset": "mnist", "data_dir": str(empty), "download": False})
    from wiring import build_task
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*missing.*data.data_dir"):
        build_task(missing).build_datasets()


def test_idx_reader_on_real_mnist(shared_data):
    from tasks.mnist import MNIST_FILES, load_mnist
    mnist = os.path.join(shared_data, "mnist")
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        digest = hashlib.md5(open(os.path.join(mnist, name + ".gz"), "rb").read()).hexdigest()
        assert digest == MNIST_FILES[name]
    images, labels = load_mnist(mnist, "t10k", download=False)
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8 and labels.shape == (10000,)
    assert np.bincount(labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert images.max() == 255 and 30 < images.mean() < 36  # MNIST's mean pixel is ~33


def test_digits_read_from_the_shipped_csv_equal_scikit_learns_loader():
    """read_digits skips importing sklearn.datasets (seconds per rank); it must return what load_digits does."""
    from sklearn.datasets import load_digits
    from tasks.image import read_digits
    images, target = read_digits()
    digits = load_digits()
    assert images.dtype == digits.images.dtype and target.dtype == digits.target.dtype
    assert np.array_equal(images, digits.images) and np.array_equal(target, digits.target)


def test_classification_metrics_equal_scikit_learns():
    """tasks.metrics.classification_metrics computes accuracy, F1 and MCC itself (sklearn.metrics costs seconds to
    import in every rank); the numbers must be scikit-learn's, degenerate cases included."""
    import warnings
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
    from tasks.metrics import classification_metrics
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, k, n), rng.integers(0, k, n)) for k in (2, 3, 10) for n in (1, 7, 500)]
    cases += [(np.ones(5), np.ones(5)), (np.zeros(6), np.ones(6)), (np.zeros(4), np.zeros(4)),  # one class
              (np.array([0, 0, 1]), np.array([0, 0, 0])), (np.array([2, 2, 3]), np.array([3, 2, 2])),
              (np.array([1, 1, 1, 0]), np.array([1, 0, 1, 1]))]
    for labels, preds in cases:
        for average in ("macro", "binary"):
            if average == "binary" and not set(np.union1d(labels, preds)) <= {0, 1}:
                continue
            got = classification_metrics(preds, labels, 3.0, len(labels), average=average)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # sklearn warns on undefined F1/MCC and returns 0
                want = {"accuracy": accuracy_score(labels, preds),
                        "f1": f1_score(labels, preds, average=average, zero_division=0.0),
                        "mcc": matthews_corrcoef(labels, preds)}
            for k, v in want.items():
                assert abs(got[k] - v) < 1e-12, (labels, preds, average, k, got[k], v)


def test_accumulation_micro_batches_run_under_the_wrappers_no_sync_and_the_last_one_syncs():
    """Strategy.forward_backward keeps DDP's gradients local (the model's no_sync(), as DDP and fairscale's wrappers
    have it) on every micro-batch but the last, whose backward all-reduces them; a plain module needs none."""
    import contextlib
    from core.distributed import DistContext
    from strategies.base import Strategy

    class Wrapper(torch.nn.Module):  # what forward_backward needs of DistributedDataParallel: forward, no_sync
        def __init__(self, module):
            super().__init__()
            self.module, self.syncing, self.backwards_synced = module, True, []

        def forward(self, x):
            out = self.module(x)
            out.register_hook(lambda g: self.backwards_synced.append(self.syncing))
            return out

        @contextlib.contextmanager
        def no_sync(self):
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True

    class Task:
        def loss_sum(self, model, batch):
            return model(batch["x"]).sum()

    raw = torch.nn.Linear(3, 1)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    batches = [{"x": torch.randn(2, 3)} for _ in range(3)]
    wrapped = Wrapper(raw)
    Strategy(wrapped, raw, torch.optim.SGD(raw.parameters(), lr=0.1), ctx).forward_backward(
        Task(), batches, 1.0, contextlib.nullcontext)
    assert wrapped.backwards_synced == [False, False, True]
    plain = Strategy(raw, raw, torch.optim.SGD(raw.parameters(), lr=0.1), ctx)
    assert isinstance(plain.no_sync(), contextlib.nullcontext)
