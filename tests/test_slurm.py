"""SLURM for real: a one-node cluster (slurmctld + slurmd + munged from Debian's packages, brought up by the
`slurm` fixture in tests/cluster.py; skipped where it cannot start: no packages, not root, daemons failing).

- `srun --ntasks=2 python main.py ...` trains like main.py's own spawn;
- scripts/slurm_job.sh, the recipe of docs/slurm.md, stopped by SIGUSR1 (what `#SBATCH --signal=B:USR1@120`
  sends before the time limit) saves, requeues itself and resumes to the parameters of an uninterrupted run.
"""
import os
import re
import signal
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")

from cluster import (JOB_NAME, ROOT, STEPS, TRAIN_ARGS, checkpoint_steps, freeze, signal_pending, slurm,
                     spawn_reference, wait_for)  # noqa: F401 (fixtures)
from conftest import free_port, load_model_state, max_diff


@pytest.mark.slow
def test_srun_two_tasks_train_like_our_own_spawn(slurm, tmp_path, spawn_reference):
    out = tmp_path / "run"
    r = slurm.run("srun", "--ntasks=2", f"--job-name={JOB_NAME}", sys.executable, "main.py", *TRAIN_ARGS,
                  "--set", f"output_dir={out}", "--set", f"dist.master_addr={slurm.master_addr}",
                  "--set", f"dist.master_port={free_port()}", cwd=ROOT, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world size 2, ranks per node launched by slurm" in r.stdout
    assert max_diff(load_model_state(out, STEPS), spawn_reference) < 1e-6


def job_tasks(job_id: str) -> list[int]:
    """The pids of the job's main.py processes (the srun tasks)."""
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "main.py" in (p.info["cmdline"] or []) and p.environ().get("SLURM_JOB_ID") == job_id \
                    and "SLURM_STEP_ID" in p.environ():
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


@pytest.mark.slow
def test_sbatch_recipe_stops_on_usr1_saves_requeues_and_resumes(slurm, tmp_path, spawn_reference):
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    r = slurm.run("sbatch", "--parsable", f"--job-name={JOB_NAME}", f"--output={log}", f"--chdir={ROOT}",
                  os.path.join(ROOT, "scripts", "slurm_job.sh"), *TRAIN_ARGS, "--set", f"output_dir={out}",
                  "--set", "train.save_every=2", *(["--set", "dist.master_addr=127.0.0.1"] if slurm.master_addr !=
                                                   slurm.host else []),
                  env=slurm.env(TRAINER_MASTER_PORT=str(free_port())))
    job = r.stdout.strip().split(";")[0]

    def job_ended_early():
        state = slurm.job(job).get("JobState", "")
        if state in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            pytest.fail(f"job {job} ended ({state}) before it was signalled:\n{read(log)[-3000:]}")

    def first_checkpoint():
        job_ended_early()
        return checkpoint_steps(out)

    try:
        wait_for(first_checkpoint, 240, "the job's first checkpoint", interval=0.02)
        tasks = job_tasks(job)
        freeze(tasks, True)  # hold the run between two steps while the signal travels, however fast the machine
        saved = checkpoint_steps(out)
        if len(tasks) != 2 or saved[-1] >= STEPS:
            freeze(tasks, False)
            pytest.fail(f"could not catch the run in time (tasks {tasks}, checkpoints {saved})")
        # What `--signal=B:USR1@120` does 120 s before the time limit, now (its timer has up to a minute of jitter)
        slurm.run("scancel", "--batch", "--signal=USR1", job)
        try:
            wait_for(lambda: all(signal_pending(pid, signal.SIGUSR1) for pid in tasks), 60,
                     "the batch shell to forward SIGUSR1 to the ranks")
        finally:
            freeze(tasks, False)

        seen = {}

        def requeued():
            info = slurm.job(job)
            state = info.get("JobState", "")
            if info.get("Restarts") == "1" and state in ("PENDING", "RUNNING", "COMPLETED"):  # not REQUEUED
                return info
            if state in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                # a requeue passes through transient states; one that stays means the job ended
                if time.monotonic() - seen.setdefault(state, time.monotonic()) > 10:
                    pytest.fail(f"job {job} ended ({state}) instead of requeueing:\n{read(log)[-3000:]}")
            return None
        if wait_for(requeued, 120, "the job to requeue itself").get("JobState") == "PENDING":
            # SLURM holds a requeued job back for about two minutes (its BeginTime); a test need not wait that
            # long, but a restart in the second of the requeue fails ("Job credential revoked"): wait a little
            time.sleep(5)
            slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)

        def done():
            info = slurm.job(job)
            if info.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                pytest.fail(f"job {job} ended {info.get('JobState')}:\n{read(log)[-3000:]}")
            return info if info.get("JobState") == "COMPLETED" else None
        info = wait_for(done, 300, "the requeued job to finish", interval=0.5)
    finally:
        slurm.run("scancel", job, check=False)
    text = read(log)
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "1", info
    stop = re.search(r"stopped by SIGUSR1 at step (\d+); saved step-(\d+); run the same command to resume", text)
    assert stop and stop.group(1) == stop.group(2), text[-3000:]
    assert f"requeueing job {job}" in text and "start 2" in text and "finished" in text, text[-3000:]
    assert f"resumed from {out}/checkpoints/step-{stop.group(1)} " in read(out / "logs" / "rank0.log")
    assert max_diff(load_model_state(out, STEPS), spawn_reference) < 1e-6


def read(path) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
