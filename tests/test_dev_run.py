"""The dev run (--dev-run, train.dev_run): every stage of a job for a step or two, in a temporary folder; a stage that
fails is named with its error, and the real output_dir is never written."""
import json
import os
import re
import socket
import shutil
import signal
import subprocess
import sys
import time

import pytest

import main
from conftest import ROOT, free_port, make_config
from core.config import read_config
from extras import dev_run
from image_folders import digit_folder
from test_text_tasks import train

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_a_dev_run_passes_every_stage_and_writes_nothing_to_output_dir(tmp_path):
    real = tmp_path / "real"
    out = subprocess.run([sys.executable, "main.py", "--params", "parameters.yml", "--dev-run",
                          "--set", f"output_dir={real}", "--set", "log.tensorboard=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "shrunk: 1 batch per evaluation, batch 32 -> 2, eval batch 256 -> 2" in out.stdout
    for stage in ("train", "resume", "test", "export"):
        assert re.search(rf"^  {stage} .*: ok in [\d.]+ s$", out.stdout, re.M), out.stdout
    assert "dev run passed" in out.stdout
    assert not real.exists()  # nothing written to the real output_dir, not even its folder
    temporary = re.search(r" in (\S+) \(nothing is written", out.stdout).group(1)
    assert not os.path.exists(temporary)  # removed once every stage passed


@pytest.mark.slow
def test_a_dev_run_names_the_stage_that_fails_and_keeps_its_files(tmp_path, capsys, monkeypatch):
    """A fault in step 3 is the resume stage's (the train stage runs steps 1-2): it is named, with the error."""
    monkeypatch.setenv("FAULT", "raise:0:3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = dev_run.run(os.path.join(ROOT, "tests", "faulty_main.py"), os.path.join(ROOT, "parameters.yml"),
                       ["log.tensorboard=false"], str(tmp_path / "real"), exports=True)
    out = capsys.readouterr()
    assert code != 0
    assert re.search(r"^  train .*: ok in", out.out, re.M)
    assert "resume" in out.err and "FAILED" in out.err and "injected fault" in out.err
    assert "test " not in out.out  # nothing after the failing stage
    kept = re.search(r"every stage's output is in (\S+)", out.err).group(1)
    assert os.path.isfile(os.path.join(kept, "resume.log"))
    assert not (tmp_path / "real").exists()
    shutil.rmtree(kept)  # kept for a user to read; a test leaves nothing in the temporary folder


def test_every_stage_resumes_tests_and_exports_the_dev_runs_own_checkpoints_whatever_the_config_says(tmp_path,
                                                                                                   monkeypatch):
    """A real run's train.resume: false (or a path), start_over and test.checkpoint would make the resume stage
    fail on a good edit, or test and export the real run's checkpoint instead of the dev run's."""
    stages = []

    def stage(main_py, params, overrides, log_path):
        stages.append(dict(item.split("=", 1) for item in overrides))  # the last --set of a key wins
        return 0, 0.0, ["resumed from step-2"]
    monkeypatch.setattr(dev_run, "stage", stage)
    real = tmp_path / "real"
    user = ["train.resume=false", "train.start_over=true", f"test.checkpoint={real}/checkpoints/step-9"]
    assert dev_run.run("main.py", os.path.join(ROOT, "parameters.yml"), user, str(real), exports=True) == 0
    assert [s["mode"] for s in stages] == ["train", "train", "test", "export"]
    for s in stages:
        assert (s["train.resume"], s["train.start_over"], s["test.checkpoint"]) == ("auto", "false", "null")


def test_ctrl_c_during_a_dev_run_is_one_line_naming_the_stage_and_its_folder(tmp_path, monkeypatch, capsys):
    """It was KeyboardInterrupt's traceback from inside subprocess.run, and the temporary folder left unnamed."""
    def stage(main_py, params, overrides, log_path):
        if os.path.basename(log_path) == "resume.log":
            raise KeyboardInterrupt
        return 0, 0.0, []
    monkeypatch.setattr(dev_run, "stage", stage)
    assert dev_run.run("main.py", "parameters.yml", [], str(tmp_path / "real"), exports=True) == 130
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dev run interrupted (Ctrl-C) in stage 'resume'; the output so far "
                                               "is in "), err
    kept = err[0].rsplit(" ", 1)[-1]
    assert os.path.isdir(kept)
    shutil.rmtree(kept)


@pytest.mark.slow
def test_a_stop_signal_to_a_dev_run_ends_it_and_its_stage_in_one_line(tmp_path):
    """SIGTERM to `python main.py --dev-run` (a scheduler's, `kill`) killed it without a word (exit 143), and the
    stage it had started trained on, orphaned, in a folder nobody was told of."""
    env = {**ENV, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "main.py", "--dev-run", "--set", f"output_dir={tmp_path / 'real'}",
                             "--set", "train.log_every=1"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(os.path.exists(os.path.join(tmp_path, d, "run", "logs", "rank0.log"))
                  for d in os.listdir(tmp_path) if d.startswith("dev-run-")):  # the train stage is running
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    folder = next(os.path.join(tmp_path, d) for d in os.listdir(tmp_path) if d.startswith("dev-run-"))
    assert proc.returncode == 143, (out, err)
    assert err.splitlines() == [f"dev run interrupted by SIGTERM in stage 'train'; the output so far is in {folder}"]
    time.sleep(1)
    stages = [p for p in os.listdir("/proc") if p.isdigit() and folder.encode() in open_cmdline(p)]
    assert not stages, stages  # the stage and whatever it started are gone


def open_cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # (gone meanwhile)
        return b""


@pytest.mark.parametrize("rank", [0, 1])
def test_a_dev_run_under_torchrun_is_one_line_from_rank_0(rank, monkeypatch, capsys):
    """Each rank would run a dev run of its own, whose stages, seeing torchrun's variables, joined the other
    ranks' as ranks of one group (in other temporary folders) and failed with gloo's traceback."""
    monkeypatch.setattr(dev_run.tempfile, "mkdtemp", lambda **kw: pytest.fail("a dev run started"))
    for name, value in {"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": 2,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():  # as torchrun sets them
        monkeypatch.setenv(name, str(value))
    assert dev_run.run("main.py", "parameters.yml", [], "runs/digits", exports=True) == 2
    said = ["error: --dev-run (train.dev_run) starts the stages' processes itself: run `python main.py --params "
            "parameters.yml --dev-run` on its own, not under torchrun"]
    assert capsys.readouterr().err.splitlines() == ([] if rank else said)


def test_a_dev_run_of_a_config_of_several_nodes_is_one_line(tmp_path, monkeypatch, capsys):
    """Its stages waited for the other nodes' ranks (up to dist.timeout_s, 30 minutes), the terminal silent: a dev
    run's folder is this machine's own, so other nodes could never have joined it."""
    monkeypatch.setattr(dev_run.tempfile, "mkdtemp", lambda **kw: pytest.fail("a dev run started"))
    code = main.main(["--params", os.path.join(ROOT, "parameters.yml"), "--dev-run", "--set", "dist.nodes=2",
                      "--set", "dist.strategy=ddp", "--set", "dist.master_addr=127.0.0.1",
                      "--set", f"output_dir={tmp_path / 'real'}"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dist.nodes is 2" in err[0] and "--set dist.nodes=1" in err[0], err
    assert not (tmp_path / "real").exists()


@pytest.mark.parametrize("preset, strategy, expected", [
    ("configs/resnet50_imagefolder.yml", "none", ["train.batch_size=2", "train.eval_batch_size=2",
                                                  "train.precision=fp32"]),  # (on a CPU: auto is timed there)
    ("configs/gpt2_lm.yml", "ddp", ["train.batch_size=2", "train.eval_batch_size=2", "data.max_length=64",
                                    "train.grad_accum_steps=2"]),
    ("configs/gpt2_lm.yml", "pipe", ["train.batch_size=4", "train.eval_batch_size=4"]),  # 1 per micro-batch
    # 2 per micro-batch: one 32 px image was refused (the ResNet's BatchNorm on a 1x1 map): the dev run failed
    ("configs/image_folder_tiny.yml", "pipe", ["train.batch_size=8", "train.eval_batch_size=8"]),
    ("configs/shakespeare_char.yml", "none", ["train.batch_size=2"]),
])
def test_the_dev_run_shrinks_only_what_costs_time(preset, strategy, expected):
    """The batch per rank (under pipe: one sample per micro-batch), the evaluation batch and how many it reads,
    the LM window and precision auto's timed passes shrink; model, strategy and data stay the preset's."""
    cfg = read_config(os.path.join(ROOT, preset), [f"dist.strategy={strategy}", "dist.device=cpu"])
    overrides, said = dev_run.shrunk(cfg)
    assert overrides[0] == "train.limit_eval_batches=1" and set(expected) <= set(overrides)
    assert len(said) == len(overrides)
    overrides = [o for o in overrides if not o.startswith("dist.master_port=")]  # (29500 may be another run's)
    assert not any(o.startswith(("model.", "dist.")) for o in overrides)
    if "shakespeare" in preset:  # a 64-token window already, precision fp32: nothing else to shrink
        assert not any(o.startswith(("data.", "train.precision", "train.grad")) for o in overrides)
    stages = [f"dist.strategy={strategy}", "dist.device=cpu"] + overrides
    read_config(os.path.join(ROOT, preset), stages)  # the stages' config is valid


def test_a_dev_run_reports_to_no_shared_tracker():
    """W&B and MLflow are left out (a trial makes no run in a team's project); TensorBoard and the CSV stay."""
    cfg = read_config(os.path.join(ROOT, "parameters.yml"), ["log.report_to=[tensorboard, wandb, csv, mlflow]"])
    overrides, said = dev_run.shrunk(cfg)
    assert "log.report_to=[tensorboard, csv]" in overrides and "no wandb or mlflow run" in said
    kept = [o for o in overrides if o.startswith("log.report_to=")]
    assert read_config(os.path.join(ROOT, "parameters.yml"), kept).log.report_to == ["tensorboard", "csv"]
    assert not any(o.startswith("log.") for o in dev_run.shrunk(read_config(os.path.join(ROOT, "parameters.yml")))[0])


def test_a_dev_run_takes_a_free_port_when_another_program_holds_the_configured_one():
    """One node over tcp: the stages would all fail with "address already in use"; the dev run moves, and says so."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = read_config(os.path.join(ROOT, "parameters.yml"), [f"dist.master_port={port}"])
        overrides, said = dev_run.shrunk(cfg)
    moved = [o for o in overrides if o.startswith("dist.master_port=")]
    assert len(moved) == 1 and moved[0] != f"dist.master_port={port}", overrides
    assert any(f"port {port} (in use) -> " in s for s in said), said


@pytest.mark.slow
def test_the_dev_run_of_resnet50_passes_on_a_small_image_folder_with_its_batch_shrunk(tmp_path):
    """A GPU-sized preset (ResNet-50 at 224x224, SGD, precision auto) as it is, on 30 made images."""
    images = digit_folder(tmp_path / "images", train=8, val=2)
    real = tmp_path / "real"
    out = subprocess.run([sys.executable, "main.py", "--params", "configs/resnet50_imagefolder.yml", "--dev-run",
                          "--set", f"output_dir={real}", "--set", f"data.data_dir={images}",
                          "--set", "log.tensorboard=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("shrunk: 1 batch per evaluation, batch 32 -> 2, eval batch 256 -> 2, precision auto -> fp32 (not timed "
            "on a CPU)") in out.stdout
    assert re.search(r"^  export .*: ok in", out.stdout, re.M) and not real.exists()


@pytest.mark.slow
def test_a_dev_run_under_ddp_with_two_processes_passes_and_writes_nothing_to_output_dir(tmp_path):
    real = tmp_path / "real"
    out = subprocess.run([sys.executable, "main.py", "--params", "parameters.yml", "--dev-run",
                          "--set", f"output_dir={real}", "--set", "log.tensorboard=false",
                          "--set", "dist.strategy=ddp", "--set", "dist.procs_per_node=2",
                          "--set", f"dist.master_port={free_port()}"],  # (29500 may be another run's)
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    for stage in ("train", "resume", "test", "export"):
        assert re.search(rf"^  {stage} .*: ok in [\d.]+ s$", out.stdout, re.M), out.stdout
    assert not real.exists()
    temporary = re.search(r" in (\S+) \(nothing is written", out.stdout).group(1)
    assert not os.path.exists(temporary)


def test_limit_eval_batches_holds_the_last_evaluation_and_test_mode_to_that_many_batches(tmp_path):
    cfg = make_config(tmp_path, train={"max_steps": 2, "epochs": 0, "eval_every": 1, "eval_batch_size": 8,
                                       "eval_batches": 4, "limit_eval_batches": 2})
    train(cfg, 1)
    log = open(tmp_path / "logs" / "rank0.log").read()
    for step in (1, 2):  # below eval_batches' 4 batches during training, and the last one too
        # the note names the key that chose the subset (it said train.eval_batches, which chose none here)
        assert re.search(rf"step {step} dev: .*samples=16 \(on 16 of 225 samples: train.limit_eval_batches\)", log), log
    test = make_config(tmp_path, mode="test", train={"eval_batch_size": 8, "limit_eval_batches": 2},
                       test={"splits": ["dev"]})
    assert main.run(test) == 0
    assert json.load(open(tmp_path / "dev_results.json"))["metrics"]["samples"] == 16
