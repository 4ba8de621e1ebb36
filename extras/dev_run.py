"""A dev run (Lightning's fast_dev_run): every stage of a job, tiny, in a temporary folder, so that a broken edit is
found in seconds rather than at the first evaluation, save or resume of a real run.

    python main.py --params configs/X.yml --dev-run          (or --set train.dev_run=true)

Each stage is `python main.py` with the same params file and --set values, plus a few overrides: two training steps
with an evaluation after the first (one batch), a save, a resume from it, test mode, export where the task exports.
The overrides lift what a real run rightly refuses in a 2-step trial (a warm-up longer than the run, say), and shrink
what only costs time (shrunk): 2 samples per rank, one batch per evaluation, LM windows of 64 tokens, at most 2
micro-batches accumulated, fp32 for precision auto on a CPU (not timed), one timed pass for batch auto, no W&B or
MLflow run (as Lightning's fast_dev_run: a trial is not reported to a team's tracker); the model,
the strategy and every stage's code stay the job's, so a GPU-sized preset's dev run also ends in under a minute on a
CPU. Every stage runs under the configured strategy; output_dir is a temporary folder, removed when all passed, kept
to read when one failed or the dev run was interrupted (Ctrl-C, a stop signal: the stage running is killed).
Nothing is written to the real output_dir. It runs on this machine alone: a config of several nodes is refused.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from core.launch_env import launcher_env
from resilience import launcher

# The overrides every stage takes: a 2-step run that evaluates, saves and can be resumed, with no early stop; it
# resumes, tests and exports its own checkpoints (not a train.resume, test.checkpoint or predict.checkpoint path of
# the real run's).
RUN = ["train.dev_run=false", "train.epochs=0", "train.max_steps=3", "train.warmup=0", "train.eval_every=1",
       "train.eval_batches=1", "train.save_every=1", "train.patience=0", "train.time_limit=null", "train.profile_steps=null",
       "train.log_every=1", "log.progress_bar=false", "train.resume=auto", "train.start_over=false",
       "test.checkpoint=null", "predict.checkpoint=null"]
STAGES = [  # name, what it checks, its own overrides
    ("train", "2 steps, an evaluation of one batch, a save", ["mode=train", "train.max_steps=2"]),
    ("resume", "from step 2 to step 3", ["mode=train"]),
    ("test", "the best checkpoint", ["mode=test"]),
    ("export", "the best checkpoint", ["mode=export"]),
]
TAIL_LINES = 15  # of a failed stage's output
SAMPLES = 2  # per rank and step (under pipe: one per micro-batch), and per evaluation batch
LM_WINDOW = 64  # tokens per language-model window


def shrunk(cfg) -> tuple[list[str], list[str]]:
    """The overrides that make each step and evaluation cheap without changing the model or the strategy, and how
    the plan line says them: the batch per rank (under pipe: one sample per micro-batch, or two (below), which each
    pipeline batch must divide into), the evaluation batch, one batch per evaluation (the last and test mode's too),
    the accumulation, precision auto's timing on a CPU, the LM window."""
    train, overrides, said = cfg.train, ["train.limit_eval_batches=1"], ["1 batch per evaluation"]
    # under pipe one sample per micro-batch; two for image_folder's ResNet at 32 px or less, whose BatchNorm cannot
    # train on one (a 1x1 last feature map: image_folder.ONE_PIXEL_MAP, not imported: main reads this before torch)
    per_micro = 2 if cfg.task == "image_folder" and cfg.data.image_size <= 32 else 1
    per_rank = cfg.dist.pp_microbatches * per_micro if cfg.dist.strategy == "pipe" else SAMPLES
    size = train.batch_size
    if isinstance(size, list) and max(size) > per_rank:
        overrides.append(f"train.batch_size=[{','.join(str(min(b, per_rank)) for b in size)}]")
        said.append(f"batch {size} -> [{','.join(str(min(b, per_rank)) for b in size)}]")
    elif isinstance(size, int) and size > per_rank:
        overrides.append(f"train.batch_size={per_rank}")
        said.append(f"batch {size} -> {per_rank}")
    # batch_size auto is kept: its global batch is split by speed over ranks the dev run does not count
    if train.eval_batch_size > per_rank:
        overrides.append(f"train.eval_batch_size={per_rank}")
        said.append(f"eval batch {train.eval_batch_size} -> {per_rank}")
    if train.grad_accum_steps > 2:  # 2 still syncs on the last micro-batch only
        overrides.append("train.grad_accum_steps=2")
        said.append(f"accumulation {train.grad_accum_steps} -> 2")
    if train.precision == "auto" and not cfg.dist.on_gpu():  # a CPU times both precisions, minutes for GPT-2
        overrides.append("train.precision=fp32")
        said.append("precision auto -> fp32 (not timed on a CPU)")
    if size == "auto" and train.balance_steps > 1:  # timed passes per stage
        overrides.append("train.balance_steps=1")
        said.append(f"timed passes {train.balance_steps} -> 1")
    if cfg.task == "gpt2_lm" and cfg.data.max_length > LM_WINDOW:
        overrides.append(f"data.max_length={LM_WINDOW}")
        said.append(f"window {cfg.data.max_length} -> {LM_WINDOW} tokens")
    shared = [name for name in cfg.log.report_to if name in ("wandb", "mlflow")]
    if shared:  # as Lightning's fast_dev_run: a trial makes no run in the team's W&B project or MLflow server
        kept = [name for name in cfg.log.report_to if name not in shared]
        overrides.append(f"log.report_to=[{', '.join(kept)}]")
        said.append(f"no {' or '.join(shared)} run")
    d = cfg.dist
    # Another run holding the port is not the edit's error: the dev run moves to a free one.
    if d.nodes == 1 and d.init_method == "tcp" and launcher.port_in_use("127.0.0.1", d.master_port):
        port = free_port()
        overrides.append(f"dist.master_port={port}")
        said.append(f"port {d.master_port} (in use) -> {port}")
    return overrides, said


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(main_py: str, params: str, overrides: list[str], output_dir: str, exports: bool,
        smaller: tuple[list[str], list[str]] = ([], []), nodes: int = 1) -> int:
    """Run the stages one after another; 0 when all passed, else the failing stage's exit code. `smaller`: shrunk's
    overrides and their words, after the user's --set values. `nodes`: dist.nodes (more than 1 is refused)."""
    env = launcher_env()
    if env is not None:  # each rank would run its own dev run, whose stages would join the other ranks' as ranks
        launched_by = "srun" if env["launcher"] == "slurm" else env["launcher"]
        if env["rank"] == 0:
            print(f"error: --dev-run (train.dev_run) starts the stages' processes itself: run `python main.py --params "
                  f"{params} --dev-run` on its own, not under {launched_by}", file=sys.stderr, flush=True)
        return 2
    if nodes > 1:  # its stages would wait for other nodes' ranks, which cannot share this machine's temporary folder
        print(f"error: --dev-run (train.dev_run) runs every stage on this machine, in a folder of its own, but "
              f"dist.nodes is {nodes}: its stages would wait for the other nodes; add --set dist.nodes=1 (and "
              "dist.procs_per_node for this machine)", file=sys.stderr, flush=True)
        return 2
    folder = tempfile.mkdtemp(prefix="dev-run-")
    print(f"dev run of {params} under its configured strategy, in {folder} (nothing is written to {output_dir})"
          + (f"; shrunk: {', '.join(smaller[1])}" if smaller[1] else ""), flush=True)
    overrides = overrides + smaller[0]
    began = time.perf_counter()
    for name, what, own in STAGES:
        if name == "export" and not exports:
            print(f"  {name:<7} skipped: this task does not export", flush=True)
            continue
        try:
            code, seconds, log = stage(main_py, params, overrides + RUN + own
                                       + [f"output_dir={folder}/run", f"export.dir={folder}/export"],
                                       os.path.join(folder, f"{name}.log"))
        except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal (faults.Interrupted): the stage was ended (stage)
            by = f"by {e}" if str(e) not in ("", "SIGINT") else "(Ctrl-C)"
            print(f"dev run interrupted {by} in stage {name!r}; the output so far is in {folder}",
                  file=sys.stderr, flush=True)
            return getattr(e, "exit_code", 130)
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
    """One `python main.py`: its exit code, its seconds and its output's lines (also kept in log_path). Interrupted
    (Ctrl-C, a stop signal to this process alone), the stage and the ranks it started are killed, as its own session."""
    command = [sys.executable, main_py, "--params", params]
    for item in overrides:
        command += ["--set", item]
    began = time.perf_counter()
    with open(log_path, "w") as log:
        stage_run = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            code = stage_run.wait()
        except KeyboardInterrupt:
            os.killpg(stage_run.pid, signal.SIGKILL)  # a throwaway run: nothing of it to save
            stage_run.wait()
            raise
    seconds = time.perf_counter() - began
    with open(log_path, errors="replace") as log:
        return code, seconds, log.read().splitlines()
