"""A week-long run, compressed: what a run keeps for its whole length (or a window of it) must not drift or grow."""
import csv
import multiprocessing
import os
import shutil
import tracemalloc

import pytest
import torch

import main
from core import checkpoint, trackers
from core.distributed import DistContext
from core.run_log import LossWindow
from resilience import launcher

from conftest import make_config

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


def test_the_loss_window_stays_exact_after_ten_million_steps():
    # train.log_every as long as the run (one line at the end): the window holds 10^7 steps' sums, as a resume gives
    # them back. In float32 a step's 3.25 added to 3.2e7 rounded to a multiple of 2, and the loss drifted.
    window = LossWindow(CPU)
    steps, loss_sum, count = 10 ** 7, 0.1 * 32, 32
    window.load_state_dict({"loss": steps * loss_sum, "count": steps * count})
    for _ in range(1000):
        window.add(torch.tensor(3.25), torch.tensor(32.0), samples=32)
    expected = (steps * loss_sum + 1000 * 3.25) / ((steps + 1000) * count)
    assert abs(window.flush()["loss"] - expected) < 1e-12 * expected


def test_a_checkpoint_whose_delete_failed_goes_at_the_next_prune(tmp_path, monkeypatch):
    # rmtree failing halfway (a file held open on NFS leaves a .nfsXXXX; ignore_errors says nothing) left step-N
    # without meta.json, which only the next run's start removed: over a week, a checkpoint's disk per failure.
    def save(step):
        os.makedirs(tmp_path / "checkpoints" / f"step-{step}")
        for name in ("model.pt", "meta.json"):
            (tmp_path / "checkpoints" / f"step-{step}" / name).write_text("{}")
    for step in (1, 2, 3):
        save(step)
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path, **kwargs: None)  # the delete fails, unsaid
    assert checkpoint.prune(str(tmp_path), keep_last=2, keep=set()) == [1]
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-1", "step-2", "step-3"]
    save(4)
    os.makedirs(tmp_path / "checkpoints" / "step-9")  # not older than the checkpoints kept: not a prune's
    assert checkpoint.prune(str(tmp_path), keep_last=2, keep=set()) == [2]  # (step-1: no checkpoint since)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-3", "step-4", "step-9"]


def test_a_resumed_metrics_csv_is_copied_row_by_row(tmp_path):
    # A resume keeps metrics.csv's rows up to its step: they were all read into a list first, ten times the file
    # in memory (a day logged every step, 22 MB: 213 MB), growing with the run. Now streamed into the new file.
    path = str(tmp_path / "metrics.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(trackers.CSV.FIELDS)
        for step in range(1, 10001):
            writer.writerows((step, f"train/{tag}", repr(step / 7)) for tag in ("loss", "lr", "grad_norm", "ms"))
        writer.writerow((10000, "summary/steps", "10000.0"))
    tracemalloc.start()
    try:
        resumed = trackers.CSV(path, 9990)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    resumed.scalars(9991, {"train/loss": 0.5})
    resumed.close()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * 9990 + 1 and rows[-2] == {"step": "9990", "tag": "train/ms", "value": repr(9990 / 7)}
    assert rows[-1] == {"step": "9991", "tag": "train/loss", "value": "0.5"}
    assert peak < 2 << 20, f"{peak >> 20} MB to resume a {os.path.getsize(path) >> 20} MB file"


def says_how_data_workers_start(cfg, place) -> int:
    """A rank's worker: writes how a DataLoader there would start its workers (the default start method)."""
    with open(os.path.join(cfg.output_dir, f"rank{place.rank}.txt"), "w") as f:
        f.write(multiprocessing.get_context().get_start_method())
    return 0


@pytest.mark.slow
def test_the_ranks_main_py_starts_start_their_data_workers_as_torchruns_do(tmp_path):
    # main.py's ranks are spawned, and a spawned process spawns too: each evaluation's data.num_workers started as
    # fresh interpreters that import everything again (2 ranks, 1 worker: 4.5 s an evaluation, 0.1 s under fork).
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "procs_per_node": 2})
    places = [main.RankPlace(rank, rank, 2, 2) for rank in range(2)]
    assert launcher.Supervisor(cfg, places, says_how_data_workers_start).supervise() == 0
    default = multiprocessing.get_all_start_methods()[0]  # the platform's: a torchrun rank's, a one-process run's
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == [default, default]
