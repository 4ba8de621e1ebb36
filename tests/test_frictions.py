"""What a new user runs into (issue 11): precision `auto`, OpenMP threads of ranks sharing a CPU, evaluation that
shows it is alive, progress bar and log lines side by side, the dev loss following the task's training loss."""
import contextlib
import dataclasses
import fcntl
import io
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
import torch

from conftest import ROOT, free_port, make_config

from resilience import launcher
from core import run_log, run_record
from wiring import checked_config
from extras.balance import resolve_precision


def build_trainer(cfg, task=None):
    from core import process_group
    import wiring
    return wiring.build_trainer(cfg, process_group.init(cfg, 0, 1, 0), task)


def child_env(**extra):
    """This environment without the OpenMP settings conftest gives the test process, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------------------------
# train.precision: auto
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device, bf16, expected, note", [
    ("cuda", True, "bf16", "auto -> bf16 (GPU with bf16)"),
    ("cuda", False, "fp32", "auto -> fp32 (GPU without bf16)"),
    ("cpu", False, "fp32", "auto -> fp32 (CPU)"),
])
def test_precision_auto_follows_the_device(device, bf16, expected, note):
    assert resolve_precision("auto", device, bf16) == (expected, note)
    for explicit in ("fp32", "fp16", "bf16"):  # an explicit choice is never changed
        assert resolve_precision(explicit, device, bf16) == (explicit, explicit)


def test_precision_auto_is_fp32_on_cpu_and_the_plan_says_so(tmp_path):
    t = build_trainer(make_config(tmp_path, train={"precision": "auto", "max_steps": 2}))
    assert t.train_cfg.precision == "fp32" and t.cfg.train.precision == "fp32"
    assert isinstance(t.autocast(), contextlib.nullcontext)  # no autocast
    assert "precision auto -> fp32 (CPU)" in run_record.plan(t)


def test_presets_use_auto_precision():
    """The GPU presets ask for bf16 only where the device has it (bf16 on a CPU is several times slower)."""
    import yaml
    configs = os.path.join(ROOT, "configs")
    for name in sorted(os.listdir(configs)):
        with open(os.path.join(configs, name)) as f:
            precision = (yaml.safe_load(f).get("train") or {}).get("precision", "fp32")
        assert precision in ("auto", "fp32"), f"configs/{name}: precision {precision}"
    assert checked_config(os.path.join(configs, "sst2_minilm.yml")).train.precision == "auto"  # and it validates


# ---------------------------------------------------------------------------------------------------------------
# OpenMP and threads of ranks sharing a CPU
# ---------------------------------------------------------------------------------------------------------------
def test_rank_environment_sets_passive_waiting_only_for_cpu_ranks_sharing_a_host(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "procs_per_node": 2, "device": "cpu"})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert launcher.rank_environment(cfg, 2) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert launcher.rank_environment(cfg, 1) == {}  # one rank: nothing shares its cores
    gpu = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, device="cuda"))  # (validation needs one)
    assert launcher.rank_environment(gpu, 2) == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # yours is kept
    assert launcher.rank_environment(cfg, 2) == {}
    with launcher.environment({"TRAINER_TEST_VAR": "1"}):
        assert os.environ["TRAINER_TEST_VAR"] == "1"
    assert "TRAINER_TEST_VAR" not in os.environ


def test_spawned_ranks_start_with_passive_openmp_and_their_share_of_the_cores(tmp_path):
    """OMP_DISPLAY_ENV makes each process's OpenMP runtime print what it read when torch loaded it: with
    PASSIVE its spin count is 0. The launcher (which has no PASSIVE) prints its own, non-zero."""
    r = subprocess.run([sys.executable, "main.py", "--set", f"output_dir={tmp_path}", "--set", "dist.strategy=ddp",
                        "--set", "dist.procs_per_node=2", "--set", "train.max_steps=2", "--set", "train.eval_every=0",
                        "--set", "log.tensorboard=false", "--set", "log.progress_bar=false",
                        "--set", f"dist.master_port={free_port()}"],  # not 29500: another run may hold it
                       cwd=ROOT, env=child_env(OMP_DISPLAY_ENV="VERBOSE"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    spins = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", r.stderr)  # (a process may load two OpenMP runtimes)
    assert spins.count("0") >= 2 and "300000" in spins, spins  # the ranks passive, the launcher unchanged
    cores = len(os.sched_getaffinity(0))
    assert (f"CPU threads per rank {max(1, cores // 2)} ({cores} cores shared by 2 ranks on this host), "
            f"OMP_WAIT_POLICY PASSIVE") in r.stdout


def test_omp_num_threads_of_the_user_is_kept(tmp_path, monkeypatch):
    from core import distributed
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ctx = distributed.DistContext(0, 1, 0, torch.device("cpu"), None)
    try:
        torch.set_num_threads(1)
        line = distributed.share_cores(ctx, 2)
        assert torch.get_num_threads() == 1 and "CPU threads per rank 1 (OMP_NUM_THREADS=1)" in line
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        line = distributed.share_cores(ctx, 2)
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        assert "OMP_WAIT_POLICY unset (idle threads spin: export OMP_WAIT_POLICY=PASSIVE" in line
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation shows it is alive; bar and log lines side by side
# ---------------------------------------------------------------------------------------------------------------
def test_long_evaluation_writes_progress_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(run_log, "EVAL_LOG_EVERY_S", 0.0)  # every batch (30 s in real runs)
    t = build_trainer(make_config(tmp_path, train={"eval_batch_size": 8}))
    metrics = t.evaluate("dev")
    log = open(tmp_path / "logs" / "rank0.log").read()
    batches = -(-225 // 8)  # the digits dev split: 225 images
    lines = re.findall(r"evaluating dev at step 0: (\d+)/(\d+) batches, \d+ s", log)
    assert [int(d) for d, _ in lines] == list(range(1, batches)) and {int(n) for _, n in lines} == {batches}
    assert metrics["samples"] == 225 and re.search(r"step 0 dev: .*\bloss=", log)


def run_in_terminal(args, cwd=ROOT, columns=120) -> tuple[int, str]:
    """Run a command attached to a pseudo-terminal (so tqdm draws its bar) of `columns` columns; return its
    exit code and everything it wrote to the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(args, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return p.wait(timeout=300), out.decode(errors="replace")


def test_progress_bar_and_log_lines_coexist(tmp_path):
    code, screen = run_in_terminal([sys.executable, "main.py", "--set", f"output_dir={tmp_path}",
                                    "--set", "train.max_steps=12", "--set", "train.log_every=2",
                                    "--set", "train.eval_every=4", "--set", "train.eval_batch_size=8",
                                    "--set", "log.tensorboard=false", "--set", "log.progress_bar=true"])
    assert code == 0, screen[-3000:]
    assert "/12 [" in screen and "dev:" in screen  # the training bar and the evaluation bar were drawn
    for step in (4, 8, 12):  # a dev line starts a line of its own, above the bar, not glued onto it
        at = screen.index(f"step {step} dev: ")
        assert screen[at - 1] in "\r\n", repr(screen[at - 80:at + 20])
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert [int(s) for s in re.findall(r"step (\d+)/12 .*\bloss=", log)] == list(range(2, 13, 2))  # every step line
    assert [int(s) for s in re.findall(r"step (\d+) dev: .*\bloss=", log)] == [4, 8, 12]
    assert "\x1b[" not in log and "\r" not in log and "%|" not in log and "it/s" not in log


def test_transformers_output_has_no_bars_and_no_colour_codes_in_a_file():
    """transformers colours its load report even when its output is a file (and draws loading bars)."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging
    from tasks.text_common import plain_transformers_output
    plain_transformers_output()
    assert not hf_logging.is_progress_bar_enabled()
    handler = logging.getLogger("transformers").handlers[0]
    saved, verbosity = handler.setStream(io.StringIO()), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # (an earlier test's export may have quietened transformers)
    try:
        hf_logging.get_logger("transformers.modeling_utils").warning("\x1b[1mBertModel LOAD REPORT\x1b[0m x=%d", 3)
        written = handler.stream.getvalue()
    finally:
        handler.setStream(saved)
        hf_logging.set_verbosity(verbosity)
    assert written.endswith("BertModel LOAD REPORT x=3\n") and "\x1b" not in written, repr(written)


# ---------------------------------------------------------------------------------------------------------------
# The dev loss is the task's own loss
# ---------------------------------------------------------------------------------------------------------------
def test_dev_loss_follows_an_edited_training_loss(tmp_path):
    from tasks.image import ImageTask

    class Smoothed(ImageTask):  # a user edits the loss at its `# ----->` marker
        def loss_from_output(self, logits, labels):
            return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=0.3)

    cfg = make_config(tmp_path, train={"max_steps": 2})
    plain = build_trainer(cfg).evaluate("dev")
    edited_trainer = build_trainer(cfg, Smoothed(cfg))
    edited = edited_trainer.evaluate("dev")
    # Same initial weights (same seed): the predictions agree, the loss is the smoothed one.
    assert edited["accuracy"] == plain["accuracy"] and abs(edited["loss"] - plain["loss"]) > 1e-3
    batch = edited_trainer.task.collate([edited_trainer.datasets["dev"][i] for i in range(225)])
    model = edited_trainer.strategy.raw_model.eval()
    with torch.no_grad():
        expected = edited_trainer.task.loss_sum(model, batch).item() / 225
    assert edited["loss"] == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# --help says what there is to run (issue 23)
# ---------------------------------------------------------------------------------------------------------------
def test_help_lists_the_modes_the_presets_and_points_to_parameters_yml():
    r = subprocess.run([sys.executable, "main.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "--set mode=" in out
    for mode in ("train", "test", "export"):  # one line per mode, its name first
        assert re.search(rf"^  {mode} +\S", out, re.M), f"--help does not describe mode {mode}:\n{out}"
    presets = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith((".yml", ".yaml")))
    assert presets, "configs/ holds no preset"
    for name in presets:
        assert re.search(rf"^  configs/{re.escape(name)}$", out, re.M), f"--help does not list configs/{name}"
    after_presets = out.split("\n  configs/" + presets[-1])[-1]  # the epilog's pointer, not --params' default
    assert "parameters.yml" in after_presets and "config.py" in after_presets, out
