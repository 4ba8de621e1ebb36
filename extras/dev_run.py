"""A dev run (Lightning's fast_dev_run): every stage of a job, tiny, in a temporary folder, so that a broken edit is
found in seconds rather than at the first evaluation, save or resume of a real run.

    python main.py --params configs/X.yml --dev-run          (or --set train.dev_run=true)

Each stage is `python main.py` with the same params file and --set values, plus a few overrides: two training steps
with an evaluation after the first (one batch), a save, a resume from it, test mode, export where the task exports.
The overrides lift what a real run rightly refuses in a 2-step trial (a warm-up longer than the run, say). Every
stage runs under the configured strategy; output_dir is a temporary folder, removed when all passed, kept to read
when one failed. Nothing is written to the real output_dir.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

# The overrides every stage takes: a 2-step run that evaluates, saves and can be resumed, with no early stop.
RUN = ["train.dev_run=false", "train.epochs=0", "train.max_steps=3", "train.warmup=0", "train.eval_every=1", "train.eval_batches=1",
       "train.save_every=1", "train.patience=0", "train.time_limit=null", "train.profile_steps=null",
       "train.log_every=1", "log.progress_bar=false"]
STAGES = [  # name, what it checks, its own overrides
    ("train", "2 steps, an evaluation of one batch, a save", ["mode=train", "train.max_steps=2"]),
    ("resume", "from step 2 to step 3", ["mode=train"]),
    ("test", "the best checkpoint", ["mode=test"]),
    ("export", "the best checkpoint", ["mode=export"]),
]
TAIL_LINES = 15  # of a failed stage's output


def run(main_py: str, params: str, overrides: list[str], output_dir: str, exports: bool) -> int:
    """Run the stages one after another; 0 when all passed, else the failing stage's exit code."""
    folder = tempfile.mkdtemp(prefix="dev-run-")
    print(f"dev run of {params} under its configured strategy, in {folder} (nothing is written to {output_dir})",
          flush=True)
    began = time.perf_counter()
    for name, what, own in STAGES:
        if name == "export" and not exports:
            print(f"  {name:<7} skipped: this task does not export", flush=True)
            continue
        code, seconds, log = stage(main_py, params, overrides + RUN + own
                                   + [f"output_dir={folder}/run", f"export.dir={folder}/export"],
                                   os.path.join(folder, f"{name}.log"))
        if code == 0 and name == "resume" and not any("resumed from" in line for line in log):
            code, log = 1, log + ["dev run: the resume stage trained, but did not resume from the saved step 2"]
        if code != 0:
            print(f"  {name:<7} {what}: FAILED (exit code {code}) after {seconds:.1f} s; its last lines:",
                  file=sys.stderr)
            print("\n".join("    " + line for line in log[-TAIL_LINES:]), file=sys.stderr)
            print(f"dev run: stage {name!r} failed; every stage's output is in {folder}", file=sys.stderr)
            return code
        print(f"  {name:<7} {what}: ok in {seconds:.1f} s", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    print(f"dev run passed in {time.perf_counter() - began:.1f} s", flush=True)
    return 0


def stage(main_py: str, params: str, overrides: list[str], log_path: str) -> tuple[int, float, list[str]]:
    """One `python main.py`: its exit code, its seconds and its output's lines (also kept in log_path)."""
    command = [sys.executable, main_py, "--params", params]
    for item in overrides:
        command += ["--set", item]
    began = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - began
    with open(log_path, errors="replace") as log:
        return code, seconds, log.read().splitlines()
