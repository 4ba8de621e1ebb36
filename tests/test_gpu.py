"""CUDA paths a CPU cannot run: fp16/bf16 autocast on CUDA, NCCL, FSDP2 and fairscale FSDP in mixed precision,
fairscale FSDP checkpoints. Everything skips without CUDA; tests with two ranks skip below two GPUs (NCCL cannot
put two ranks on one GPU). One rank of ddp/fsdp is a real NCCL process group of size 1: it runs the wrappers,
mixed-precision casts, loss scaling and checkpoint formats, not the communication between GPUs.

Each run trains the image CNN on digits for 60 steps and must: use CUDA (and NCCL where there is a group), keep
the loss finite and cut it at least in half (CPU: 2.13 -> 0.31), reach 0.85 dev accuracy (CPU, fp32/bf16/fp16:
0.90-0.91; from ~0.1 at init), and leave the checkpoint files of its strategy. The helpers take a device, so
they were checked on CPU (run_image with none/ddp/fsdp, resume_then_test with FSDP2 fp16; dropping the optimizer
state on resume fails it). Aimed at 5-20 s per test on an H100.
"""
import json
import math
import os
import re

import pytest
import torch

from conftest import logged, make_config

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
pytestmark = pytest.mark.skipif(not CUDA, reason="needs CUDA")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (one NCCL rank per GPU)")

STEPS = 60
TRAIN = {"max_steps": STEPS, "eval_every": 20, "save_every": 20, "keep_last": 5, "lr": 3e-3, "log_every": 10,
         "batch_size": 32}


def run_image(out, precision, dist=None, device="cuda", **train):
    """Train the image task; return (logged training losses, dev metrics per evaluated step)."""
    from main import run
    dist = {"strategy": "none", "procs_per_node": 1, "device": device, **(dist or {})}
    cfg = make_config(out, model={"dropout": 0.0}, dist=dist, train={**TRAIN, "precision": precision, **train})
    assert run(cfg) == 0
    log = open(os.path.join(out, "logs", "rank0.log")).read()
    backend = {"none": "-", "dp": "-"}.get(dist["strategy"], "nccl" if device == "cuda" else "gloo")
    assert f"backend {backend}, device {device}, precision {precision}" in log  # the plan: really on the GPU
    losses = logged(out, "loss")
    dev = {int(s): float(a) for s, a in re.findall(r"step (\d+) dev: .*?accuracy=(\S+)", log)}
    return losses, dev


def assert_learns(losses, dev):
    assert len(losses) == STEPS // TRAIN["log_every"] and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < 0.5 * losses[0], losses
    assert sorted(dev) == [20, 40, 60] and dev[60] >= 0.85 and dev[60] >= dev[20] - 0.02, dev


def checkpoint_files(out, step=STEPS):
    path = os.path.join(out, "checkpoints", f"step-{step}")
    return json.load(open(os.path.join(path, "meta.json"))), sorted(os.listdir(path)), \
        torch.load(os.path.join(path, "state.pt"), weights_only=True)


def assert_scaler(state, precision):
    """fp16 checkpoints carry the loss scaler (a finite scale > 0); bf16 ones none."""
    if precision == "fp16":
        assert state["scaler"] is not None and 0 < state["scaler"]["scale"] < math.inf
    else:
        assert state["scaler"] is None


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("strategy", ["none", "ddp"])
def test_amp_trains_on_one_gpu(tmp_path, strategy, precision):
    assert_learns(*run_image(tmp_path, precision, {"strategy": strategy}))
    meta, files, state = checkpoint_files(tmp_path)
    assert meta["format"] == "full" and "model.pt" in files and "optimizer.pt" in files
    assert_scaler(state, precision)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp2_mixed_precision_on_one_rank(tmp_path, precision):
    assert_learns(*run_image(tmp_path, precision, {"strategy": "fsdp"}, clip_grad_norm=1.0))
    meta, files, state = checkpoint_files(tmp_path)
    assert meta["format"] == "sharded-dcp" and {"model_dcp", "optimizer_dcp"} <= set(files)
    assert_scaler(state, precision)


FAIRSCALE = {"strategy": "fsdp", "fsdp_impl": "fairscale"}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fairscale_fsdp_mixed_precision_on_one_rank(tmp_path, precision):
    assert_learns(*run_image(tmp_path, precision, FAIRSCALE, clip_grad_norm=1.0))
    meta, files, state = checkpoint_files(tmp_path)
    assert meta["format"] == "sharded-fairscale" and {"model.pt", "optimizer-rank0.pt"} <= set(files)
    assert_scaler(state, precision)
    params = torch.load(os.path.join(tmp_path, "checkpoints", f"step-{STEPS}", "model.pt"), weights_only=True)
    assert all(torch.isfinite(v.float()).all() for v in params.values())


def test_fairscale_fsdp_checkpoint_resume_and_test_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # the two runs must be comparable
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    resume_then_test(tmp_path, FAIRSCALE, "fp16")


def resume_then_test(tmp_path, dist, precision, device="cuda"):
    """Save at step 20, resume in a new directory, finish; the result matches the uninterrupted run; test mode
    (one process, strategy none) reads the checkpoint and scores dev as training did."""
    from core.checkpoint_meta import best_recorded as best, read as read_meta
    from core.checkpoint_io import model_state_dict
    from main import run
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert_learns(*run_image(full, precision, dist, device))
    losses, _ = run_image(resumed, precision, dist, device, resume=str(full / "checkpoints" / "step-20"))
    assert "resumed from" in (resumed / "logs" / "rank0.log").read_text() and len(losses) == 4  # steps 30..60
    a, b = (model_state_dict(str(d / "checkpoints" / "step-60")) for d in (full, resumed))
    start = model_state_dict(str(full / "checkpoints" / "step-20"))
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-4
    assert max((a[k].float() - start[k].float()).abs().max().item() for k in a) > 1e-2  # it did train on
    test_cfg = make_config(resumed, mode="test", train={"precision": precision}, dist={"device": device})
    assert run(test_cfg) == 0
    dev = json.load(open(resumed / "dev_results.json"))
    trained = read_meta(best(str(resumed)))["metrics"]
    assert dev["checkpoint"] == os.path.abspath(best(str(resumed)))
    # Training evaluated through the FSDP wrapper (low-precision parameters), test mode the plain model under
    # autocast: the same low-precision matmuls, but allow a near-tie or two to flip (1/225 each).
    assert dev["metrics"]["accuracy"] == pytest.approx(trained["accuracy"], abs=0.01)
    assert dev["metrics"]["loss"] == pytest.approx(trained["loss"], rel=1e-3) and dev["metrics"]["accuracy"] >= 0.85
    assert json.load(open(resumed / "test_results.json"))["metrics"]["samples"] == 300


# ---- two GPUs: real NCCL communication ---------------------------------------------------------------------------
@two_gpus
@pytest.mark.parametrize("dist,precision", [({"strategy": "ddp"}, "bf16"), ({"strategy": "fsdp"}, "fp16"),
                                            (FAIRSCALE, "bf16"), ({"strategy": "oss", "shard_grads": True}, "fp16")],
                         ids=["ddp-bf16", "fsdp-fp16", "fairscale-fsdp-bf16", "oss-shard-grads-fp16"])
def test_two_ranks_train(tmp_path, dist, precision):
    assert_learns(*run_image(tmp_path, precision, {**dist, "procs_per_node": 2}, batch_size=16))
    meta, _, state = checkpoint_files(tmp_path)
    assert meta["world_size"] == 2
    assert_scaler(state, precision)

