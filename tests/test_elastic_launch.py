"""torchrun's elastic restarts (issue 20, item 4).

- main.py under torchrun refuses, in one line naming the command to use, a restartable torchrun whose workers
  would share the agent's rendezvous store (pytorch/pytorch#135712): it could hang or burn its restarts.
- `torchrun --nnodes=1:2 --max-restarts=3 --rdzv-backend=c10d` on two nodes (network namespaces, tests/cluster.py;
  needs root): node 1 lost -> node 0 restarts alone and resumes from the last checkpoint; a new agent on node 1
  -> both restart at world 2 and resume; the run keeps its global batch (train.batch_size=auto with
  train.global_batch_size), so it ends where an uninterrupted 2-rank run does.
"""
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from cluster import (NODE_ADDRS, ROOT, STEPS, checkpoint_steps, clean_env, freeze, kill_tree, spawn_reference,
                     two_nodes, wait_for)  # noqa: F401 (fixtures)
from conftest import free_port, load_model_state, max_diff

from resilience import elastic

# ---- the refusal, from the worker's environment and the agent's command line ---------------------------------
SHARED = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}


def test_the_readme_torchrun_command_runs():
    """One attempt (no restarts, fixed nodes) is safe with a shared store: nothing refused."""
    argv = ["--nproc_per_node=8", "main.py", "--params", "parameters.yml", "--set", "dist.strategy=ddp"]
    assert elastic.torchrun_restart_problem({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "0"}, argv) is None
    assert elastic.torchrun_restart_problem({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"},
                                      ["--nnodes=1:2", *argv]) is None  # the variable was set: safe


@pytest.mark.parametrize("argv, fixed", [
    (["--nnodes=1", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d",
      "--rdzv-endpoint=127.0.0.1:29400", "main.py", "--set", "dist.strategy=ddp"],
     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=3 "
     "--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 main.py --set dist.strategy=ddp"),
    (["--nproc_per_node", "2", "--max_restarts", "3", "--rdzv_backend", "static", "main.py"],  # static: c10d added
     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 "
     "--nproc_per_node 2 --max_restarts 3 main.py"),
    (["--standalone", "--nproc-per-node=2", "--max-restarts=1", "main.py"],
     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 --max-restarts=1 main.py"),
])
def test_restarts_with_a_shared_store_are_refused_naming_the_command(argv, fixed):
    problem = elastic.torchrun_restart_problem(SHARED, argv)
    assert "pytorch/pytorch#135712" in problem and "\n" not in problem
    assert f"Run instead: {fixed}   (docs/slurm.md" in problem


def test_nodes_joining_or_leaving_are_restarts_too():
    problem = elastic.torchrun_restart_problem({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "0"},
                                         ["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=n0:29400", "x.py"])
    assert problem.startswith("torchrun --nnodes=1:2 restarts its workers")


def test_time_limit_counts_from_the_launchs_first_start_and_0_is_refused(tmp_path, capsys):
    """train.time_limit started anew at each torchrun restart (a job with --max-restarts could outrun its SLURM
    allocation), and 0 silently meant no limit. The limit now counts from the launch's first start on a restart
    of the same torchrun, anew for a new command; 0 is one line saying to use null."""
    import json
    import main
    first, restart = {"TORCHELASTIC_RESTART_COUNT": "0"}, {"TORCHELASTIC_RESTART_COUNT": "1"}
    out = str(tmp_path)
    assert elastic.time_used(out, 0, first, now=1000.0) == 0.0  # the first start: recorded by local rank 0
    assert elastic.time_used(out, 1, first, now=1005.0) == 0.0  # (the other local ranks record nothing)
    assert elastic.time_used(out, 1, restart, now=1600.0) == 600.0  # a restart of the same launch: 600 s used
    assert elastic.time_used(out, 0, first, now=2000.0) == 0.0  # a new command (a resume): anew
    assert elastic.time_used(out, 0, restart, now=2100.0) == 100.0
    record = tmp_path / "logs" / f"launch-{socket.gethostname()}.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "torchrun_pid": os.getppid() + 1}))
    assert elastic.time_used(out, 0, restart, now=2100.0) == 0.0  # another torchrun's record: not this launch
    for text in ("[1]", "{", '{"started": NaN}'):
        record.write_text(text)
        assert elastic.time_used(out, 0, restart, now=2100.0) == 0.0
    # a record or its .tmp planted as symlinks: the outside file is neither read nor written through
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"host": socket.gethostname(), "torchrun_pid": os.getppid(), "started": 1500.0}))
    record.unlink()
    record.symlink_to(outside)
    assert elastic.time_used(out, 0, restart, now=2100.0) == 0.0
    record.unlink()
    os.symlink(outside, str(record) + ".tmp")
    assert elastic.time_used(out, 0, first, now=3000.0) == 0.0
    assert json.loads(outside.read_text())["started"] == 1500.0 and json.loads(record.read_text())["started"] == 3000.0
    assert elastic.time_used(str(tmp_path / "plain"), 0, {}, now=1.0) == 0.0  # not torchrun's: no file
    assert not os.path.exists(tmp_path / "plain")
    for value in ("0", "00:00:00", "0.0"):
        assert main.main(["--set", f"output_dir={tmp_path / 'run'}", "--set", f"train.time_limit={value}"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "train.time_limit" in err[0] and err[0].endswith(
            "0 seconds would stop the run at its first step; use null for no limit"), err


def test_a_torchrun_restart_after_the_time_limit_stops_at_once_and_the_record_keeps_exit_3(tmp_path, capsys,
                                                                                             monkeypatch):
    """torchrun counts a time-limit stop (exit 3) as a failure and restarts: each restart trained a step, saved and
    stopped again until the restarts were used up, and torchrun's exit 1 hid the stop from a requeueing script.
    A restart whose launch's time is spent now trains nothing (one line, exit 3, before any rank meets), and the
    launch record keeps the workers' exit code for the script around torchrun."""
    import json
    import main
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    record = out / "logs" / f"launch-{socket.gethostname()}.json"
    record.write_text(json.dumps({"host": socket.gethostname(), "torchrun_pid": os.getppid(),
                                  "started": time.time() - 100, "exit": 1}))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert main.main(["--set", f"output_dir={out}", "--set", "train.time_limit=00:01:30"]) == 3
    said = capsys.readouterr()
    assert said.err == "", said.err
    assert re.fullmatch(r"stopped by the time limit \(train\.time_limit=00:01:30\) as torchrun restarted its workers: "
                        r"this launch started 1\d\d s ago; nothing was trained, the latest checkpoint is kept; run the "
                        r"same command to resume\n", said.out), said.out  # (1xx: loading torch takes seconds)
    assert not (out / "checkpoints").exists() and json.loads(record.read_text())["exit"] == 3
    # a new attempt drops the last one's code (a worker killed outright leaves none); its end records its own
    elastic.record_exit(str(out), 0, None)
    assert "exit" not in json.loads(record.read_text())
    elastic.record_exit(str(out), 1, 0)  # (local rank 0 alone writes it)
    assert "exit" not in json.loads(record.read_text())
    elastic.record_exit(str(out), 0, 0)
    assert json.loads(record.read_text())["exit"] == 0


def test_a_torchrun_restart_after_the_workers_stopped_says_why_training_goes_on(tmp_path, capsys, monkeypatch):
    """A stop signal sent to the workers, not to torchrun: they stop and save (exit 3), torchrun counts it as a
    failure and restarts them, and the restart trained on from the stop's checkpoint without a word on why the stop
    was undone. A restart after exit 3 (the launch record's) now says it, in one line, as its rank joins."""
    import json
    from conftest import make_config
    from main import RankPlace
    from resilience.rank_run import RankRun
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    record = out / "logs" / f"launch-{socket.gethostname()}.json"
    for count, code, said in (("1", 3, 1), ("1", 1, 0), ("0", 3, 0)):  # (0: a new command; its record is anew)
        record.write_text(json.dumps({"host": socket.gethostname(), "torchrun_pid": os.getppid(),
                                      "started": time.time() - 100, "exit": code}))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
        with RankRun(make_config(out, train={"max_steps": 1}), RankPlace(0, 0, 1, 1)) as rank:
            rank.join_group()
        notes = [line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("note: torchrun restarted its workers after they stopped")]
        assert len(notes) == said and all("signal torchrun itself" in line for line in notes), (count, code, notes)
        assert all(line in (out / "logs" / "rank0.log").read_text() for line in notes)
        assert json.loads(record.read_text())["exit"] == 0  # this attempt's, recorded as it ends


def test_a_refused_second_torchrun_leaves_the_running_runs_launch_record_as_it_was(tmp_path, monkeypatch):
    """A second torchrun on an output_dir in use, on the nodes of the running one: node 1's local rank 0 (rank 2)
    wrote this host's launch record, the running run's, with its own torchrun's pid and start before rank 0's
    refusal reached it at the roll call; the running run's restarts then counted train.time_limit anew, and its
    workers' exit code 3 went unrecorded (no requeue). It now writes there once the ranks have met."""
    import json
    from conftest import make_config
    from core import process_group
    from core.errors import UserError
    from main import RankPlace
    from resilience.rank_run import RankRun
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    record = out / "logs" / f"launch-{socket.gethostname()}.json"
    record.write_text(json.dumps({"host": socket.gethostname(), "torchrun_pid": os.getppid() + 1, "started": 1.0}))
    running = {p.name: p.read_bytes() for p in (out / "logs").iterdir()}
    for k, v in {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    def refused(*args, **kwargs):
        raise UserError(f"output_dir {str(out)!r} is in use by another run")
    monkeypatch.setattr(process_group, "init", refused)
    cfg = make_config(out, dist={"strategy": "ddp", "nodes": 2, "procs_per_node": [2, 1], "node_rank": 1,
                                 "master_addr": "127.0.0.1"})
    with RankRun(cfg, RankPlace(2, 0, 3, 1)) as rank:
        rank.join_group()
    assert rank.code == 2
    assert {p.name: p.read_bytes() for p in (out / "logs").iterdir()} == running


@pytest.mark.slow
def test_plain_torchrun_with_restarts_exits_at_once_with_the_line(tmp_path):
    """The real thing: a worker reads its agent's command line from /proc and names the command to use."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "main.py", "--set", f"output_dir={tmp_path / 'run'}", "--set", "dist.strategy=ddp"]
    env = clean_env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: torchrun")]
    assert r.returncode != 0 and time.monotonic() - t0 < 120, r.stderr[-2000:]
    assert len(lines) == 2, r.stderr[-3000:]  # one per attempt (local rank 0), both attempts refused
    assert lines[0].endswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 "
                             f"--max-restarts=1 main.py --set output_dir={tmp_path / 'run'} --set dist.strategy=ddp"
                             "   (docs/slurm.md, section 4)"), lines[0]
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.slow
def test_workers_whose_torchrun_dies_stop_and_save_instead_of_training_on_as_orphans(tmp_path):
    """torchrun killed by a signal it does not handle (SIGUSR1, SLURM's time-limit warning forwarded by srun; or
    kill -9, the OOM killer) left its workers training on as orphans until the run's end, holding output_dir. They
    now get SIGTERM when torchrun dies: they stop after a step, save, and the launch record says exit 3."""
    import json
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.2", "main.py",
           "--set", f"output_dir={out}", "--set", "dist.strategy=ddp", "--set", "train.max_steps=100000",
           "--set", "train.save_every=20", "--set", "train.eval_every=0", "--set", "log.progress_bar=false",
           "--set", "log.tensorboard=false"]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        first = wait_for(lambda: checkpoint_steps(out), 120, "a first checkpoint", procs=[agent])[-1]
        workers = worker_pids(agent)
        assert len(workers) == 2
        agent.kill()
        agent.wait()
        wait_for(lambda: not any(alive(pid) for pid in workers), 60, "the orphaned workers to stop")
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log = read(out / "logs" / "rank0.log")
    assert re.search(r"stopped by SIGTERM at step (\d+); saved step-\1", log), log[-2000:]
    assert checkpoint_steps(out)[-1] > first
    assert json.loads(read(out / "logs" / f"launch-{socket.gethostname()}.json"))["exit"] == 3


def alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- two agents, one lost, one joining -------------------------------------------------------------------------
GLOBAL_BATCH = 32  # the spawn reference's 2 x 16
ELASTIC_SETS = ["dist.strategy=ddp", f"train.max_steps={STEPS}", "train.batch_size=auto",
                f"train.global_batch_size={GLOBAL_BATCH}", "model.dropout=0", "train.eval_every=0",
                "log.progress_bar=false", "log.tensorboard=false", "train.log_every=1", "train.save_every=2"]


def agent_command(node, out, port) -> list:
    """One torchrun agent on `node`, one worker; node 0 hosts the c10d rendezvous (is_host: the test nodes' host
    names resolve to nothing, so torchrun cannot tell by itself). last_call_timeout=1: a round waits 1 s for late
    nodes once the minimum is there (30 s by default)."""
    return node.command([
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={NODE_ADDRS[0]}:{port}", "--rdzv-id=elastic-test",
        f"--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,is_host={node.index == 0}", f"--local-addr={node.addr}", "--monitor-interval=0.2",
        "main.py", "--params", "parameters.yml", "--set", f"output_dir={out}",
        *[a for kv in ELASTIC_SETS for a in ("--set", kv)]])


def start_agent(node, out, port, tmp_path, name):
    with open(tmp_path / f"{name}.out", "w") as stdout, open(tmp_path / f"{name}.err", "w") as stderr:
        return subprocess.Popen(agent_command(node, out, port), cwd=ROOT, stdout=stdout, stderr=stderr,
                                env=node.env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO"))


def worker_pids(agent) -> list:
    import psutil
    try:
        return [p.pid for p in psutil.Process(agent.pid).children(recursive=True) if "main.py" in p.cmdline()]
    except psutil.NoSuchProcess:
        return []


def read(path) -> str:
    with open(path) as f:
        return f.read()


def after(log: str, mark: str, pattern: str):
    """The first match of `pattern` after the last `mark` in `log` (None when there is none yet)."""
    i = log.rfind(mark)
    return re.search(pattern, log[i:]) if i >= 0 else None


def lose_node_1_then_add_it_back(nodes, tmp_path) -> dict:
    """The scenario, timed: returns seconds from node 1's kill to each stage of node 0's recovery, and the
    output folder."""
    out, port = tmp_path / "run", free_port()
    log0 = out / "logs" / "rank0.log"
    agents = [start_agent(nodes[0], out, port, tmp_path, "agent0"), start_agent(nodes[1], out, port, tmp_path, "agent1")]
    try:
        # 1. world 2 until the first checkpoint; then node 1 is lost (every process in its namespace killed)
        wait_for(lambda: checkpoint_steps(out), 300, "a first checkpoint at world 2", interval=0.02, procs=agents)
        frozen = worker_pids(agents[0])
        freeze(frozen, True)
        if checkpoint_steps(out)[-1] >= STEPS:
            pytest.fail("the run finished before node 1 could be lost")
        t = {"saved before the loss": checkpoint_steps(out)[-1]}
        nodes[1].kill_all()
        t0 = time.monotonic()
        freeze(frozen, False)
        # 2. node 0's worker fails on its peer, its agent restarts it alone; it resumes and trains on
        wait_for(lambda: not set(frozen) & set(worker_pids(agents[0])), 120, "node 0's worker to fail",
                 interval=0.02, procs=agents[:1])
        t["worker failed"] = time.monotonic() - t0
        wait_for(lambda: worker_pids(agents[0]), 120, "the restarted worker", interval=0.02, procs=agents[:1])
        t["worker restarted"] = time.monotonic() - t0
        wait_for(lambda: read(log0).count("resumed from") == 1, 180, "the resume at world 1", interval=0.02,
                 procs=agents[:1])
        t["checkpoint reloaded"] = time.monotonic() - t0
        wait_for(lambda: after(read(log0), "resumed from", r"step \d+/"), 120, "a first step at world 1",
                 interval=0.01, procs=agents[:1])
        t["first step"] = time.monotonic() - t0
        # 3. a new agent on node 1: node 0's agent sees it waiting and restarts its worker (SIGTERM: it saves)
        frozen = worker_pids(agents[0])
        freeze(frozen, True)  # (at world 1 the rest of the run takes a second or two: hold it for node 1)
        if read(log0).rstrip().endswith(f"step {STEPS}/{STEPS}") or checkpoint_steps(out)[-1] >= STEPS:
            pytest.fail("the run finished before node 1 came back")
        agents[1] = start_agent(nodes[1], out, port, tmp_path, "agent1-again")
        wait_for(lambda: "new nodes" in read(tmp_path / "agent0.err"), 180, "node 0's agent to see node 1",
                 procs=agents)
        freeze(frozen, False)
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            kill_tree(a.pid)
    assert codes == [0, 0], read(tmp_path / "agent0.err")[-3000:] + read(tmp_path / "agent1-again.err")[-3000:]
    t["out"] = out
    return t


@pytest.mark.slow
def test_a_node_lost_then_back_resumes_at_each_world_size_to_the_uninterrupted_result(two_nodes, tmp_path,
                                                                                      spawn_reference):
    t = lose_node_1_then_add_it_back(two_nodes, tmp_path)
    out = t.pop("out")
    log0 = read(out / "logs" / "rank0.log")
    plans = re.findall(r"world size (\d+), ranks per node", "".join(read(tmp_path / f"{name}.out") for name in
                                                                    ("agent0", "agent1", "agent1-again")))
    assert sorted(plans) == ["1", "2", "2"], plans  # 2 -> 1 -> 2 (rank 0 prints it, on either node)
    resumed = [int(s) for s in re.findall(r"resumed from \S*step-(\d+) at step", log0)]
    assert len(resumed) == 2 and resumed[0] >= t["saved before the loss"] and resumed[1] > resumed[0], resumed
    assert "written by a run that differs" not in log0  # the same global batch: no train.resume_changed needed
    assert max_diff(load_model_state(out, STEPS), spawn_reference) < 1e-5
    print("recovery after node 1 was lost (s from the kill):", t)
