"""main.py runs unchanged under torchrun and under SLURM's srun (simulated by its environment variables), and
dp in one process."""
import dataclasses
import datetime
import os
import subprocess
import sys
import time

import pytest
import torch

from cluster import STEPS, TRAIN_SETS, spawn_reference  # noqa: F401 (fixture)
from conftest import ROOT, free_port, load_model_state, make_config, max_diff

from core import checkpoint

from core import checkpoint_meta
from resilience import launcher
import main
import wiring

# The launched runs train TRAIN_SETS (ddp, 2 x 16 samples, STEPS steps, no dropout) over parameters.yml and must
# land on `spawn_reference`: the same run by main.py's own spawn, computed once a session and shared with
# test_multinode.py and test_slurm.py (each test here used to train its own reference).
ARGS = [a for kv in TRAIN_SETS for a in ("--set", kv)]


def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_torchrun(tmp_path, spawn_reference):
    out = tmp_path / "torchrun"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", "main.py", "--params", "parameters.yml",
                        "--set", f"output_dir={out}", *ARGS], cwd=ROOT, env=clean_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world size 2, ranks per node launched by torchrun" in r.stdout
    assert os.path.isfile(out / "logs" / "rank1.log")
    assert max_diff(load_model_state(out, STEPS), spawn_reference) < 1e-6


def test_slurm_environment(tmp_path, spawn_reference):
    out, port = tmp_path / "slurm", free_port()
    procs = []
    for rank in range(2):
        env = clean_env()
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_ID="0",
                   SLURM_JOB_ID="1")
        procs.append(subprocess.Popen(
            [sys.executable, "main.py", "--params", "parameters.yml", "--set", f"output_dir={out}",
             "--set", "dist.master_addr=127.0.0.1", "--set", f"dist.master_port={port}", *ARGS],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert "launched by slurm" in outputs[0][0]
    assert max_diff(load_model_state(out, STEPS), spawn_reference) < 1e-6


@pytest.mark.slow
def test_srun_ranks_of_a_run_whose_output_dir_is_in_use_all_leave_with_rank_0s_line(tmp_path):
    """A second srun job on an output_dir in use: rank 0 was refused in one line, and rank 1 (srun ends no task
    for another's exit) waited at the rendezvous for dist.timeout_s (30 minutes by default), silent, holding the
    job. Rank 0 now gives its line at the roll call: every rank leaves at once with it, exit 2. And rank 1 had
    written its first line into the running run's logs/rank1.log before it heard: nothing of it is there now."""
    from resilience.run_dir_lock import hold_output_dir
    out, port = tmp_path / "run", free_port()
    (out / "logs").mkdir(parents=True)
    for rank in range(2):  # the running run's logs, as they are before and must be after
        (out / "logs" / f"rank{rank}.log").write_text(f"03:12:01 rank{rank} step 7/40 loss=0.51\n")
    logs = {p.name: p.read_bytes() for p in (out / "logs").iterdir()}
    held = hold_output_dir(str(out))  # (this test is the other run)
    procs = []
    try:
        for rank in range(2):
            env = clean_env()
            env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_ID="0",
                       SLURM_JOB_ID="2")
            procs.append(subprocess.Popen(
                [sys.executable, "main.py", "--set", f"output_dir={out}", "--set", "dist.strategy=ddp",
                 "--set", "dist.master_addr=127.0.0.1", "--set", f"dist.master_port={port}",
                 "--set", "dist.timeout_s=600"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
        held.close()
    line = f"error: output_dir {str(out)!r} is in use by another run (pid {os.getpid()} on "
    assert [p.returncode for p in procs] == [2, 2], outputs
    for stdout, stderr in outputs:
        assert len(stderr.splitlines()) == 1 and stderr.startswith(line), stderr
    assert not (out / "checkpoints").exists()
    assert {p.name: p.read_bytes() for p in (out / "logs").iterdir()} == logs


def test_dp_runs_in_one_process(tmp_path):
    """On CPU, DataParallel has no GPUs to scatter to and runs the module as is: same result as `none`."""
    runs = {}
    for strategy in ("dp", "none"):
        cfg = make_config(tmp_path / strategy, dist={"strategy": strategy}, train={"max_steps": 5, "eval_every": 0})
        assert main.run(cfg) == 0
        runs[strategy] = load_model_state(tmp_path / strategy, 5)
    assert max_diff(runs["dp"], runs["none"]) == 0.0
    assert checkpoint_meta.read(checkpoint.latest(str(tmp_path / "dp")))["strategy"] == "dp"


def test_more_ranks_than_gpus_under_nccl_is_one_line_before_the_ranks_meet(tmp_path, monkeypatch):
    """Two ranks on a one-GPU node: NCCL would refuse the second GPU-sharing rank only after the rendezvous, as a
    traceback. The rank that has no GPU of its own says so, naming the key, before it touches the device or the group."""
    from core import process_group
    from core.errors import ConfigError
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "procs_per_node": 2})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    touched = []
    monkeypatch.setattr(torch.cuda, "set_device", touched.append)
    monkeypatch.setattr(process_group, "join_group", lambda *a, **k: touched.append("group"))
    with pytest.raises(ConfigError) as e:
        process_group.init(cfg, rank=1, world_size=2, local_rank=1)
    assert "dist.procs_per_node" in str(e.value) and "(1)" in str(e.value) and "gloo" in str(e.value)
    assert touched == []
    # with gloo, two ranks may share the GPU: no refusal (set_device and the group are reached)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    gloo = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, backend="gloo"))
    ctx = process_group.init(gloo, rank=1, world_size=2, local_rank=1)
    assert (ctx.backend, str(ctx.device), touched) == ("gloo", "cuda:0", [0, "group"])
    # (set again in the thread that forms the group: the current GPU is each thread's own)
    monkeypatch.setattr(torch.distributed, "PrefixStore", lambda prefix, store: store)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: touched.append("formed"))
    process_group.form_group("gloo", None, 1, 2, datetime.timedelta(seconds=5), ctx.device)
    assert touched[2:] == [torch.device("cuda", 0), "formed"]


def test_ranks_under_torchrun_and_srun_know_how_many_share_their_node(monkeypatch):
    """Each rank takes cores / (ranks on its node) threads: the launchers' environment says how many."""
    from core.launch_env import launcher_env
    from core.launch_env import tasks_on_this_node
    for k in list(os.environ):
        if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "node0")  # (torchrun sets them with the ranks)
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert launcher_env()["local_world_size"] == 4
    assert tasks_on_this_node({"SLURM_STEP_TASKS_PER_NODE": "4(x2),1", "SLURM_NODEID": "1"}) == 4
    assert tasks_on_this_node({"SLURM_TASKS_PER_NODE": "4(x2),1", "SLURM_NODEID": "2"}) == 1
    assert tasks_on_this_node({"SLURM_TASKS_PER_NODE": "2,3", "SLURM_NODEID": "1"}) == 3
    assert tasks_on_this_node({"SLURM_TASKS_PER_NODE": "weird"}) == 1


@pytest.mark.parametrize("env, named", [
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "MASTER_ADDR"),  # a shell that kept another job's ranks
    ({"RANK": "abc", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='abc'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "x", "SLURM_STEP_ID": "0"}, "SLURM_NTASKS='x'"),
])
@pytest.mark.parametrize("strategy", ["none", "ddp"])
def test_rank_variables_left_over_from_another_job_are_one_line(tmp_path, capsys, monkeypatch, env, named, strategy):
    """RANK/WORLD_SIZE/LOCAL_RANK (or SLURM's) left in the shell by another job, with a plain `python main.py`:
    one line naming the variables (was: `strategy is none but 2 processes are configured`, a ValueError
    traceback from int(), or a crash report with torch's traceback for the missing MASTER_ADDR)."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main.main(["--set", f"output_dir={tmp_path}", "--set", f"dist.strategy={strategy}",
                      "--set", "train.max_steps=1"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    errors = captured.err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and named in errors[0], captured.err
    assert "another job" in errors[0] and "unset" in errors[0], errors[0]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_a_config_mistake_under_torchrun_is_said_by_the_first_rank_of_each_node(capsys, monkeypatch, local_rank):
    """torchrun --nproc_per_node=8 with strategy none: each of the 8 ranks printed the same config error (found
    before the ranks meet, so not deduplicated through the store). Local rank 0 says it; the others say nothing
    and wait a moment (main.QUIET_WAIT_S) so that torchrun, seeing them exit, does not kill rank 0 before it has."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(main, "QUIET_WAIT_S", 0.01)
    assert main.main(["--set", "train.max_steps=1"]) == 2  # strategy none, 2 ranks
    err = capsys.readouterr().err.strip().splitlines()
    if local_rank == 0:
        assert len(err) == 1 and "`dist.strategy` is none but torchrun started 2 processes" in err[0], err
        assert "procs_per_node" not in err[0] and "--nproc_per_node=1" in err[0], err  # what torchrun was told
    else:
        assert err == []


def test_torchrun_ranks_say_the_same_error_once(tmp_path):
    """Under torchrun each rank prints its own final word (no launcher of ours collects them); the same user
    error from both ranks still reaches the console once, deduplicated through the rendezvous store."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", "main.py", "--params", "parameters.yml",
                        "--set", f"output_dir={tmp_path / 'run'}", "--set", "data.dataset=mnist",
                        "--set", f"data.data_dir={tmp_path / 'none'}", "--set", "data.download=false", *ARGS],
                       cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "MNIST IDX files" in errors[0], r.stderr[-3000:]


def test_a_rank_that_cannot_start_takes_the_started_ones_down(tmp_path, monkeypatch):
    """p.start() failing for rank 1 (e.g. too many open files) surfaces as that error; rank 0, already started,
    is killed, not left running, and the clean-up does not trip over the rank that never started."""
    import multiprocessing.context as mpctx
    import psutil
    real_start, started = mpctx.SpawnProcess.start, []

    def start(self):
        if self.name == "rank1":
            raise OSError(24, "Too many open files")
        real_start(self)
        started.append(self.pid)
    monkeypatch.setattr(mpctx.SpawnProcess, "start", start)
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "procs_per_node": 2}, train={"max_steps": 2})
    with pytest.raises(OSError, match="Too many open files"):
        launcher.Supervisor(cfg, [main.RankPlace(rank, rank, 2, 2) for rank in range(2)], wiring.worker).supervise()
    assert len(started) == 1
    assert gone(started[0], psutil), f"rank 0 (pid {started[0]}) is still running"


def gone(pid, psutil, wait_s=10.0) -> bool:
    """The process has exited (a zombie not yet reaped counts): SIGKILL takes a moment to land."""
    import time
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False




@pytest.mark.slow
def test_a_file_rendezvous_works_again_and_a_missing_folder_is_one_line(tmp_path):
    """dist.init_method: file://PATH (docs/running.md). The ranks' FileStore leaves PATH behind (they end without
    the interpreter's teardown, where torch would remove it), and a second run on it, such as the resume that
    `run the same command` promises, waited dist.timeout_s (30 min) for ranks that had met in the old file. A
    folder that does not exist waited as long too, then blamed the timeout."""
    rendezvous = tmp_path / "rendezvous"
    run = [sys.executable, "main.py", "--set", "dist.strategy=ddp", "--set", "dist.procs_per_node=2",
           "--set", f"dist.init_method=file://{rendezvous}", "--set", f"output_dir={tmp_path / 'run'}",
           "--set", "train.warmup=1", "--set", "log.progress_bar=false"]
    for steps in (2, 4):  # train, then resume with the same rendezvous file (the first run's, 10 s later)
        if rendezvous.exists():
            os.utime(rendezvous, (time.time() - 11, time.time() - 11))
        r = subprocess.run(run + ["--set", f"train.max_steps={steps}"], cwd=ROOT, env=clean_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert f"done: {steps} steps" in r.stdout
    assert "resumed from" in r.stdout
    os.utime(rendezvous)  # written just now: a run going on may be using it; this one is refused, it is not removed
    r = subprocess.run(run + ["--set", "train.max_steps=6"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "s ago, by a run going on?" in r.stderr and rendezvous.exists(), r.stderr
    missing = f"file://{tmp_path}/no/such/folder/rendezvous"
    r = subprocess.run(run + ["--set", f"dist.init_method={missing}"], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr
    assert f"error: dist.init_method {missing}: the folder {tmp_path}/no/such/folder does not exist" in r.stderr
