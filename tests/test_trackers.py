"""Trackers (log.report_to, trackers.py): TensorBoard, metrics.csv, W&B offline and MLflow on a local sqlite store,
read back; resume continues the same tracked run. And one voice: the libraries' reports from rank 0 only, and not
the "newly initialized" report when a checkpoint's weights come next (issue 34, items 1 and 5)."""
from __future__ import annotations

import csv
import errno
import glob
import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, make_config, save_tiny_minilm

import main
from core import run_record, trackers
from resilience import launcher
from wiring import checked_config
from core.errors import ConfigError

TRAIN = {"max_steps": 4, "epochs": 0, "eval_every": 2, "save_every": 2, "log_every": 2}


def run(out, report_to, train=None, **sections) -> int:
    # log.tensorboard: null, so that report_to decides (make_config's false would take TensorBoard out)
    log = {"report_to": report_to, "tensorboard": None}
    return main.run(make_config(out, train={**TRAIN, **(train or {})}, log=log, **sections))


def csv_rows(out) -> list[tuple[int, str, float]]:
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        return [(int(r["step"]), r["tag"], float(r["value"])) for r in csv.DictReader(f)]


def logged_lines(out) -> dict:
    """{(step, tag): value} of rank 0's training and dev lines, as printed (4 significant digits)."""
    values = {}
    for step, split, fields in re.findall(r"step (\d+)(?:/\d+)?( dev:)? (.*)", open(os.path.join(out, "logs",
                                                                                              "rank0.log")).read()):
        for k, v in re.findall(r"(\w+)=(\S+)", fields):
            values[(int(step), f"{'dev' if split else 'train'}/{k}")] = float(v)
    return values


# ---------------------------------------------------------------------------------------------------------------
# The setting
# ---------------------------------------------------------------------------------------------------------------
def test_report_to_defaults_to_tensorboard_and_log_tensorboard_adds_or_removes_it():
    def names(*overrides):
        return trackers.names(checked_config(None, list(overrides)))
    assert names() == ["tensorboard"]
    assert names("log.report_to=[csv]") == ["csv"]
    assert names("log.report_to=[csv]", "log.tensorboard=true") == ["tensorboard", "csv"]
    assert names("log.tensorboard=false") == []  # what configs and tests that turned TensorBoard off still do
    assert names("log.report_to=[csv, tensorboard, csv]", "log.tensorboard=false") == ["csv"]
    assert names("log.report_to=[]") == []


@pytest.mark.parametrize("overrides, content", [
    (["log.report_to=[tensorbord]"], ["`log.report_to` lists 'tensorbord', not a tracker", "tensorboard, csv"]),
    (["log.report_to=csv"], ["log.report_to"]),  # a list is expected
    (["log.mlflow_tracking_uri=' '"], ["`log.mlflow_tracking_uri` is empty"]),
    # a path, which MLflow 3 refused after torch and the model had loaded, its reason cut mid-word ("Please m")
    (["log.report_to=[mlflow]", "log.mlflow_tracking_uri=runs/mlflow.db"],
     ["`log.mlflow_tracking_uri` is 'runs/mlflow.db', a path", f"sqlite:///{os.path.abspath('runs/mlflow.db')}"]),
    (["log.report_to=[mlflow]", "log.mlflow_tracking_uri=./mlruns"],
     [f"sqlite:///{os.path.abspath('mlruns')}/mlflow.db"]),
])
def test_a_wrong_report_to_is_one_line(overrides, content):
    with pytest.raises(ConfigError) as e:
        checked_config(None, overrides)
    assert "\n" not in str(e.value) and all(c in str(e.value) for c in content), str(e.value)


def test_an_output_dir_that_mlflows_default_store_would_misread_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("runs?a", "runs%41"):  # sqlite:///.../runs?a/mlflow.db opens .../runs; runs%41: .../runsA
        with pytest.raises(ConfigError) as e:
            checked_config(None, [f"output_dir={tmp_path / name}", "log.report_to=[mlflow]"])
        assert "`output_dir`" in str(e.value) and "set log.mlflow_tracking_uri" in str(e.value), str(e.value)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert checked_config(None, [f"output_dir={tmp_path / 'runs?a'}", "log.report_to=[mlflow]",
                                 f"log.mlflow_tracking_uri={store}"]).log.mlflow_tracking_uri == store
    assert checked_config(None, [f"output_dir={tmp_path / '100%'}", "log.report_to=[mlflow]"])  # read as it is
    # MLFLOW_TRACKING_URI a path: a folder store MLflow 3 refuses, said before torch loads (as the setting's)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    with pytest.raises(ConfigError) as e:
        checked_config(None, ["log.report_to=[mlflow]"])
    assert f"is null and MLFLOW_TRACKING_URI is '{tmp_path}/mlruns', a path" in str(e.value) and \
        f"give sqlite:///{tmp_path}/mlruns/mlflow.db" in str(e.value), str(e.value)


@pytest.mark.parametrize("tracker, module, pip", [
    ("wandb", "wandb", "pip install wandb==0.31.0"),
    ("mlflow", "mlflow", "pip install mlflow-skinny==3.17.2 sqlalchemy==2.1.9 alembic==1.20.1"),
    ("mlflow", "sqlalchemy", "pip install mlflow-skinny==3.17.2 sqlalchemy==2.1.9 alembic==1.20.1"),
])
def test_a_tracker_whose_package_is_missing_is_refused_in_one_line(tmp_path, capsys, monkeypatch, tracker, module,
                                                                   pip):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    code = main.main(["--set", f"output_dir={tmp_path}", "--set", f"log.report_to=[csv, {tracker}]"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "`log.report_to` lists " + tracker in err and f"no {module}" in err and pip in err, err
    assert not os.path.exists(tmp_path / "logs")  # refused before anything started
    # Another store than sqlite needs no SQL packages.
    if module == "sqlalchemy":
        cfg = checked_config(None, [f"log.report_to=[{tracker}]", "log.mlflow_tracking_uri=http://localhost:5000"])
        assert trackers.names(cfg) == ["mlflow"]


# ---------------------------------------------------------------------------------------------------------------
# metrics.csv
# ---------------------------------------------------------------------------------------------------------------
def test_csv_holds_the_logged_values_and_a_resume_continues_it(tmp_path, capsys):
    assert run(tmp_path, ["csv"]) == 0
    rows = csv_rows(tmp_path)
    printed = logged_lines(tmp_path)
    values = {(s, t): v for s, t, v in rows if not t.startswith("summary/")}
    assert set(values) == set(printed)  # the same scalars as the log lines: every one, no other
    assert all(f"{values[k]:.4g}" == f"{printed[k]:.4g}" for k in printed), (values, printed)
    assert {t for _, t, _ in rows} >= {"train/loss", "train/lr", "train/grad_norm", "dev/accuracy", "dev/loss"}
    summary = {t: v for _, t, v in rows if t.startswith("summary/")}
    assert summary["summary/steps"] == 4 and summary["summary/best_step"] in (2, 4)
    assert f"  metrics      {tmp_path}/metrics.csv" in capsys.readouterr().out
    assert not (tmp_path / "tensorboard").exists()  # report_to without tensorboard: none

    # A row written after the last checkpoint (a crash between them) is dropped: the resumed run writes it again.
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("5,train/loss,123.0\n")
    assert run(tmp_path, ["csv"], train={"max_steps": 6}) == 0
    again = csv_rows(tmp_path)
    assert again[:len(rows) - len(summary)] == rows[:len(rows) - len(summary)]  # the first steps' rows kept
    steps = [s for s, t, _ in again if t == "train/loss"]
    assert steps == [2, 4, 6] and 123.0 not in [v for _, _, v in again]
    assert [v for _, t, v in again if t == "summary/steps"] == [6]

    # train.start_over: the previous run's metrics.csv goes aside with its checkpoints, not overwritten.
    assert run(tmp_path, ["csv"], train={"max_steps": 2, "start_over": True}) == 0
    aside = [n for n in os.listdir(tmp_path) if n.startswith("replaced-")]
    assert len(aside) == 1 and csv_rows(tmp_path / aside[0]) == again
    assert [s for s, t, _ in csv_rows(tmp_path) if t == "train/loss"] == [2]

def test_tensorboard_shows_each_step_once_after_a_resume_before_the_last_checkpoint(tmp_path):
    """A crash after step 4 was logged but before its checkpoint: the resumed run (from step 2) logs steps 3 and 4
    again. TensorBoard's own reader shows each step once, with the resumed run's value, as metrics.csv holds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    assert run(tmp_path, ["tensorboard", "csv"]) == 0
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")
    assert run(tmp_path, ["tensorboard", "csv"]) == 0
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("train/loss", "train/samples_per_s", "dev/loss"):
        shown = [(e.step, e.value) for e in events.Scalars(tag)]
        assert shown == [(s, pytest.approx(v)) for s, t, v in csv_rows(tmp_path) if t == tag], (tag, shown)
        assert [s for s, _ in shown] == [2, 4]



@pytest.mark.slow  # 8 s: two runs with MLflow's store
def test_mlflow_holds_each_step_once_after_a_resume_before_the_last_checkpoint(tmp_path, monkeypatch):
    """The same crash as above: MLflow cannot delete points, so the resumed run does not send steps 3 and 4 again
    (it sent them twice before); the points it holds are the ones metrics.csv holds, and the summary is the new run's."""
    import mlflow
    from mlflow.entities import Metric
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    assert run(tmp_path, ["mlflow", "csv"]) == 0
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")
    assert run(tmp_path, ["mlflow", "csv"]) == 0
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = json.load(open(tmp_path / "trackers.json"))["mlflow"]
    for tag in ("train/loss", "dev/loss"):
        held = [(m.step, m.value) for m in client.get_metric_history(run_id, tag)]
        assert sorted(held) == [(s, pytest.approx(v)) for s, t, v in csv_rows(tmp_path) if t == tag], (tag, held)
        assert sorted(s for s, _ in held) == [2, 4]
    assert client.get_run(run_id).data.metrics["summary/steps"] == 4

    # Each key's last step is read from the run, not from every point of its history (10^5 points: 5 s and 55 MB
    # more); a step logged after a later one, as a resume before the last checkpoint does, is not the last step.
    client.log_batch(run_id, metrics=[Metric("dev/late", 1.0, 1, 5), Metric("dev/late", 2.0, 2, 3)])
    last_steps = {key: max(m.step for m in client.get_metric_history(run_id, key))
                  for key in client.get_run(run_id).data.metrics}
    history_read, real = [], SqlAlchemyStore.get_metric_history
    monkeypatch.setattr(SqlAlchemyStore, "get_metric_history",
                        lambda store, *a, **k: history_read.append(a) or real(store, *a, **k))

    # A stop at step 4 with an evaluation due there: the resumed run makes it first (eval_due), a key the run does
    # not hold at step 4 (dev/due here). MLflow skipped it: a step at or below the last one held in any key was sent.
    resumed = trackers.MLflow(make_config(tmp_path, log={"report_to": ["mlflow"]}), run_id)
    assert history_read == [] and resumed.logged_up_to == last_steps and last_steps["dev/late"] == 5
    resumed.scalars(4, {"dev/due": 0.7, "train/loss": 9.0})
    resumed.close()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "dev/due")] == [(4, 0.7)]
    assert 9.0 not in [m.value for m in client.get_metric_history(run_id, "train/loss")]  # held already


def test_a_resume_that_fails_to_rewrite_metrics_csv_leaves_its_rows(tmp_path, monkeypatch):
    import errno
    path = str(tmp_path / "metrics.csv")
    first = trackers.CSV(path, 0)
    for step in (1, 2, 3):
        first.scalars(step, {"train/loss": 1.0 / step})
    first.close()
    before = open(path).read()

    def full_disk(self, rows):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(csv.DictWriter, "writerows", full_disk)
    with pytest.raises(OSError) as e:
        trackers.CSV(path, 2)  # a resume from step 2 keeps steps 1 and 2
    assert e.value.errno == errno.ENOSPC and e.value.filename == path  # named, for disk_errors' one line
    assert open(path).read() == before  # the history is whole, not cut at the full disk


@pytest.mark.slow  # 10 s (25 s on busy cores): a run, and a Jupyter kernel
def test_the_notebook_reads_metrics_csv(tmp_path, monkeypatch):
    """notebooks/inspect_run.ipynb, executed on a run with csv (tests/test_tutorial.py runs it on one without)."""
    import nbformat
    from nbclient import NotebookClient
    from test_tutorial import kernel
    out = tmp_path / "run"
    assert run(out, ["tensorboard", "csv"]) == 0
    monkeypatch.setenv("JUPYTER_PATH", kernel(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "inspect_run.ipynb"), as_version=4)
    [first] = [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])]
    first.source = f"run = {str(out)!r}\nfigures = {str(tmp_path / 'figures')!r}"
    NotebookClient(nb, kernel_name="tutorial-test", timeout=120,
                   resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
    printed = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    last = {t: (s, v) for s, t, v in csv_rows(out)}
    assert float(re.search(r"csv train/loss: last (\S+) at step 4 \(2 rows\)", printed).group(1)) == \
        pytest.approx(last["train/loss"][1], rel=1e-5)
    assert "csv dev/accuracy: last" in printed


# ---------------------------------------------------------------------------------------------------------------
# W&B (offline) and MLflow (sqlite in output_dir), read back
# ---------------------------------------------------------------------------------------------------------------
def wandb_records(path):
    """The records of a W&B run file (run-<id>.wandb: W&B's log of protobuf records in 32 KiB blocks, each piece
    with a 7-byte header: CRC32, length, kind (1 whole, 2 first, 3 middle, 4 last))."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_run(path) -> dict:
    """What a W&B run file holds: its run record's id and name, its config, and its history rows."""
    out = {"history": [], "summary": {}, "config": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["name"], out["project"] = record.run.run_id, record.run.display_name, record.run.project
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "summary":
            out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.summary.update})
    return out


@pytest.mark.slow  # 15 s (45 s on busy cores): W&B's service and MLflow's sqlite schema start twice
def test_wandb_offline_and_mlflow_receive_the_run_and_a_resume_continues_them(tmp_path, monkeypatch):
    import mlflow
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "digits-a"
    assert run(out, ["csv", "wandb", "mlflow"]) == 0
    ids = json.load(open(out / "trackers.json"))
    first = csv_rows(out)
    assert run(out, ["csv", "wandb", "mlflow"], train={"max_steps": 6}) == 0  # resumed from step 4
    assert json.load(open(out / "trackers.json")) == ids  # the same tracked runs
    rows = {(s, t): v for s, t, v in csv_rows(out)}
    assert first and {(s, t) for s, t, _ in first if not t.startswith("summary/")} <= set(rows)

    # W&B: two offline files under output_dir/wandb, one run id, named after output_dir; the history is the CSV's.
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2, files
    runs = [wandb_run(f) for f in files]
    assert {r["id"] for r in runs} == {ids["wandb"]} and {r["name"] for r in runs} == {"digits-a"}
    assert runs[0]["project"] == "image"  # the task's name without WANDB_PROJECT
    history = {(row["_step"], k): v for r in runs for row in r["history"] for k, v in row.items()
               if not k.startswith("_")}
    assert history == {k: v for k, v in rows.items() if not k[1].startswith("summary/")}
    config = runs[0]["config"]
    assert config["train"]["max_steps"] == 4 and config["output_dir"] == str(out)
    assert runs[1]["summary"]["summary/steps"] == 6

    # MLflow: one run in output_dir/mlflow.db, resumed, named after output_dir, with the config as params.
    uri = f"sqlite:///{out}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # where mlflow.search_runs looks
    found = mlflow.search_runs(experiment_names=["image"], output_format="list")
    assert len(found) == 1, found
    r = found[0]
    assert r.info.run_id == ids["mlflow"] and r.info.run_name == "digits-a" and r.info.status == "FINISHED"
    assert r.data.params["train.max_steps"] == "4" and r.data.params["task"] == "image"
    assert r.data.metrics["summary/steps"] == 6
    client = mlflow.MlflowClient(uri)
    loss = [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "train/loss")]
    assert sorted(loss) == sorted((s, v) for (s, t), v in rows.items() if t == "train/loss")
    assert sorted(s for s, _ in loss) == [2, 4, 6]



@pytest.mark.slow  # W&B's service and MLflow's store, a run stopped then resumed
def test_a_run_stopped_by_a_signal_ends_its_tracked_runs_stopped_and_a_resume_finishes_them(tmp_path, monkeypatch):
    """SIGTERM (or the time limit): the run saves and exits 3, for a requeue, and its MLflow run showed FINISHED, its
    W&B run exit code 0: in the runs table a stopped run looked like a finished one. Now MLflow's run is KILLED and
    W&B's is marked preempting with exit code 3; the resume continues both, and its end is FINISHED (W&B: 0)."""
    import mlflow
    from resilience import faults
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    # (the instance's vote, as other tests patch it: one patched on the class hides behind what they leave there)
    votes, vote = [], faults.stop_request.vote

    def signalled_in_step_2():
        votes.append(1)
        if len(votes) == 2:
            monkeypatch.setattr(faults.stop_request, "reason", "SIGTERM")  # as the signal handler sets it
        return vote()
    monkeypatch.setattr(faults.stop_request, "vote", signalled_in_step_2)
    assert run(tmp_path, ["wandb", "mlflow"]) == 3
    ids = json.load(open(tmp_path / "trackers.json"))
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(ids["mlflow"]).info.status == "KILLED"

    def wandb_end(file) -> tuple[bool, int]:
        records = [r for r in wandb_records(file) if r.WhichOneof("record_type") in ("preempting", "exit")]
        assert records[-1].WhichOneof("record_type") == "exit", records
        return any(r.WhichOneof("record_type") == "preempting" for r in records), records[-1].exit.exit_code
    [stopped] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert wandb_end(stopped) == (True, 3)

    monkeypatch.setattr(faults.stop_request, "vote", vote)
    monkeypatch.setattr(faults.stop_request, "reason", None)
    assert run(tmp_path, ["wandb", "mlflow"]) == 0  # resumed from step 2, to its end
    assert json.load(open(tmp_path / "trackers.json")) == ids  # the same tracked runs
    held = client.get_run(ids["mlflow"])
    assert held.info.status == "FINISHED" and held.data.metrics["summary/steps"] == 4
    [resumed] = set(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))) - {stopped}
    assert wandb_run(resumed)["id"] == ids["wandb"] and wandb_end(resumed) == (False, 0)


# ---------------------------------------------------------------------------------------------------------------
# One voice: rank 0 reports; the load report only where it is true
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # 5 s: a process that loads transformers
def test_ranks_after_0_leave_library_reports_and_warnings_to_rank_0(tmp_path):
    """Run in a fresh interpreter: quieting changes the process's logging and warnings for good."""
    code = f"""
import logging, warnings, sys
sys.path.insert(0, {ROOT!r})
from core import run_log
run_log.setup_logging({str(tmp_path / 'r0')!r}, 0)
import transformers
from transformers.utils import logging as hf_logging
print("rank0", hf_logging.get_verbosity() == logging.WARNING)
run_log.setup_logging({str(tmp_path / 'r1')!r}, 1)
peft = logging.getLogger("peft").getEffectiveLevel()
print("rank1", hf_logging.get_verbosity() == logging.ERROR, peft == logging.ERROR)
with warnings.catch_warnings(record=True) as seen:
    warnings.warn_explicit("library", FutureWarning, "x.py", 1, module="transformers.modeling_utils")
    warnings.warn_explicit("library", UserWarning, "x.py", 1, module="peft.tuners")
    warnings.warn_explicit("ours", UserWarning, "x.py", 1, module="trainer")
print("warnings", [str(w.message) for w in seen])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TRANSFORMERS_VERBOSITY": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["rank0 True", "rank1 True True", "warnings ['ours']"], r.stdout


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return save_tiny_minilm(tmp_path_factory.mktemp("tiny_bert"))


def load_reports(cfg) -> list[str]:
    """The warnings transformers logs while sst2 builds its model under `cfg`."""
    import logging
    import random

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_sample_text_data as sample
    from wiring import build_task
    if not os.path.isdir(cfg.data.data_dir):
        sample.write_sst2(cfg.data.data_dir, random.Random(0))
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    from transformers.utils import logging as hf_logging
    keep, level = Keep(logging.WARNING), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # as in a rank 0 process (a test before may have quieted a rank > 0 here)
    logging.getLogger("transformers").addHandler(keep)
    try:
        task = build_task(cfg)
        task.build_datasets()
        task.build_model()
    finally:
        logging.getLogger("transformers").removeHandler(keep)
        hf_logging.set_verbosity(level)
    return [m for m in seen if "LOAD REPORT" in m]


def test_the_newly_initialized_report_shows_only_when_training_starts_from_the_folder(tmp_path, tiny_bert,
                                                                                      monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = make_config(tmp_path / "run", task="sst2", data={"data_dir": str(tmp_path / "sst2"), "max_length": 32},
                      model={"name": "tiny", "pretrained_dir": tiny_bert})
    fresh = load_reports(cfg)
    assert len(fresh) == 1 and "classifier" in fresh[0]  # a fine-tuning starts: the new head is worth saying
    (tmp_path / "run" / "checkpoints" / "step-2").mkdir(parents=True)  # a run to resume (train.resume: auto)
    (tmp_path / "run" / "checkpoints" / "step-2" / "meta.json").write_text("{}")
    assert load_reports(cfg) == []  # the checkpoint's head replaces the new one
    cfg.train.start_over = True
    assert len(load_reports(cfg)) == 1
    cfg.train.start_over = False
    for mode in ("test", "export"):
        cfg.mode = mode
        assert load_reports(cfg) == []


@pytest.mark.slow  # 25 s (80 s on busy cores): two spawned ranks, W&B's service, a LoRA model, test mode
def test_two_ranks_report_once(tmp_path, tiny_bert):
    """Two ranks, sst2 with LoRA on a pretrained folder: the console shows transformers' load report and the
    libraries' warnings once (rank 0's), and the trackers get one value per step and tag, from rank 0 alone."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import random

    import make_sample_text_data as sample
    data = sample.write_sst2(str(tmp_path / "sst2"), random.Random(0))
    out = tmp_path / "run"
    args = [sys.executable, "main.py", "--set", "task=sst2", "--set", f"data.data_dir={data}",
            "--set", "data.max_length=32", "--set", "model.name=tiny", "--set", f"model.pretrained_dir={tiny_bert}",
            "--set", "model.lora_rank=4", "--set", "train.batch_size=8", "--set", "train.max_steps=4",
            "--set", "train.eval_every=2", "--set", "train.log_every=2", "--set", "dist.strategy=ddp",
            "--set", "dist.procs_per_node=2", "--set", f"output_dir={out}", "--set", "log.progress_bar=false",
            "--set", "log.report_to=[csv, wandb]"]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_DIR", None)
    env.pop("TRANSFORMERS_VERBOSITY", None)  # set by a test that quieted a rank > 0 in the test process
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    console = r.stdout + r.stderr
    assert r.returncode == 0, console[-3000:]
    assert console.count("LOAD REPORT") == 1, console[-3000:]  # rank 0's; a fine-tuning starts: it is true
    warned = [line for line in console.splitlines() if "Warning: " in line]
    assert len(warned) == len(set(warned)), warned  # each library warning once, not once per rank
    rows = csv_rows(out)
    assert len({(s, t) for s, t, _ in rows}) == len(rows) and [s for s, t, _ in rows if t == "train/loss"] == [2, 4]
    assert len(glob.glob(str(out / "wandb" / "offline-run-*"))) == 1
    # Test mode: the checkpoint's weights replace the new head, so no "newly initialized" report.
    test = subprocess.run(args + ["--set", "mode=test", "--set", "dist.strategy=none", "--set",
                                  "dist.procs_per_node=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert test.returncode == 0, (test.stdout + test.stderr)[-3000:]
    assert "LOAD REPORT" not in test.stdout + test.stderr and "newly initialized" not in test.stdout + test.stderr


# ---------------------------------------------------------------------------------------------------------------
# A tracker that cannot start is one line before training; one that fails later is dropped (issue 40, item 6)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("store, cause", [
    ("file://{tmp}/mlruns", "MlflowException: "),  # MLflow 3 refuses file stores
    # no server there (a typo): said at once, not after MLflow's 4 minutes of silent retries
    ("http://127.0.0.1:{port}", "ConnectionError: no server answers at http://127.0.0.1:{port} (Connection refused)")])
def test_a_store_mlflow_refuses_is_one_line_before_training(tmp_path, capsys, monkeypatch, store, cause):
    port = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.format(tmp=tmp_path, port=port))
    start = time.monotonic()
    assert run(tmp_path / "run", ["mlflow"]) == 2
    assert time.monotonic() - start < 60
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    said = f"error: log.report_to: mlflow could not start ({cause.format(port=port)}"
    assert len(err) == 1 and err[0].startswith(said), err
    assert "set log.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) to a store MLflow accepts" in err[0]
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def stand_ins_for_wandb_and_mlflow(monkeypatch, new_id: str) -> list:
    """W&B's and MLflow's runs replaced by CSV files in output_dir; returns the list of (tracker, run id it was
    given) each start appends to. A run given no id takes new_id.format(tracker)."""
    continued = []

    def tracked(name):
        class Tracked(trackers.CSV):  # stands in for W&B's or MLflow's run: a new id, or the one it continues
            def __init__(self, cfg, run_id):
                continued.append((name, run_id))
                self.run_id = run_id or new_id.format(name)
                super().__init__(os.path.join(cfg.output_dir, f"{name}.csv"), 0)
        return Tracked
    monkeypatch.setattr(trackers, "WandB", tracked("wandb"))
    monkeypatch.setattr(trackers, "MLflow", tracked("mlflow"))
    return continued


def test_a_resume_without_a_tracker_keeps_its_run_id_for_the_next_resume(tmp_path, monkeypatch):
    continued = stand_ins_for_wandb_and_mlflow(monkeypatch, new_id="{}-1")

    def start(step, report_to):
        cfg = make_config(tmp_path, log={"report_to": report_to, "tensorboard": None})
        trackers.Trackers(cfg, step, tensorboard=None).close()
    start(0, ["wandb", "mlflow"])
    start(4, ["wandb"])  # resumed once without MLflow (on a node that cannot reach its server, say)
    start(8, ["wandb", "mlflow"])
    assert continued[-2:] == [("wandb", "wandb-1"), ("mlflow", "mlflow-1")]  # the same MLflow run again
    start(0, ["mlflow"])  # a fresh start opens a new one
    assert continued[-1] == ("mlflow", None)


def test_a_tracker_failing_mid_run_is_named_once_and_training_goes_on(tmp_path, monkeypatch):
    real, calls = trackers.CSV.scalars, []

    def scalars(self, step, values):
        calls.append(step)
        if step >= 2:
            raise ConnectionError("the tracking server went away")
        real(self, step, values)
    monkeypatch.setattr(trackers.CSV, "scalars", scalars)
    assert run(tmp_path, ["csv"]) == 0
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert log.count("tracker csv failed (ConnectionError: the tracking server went away); it is dropped and "
                     "training goes on without it") == 1
    assert calls == [2] and os.path.isdir(tmp_path / "checkpoints" / "step-4")  # called no more; the run ended


@pytest.mark.slow  # W&B's service and MLflow's store, started (no training)
def test_a_tracker_dropped_mid_run_is_closed_marked_failed(tmp_path, monkeypatch):
    """A W&B or MLflow tracker that failed mid-run was dropped and never closed: MLflow's run stayed RUNNING after
    the run had ended, and W&B's file lost what it held (its service ended with the process, unwritten). Now each
    is closed marked failed as it is dropped; one that cannot be closed is said in a line of its own."""
    import mlflow
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    cfg = make_config(tmp_path, log={"report_to": ["csv", "wandb", "mlflow"], "tensorboard": None})
    said = []
    tracked = trackers.Trackers(cfg, 0, tensorboard=None, warn=said.append)
    tracked.scalars(1, {"train/loss": 2.5})

    def gone(self, step, values):
        raise ConnectionError("the tracking server went away")
    for member in (trackers.CSV, trackers.WandB, trackers.MLflow):
        monkeypatch.setattr(member, "scalars", gone)
    monkeypatch.setattr(trackers.CSV, "close", lambda self, failed=False, stopped=False: gone(self, 0, {}))
    tracked.scalars(2, {"train/loss": 2.0})
    failed = [f"tracker {name} failed (ConnectionError: the tracking server went away); it is dropped and training "
              "goes on without it" for name in ("csv", "wandb", "mlflow")]
    assert said == [failed[0], "tracker csv was not closed (ConnectionError: the tracking server went away)",
                    *failed[1:]], said
    ids = json.load(open(tmp_path / "trackers.json"))
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(ids["mlflow"])
    assert run.info.status == "FAILED" and run.data.metrics["train/loss"] == 2.5
    [file] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    [end] = [r.exit for r in wandb_records(file) if r.WhichOneof("record_type") == "exit"]
    assert end.exit_code == 1 and [row["train/loss"] for row in wandb_run(file)["history"]] == [2.5]
    said.clear()
    tracked.close()  # none left
    assert said == [] and tracked.members == []


# ---------------------------------------------------------------------------------------------------------------
# A run writes inside output_dir only; a crash closes the trackers
# ---------------------------------------------------------------------------------------------------------------
# What tells MLflow it runs under a test or CI (then it skips its telemetry, which a user's run has)
CI_VARIABLES = ("PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "CI", "CIRCLECI", "GITLAB_CI", "JENKINS_URL", "TRAVIS",
                "TF_BUILD", "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN", "BUILDKITE", "TEAMCITY_VERSION",
                "CLOUD_RUN_EXECUTION", "RUNBOT_HOST_URL", "RUNBOT_BUILD_NAME", "RUNBOT_WORKER_ID")


@pytest.mark.slow  # 15 s: a process with W&B's service and MLflow's store
def test_a_run_with_every_tracker_writes_inside_output_dir_only_and_a_crash_closes_them_failed(tmp_path):
    """As a user runs it: from another folder, with a home and a temporary folder of its own, W&B offline and
    MLflow's default store. W&B's service logs (~/.cache/wandb/logs) and MLflow's telemetry id
    (~/.config/mlflow/telemetry.json) went outside output_dir. The run crashes in step 3: its trackers are closed
    marked failed (MLflow's run was left RUNNING, W&B's exited 0), with what was logged before."""
    import mlflow
    home, temp, cwd, out = (tmp_path / name for name in ("home", "temp", "cwd", "out"))
    for folder in (home, temp, cwd):
        folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in CI_VARIABLES and not k.startswith(("WANDB_", "MLFLOW_",
                                                                                              "XDG_"))}
    env.update(HOME=str(home), TMPDIR=str(temp), WANDB_MODE="offline", OMP_NUM_THREADS="1", FAULT="raise:0:3")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "faulty_main.py"), "--params",
                        os.path.join(ROOT, "parameters.yml"), "--set", f"output_dir={out / 'run'}",
                        "--set", "log.report_to=[tensorboard, csv, wandb, mlflow]", "--set", "train.max_steps=4",
                        "--set", "train.log_every=1", "--set", "train.eval_every=2", "--set", "log.progress_bar=false"],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "injected fault" in r.stderr, (r.stdout + r.stderr)[-3000:]
    assert "INFO mlflow" not in r.stderr, r.stderr[-3000:]  # "Creating initial MLflow database tables...": its own
    outside = [str(p) for folder in (home, temp, cwd) for p in folder.rglob("*") if p.is_file()]
    assert outside == [], outside
    assert os.listdir(out) == ["run"]

    run_dir = out / "run"
    rows = csv_rows(run_dir)
    assert [s for s, t, _ in rows if t == "train/loss"] == [1, 2] and (2, "dev/loss") in {(s, t) for s, t, _ in rows}
    ids = json.load(open(run_dir / "trackers.json"))
    held = mlflow.MlflowClient(f"sqlite:///{run_dir}/mlflow.db").get_run(ids["mlflow"])
    assert held.info.status == "FAILED" and held.data.metrics["train/loss"] == [v for _, t, v in rows if t == "train/loss"][-1]
    [file] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    [end] = [record.exit for record in wandb_records(file) if record.WhichOneof("record_type") == "exit"]
    assert end.exit_code == 1
    assert sorted(row["_step"] for row in wandb_run(file)["history"]) == [1, 2]


def test_a_trackers_json_that_is_not_ids_is_one_line_and_never_followed(tmp_path, monkeypatch):
    """output_dir/trackers.json cut, edited or planted: a W&B id with a `/` or of another type refused the run with
    "could not start ... run `wandb login`" (never naming the file); a cut one was dropped without a word; a symlink
    was read and written through (outside output_dir), a FIFO hung the start. Now: one line naming the file, the
    good ids kept, new runs for the others, and the file written anew in output_dir."""
    continued, said = stand_ins_for_wandb_and_mlflow(monkeypatch, new_id="new-{}"), []
    out = tmp_path / "run"
    out.mkdir()
    ids_file = out / "trackers.json"
    outside = tmp_path / "elsewhere.json"
    outside.write_text('{"wandb": "outside1", "mlflow": "outside2"}')
    cfg = make_config(out, log={"report_to": ["wandb", "mlflow"], "tensorboard": None})

    def planted(content):
        if ids_file.exists() or ids_file.is_symlink():
            ids_file.unlink()
        if content == "symlink":
            ids_file.symlink_to(outside)
        elif content == "fifo":
            os.mkfifo(ids_file)
        else:
            ids_file.write_text(content)
    cases = [('{"wandb": "abc', [None, None], "not JSON"),
             ('["abc"]', [None, None], "a JSON list"),
             ('{"wandb": 5, "mlflow": {"x": 1}}', [None, None], "`wandb`"),
             ('{"wandb": "../../x", "mlflow": "4f2a"}', [None, "4f2a"], "`wandb`"),
             ('{"wandb": "' + "a" * 300 + '", "mlflow": "4f2a"}', [None, "4f2a"], "`wandb`"),
             ("symlink", [None, None], "not a regular file"),
             ("fifo", [None, None], "not a regular file")]
    for content, ids, why in cases:
        planted(content)
        said.clear()
        trackers.Trackers(cfg, 4, tensorboard=None, warn=said.append).close()
        assert [i for _, i in continued[-2:]] == ids, content
        assert len(said) == 1 and said[0].startswith(f"{ids_file}: ") and why in said[0], (content, said)
        assert "new" in said[0] and "\n" not in said[0]
        assert not ids_file.is_symlink() and json.load(open(ids_file)) == {
            "wandb": ids[0] or "new-wandb", "mlflow": ids[1] or "new-mlflow", **trackers.folder_identity(out)}, content
    assert json.load(open(outside)) == {"wandb": "outside1", "mlflow": "outside2"}  # neither read nor written
    said.clear()
    trackers.Trackers(cfg, 4, tensorboard=None, warn=said.append).close()  # ours: continued, nothing said
    assert continued[-2:] == [("wandb", "new-wandb"), ("mlflow", "new-mlflow")] and said == []


def test_a_resumed_metrics_csv_is_read_and_written_in_output_dir_only(tmp_path):
    """A resume reads metrics.csv back: a symlink there was read (its rows, from outside output_dir, kept), a
    metrics.csv.tmp symlink was written through (the file outside emptied), a FIFO hung the start, and a file that
    is not UTF-8 stopped the run as "csv could not start" without naming it. Now: one line naming the file."""
    out, outside = tmp_path / "run", tmp_path / "outside.csv"
    out.mkdir()
    path, text = out / "metrics.csv", "step,tag,value\n1,train/loss,9.0\n"
    outside.write_text("step,tag,value\n1,outside,7.0\n")

    def planted(name, make):
        for p in (path, out / "metrics.csv.tmp"):
            if os.path.lexists(p):
                p.unlink()
        make()
        return name

    planted("tmp symlink", lambda: (path.write_text(text), (out / "metrics.csv.tmp").symlink_to(outside)))
    trackers.CSV(str(path), 2).close()
    assert csv_rows(out) == [(1, "train/loss", 9.0)] and not path.is_symlink()
    assert outside.read_text() == "step,tag,value\n1,outside,7.0\n"
    for case, make, why in [("symlink", lambda: path.symlink_to(outside), "not a regular file"),
                            ("not UTF-8", lambda: path.write_bytes(b"step,tag,value\n1,\xe9,1\n"), "unreadable"),
                            ("fifo", lambda: os.mkfifo(path), "not a regular file")]:
        planted(case, make)
        with pytest.raises(trackers.UserError) as e:
            trackers.CSV(str(path), 2)
        assert str(e.value).startswith(f"{path}: {why}") and "move it" in str(e.value), (case, str(e.value))
        assert outside.read_text() == "step,tag,value\n1,outside,7.0\n"



def test_an_output_dir_named_with_a_newline_is_shown_on_one_line(tmp_path):
    """trackers.json cut, metrics.csv a FIFO, in an output_dir whose name holds a newline: each line broke in two."""
    out = tmp_path / "run\nx"
    out.mkdir()
    (out / "trackers.json").write_text('{"wandb": "abc')
    said = []
    assert trackers.read_ids(str(out / "trackers.json"), said.append) == {}
    assert said == [f"{tmp_path}/run\\nx/trackers.json: unreadable (not JSON), so W&B and MLflow start new runs"], said
    os.mkfifo(out / "metrics.csv")
    with pytest.raises(trackers.UserError) as e:
        trackers.CSV(str(out / "metrics.csv"), 2)
    assert str(e.value).startswith(f"{tmp_path}/run\\nx/metrics.csv: not a regular file"), str(e.value)


def test_metrics_csv_on_a_full_disk_mid_run_is_one_line(tmp_path, capsys, monkeypatch):
    """The run stops on the full disk, and its trackers are closed as it fails: closing metrics.csv meets the same
    full disk, which printed a second line ("the trackers were not all closed") before the error."""
    import errno
    real = trackers.CSV.scalars

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            self.write("")
        flush = close

    def scalars(self, step, values):
        if step == 2:
            self.file = Full()
            self.writer = csv.DictWriter(self.file, self.FIELDS)
        real(self, step, values)
    monkeypatch.setattr(trackers.CSV, "scalars", scalars)
    assert run(tmp_path, ["csv", "tensorboard"], train={"log_every": 1}) == 2
    said = capsys.readouterr()
    err = said.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'metrics.csv'}: No space left on device"), err
    assert "closed" not in said.out and "No space" not in said.out, said.out  # (the console's other stream)


def test_trackers_started_before_one_that_cannot_start_are_closed_failed(tmp_path, monkeypatch):
    """MLflow refused after W&B had started its run: the run is refused in one line, and W&B's run, which never
    trained, was closed as a success. Any failure after they started closes them failed."""
    closed = []

    class Started(trackers.CSV):
        def __init__(self, cfg, run_id):
            self.run_id = "w1"
            super().__init__(os.path.join(cfg.output_dir, "wandb.csv"), 0)

        def close(self, failed=False):
            closed.append(failed)
            super().close(failed)

    def refused(cfg, run_id):
        raise RuntimeError("the store says no")
    monkeypatch.setattr(trackers, "WandB", Started)
    monkeypatch.setattr(trackers, "MLflow", refused)
    cfg = make_config(tmp_path, log={"report_to": ["wandb", "mlflow"], "tensorboard": None})
    with pytest.raises(trackers.UserError, match=r"mlflow could not start \(RuntimeError: the store says no\)"):
        trackers.Trackers(cfg, 0, tensorboard=None)
    assert closed == [True]

    # Both started, then trackers.json met a full disk: the run stops on it, and both runs were left open (MLflow's
    # RUNNING for ever), the Trackers never made.
    def full_disk(path, write, real=trackers.write_beside):
        if path.endswith(trackers.IDS_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(path, write)
    monkeypatch.setattr(trackers, "MLflow", Started)
    monkeypatch.setattr(trackers, "write_beside", full_disk)
    closed.clear()
    with pytest.raises(OSError, match="No space left on device"):
        trackers.Trackers(cfg, 0, tensorboard=None)
    assert closed == [True, True]


def test_a_full_disk_as_the_trackers_get_the_config_closes_them_failed(tmp_path, monkeypatch, capsys):
    """TensorBoard's config text met a full disk as the run started: the run stopped on it in one line, and the
    trackers already started (MLflow's run: RUNNING for ever) were never closed, the Trainer not holding them yet."""
    closed = []

    class Tracked(trackers.CSV):  # stands in for MLflow's run
        def __init__(self, cfg, run_id):
            self.run_id = "m1"
            super().__init__(os.path.join(cfg.output_dir, "mlflow.csv"), 0)

        def close(self, failed=False):
            closed.append(failed)
            super().close(failed)

    def full_disk(self, values):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.folder)
    monkeypatch.setattr(trackers, "MLflow", Tracked)
    monkeypatch.setattr(run_record.TensorBoard, "config", full_disk)
    assert run(tmp_path, ["tensorboard", "mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert closed == [True]

def test_ending_a_killed_rank_0s_mlflow_run_waits_for_its_store_a_bounded_time(tmp_path, monkeypatch):
    """After rank 0's death, a tracking server that takes connections but does not answer kept main.py's launcher
    (or a one-process run's watcher) waiting, without a word, for MLflow's retries: minutes, the job not ending."""
    cfg = make_config(tmp_path, log={"report_to": ["mlflow"], "tensorboard": None,
                                     "mlflow_tracking_uri": "http://127.0.0.1:9/"})
    (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": "0123abcd"}))
    monkeypatch.setattr(trackers, "mlflow_client", lambda cfg: time.sleep(30))  # no answer
    monkeypatch.setattr(trackers, "END_WAIT_S", 0.5)
    said, started = [], time.monotonic()
    trackers.end_runs_left_running(cfg, said.append)
    assert time.monotonic() - started < 5
    assert said == ["warning: MLflow run 0123abcd was not marked FAILED after rank 0's death (its store, "
                    "http://127.0.0.1:9/, did not answer within 0.5 s)"], said

@pytest.mark.slow  # MLflow's store made
def test_an_mlflow_run_id_the_store_does_not_hold_is_said_before_a_new_run(tmp_path, monkeypatch):
    """trackers.json names a run MLflow's store does not hold as an active one (deleted, or another store since):
    a new run started without a word, though the docs promise one line, as for a W&B or cut id."""
    import mlflow
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = make_config(tmp_path, log={"report_to": ["mlflow"], "mlflow_tracking_uri": uri})
    client = mlflow.MlflowClient(uri)
    deleted = client.create_run(client.create_experiment("image")).info.run_id
    client.delete_run(deleted)
    for gone in (deleted, "0123456789abcdef0123456789abcdef"):  # deleted; never in this store
        (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": gone}))
        said = []
        started = trackers.Trackers(cfg, 4, None, warn=said.append)
        new = json.load(open(tmp_path / "trackers.json"))["mlflow"]
        started.close()
        assert new != gone and client.get_run(new).info.status == "FINISHED"
        assert len(said) == 1 and said[0].startswith(f"{tmp_path}/trackers.json: MLflow run {gone} is not an active "
                                                     f"run of {uri}") and f"a new run, {new}, goes on" in said[0], said


def test_a_copied_output_dir_starts_its_own_tracked_runs(tmp_path, monkeypatch):
    """`cp -r run-a run-b`, then run-b resumed: it continued run-a's W&B and MLflow runs (their ids in the copied
    trackers.json), so in a shared store (a server, MLFLOW_TRACKING_URI) one tracked run held both runs' points. Now
    the copy starts its own, said in one line; the original, and a folder moved (same inode), continue theirs."""
    continued, said = stand_ins_for_wandb_and_mlflow(monkeypatch, new_id="{}-a"), []

    def start(out, step):
        before = len(continued)
        cfg = make_config(out, log={"report_to": ["wandb", "mlflow"], "tensorboard": None})
        trackers.Trackers(cfg, step, tensorboard=None, warn=said.append).close()
        return [run_id for _, run_id in continued[before:]]
    original, copy, moved = tmp_path / "run-a", tmp_path / "run-b", tmp_path / "run-c"
    original.mkdir()
    assert start(original, 0) == [None, None]
    first = json.load(open(original / "trackers.json"))
    ids = [first["wandb"], first["mlflow"]]
    shutil.copytree(original, copy)
    # Its rank 0 killed before its trackers started: the original's MLflow run, which may be training, is not ended
    ended = []
    monkeypatch.setattr(trackers, "mlflow_client", lambda cfg: ended.append(cfg.output_dir))
    trackers.end_runs_left_running(make_config(copy, log={"report_to": ["mlflow"]}), said.append)
    assert ended == [] and said == [], said
    continued = stand_ins_for_wandb_and_mlflow(monkeypatch, new_id="{}-b")  # (what a new run is named from now)
    assert start(copy, 4) == [None, None]  # new runs
    assert len(said) == 1 and said[0].startswith(f"{copy}/trackers.json: written in '{original}', of which this "
                                                 "output_dir is a copy, so W&B and MLflow start new runs"), said
    own = json.load(open(copy / "trackers.json"))
    assert [own["wandb"], own["mlflow"]] == ["wandb-b", "mlflow-b"] and own["output_dir"] == str(copy)
    assert start(copy, 8) == [own["wandb"], own["mlflow"]]  # the copy's own, continued
    assert start(original, 4) == ids  # the original goes on with its own
    os.rename(original, moved)
    assert start(moved, 8) == ids  # moved, not copied: the same runs
    assert len(said) == 1, said


def killed_at_rank_0(cfg, place) -> int:
    """A rank's worker (launcher.Supervisor): rank 0 is killed as the kernel's OOM killer does."""
    if place.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


@pytest.mark.slow  # 12 s: MLflow's store, a spawned rank, a killed process
def test_rank_0_killed_under_main_pys_launcher_leaves_no_mlflow_run_running(tmp_path, monkeypatch, capsys):
    """Rank 0 killed outright (kill -9, the OOM killer) closes no tracker: its MLflow run stayed RUNNING for ever.
    What outlives it (the Supervisor; a one-process run's watcher) ends it FAILED and says so; a run a clean end
    closed is left as it is."""
    import mlflow
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    cfg = make_config(tmp_path, log={"report_to": ["mlflow"], "tensorboard": None})
    opened = trackers.Trackers(cfg, 0, tensorboard=None)  # rank 0's, as the kill finds them: open
    run_id = opened.members[0].run_id
    client = mlflow.MlflowClient(trackers.mlflow_uri(cfg))
    assert client.get_run(run_id).info.status == "RUNNING"
    assert launcher.Supervisor(cfg, [main.RankPlace(0, 0, 1, 1)], killed_at_rank_0).supervise() == 1
    out = capsys.readouterr().out
    assert client.get_run(run_id).info.status == "FAILED"
    assert f"note: MLflow run {run_id}, left RUNNING by rank 0's death, is marked FAILED" in out, out
    client.update_run(run_id, status="FINISHED")  # a run closed, then a resume killed before its trackers started
    said = []
    trackers.end_runs_left_running(cfg, said.append)
    assert said == [] and client.get_run(run_id).info.status == "FINISHED"

    # A run of one process (no launcher above it): the watcher that says it was killed ends its MLflow run too.
    client.update_run(run_id, status="RUNNING")  # as the killed process leaves it
    (tmp_path / "cfg.pickle").write_bytes(pickle.dumps(cfg))
    code = (f"import os, pickle, signal, sys\nsys.path.insert(0, {ROOT!r})\nimport main\n"
            f"cfg = pickle.load(open({str(tmp_path / 'cfg.pickle')!r}, 'rb'))\n"
            "main.start_ranks(cfg, None, lambda cfg, place: os.kill(os.getpid(), signal.SIGKILL))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL and "error: the run (pid " in r.stderr, r.stderr
    assert client.get_run(run_id).info.status == "FAILED"
    assert r.stdout == f"note: MLflow run {run_id}, left RUNNING by rank 0's death, is marked FAILED\n", r.stdout
