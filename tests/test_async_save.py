"""train.async_save (issue 20, item 6): training goes on while a checkpoint is written; a failure during the
background write leaves the previous checkpoints loadable, and the run resumes from them; the files are the ones a
synchronous save writes (fsdp through DCP's async_save included)."""
import threading

import pytest
import torch

from conftest import make_config

from core import checkpoint
from core import checkpoint_io
import main
import trainer as T

TRAIN = {"max_steps": 8, "epochs": 0, "save_every": 5, "eval_every": 0, "log_every": 1, "keep_last": 5}


def run(out, **train) -> int:
    return main.run(make_config(out, train={**TRAIN, **train}))


def same(a, b) -> bool:
    x, y = checkpoint_io.model_state_dict(a), checkpoint_io.model_state_dict(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_training_goes_on_while_a_checkpoint_is_written(tmp_path, monkeypatch):
    step_6_started, order = threading.Event(), []
    real_step, real_save = T.Trainer.train_step, torch.save

    def train_step(self, batches):
        if self.state.step == 5:
            step_6_started.set()
        return real_step(self, batches)

    def slow_save(obj, path, *args, **kwargs):
        if str(path).endswith("model.pt") and ".tmp-step-5-" in str(path):
            order.append(step_6_started.wait(timeout=20))  # a synchronous save would wait here in vain
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(T.Trainer, "train_step", train_step)
    monkeypatch.setattr(torch, "save", slow_save)
    assert run(tmp_path / "async", async_save=True) == 0
    assert order == [True]  # step 6 ran while step-5's model.pt was being written
    monkeypatch.setattr(torch, "save", real_save)
    assert run(tmp_path / "sync") == 0
    for step in (5, 8):  # the same files as a synchronous save
        assert same(tmp_path / f"async/checkpoints/step-{step}", tmp_path / f"sync/checkpoints/step-{step}")


def test_a_failed_background_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt") and ".tmp-step-8-" in str(path):
            raise OSError("the disk went away (simulated)")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    assert run(tmp_path, async_save=True) == 1  # a crash, named
    assert "OSError: the disk went away (simulated)" in capsys.readouterr().err
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [5]
    monkeypatch.setattr(torch, "save", real_save)
    assert run(tmp_path, async_save=True) == 0  # resumes from step 5
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [5, 8]
    assert run(tmp_path / "sync") == 0
    assert same(tmp_path / "checkpoints/step-8", tmp_path / "sync/checkpoints/step-8")


def test_a_crash_after_a_background_write_keeps_its_checkpoint(tmp_path, monkeypatch, capsys):
    """A crash at step 7 in one process: step-5, written in the background and complete, was never published, and
    the next run removed it as a stale save and started from step 0. It is published before the crash is reported."""
    real_step = T.Trainer.train_step

    def train_step(self, batches):
        if self.state.step == 6:
            raise ValueError("a bad batch (simulated)")
        return real_step(self, batches)

    monkeypatch.setattr(T.Trainer, "train_step", train_step)
    assert run(tmp_path, async_save=True) == 1  # a crash, named
    assert "ValueError: a bad batch (simulated)" in capsys.readouterr().err
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [5]
    monkeypatch.setattr(T.Trainer, "train_step", real_step)
    assert run(tmp_path, async_save=True) == 0
    assert "resumed from" in open(tmp_path / "logs" / "rank0.log").read()
    assert run(tmp_path / "sync") == 0
    assert same(tmp_path / "checkpoints/step-8", tmp_path / "sync/checkpoints/step-8")


@pytest.mark.slow
def test_fsdp_writes_with_dcp_async_save(tmp_path):
    fsdp = {"strategy": "fsdp", "procs_per_node": 2}
    for name, async_save in (("async", True), ("sync", False)):
        cfg = make_config(tmp_path / name, train={**TRAIN, "batch_size": 16, "async_save": async_save}, dist=fsdp)
        assert main.run(cfg) == 0
    for step in (5, 8):
        assert same(tmp_path / f"async/checkpoints/step-{step}", tmp_path / f"sync/checkpoints/step-{step}")
