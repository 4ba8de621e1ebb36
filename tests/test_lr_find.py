"""mode: lr_find (issue 41): an exponential sweep of the learning rate with the run's own Trainer, stopped when the
loss diverges; lr_find.csv and lr_find.png in output_dir, the suggestion in one line, no checkpoint; under ddp the
losses are the global ones, equal to one process's on the same global batches."""
import csv
import math
import os
import signal

import main
from conftest import make_config
from extras import lr_find


def sweep(tmp_path, **dist) -> list[dict]:
    cfg = make_config(tmp_path, mode="lr_find", lr_find={"min": 1e-6, "max": 10.0, "steps": 100},
                      model={"dropout": 0.0},  # dropout masks differ between ranks: the same losses need none
                      train={"batch_size": 32 // dist.get("procs_per_node", 1)}, dist=dist)
    assert main.run(cfg) == 0
    with open(tmp_path / "lr_find.csv") as f:
        return list(csv.DictReader(f))


def test_lr_find_sweeps_stops_at_divergence_and_writes_its_files(tmp_path, caplog):
    from PIL import Image
    rows = sweep(tmp_path)
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[0] == 1e-6 and all(math.isclose(b / a, 1e7 ** (1 / 99), rel_tol=1e-4) for a, b in zip(lrs, lrs[1:]))
    assert 20 < len(rows) < 100, "AdamW at lr 10 diverges: the sweep stops before its last step"
    smoothed = [float(r["smoothed_loss"]) for r in rows]
    assert smoothed[-1] > 4 * min(smoothed[:-1])  # it stopped because the loss diverged
    with Image.open(tmp_path / "lr_find.png") as picture:
        assert picture.size[0] > 300 and picture.size[1] > 200
    log = open(tmp_path / "logs" / "rank0.log").read()
    line = [l for l in log.splitlines() if "lr_find: suggested lr" in l]
    assert len(line) == 1, log
    suggested = float(line[0].split("suggested lr ")[1].split()[0])
    assert lrs[10] <= suggested <= lrs[smoothed.index(min(smoothed))]  # on the fall, before the divergence
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_lr_find_under_ddp_records_the_global_loss(tmp_path):
    one = sweep(tmp_path / "one")
    two = sweep(tmp_path / "two", strategy="ddp", procs_per_node=2)
    n = min(len(one), len(two), 60)  # the flat start and the fall: equal to float rounding on the same batches
    for a, b in zip(one[:n], two[:n]):
        assert math.isclose(float(a["loss"]), float(b["loss"]), rel_tol=1e-4), (a, b)


def test_the_suggestion_is_on_the_fall_not_where_a_spike_fades_from_the_smoothed_loss():
    """A spike the smoothed loss stays below 4x its lowest (the sweep goes on): afterwards the average decays
    steeply towards the ruined model's loss, which is no fall of the loss to suggest."""
    losses = [2.3] * 20 + [2.3 - 0.05 * i for i in range(30)] + [80.0] + [3.0] * 30
    lrs = [1e-6 * 1.2 ** i for i in range(len(losses))]
    average, smoothed = 0.0, []
    for i, loss in enumerate(losses):
        average = lr_find.SMOOTHING * average + (1 - lr_find.SMOOTHING) * loss
        smoothed.append(average / (1 - lr_find.SMOOTHING ** (i + 1)))
    assert max(smoothed) < lr_find.DIVERGED * min(smoothed)
    assert lrs[20] <= lr_find.suggest(lrs, smoothed) <= lrs[50]
    assert lr_find.suggest(lrs[:12], smoothed[:12]) is None  # the flat start alone


def test_ctrl_c_ends_the_sweep_at_its_step_with_its_files_written(tmp_path, monkeypatch):
    """It was a KeyboardInterrupt anywhere ("interrupted before training (setup)", exit 130), the sweep lost."""
    from resilience import faults
    monkeypatch.setattr(faults.stop_request, "reason", None)
    vote, calls = faults.stop_request.vote, []

    def ctrl_c_at_step_20():
        calls.append(1)
        if len(calls) == 20:
            os.kill(os.getpid(), signal.SIGINT)
        return vote()
    monkeypatch.setattr(faults.stop_request, "vote", ctrl_c_at_step_20)
    cfg = make_config(tmp_path, mode="lr_find", lr_find={"min": 1e-6, "max": 1e-3, "steps": 100})
    assert main.run(cfg) == 3
    with open(tmp_path / "lr_find.csv") as f:
        assert len(list(csv.DictReader(f))) == 20
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert "lr_find stopped by SIGINT after 20 of 100 steps" in log
    # the signal's own line says what the stop keeps: the sweep saves no checkpoint (it said it would)
    assert "SIGINT received: stopping after the current step, once the sweep so far is written to lr_find.csv" in log
    assert "checkpoint" not in log
