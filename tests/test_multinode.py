"""Several nodes for real, on one machine: two network namespaces joined by a veth pair (node 0 at 10.77.0.1,
node 1 at 10.77.0.2, each with its own host name), and torchrun's elastic restarts. Needs root (skips otherwise).

- two nodes over tcp init equal one process on the combined batch;
- a node lost mid-training (its processes killed, or its cable pulled and then killed) ends node 0 within 30 s,
  naming node 1's ranks;
- torchrun --max-restarts=1 with c10d rendezvous restarts a killed worker, which resumes from the checkpoint to
  the parameters of an uninterrupted run (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: see the xfail below).
"""
import os
import re
import subprocess
import sys
import time

import pytest

from cluster import (NODE_ADDRS, ROOT, STEPS, TRAIN_ARGS, checkpoint_steps, clean_env, freeze, kill_tree,
                     spawn_reference, two_nodes, wait_for)  # noqa: F401 (fixtures)
from conftest import free_port, load_model_state, max_diff

import main
from wiring import checked_config

PORT = 29500  # node 0's own namespace: nothing else listens there


def node_command(node, out, extra):
    return node.command([sys.executable, "main.py", "--params", "parameters.yml", "--set", f"output_dir={out}",
                         "--set", "dist.strategy=ddp", "--set", "dist.nodes=2", "--set", "dist.procs_per_node=[1,2]",
                         "--set", f"dist.node_rank={node.index}", "--set", f"dist.master_addr={NODE_ADDRS[0]}",
                         "--set", f"dist.master_port={PORT}", "--set", "model.dropout=0",
                         "--set", "log.progress_bar=false", "--set", "log.tensorboard=false",
                         "--set", "train.eval_every=0", *extra])


def start_nodes(nodes, out, extra, tmp_path):
    """Node 0 (rank 0) and node 1 (ranks 1, 2, by main.py's own spawn), each in its namespace. Output to files."""
    procs = []
    for node in nodes:
        with open(tmp_path / f"node{node.index}.out", "w") as stdout, \
                open(tmp_path / f"node{node.index}.err", "w") as stderr:
            procs.append(subprocess.Popen(node_command(node, out, [a for kv in extra for a in ("--set", kv)]),
                                          cwd=ROOT, env=node.env(), stdout=stdout, stderr=stderr))
    return procs


def finish(proc, timeout):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise


def read(path):
    with open(path) as f:
        return f.read()


@pytest.mark.slow
def test_two_nodes_over_a_network_equal_one_process_on_the_combined_batch(two_nodes, tmp_path):
    """Node 0 runs rank 0, node 1 runs ranks 1 and 2; 3 x 8 samples per step against one process with 24."""
    out = tmp_path / "nodes"
    procs = start_nodes(two_nodes, out, ["train.batch_size=8", "train.max_steps=6"], tmp_path)
    try:
        codes = [finish(p, 240) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    errs = [read(tmp_path / f"node{i}.err") for i in range(2)]
    assert codes == [0, 0], [e[-2000:] for e in errs]
    assert "world size 3, ranks per node [1, 2]" in read(tmp_path / "node0.out")
    # ranks 1 and 2 ran on the other "machine"
    assert "tnode1" in read(out / "logs" / "rank1.log") and "tnode1" in read(out / "logs" / "rank2.log")
    assert "tnode0" in read(out / "logs" / "rank0.log")

    one = checked_config(os.path.join(ROOT, "parameters.yml"), [  # as the nodes read it, in one process
        f"output_dir={tmp_path / 'one'}", "model.dropout=0", "train.eval_every=0", "train.max_steps=6",
        "train.batch_size=24", "log.progress_bar=false", "log.tensorboard=false"])
    assert main.run(one) == 0
    assert max_diff(load_model_state(out, 6), load_model_state(tmp_path / "one", 6)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "unplugged"])
def test_losing_node_1_ends_node_0_within_30_s_naming_its_ranks(two_nodes, tmp_path, how):
    """killed: node 1's processes get SIGKILL (their sockets close, so node 0's collective fails at once).
    unplugged: node 1's link goes down first, then its processes die: nothing reaches node 0 any more, as when a
    machine loses power; only the heartbeat watchdog (dist.hang_timeout_s) can tell."""
    node0, node1 = two_nodes
    out = tmp_path / "nodes"
    procs = start_nodes(two_nodes, out, ["train.batch_size=8", "train.max_steps=100000", "train.epochs=0",
                                         "train.save_every=0", "train.log_every=5", "dist.hang_timeout_s=5"],
                        tmp_path)
    try:
        log0 = out / "logs" / "rank0.log"
        wait_for(lambda: os.path.exists(log0) and "step 10/" in read(log0), 180, "node 0 to train 10 steps",
                 procs=procs)
        if how == "unplugged":
            subprocess.run(["ip", "-n", node1.netns, "link", "set", node1.ifname, "down"], check=True, timeout=10)
        t0 = time.monotonic()
        node1.kill_all()
        try:
            code = procs[0].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 0 still running 60 s after node 1 was {how}")
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            kill_tree(p.pid)
    err = read(tmp_path / "node0.err")
    assert code == 1, (code, err[-3000:])
    assert elapsed < 30, (elapsed, err[-3000:])
    # on which host, at which step, which ranks and how
    assert re.search(r"\bon tnode[01]\b[^\n]*\bstep \d+", err), err[-3000:]
    if how == "killed":  # node 0's collective failed: its own report
        assert re.search(r"rank 0 on tnode0 failed at step \d+: ", err), err[-3000:]
    named = lost_ranks_named(err)
    assert named and named <= {1, 2}, err[-3000:]
    if named != {1, 2}:
        pytest.xfail(f"node 0 named only rank(s) {sorted(named)} of node 1's ranks 1, 2 (the watchdog reports the "
                     f"first silent rank it sees): {err[-500:]}")


def lost_ranks_named(err: str) -> set:
    """The ranks that node 0's report says stopped responding or died (rank 0 itself is the reporter)."""
    found = set()
    for line in err.splitlines():
        if re.search(r"stopped responding|died", line):
            for group in re.findall(r"\branks? (\d+(?:, \d+)*)", line):
                found |= {int(r) for r in group.split(", ")}
    return found - {0}


# ---------------------------------------------------------------------------------------------------------------
# torchrun: elastic restart of a killed worker
# ---------------------------------------------------------------------------------------------------------------
def torchrun(args, tmp_path, name, env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    with open(tmp_path / f"{name}.out", "w") as stdout, open(tmp_path / f"{name}.err", "w") as stderr:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)


def workers(agent_pid) -> dict:
    """torchrun's workers by global rank."""
    import psutil
    found = {}
    for p in psutil.Process(agent_pid).children(recursive=True):
        try:
            rank = p.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None:
            found[int(rank)] = p.pid
    return found


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_which_resumes_to_the_uninterrupted_result(tmp_path, spawn_reference):
    out = tmp_path / "run"
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # see the xfail below
    agent = torchrun(["main.py", *TRAIN_ARGS, "--set", f"output_dir={out}", "--set", "train.save_every=2"],
                     tmp_path, "torchrun", env)
    try:
        wait_for(lambda: checkpoint_steps(out), 180, "a first checkpoint", interval=0.02, procs=[agent])
        ranks = workers(agent.pid)
        freeze(ranks.values(), True)  # hold the run between two steps, however fast this machine is
        saved = checkpoint_steps(out)
        if saved[-1] >= STEPS:
            freeze(ranks.values(), False)
            pytest.fail("the run finished before it could be interrupted")
        os.kill(ranks[1], 9)
        freeze(ranks.values(), False)
        code = finish(agent, 300)
    finally:
        kill_tree(agent.pid)
    log0 = read(out / "logs" / "rank0.log")
    assert code == 0, read(tmp_path / "torchrun.err")[-3000:]
    resumed = re.findall(r"resumed from \S*step-(\d+) at step", log0)
    assert resumed and int(resumed[0]) >= saved[0], log0[-3000:]  # the restart went on from a checkpoint
    assert max_diff(load_model_state(out, STEPS), spawn_reference) < 1e-6


WORKER = """
import os, sys, time
import torch, torch.distributed as dist
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), os.environ["RANK"]
mark = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank1-joining-{attempt}")
if rank == "1":
    open(mark, "w").close()
elif attempt == 1:  # the restarted rank 0 is the slower to start (imports, checkpoint loading, ...)
    deadline = time.monotonic() + 30
    while not os.path.exists(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=5))
print(f"attempt {attempt} rank {dist.get_rank()} up", flush=True)
for _ in range(100 if attempt == 0 else 3):
    dist.all_reduce(torch.ones(1))
    time.sleep(0.1)
dist.destroy_process_group()
"""


class StaleStoreBug(AssertionError):
    """The symptom of pytorch/pytorch#135712, and only it, makes the test below an expected failure."""


@pytest.mark.slow
@pytest.mark.xfail(strict=False, raises=StaleStoreBug, reason=(
    "pytorch/pytorch#135712: torchrun's c10d rendezvous shares its TCPStore with the workers "
    "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0, the default) and keeps the previous attempt's keys; a restarted worker "
    "that reaches init_process_group before the new rank 0 reads the dead rank 0's gloo address and fails "
    "(Connection refused / Connect timeout), so --max-restarts gives up. Workaround: "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (tested above)"))
def test_torchrun_restart_with_its_shared_store_pytorch_bug(tmp_path):
    """Plain PyTorch, no trainer: the restart of a killed worker fails when the new rank 0 is slower than rank 1."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = clean_env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    agent = torchrun([str(script)], tmp_path, "plain", env)
    try:
        wait_for(lambda: read(tmp_path / "plain.out").count("attempt 0") == 2, 120, "both workers", procs=[agent])
        os.kill(workers(agent.pid)[1], 9)
        code = finish(agent, 120)
    finally:
        kill_tree(agent.pid)
    err = read(tmp_path / "plain.err")
    if code != 0 and ("Connection refused" in err or "Connect timeout" in err) \
            and "attempt 1 rank 1 up" not in read(tmp_path / "plain.out"):
        raise StaleStoreBug(err[-2000:])
    assert code == 0, err[-2000:]
