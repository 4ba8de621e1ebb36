"""One output_dir holds one run (issue 23 item 1, issue 20's lock): a fresh start into a folder with another run's
checkpoints is refused unless asked to start over (then the old run is moved aside, and test mode scores the new
model); a checkpoint whose run differs in what changes the result is refused with the differences listed; a step
saved again replaces the old files; a second run on a folder in use is refused. And a run says which limit ends it
and ends with a summary whose commands work (items 2 and 3)."""
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, make_config, write_checkpoint

from core import checkpoint

from core import checkpoint_meta
import main
from core.distributed import DistContext
from core.errors import ConfigError

TRAIN = {"max_steps": 6, "epochs": 0, "eval_every": 3, "save_every": 3, "log_every": 3}


def run(out, train=None, **sections) -> int:
    return main.run(make_config(out, train={**TRAIN, **(train or {})}, **sections))


def md5(path) -> str:
    with open(path, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_a_fresh_start_into_another_runs_folder_is_refused_or_starts_over(tmp_path, capsys):
    """The issue's two commands: the default job, then the same with resume=false and another lr. It used to print
    'saved step-N' while keeping the old model.pt, and test mode scored the old model."""
    assert run(tmp_path) == 0
    old = md5(tmp_path / "checkpoints/step-6/model.pt")
    capsys.readouterr()
    assert run(tmp_path, train={"resume": False, "lr": 1e-4}) == 2
    assert errors(capsys) == [f"error: {tmp_path} holds another run (latest {tmp_path}/checkpoints/step-6) and "
                              "train.resume is false: one folder holds one run; resume it (train.resume=auto), use "
                              "another output_dir, or start over with --set train.start_over=true (moves the old "
                              "run aside)"]
    assert md5(tmp_path / "checkpoints/step-6/model.pt") == old  # untouched

    assert run(tmp_path, train={"start_over": True, "lr": 1e-4}) == 0
    out = capsys.readouterr().out
    aside = [n for n in os.listdir(tmp_path) if n.startswith("replaced-")]
    assert len(aside) == 1 and f"moved the previous run's checkpoints, config.yml aside to {tmp_path / aside[0]}" in out
    assert md5(tmp_path / aside[0] / "checkpoints/step-6/model.pt") == old  # nothing was deleted
    assert md5(tmp_path / "checkpoints/step-6/model.pt") != old  # the new run's bytes
    assert "start_over: false" in (tmp_path / "config.yml").read_text()  # a one-off, not a setting of the run

    # Test mode scores the new model: its dev result is the one the new run logged at its best step.
    assert main.main(["--params", str(tmp_path / "config.yml"), "--set", "mode=test"]) == 0
    result = json.loads((tmp_path / "dev_results.json").read_text())
    best = checkpoint_meta.read(str(tmp_path / "checkpoints/step-6"))["state"]["best_step"]
    assert result["checkpoint"] == str(tmp_path / f"checkpoints/step-{best}")
    logged = checkpoint_meta.read(result["checkpoint"])["metrics"]
    assert abs(result["metrics"]["loss"] - logged["loss"]) < 1e-6
    assert result["metrics"]["accuracy"] == logged["accuracy"]
    assert f"wrote {tmp_path}/dev_results.json\n" in capsys.readouterr().out
    assert main.main(["--params", str(tmp_path / "config.yml"), "--set", "mode=test"]) == 0  # again: said
    assert f"wrote {tmp_path}/dev_results.json, replacing the earlier dev_results.json" in capsys.readouterr().out


def test_resuming_another_runs_checkpoint_lists_the_differences(tmp_path, capsys):
    assert run(tmp_path, train={"max_steps": 3}) == 0
    capsys.readouterr()
    assert run(tmp_path, seed=3, model={"dropout": 0.0}) == 2
    # (dropout as each config wrote it: null, which the digits CNN builds as 0.25)
    assert errors(capsys) == [f"error: {tmp_path}/checkpoints/step-3 was written by another run: seed=42 (now 3), "
                              "model.dropout=None (now 0.0); use another output_dir, start over (--set "
                              "train.start_over=true), or resume it anyway (--set train.resume_changed=true)"]
    assert run(tmp_path, train={"batch_size": 16}) == 2
    assert "global batch 32 (now 16: train.batch_size 32 -> 16);" in errors(capsys)[0]  # the key, not a sum
    assert run(tmp_path, train={"grad_accum_steps": 2}) == 2
    assert "global batch 32 (now 64: train.grad_accum_steps 1 -> 2);" in errors(capsys)[0]
    # lr and length may change (extending a run is common): a warning, not a refusal; speed-only settings too.
    assert run(tmp_path, train={"lr": 5e-4}, model={"activation_checkpointing": False}) == 0
    assert "resuming with train.lr 0.001 -> 0.0005" in capsys.readouterr().out
    # An explicit yes: resumed, the differences said once.
    assert run(tmp_path, seed=3, train={"max_steps": 9, "resume_changed": True}) == 0
    out = capsys.readouterr().out
    assert "written by a run that differs: seed=42 (now 3) (train.resume_changed)" in out
    assert checkpoint.latest(str(tmp_path)).endswith("step-9")


def test_resuming_after_the_training_file_changed_size_is_refused_or_starts_the_next_epoch(tmp_path, capsys):
    # 40 rows cut to 8 (the same words and classes): the checkpoint's position (sample 12 of an epoch of 40) was
    # taken in an order of 8 without a word, its epoch's samples repeated or never seen
    data = tmp_path / "data"
    data.mkdir()
    rows = lambda n: "text,label\n" + "".join(("a good film,1\n", "a bad film,0\n")[i % 2] for i in range(n))  # noqa
    (data / "train.csv").write_text(rows(40))
    (data / "dev.csv").write_text(rows(2))
    csv = {"task": "csv_text", "data": {"data_dir": str(data)}}
    assert run(tmp_path / "run", train={"max_steps": 3, "batch_size": 4}, **csv) == 0
    (data / "train.csv").write_text(rows(8))
    capsys.readouterr()
    assert run(tmp_path / "run", train={"batch_size": 4}, **csv) == 2
    assert "step-3 was written by another run: a training set of 40 samples (now 8);" in errors(capsys)[0]
    assert run(tmp_path / "run", train={"batch_size": 4, "resume_changed": True}, **csv) == 0
    assert "a training set of 40 samples (now 8) (train.resume_changed)" in capsys.readouterr().out
    state = checkpoint_meta.read(checkpoint.latest(str(tmp_path / "run")))["state"]
    assert (state["epoch"], state["sample_in_epoch"]) == (2, 4)  # steps 4-6: 8 rows, then 4 more: 1.5 epochs on


def test_a_step_saved_again_replaces_the_old_files(tmp_path):
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    for value in (1.0, 2.0):
        path = write_checkpoint(str(tmp_path), 5, ctx, lambda d, v=value: torch.save({"w": torch.tensor(v)},
                                                                                   os.path.join(d, "model.pt")),
                                {"step": 5, "state": {}})
        assert torch.load(os.path.join(path, "model.pt"))["w"].item() == value
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-5"]  # the old copy is gone, nothing left over


def test_the_plan_says_which_limit_ends_the_run(tmp_path, capsys):
    # digits: 1272 samples, batch 32 -> 40 batches an epoch; epochs=1 ends before max_steps=1000.
    assert run(tmp_path, train={"epochs": 1, "max_steps": 1000, "eval_every": 0, "save_every": 0}) == 0
    assert "  40 optimizer steps: epochs=1 ends before max_steps=1000 (40 micro-batches per epoch)" in \
        capsys.readouterr().out
    # --set train.max_steps alone on the command line makes it the limit, and says so; resuming extends the run.
    params = tmp_path / "config.yml"
    assert main.main(["--params", str(params), "--set", "train.max_steps=50"]) == 0
    out = capsys.readouterr().out
    assert "note: --set train.max_steps=50 without train.epochs: the run lasts 50 steps" in out
    assert "(now 50 steps in all: max_steps=50)" in out and "already complete" not in out
    assert checkpoint.latest(str(tmp_path)).endswith("step-50")
    # Run again: complete, and the message says why, consistently with the plan.
    assert main.main(["--params", str(params), "--set", "train.max_steps=50"]) == 0
    assert f"already complete at step 50 ({tmp_path}/checkpoints/step-50): this run ends at step 50 " \
           "(max_steps=50)" in capsys.readouterr().out


def test_the_max_steps_note_prints_only_where_the_file_limits_epochs(tmp_path, monkeypatch, capsys):
    # The note says the appended train.epochs=0 lifts the file's epochs limit: a file (or preset) whose epochs is
    # already 0 has none to lift, and the note said so anyway.
    monkeypatch.setattr(main, "run", lambda cfg: 0)  # the note is printed before the run starts
    for epochs, noted in ((0, False), (3, True)):
        params = tmp_path / f"epochs{epochs}.yml"
        params.write_text(f"output_dir: {tmp_path}\ntrain:\n  epochs: {epochs}\n  max_steps: 5\n")
        assert main.main(["--params", str(params), "--set", "train.max_steps=7"]) == 0
        assert ("note: --set train.max_steps=7 without train.epochs" in capsys.readouterr().out) == noted, epochs
    assert main.main(["--params", os.path.join(ROOT, "configs", "gpt2_lm_tiny.yml"), "--set",
                      f"output_dir={tmp_path}/lm", "--set", "train.max_steps=12"]) == 0  # epochs 0 (warm-up 10)
    assert "note:" not in capsys.readouterr().out


def test_epochs_typed_alone_lift_the_files_step_limit_as_max_steps_do(tmp_path, monkeypatch, capsys):
    """--set train.max_steps=N alone lifted the file's epochs limit, but --set train.epochs=E alone kept the file's
    max_steps: `--set train.epochs=3` on sst2_minilm (max_steps 1000, about half an epoch) trained half an epoch."""
    ran = []
    monkeypatch.setattr(main, "run", lambda cfg: ran.append(cfg.train) or 0)
    preset = os.path.join(ROOT, "configs", "sst2_minilm.yml")
    assert main.main(["--params", preset, "--set", f"output_dir={tmp_path}", "--set", "train.epochs=3"]) == 0
    assert (ran[-1].epochs, ran[-1].max_steps) == (3, 0)
    assert ("note: --set train.epochs=3 without train.max_steps: the run lasts 3 epochs (train.max_steps=0; add "
            "--set train.max_steps=N to keep a step limit)") in capsys.readouterr().out
    assert main.main(["--params", preset, "--set", f"output_dir={tmp_path}", "--set", "train.epochs=3", "--set",
                      "train.max_steps=50"]) == 0  # both typed: both kept, nothing said
    assert (ran[-1].epochs, ran[-1].max_steps) == (3, 50) and "note:" not in capsys.readouterr().out
    params = tmp_path / "epochs_only.yml"  # a file without a step limit: nothing lifted, nothing said
    params.write_text(f"output_dir: {tmp_path}\ntrain:\n  epochs: 2\n  max_steps: 0\n")
    assert main.main(["--params", str(params), "--set", "train.epochs=5"]) == 0
    assert (ran[-1].epochs, ran[-1].max_steps) == (5, 0) and "note:" not in capsys.readouterr().out

def test_a_run_ends_with_a_summary_whose_commands_work(tmp_path, capsys):
    assert run(tmp_path, log={"tensorboard": True}) == 0
    out = capsys.readouterr().out
    summary = out[out.index("done: 6 steps; best dev accuracy="):].splitlines()
    assert summary[1] == f"  checkpoints  {tmp_path}/checkpoints (best: {checkpoint_meta.best_recorded(str(tmp_path))})"
    assert summary[3] == f"  tensorboard  tensorboard --logdir {tmp_path}/tensorboard"
    commands = {line.split()[0]: line.split(None, 1)[1] for line in summary[4:6]}
    assert commands["test"] == f"python main.py --params {tmp_path}/config.yml --set mode=test"
    for mode, wrote in (("test", "test_results.json"), ("export", "export")):
        argv = commands[mode].split()[2:]
        assert main.main(argv) == 0
        assert os.path.exists(tmp_path / wrote)


def test_the_summary_offers_no_export_to_a_task_that_has_none(tmp_path, capsys, monkeypatch):
    """A task that lists no export_formats (every built-in one has some: csv_text made to have none): its summary
    offered a command that could only fail."""
    from tasks.csv_text import CSVTextTask
    monkeypatch.setattr(CSVTextTask, "export_formats", ())
    (tmp_path / "data").mkdir()
    for split in ("train", "dev"):
        (tmp_path / "data" / f"{split}.csv").write_text("text,label\na fine film,pos\nawful,neg\n")
    assert main.run(make_config(tmp_path / "run", task="csv_text", data={"data_dir": str(tmp_path / "data")},
                                train={**TRAIN, "max_steps": 1, "batch_size": 2})) == 0
    summary = capsys.readouterr().out.split("done: 1 steps;")[1]
    assert "  test         python main.py" in summary and "mode=export" not in summary


def test_a_second_run_on_a_folder_in_use_is_refused(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from resilience import run_dir_lock;"
                               " lock = run_dir_lock.hold_output_dir(sys.argv[1]);"
                               " print('held', flush=True); time.sleep(60)", str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        held_by = (tmp_path / ".lock").read_text().strip()
        assert held_by.startswith(f"pid {holder.pid} on {os.uname().nodename}, started ")
        started = time.time()
        assert run(tmp_path) == 2
        assert errors(capsys) == [f"error: output_dir {str(tmp_path)!r} is in use by another run ({held_by}); wait "
                                  "for it to end, or use another output_dir"]
        assert time.time() - started < 5 and not os.path.exists(tmp_path / "checkpoints")
    finally:
        holder.kill()
        holder.wait()
    assert run(tmp_path) == 0  # the lock ends with its process, however it ended: never stale



def test_test_mode_takes_a_batch_list_made_for_another_world_size(tmp_path):
    """train.batch_size listed per rank for one world size was refused in test mode at another ("lists 1 sizes but
    there are 2 ranks"), though test mode runs in one process and reads no training batches. Training still
    refuses it."""
    assert run(tmp_path, train={"batch_size": [16]}) == 0
    two = {"strategy": "ddp", "procs_per_node": 2}
    assert main.run(make_config(tmp_path, mode="test", train={**TRAIN, "batch_size": [16]}, dist=two)) == 0
    assert json.loads((tmp_path / "dev_results.json").read_text())["metrics"]["samples"] > 0
    with pytest.raises(ConfigError, match=r"`train.batch_size` lists 1 sizes but there are 2 ranks"):
        make_config(tmp_path, train={**TRAIN, "batch_size": [16]}, dist=two)


def test_a_finished_run_run_again_with_a_lower_keep_last_prunes(tmp_path, capsys):
    """Run again after its end with train.keep_last lowered, a run said "already complete" and kept every old
    checkpoint. It now prunes as its next save would: the latest and the best stay, nothing else is touched."""
    train = {"max_steps": 4, "eval_every": 1, "save_every": 1, "keep_last": 5}
    assert run(tmp_path, train=train) == 0
    assert [step for step, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [1, 2, 3, 4]
    best = checkpoint_meta.read(str(tmp_path / "checkpoints/step-4"))["state"]["best_step"]
    (tmp_path / "checkpoints" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert run(tmp_path, train={**train, "keep_last": 1}) == 0
    assert [step for step, _ in checkpoint.complete_checkpoints(str(tmp_path))] == sorted({best, 4})
    gone = ", ".join(f"step-{s}" for s in (1, 2, 3) if s != best)
    assert f"removed {gone}: train.keep_last is 1 (and the best are kept)" in capsys.readouterr().out
    assert (tmp_path / "checkpoints" / "notes.txt").read_text() == "mine"


def test_a_checkpoint_key_of_another_mode_is_one_line_not_ignored(tmp_path):
    """mode: export with predict.checkpoint exported the best checkpoint, not the one named (export and test read
    test.checkpoint); mode: predict ignored test.checkpoint likewise. Each is now one line naming the key to set;
    both set, each mode reads its own."""
    assert run(tmp_path, train={"max_steps": 2, "save_every": 1, "eval_every": 1}) == 0
    step1 = str(tmp_path / "checkpoints" / "step-1")
    for mode, key, other, reads in (("export", "predict", "test", "mode predict only"),
                                    ("test", "predict", "test", "mode predict only"),
                                    ("predict", "test", "predict", "modes test and export")):
        sections = {"predict": {"input": step1}, "test": {}}
        sections[key]["checkpoint"] = step1
        with pytest.raises(ConfigError) as e:
            make_config(tmp_path, mode=mode, **sections)
        assert str(e.value) == (f"test: `{key}.checkpoint` is read by {reads}; mode {mode} reads {other}.checkpoint: "
                                "set that instead (null: the best checkpoint)")
    make_config(tmp_path, mode="export", test={"checkpoint": step1}, predict={"checkpoint": step1})
