"""Faults: a rank that crashes, dies, freezes or hangs; signals and the time limit; NaN; user mistakes at start.

Multi-process runs go through `python tests/faulty_main.py` (main.py plus an injected fault) as a user would run
them: a separate process group, signals sent from outside, stdout/stderr and exit codes read as they are.
"""
import contextlib
import copy
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, free_port, load_model_state, make_config, max_diff

from core import config, errors
from resilience import faults
from resilience import heartbeat
import main
import trainer
from wiring import checked_config

HOST = socket.gethostname()


def args(out, *extra, procs=2, steps=40):
    return ["--set", f"output_dir={out}", "--set", "dist.strategy=ddp", "--set", f"dist.procs_per_node={procs}",
            "--set", f"dist.master_port={free_port()}", "--set", "log.tensorboard=false",
            "--set", "log.progress_bar=false", "--set", "model.dropout=0", "--set", "train.eval_every=0",
            "--set", f"train.max_steps={steps}", "--set", "train.epochs=0", "--set", "train.log_every=1",
            "--set", "train.batch_size=16", *extra]


def start(out, *extra, fault=None, procs=2, steps=40):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_", "FAULT"))}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["FAULT"] = fault
    return subprocess.Popen([sys.executable, "tests/faulty_main.py", *args(out, *extra, procs=procs, steps=steps)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, like a job started from a shell


def wait_for_log(out, rank, pattern, timeout=60):
    path = os.path.join(out, "logs", f"rank{rank}.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                if re.search(pattern, f.read()):
                    return
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout} s")


def ranks_of(proc, out):
    """The rank processes main.py started (its spawned children), in rank order: each rank's log names its pid."""
    kids = {c.pid: c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())}
    pids = [int(re.search(r"rank \d+ on \S+: pid (\d+)", open(out / "logs" / f"rank{r}.log").read()).group(1))
            for r in range(len(kids))]
    return [kids[pid] for pid in pids]


def finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for c in psutil.Process(proc.pid).children(recursive=True):
            c.kill()
        raise
    return proc.returncode, out, err


# ==============================================================================================================
# Signals and the time limit: every rank stops at the same step, saves, exits 3; the run resumes exactly
# ==============================================================================================================
@pytest.mark.slow
def test_sigterm_saves_and_resume_equals_an_uninterrupted_run(tmp_path):
    out = tmp_path / "run"
    proc = start(out, fault="slow:-1:100")  # 0.1 s per step: time to send the signal mid-run
    wait_for_log(out, 1, r"step 5/40")
    proc.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(proc)
    assert code == errors.EXIT_STOPPED, stderr
    lines = [line for line in stdout.splitlines() if line.startswith("stopped by")]
    assert len(lines) == 1, stdout  # said by both ranks, printed once
    m = re.fullmatch(r"stopped by SIGTERM at step (\d+); saved step-\1; run the same command to resume", lines[0])
    assert m, lines
    step = int(m.group(1))
    assert 5 <= step < 40 and (out / "checkpoints" / f"step-{step}" / "meta.json").exists()
    assert "Traceback" not in stderr
    with open(out / "logs" / "rank1.log") as f:  # every rank's log has its own lines
        log1 = f.read()
    assert "SIGTERM received" in log1 and "step 5/40" in log1 and lines[0] in log1

    code, _, stderr = finish(start(out))  # the same command again: resumes and finishes
    assert code == 0, stderr
    with open(out / "logs" / "rank0.log") as f:
        assert f"resumed from {out}/checkpoints/step-{step} at step {step}" in f.read()
    # The uninterrupted reference: the same settings, run by main.run in this process (one Python start fewer
    # than `python tests/faulty_main.py`, and no fault to inject)
    ref = tmp_path / "ref"
    sets = args(ref)[1::2]
    assert main.run(checked_config(os.path.join(ROOT, "parameters.yml"), sets)) == 0
    assert max_diff(load_model_state(out, 40), load_model_state(ref, 40)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "SIGUSR1", "time_limit"])
def test_ctrl_c_stop_signal_and_time_limit_stop_gracefully(tmp_path, how):
    out = tmp_path / how
    extra = ["--set", "train.time_limit=00:00:04"] if how == "time_limit" else []
    proc = start(out, *extra, fault="slow:-1:100", steps=400)
    if how != "time_limit":  # (the clock starts with the ranks: a slow setup may use up 4 s before step 3)
        wait_for_log(out, 0, r"step 3/400")
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground process group
    elif how == "SIGUSR1":  # to every process of the run, as SLURM's --signal or systemd's stop do: the ranks
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:  # hear it twice
            p.send_signal(signal.SIGUSR1)  # (directly, and forwarded by the launcher)
    code, stdout, stderr = finish(proc)
    assert code == errors.EXIT_STOPPED, stderr
    reason = {"ctrl-c": "SIGINT", "SIGUSR1": "SIGUSR1",
              "time_limit": r"the time limit \(train.time_limit=00:00:04\)"}[how]
    m = re.search(rf"^stopped by {reason} at step (\d+); saved step-(\d+); run the same command to resume$",
                  stdout, re.M)
    assert m and m.group(1) == m.group(2), stdout + stderr
    assert (out / "checkpoints" / f"step-{m.group(1)}" / "meta.json").exists()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def test_joining_the_group_can_be_left_while_waiting_and_a_timeout_is_one_line(tmp_path, capfd):
    """The wait for the other ranks runs beside this thread (process_group.while_waiting): `waiting` is called during it
    and may leave at once (a stop signal), and ranks that never meet are a UserError naming where and the fix."""
    from core import process_group
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 3})
    seen = []

    def waiting(seconds, where):
        seen.append(where)
        if seconds > 1:
            raise errors.Stopped("left")
    start = time.monotonic()
    with pytest.raises(errors.Stopped):  # rank 0 of 2, alone: it would wait dist.timeout_s
        process_group.init(cfg, 0, 2, 0, waiting=waiting)
    assert time.monotonic() - start < 2.5 and seen[0] == f"tcp://127.0.0.1:{cfg.dist.master_port}"
    # rank 0's roll call stops polling with it, and ends the store it hosts (left running, it aborted the exit)
    assert not [t for t in threading.enumerate() if t.name == "join-process-group"]
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 3, "nodes": 2, "procs_per_node": 1,
                                      "node_rank": 1, "master_addr": "127.0.0.1"})  # (another free port)
    capfd.readouterr()
    start = time.monotonic()
    with pytest.raises(errors.UserError, match=rf"^rank 1: the 2 ranks did not all meet at tcp://127.0.0.1:"
                                               rf"{cfg.dist.master_port} within dist.timeout_s=3 \(Dist\w+Error: "
                                               r".*\); start all 2 nodes \(dist.node_rank 0 to 1\) with the same "
                                               r"dist.master_addr and dist.master_port, or raise dist.timeout_s$"):
        process_group.init(cfg, 1, 2, 0)  # nobody holds the rendezvous
    assert not dist.is_initialized()
    # TCPStore's own connect went on past its timeout (a second try: about twice dist.timeout_s) and printed each
    # failed try with C++ stack frames, for a whole dist.timeout_s when node 0 is down or master_addr is wrong
    assert time.monotonic() - start < 3 + 1.5
    assert "c10d" not in capfd.readouterr().err
    # over a file, rank 0 that never came was a RuntimeError's traceback from the FileStore, after the timeout
    where = tmp_path / "rendezvous"
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 1, "nodes": 2, "procs_per_node": 1,
                                      "node_rank": 1, "init_method": f"file://{where}"})
    with pytest.raises(errors.UserError) as e:
        process_group.init(cfg, 1, 2, 0)
    assert str(e.value) == (f"rank 1: the 2 ranks did not all meet at file://{where} within dist.timeout_s=1 "
                            "(DistStoreError: rank 0 never came); start all 2 nodes (dist.node_rank 0 to 1) with the "
                            "same dist.init_method, a file all of them see, or raise dist.timeout_s"), e.value
    assert not dist.is_initialized()


def rank_1_joins(cfg, within_s: float, freezing=None) -> tuple[list, list]:
    """Rank 1 joins the group in a thread (process_group.init), which must end within `within_s`; `freezing`: a store
    host process stopped (SIGSTOP) 0.6 s into the wait. Returns (what init raised, when the host was frozen)."""
    from core import process_group
    frozen, raised = [], []

    def waiting(seconds, where):
        if freezing is not None and seconds > 0.6 and not frozen:
            freezing.send_signal(signal.SIGSTOP)
            frozen.append(time.monotonic())

    def join():
        try:
            process_group.init(cfg, 1, 2, 0, waiting=waiting)
        except Exception as e:
            raised.append(e)
    joining = threading.Thread(target=join, daemon=True)
    joining.start()
    joining.join(within_s)
    assert not joining.is_alive(), f"rank 1 still waits {within_s:g} s later"
    return raised, frozen


def test_a_store_host_that_ends_as_the_ranks_meet_is_said_as_gone_not_as_not_started(tmp_path):
    """Rank 0's store went away while rank 1 waited in the roll call (rank 0's process ended): the line said the ranks
    "did not all meet within dist.timeout_s (DistNetworkError: Broken pipe)" and to start every node with the same
    address and port, or raise dist.timeout_s: none of which it was."""
    port = free_port()
    host = store_host(port)
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 5, "nodes": 2, "procs_per_node": 1,
                                      "node_rank": 1, "master_addr": "127.0.0.1", "master_port": port})
    threading.Timer(1.0, host.kill).start()
    raised, _ = rank_1_joins(cfg, within_s=20)
    store_calls_end()
    assert isinstance(raised[0], errors.UserError) and str(raised[0]).startswith(
        f"rank 1: the rendezvous store at tcp://127.0.0.1:{port} went away while the ranks met "), raised
    assert "ended or cannot be reached" in str(raised[0]) and "raise dist.timeout_s" not in str(raised[0])


def assert_store_went_silent(raised: list, port: int, seconds: int, call: str) -> None:
    """Rank 1's one line for a store (on `port`, dist.timeout_s 3) that left `call` unanswered for `seconds`."""
    assert isinstance(raised[0], errors.UserError) and re.match(
        rf"rank 1: the 2 ranks did not all meet at tcp://127.0.0.1:{port} within dist.timeout_s=3 "
        rf"\(DistNetworkError: the rendezvous store did not answer a call for {seconds} s: its host \(node 0\), or "
        rf"the network to it, is down \({call} at 127.0.0.1:{port}, from {re.escape(socket.gethostname())}\)\); "
        r"start all 2 nodes", str(raised[0])), raised


def test_a_port_that_takes_connections_but_never_answers_is_one_line_not_a_hang(tmp_path):
    """At master_addr:master_port something accepts connections and never answers: another program, or rank 0's
    process frozen (the kernel still accepts). Rank 1's TCPStore waited for its first answer for ever, whatever
    dist.timeout_s (still waiting a minute later); now the line after dist.timeout_s."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 2, "nodes": 2, "procs_per_node": 1,
                                          "node_rank": 1, "master_addr": "127.0.0.1", "master_port": port})
        raised, _ = rank_1_joins(cfg, within_s=10)
    store_calls_end()
    assert isinstance(raised[0], errors.UserError) and re.match(
        rf"rank 1: the 2 ranks did not all meet at tcp://127.0.0.1:{port} within dist.timeout_s=2 \(DistNetworkError: "
        r"the rendezvous store did not answer a call for 2 s: its host \(node 0\), or the network to it, is down "
        rf"\(connect at 127.0.0.1:{port}, ", str(raised[0])), raised

@pytest.mark.slow
def test_a_store_that_stops_answering_in_the_roll_call_is_one_line_not_a_hang(tmp_path):
    """The link to node 0 cut while rank 1 waited in the roll call (two nodes in network namespaces): TCPStore's check
    never returned, so rank 1 waited until TCP gave up (~15 min), whatever dist.timeout_s. A frozen store host (here:
    SIGSTOP) is the same to rank 1. Now one line after min(dist.timeout_s, 60 s) without an answer."""
    port = free_port()
    host = store_host(port)
    try:
        cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 3, "nodes": 2, "procs_per_node": 1,
                                          "node_rank": 1, "master_addr": "127.0.0.1", "master_port": port})
        raised, frozen = rank_1_joins(cfg, within_s=20, freezing=host)  # as it polls the store for rank 0's claim
        assert frozen and time.monotonic() - frozen[0] < 3 + 1.5
        assert_store_went_silent(raised, port, 3, "(check|get)")
    finally:
        host.kill()
        store_calls_end()


@pytest.mark.slow
def test_a_store_that_stops_answering_as_the_group_forms_is_one_line_not_a_hang(tmp_path):
    """The roll call passed (rank 0's claim and verdict are in the store), then the store's host froze while rank 1
    formed the group in init_process_group: its store calls, in C++, were not timed, and rank 1 waited until TCP
    gave up (a cut link) or for ever (a frozen host). Now the same line as in the roll call, naming the call."""
    from core import roll_call
    port = free_port()
    host = store_host(port)
    try:
        cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 3, "nodes": 2, "procs_per_node": 1,
                                          "node_rank": 1, "master_addr": "127.0.0.1", "master_port": port})
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3))
        client.set("trainer-roll/rank/0", json.dumps(roll_call.roll_call_entry(cfg, 2)))
        client.set("trainer-roll/verdict", "ok")
        raised, frozen = rank_1_joins(cfg, within_s=20, freezing=host)  # as it waits in init_process_group
        # (torch gives up on its own calls after dist.timeout_s: unanswered a store call's time more, the host is down)
        assert frozen and time.monotonic() - frozen[0] < 3 + 3 + 1.5
        assert_store_went_silent(raised, port, 6, "init_process_group")
    finally:
        host.kill()
        store_calls_end()

def test_a_node_that_never_comes_is_named_in_one_line_that_every_rank_says_alike(tmp_path):
    """Node 1 of [2, 2] never came: node 0's rank 0 said `2 of 4 ranks arrived`, not which; its rank 1 said
    another line (`DistNetworkError: Broken pipe`, the store rank 0 hosted gone) after C++ warnings. Rank 0's
    line, naming the missing node, is now every waiting rank's, so the launcher prints it once."""
    from core import process_group
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 1, "nodes": 2, "procs_per_node": [2, 2],
                                      "master_addr": "127.0.0.1"})
    said = {}

    def rank(r):
        try:
            process_group.init(cfg, r, 4, r)
        except errors.UserError as e:
            said[r] = str(e)
    ranks = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ranks:
        t.start()
        time.sleep(0.2)
    for t in ranks:
        t.join(30)
    assert said[0] == said[1] == (
        f"rank 0: the 4 ranks did not all meet at tcp://127.0.0.1:{cfg.dist.master_port} within dist.timeout_s=1 "
        "(DistStoreError: 2 of 4 ranks arrived; none from node 1 (ranks 2-3)); start all 2 nodes (dist.node_rank 0 "
        "to 1) with the same dist.master_addr and dist.master_port, or raise dist.timeout_s"), said


def test_a_rank_that_starts_late_still_reads_the_verdict(tmp_path):
    """Node 0 counts [1, 1], node 1 [1, 2], and node 1's rank 2 starts a moment after its rank 1 (a loaded machine):
    rank 0 ended with the verdict once the ranks that had come left, taking the store it hosts, and rank 2 waited
    dist.timeout_s for it, then said another line (`did not all meet`, or `Connection reset by peer`: the multi-node
    test failed so now and then). Rank 0 now waits for every rank of the nodes that came."""
    from core import process_group
    port, said = free_port(), {}

    def rank(r, layout, world):
        cfg = make_config(tmp_path / str(r), dist={"strategy": "ddp", "timeout_s": 5, "nodes": 2,
                                                   "node_rank": min(r, 1), "procs_per_node": layout,
                                                   "master_addr": "127.0.0.1", "master_port": port})
        try:
            process_group.init(cfg, r, world, 0)
        except errors.UserError as e:
            said[r] = str(e)
        gc.collect()  # rank 0's store (held by its error's frames) ends with it, as it does with its process
    ranks = [threading.Thread(target=rank, args=args) for args in ((0, [1, 1], 2), (1, [1, 2], 3), (2, [1, 2], 3))]
    for t in ranks:
        t.start()
        time.sleep(1.5 if t is ranks[1] else 0.3)
    for t in ranks:
        t.join(30)
    assert sorted(said) == [0, 1, 2] and all("the nodes count the ranks differently" in w for w in said.values()), said


def test_a_rank_claimed_twice_is_one_line_naming_both_claims(tmp_path):
    """Two nodes started with one dist.node_rank, or a rendezvous file a 2-node run left (its ranks end without the
    teardown that removes it) and the same command again: rank 1 was taken, and the line said `the nodes count the
    ranks differently`, naming one config twice. (Before the roll call ran in files, the run hung past timeout_s.)"""
    from core import process_group
    ended = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True).stdout)
    earlier = (f"file://{tmp_path}/{{rank}}-{ended} holds the roll call of an earlier run (rank {{rank}} was pid {ended} on {HOST}, which "
               "has ended): delete that file on one node, then start every node again")
    twice = (f"rank 1 is claimed twice: by node 1 ({HOST}, pid {os.getppid()}) and node 1 ({HOST}, pid {os.getpid()}); "
             "start each node with its own dist.node_rank (0 to 1), or, if the rendezvous file is an earlier run's, "
             "delete it")
    for rank, pid, words in ((1, ended, earlier.format(rank=1)), (0, ended, earlier.format(rank=0)),
                             (1, os.getppid(), twice)):
        where = tmp_path / f"{rank}-{pid}"  # (a file of its own: a FileStore's teardown spun on one removed under it)
        store = dist.FileStore(str(where), 2)
        for r in (0, 1):
            store.set(f"trainer-roll/rank/{r}", json.dumps({"node": r, "host": HOST, "pid": pid, "world": 2,
                                                             "layout": [1, 1], "counted from": "the same"}))
        cfg = make_config(tmp_path / "run", dist={"strategy": "ddp", "timeout_s": 1, "nodes": 2, "procs_per_node": 1,
                                                  "node_rank": rank, "init_method": f"file://{where}"})
        with pytest.raises(errors.UserError) as e:
            process_group.init(cfg, rank, 2, 0)
        assert str(e.value) == words


def test_a_rendezvous_file_in_a_missing_folder_is_one_line_before_the_ranks_start(tmp_path, capsys):
    """dist.init_method=file:///... in a folder that does not exist (a shared file system not mounted here, a
    typo): each rank said `did not all meet ... (No such file or directory); start every rank`, a line per rank."""
    where = tmp_path / "not-mounted" / "rendezvous"
    cfg = make_config(tmp_path / "run", dist={"strategy": "ddp", "procs_per_node": 2, "init_method": f"file://{where}"},
                      train={"max_steps": 1})
    assert main.run(cfg) == errors.EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err == (f"error: dist.init_method file://{where}: the folder {where.parent} does not exist on {HOST}; "
                   "the ranks meet through a file there: create it, or mount the file system every node shares"), err


def test_a_port_taken_under_srun_is_said_as_such(tmp_path):
    """Under srun (or a port taken between main.py's check and the rendezvous) rank 0 cannot listen on
    master_port: torch fails at once with EADDRINUSE, which was worded as ranks that `did not all meet within
    dist.timeout_s`, with the fix `start every rank, or raise dist.timeout_s`."""
    from core import process_group
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = make_config(tmp_path, dist={"strategy": "ddp", "timeout_s": 20, "master_port": port})
        with pytest.raises(errors.UserError) as e:
            process_group.init(cfg, 0, 2, 0)
    assert str(e.value).startswith(f"rank 0: dist.master_port {port} is already in use on {HOST} (another run?); "
                                   f"pick a free one, e.g. --set dist.master_port={port + 1}"), e.value
    assert not dist.is_initialized()


@pytest.mark.slow
def test_sigterm_to_the_launcher_while_its_ranks_start_is_a_stop_not_a_crash(tmp_path):
    """The ranks start with the stop signals blocked until their handlers are in; starting the first rank also
    starts multiprocessing's resource tracker, which unblocked SIGINT and SIGTERM in the launcher, so the ranks
    started with them open: SIGTERM in their first seconds was `rank 0 died from SIGTERM at step 0`, exit 1."""
    out = tmp_path / "run"
    proc = start(out, steps=3000)
    deadline = time.monotonic() + 30
    while len([c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher only, as a scheduler signals the job's process
    code, stdout, stderr = finish(proc)
    assert code == errors.EXIT_STOPPED and "died from" not in stdout + stderr, stdout[-2000:] + stderr[-2000:]


def test_a_rank_whose_setup_fails_as_rank_0_stops_with_its_store_is_stopped_not_crashed(tmp_path, monkeypatch, capsys):
    """The test above, lost as CI saw it once: SIGTERM reached rank 0 as it waited for the group, and rank 0 left
    with the store; rank 1, through the meeting, then failed to reach the store for its watchdog: a crash (exit 1)
    with a traceback, beside rank 0's stop. A store error in set-up after a stop request is the stop's consequence."""
    from main import RankPlace
    from resilience.rank_run import RankRun
    monkeypatch.setattr(faults.stop_request, "reason", "SIGTERM")
    monkeypatch.setattr(faults.progress, "phase", "setup")
    rank = RankRun(make_config(tmp_path), RankPlace(rank=1, local_rank=1, world=2, local_procs=2))
    error = torch.distributed.DistNetworkError("the rendezvous store did not answer a call for 10 s")
    assert rank.reported(error) == errors.EXIT_STOPPED
    out = capsys.readouterr()
    assert "stopped by SIGTERM while rank 1" in out.out + out.err and "Traceback" not in out.out + out.err
    monkeypatch.setattr(faults.stop_request, "reason", None)  # no stop asked: a crash, as ever
    assert rank.reported(error) == errors.EXIT_CRASH


def caught(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask, /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.slow
def test_a_stop_signal_as_main_py_starts_is_a_stop_not_death_by_it(tmp_path):
    """A stop signal before the handlers were in (main.py checking the config, importing torch, holding output_dir
    before its ranks start) ended main.py by the signal: exit 143 (SIGTERM) or 138 (SIGUSR1), which
    scripts/slurm_job.sh reads as a crash and does not requeue. Each moment, polled, is now exit 3 and one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_", "FAULT"))}
    env["OMP_NUM_THREADS"] = "1"
    before = ("before training began: nothing was trained, nothing needed saving; run the same command to start "
              "again (it resumes from the last checkpoint, if there is one)")
    for moment, name in (("caught", "SIGTERM"), ("torch loads", "SIGUSR1"), ("output_dir held", "SIGTERM")):
        out = tmp_path / moment.replace(" ", "_")
        proc = subprocess.Popen([sys.executable, "main.py", *args(out, steps=3)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        reached = {"caught": lambda: caught(proc.pid, signal.SIGTERM), "torch loads": lambda: loads_torch(proc.pid),
                   "output_dir held": lambda: (out / ".lock").exists()}[moment]
        deadline = time.monotonic() + 60
        while not reached():
            assert time.monotonic() < deadline and proc.poll() is None, (moment, proc.poll())
            time.sleep(0.005)
        proc.send_signal(getattr(signal, name))
        code, stdout, stderr = finish(proc)
        assert code == errors.EXIT_STOPPED and "Traceback" not in stderr, (moment, code, stdout[-2000:], stderr[-2000:])
        lines = [line for line in stdout.splitlines() if line.startswith("stopped by")]
        assert len(lines) == 1 and lines[0].startswith(f"stopped by {name}"), (moment, stdout)
        if moment != "output_dir held":  # (then the ranks may have started: stopped after step 1, or as they met)
            assert (stdout, stderr) == (f"stopped by {name} {before}\n", ""), moment
            assert not (out / "checkpoints").exists() and not (out / "logs").exists()


@pytest.mark.slow
def test_a_stop_signal_while_batch_size_auto_times_the_ranks_stops_at_once(tmp_path):
    """SIGTERM while train.batch_size auto (or precision auto) timed forward+backward waited for the timing to end:
    minutes on a starved CPU (here 100000 batches). Every rank now stops after the batch it is timing, together:
    exit 3, one line, nothing saved."""
    out = tmp_path / "run"
    proc = start(out, "--set", "train.batch_size=auto", "--set", "train.global_batch_size=32",
                 "--set", "train.balance_steps=100000", fault="timing:-1:0", steps=3)
    for rank in (0, 1):
        wait_for_log(out, rank, r"timing forward\+backward")
    proc.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(proc, timeout=30)
    assert code == errors.EXIT_STOPPED and "Traceback" not in stderr, stdout[-2000:] + stderr[-2000:]
    assert [line for line in stdout.splitlines() if line.startswith("stopped by")] == [errors.stopped_before_training(
        "SIGTERM", " while timing forward+backward (train.precision or train.batch_size auto)")], stdout
    assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")


@pytest.mark.slow
def test_nodes_that_count_the_ranks_differently_are_one_line_not_a_hang(tmp_path):
    """The store counts arrivals only: node 0 counting 2 ranks ([1, 1]) and node 1 counting 3 ([1, 2]) met, then
    waited at DDP's first collective until dist.timeout_s (30 min by default) and ended in gloo tracebacks. Then
    nodes that count 3 alike but split them otherwise ([2, 1] and [1, 2]: two processes take rank 1). Each node now
    says so in one line, from the roll call before the group is made. Over a file:// rendezvous the roll call did
    not run: the same mismatch waited dist.timeout_s, then ended in gloo tracebacks. Last, node 1 first over a file:
    its ranks claim 1 and 2 before node 0's rank 1 comes, which then refused in its own words beside rank 0's verdict
    (two lines on node 0; CI saw it over tcp too): the first refusal's words are every rank's now."""
    cases = (("[1,1]", "[1,2]", "tcp"), ("[2,1]", "[1,2]", "tcp"), ("[1,1]", "[1,2]", "file"),
             ("[2,1]", "[1,2]", "file, node 1 first"))
    for first, second, where in cases:
        port, out = free_port(), tmp_path / f"{where.replace(' ', '_').replace(',', '')}{first}"
        meet = (("dist.master_addr=127.0.0.1", f"dist.master_port={port}") if where == "tcp" else
                (f"dist.init_method=file://{out / 'rendezvous'}",))
        common = ("--set", "dist.nodes=2", *[a for m in meet for a in ("--set", m)], "--set", "dist.timeout_s=60")
        if where.endswith("node 1 first"):
            out.mkdir(parents=True)
            node1 = start(out / "n1", *common, "--set", f"dist.procs_per_node={second}", "--set", "dist.node_rank=1")
            rendezvous, deadline = out / "rendezvous", time.monotonic() + 40
            # until node 1's ranks have claimed 1 and 2 in the rendezvous file
            while not rendezvous.exists() or rendezvous.read_bytes().count(b"trainer-roll/rank/") < 2:
                assert time.monotonic() < deadline and node1.poll() is None
                time.sleep(0.1)
        node0 = start(out / "n0", *common, "--set", f"dist.procs_per_node={first}", "--set", "dist.node_rank=0")
        if not where.endswith("node 1 first"):
            node1 = start(out / "n1", *common, "--set", f"dist.procs_per_node={second}", "--set", "dist.node_rank=1")
        for proc in (node0, node1):
            code, _, stderr = finish(proc, timeout=45)
            assert code == errors.EXIT_USER_ERROR and "Traceback" not in stderr, stderr[-3000:]
            lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
            assert len(lines) == 1 and "count the ranks differently" in lines[0], stderr[-3000:]
            assert f"dist.procs_per_node={first.replace(',', ', ')}" in lines[0] \
                and f"dist.procs_per_node={second.replace(',', ', ')}" in lines[0], lines


@pytest.mark.slow
def test_ctrl_c_while_node_0_waits_for_node_1_stops_at_once(tmp_path):
    """Node 1 never comes: node 0 says it waits, and Ctrl-C ends it at once (was: after dist.timeout_s, a traceback)."""
    out = tmp_path / "run"
    proc = start(out, "--set", "dist.nodes=2", "--set", "dist.master_addr=127.0.0.1", procs=1)
    wait_for_log(out, 0, r"waiting for the other ranks at tcp://127.0.0.1:\d+ \(up to dist.timeout_s=1800 s; 2 ranks")
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    code, stdout, stderr = finish(proc)
    assert code == errors.EXIT_STOPPED and time.monotonic() - signalled < 10, stderr
    assert re.search(rf"^stopped by SIGINT while rank 0 on {HOST} waited \d+ s for the other ranks at "
                     r"tcp://127.0.0.1:\d+: nothing was trained$", stdout + stderr, re.M), stdout + stderr
    assert "Traceback" not in stderr


# ==============================================================================================================
# A crashing, dying, freezing or hanging rank: reported once by rank, host and step; the run ends fast
# ==============================================================================================================
@pytest.mark.slow
def test_crash_in_one_rank_is_reported_with_rank_host_step_and_traceback(tmp_path):
    out = tmp_path / "run"
    code, _, stderr = finish(start(out, fault="raise:1:3"))
    assert code == errors.EXIT_CRASH
    first = stderr.splitlines()[0]
    assert first == f"rank 1 on {HOST} failed at step 3: ValueError: injected fault", stderr
    assert stderr.count("ValueError: injected fault") == 2  # the heading and the traceback's last line, once
    assert "Traceback (most recent call last)" in stderr and "faulty_main.py" in stderr
    with open(out / "logs" / "rank1.log") as f:
        log1 = f.read()
    assert first in log1 and "Traceback" in log1


@pytest.mark.slow
def test_killed_rank_is_named_and_ends_the_run_within_10_s(tmp_path):
    proc = start(tmp_path / "run", fault="slow:-1:20", steps=100000)
    wait_for_log(tmp_path / "run", 1, r"step 3/")
    ranks = ranks_of(proc, tmp_path / "run")
    assert len(ranks) == 2
    ranks[1].kill()
    t0 = time.monotonic()
    code, _, stderr = finish(proc, timeout=30)
    assert time.monotonic() - t0 < 10
    assert code == errors.EXIT_CRASH
    assert re.match(rf"rank 1 on {HOST} \(pid {ranks[1].pid}\) died from SIGKILL \(killed by the kernel: out of "
                    r"memory\?, or kill -9\) at step \d+$", stderr.splitlines()[0]), stderr
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)
    # Each rank's log ends with why it ended: rank 1's with its death, rank 0's (killed by the launcher as it asked
    # the store who was lost) with the launcher's word; both logs used to end mid-step, without a word.
    last = [open(tmp_path / "run" / "logs" / f"rank{r}.log").read().splitlines()[-1] for r in (0, 1)]
    assert last[1].endswith(f" rank1 {stderr.splitlines()[0]}"), last
    assert re.search(rf" rank0 rank 0 on {HOST} \(pid {ranks[0].pid}\) was ended by the launcher at step \d+ "
                     rf"\(SIGKILL\), as rank 1 on {HOST} had failed first$", last[0]), last


@pytest.mark.slow
def test_rank_0_killed_each_survivor_says_one_line_without_a_stack(tmp_path):
    """kill -9 of rank 0, which hosts the rendezvous store: rank 1 printed torch's C++ TCPStore warning (c10 stack
    frames) from asking the dead store which peers were silent, then its collective's Python traceback. Now each
    survivor says one line naming rank 0 as gone, its traceback kept in its own log."""
    out = tmp_path / "run"
    proc = start(out, fault="slow:-1:20", steps=100000, procs=3)
    wait_for_log(out, 2, r"step 3/")
    ranks = ranks_of(proc, out)
    ranks[0].kill()
    code, _, stderr = finish(proc, timeout=30)
    assert code == errors.EXIT_CRASH
    assert not re.search(r"frame #|Exception raised from|Traceback|c10d", stderr), stderr
    lines = stderr.splitlines()
    # the cause first, then its consequences (the survivors' lines came first: they report, rank 0 left no report)
    assert re.match(rf"rank 0 on {HOST} \(pid {ranks[0].pid}\) died from SIGKILL .* at step \d+$", lines[0]), stderr
    for r in (1, 2):
        said = [line for line in lines if line.startswith(f"rank {r} ")]
        assert len(said) == 1 and re.match(rf"rank {r} on {HOST} failed at step \d+: lost rank 0, which is gone "
                                           r"\(the rendezvous store it hosted closed its connections\); ",
                                           said[0]), stderr
        with open(out / "logs" / f"rank{r}.log") as f:
            log = f.read()
        assert said[0] in log and "Traceback (most recent call last)" in log  # the detail, for debugging
    assert len(lines) == 3, stderr
    with open(out / "logs" / "rank0.log") as f:  # (it ended mid-step, without a word)
        assert f.read().splitlines()[-1].endswith(f" rank0 {lines[0]}")


@pytest.mark.slow
def test_a_rank_stuck_in_its_teardown_is_ended_and_the_run_still_succeeds(tmp_path):
    # Rank 1 trains, saves, is done, then hangs closing its process group (as a stuck NCCL communicator can):
    # the launcher ends it after min(60 s, dist.hang_timeout_s) with a warning; the run's result stands.
    out = tmp_path / "run"
    proc = start(out, "--set", "dist.hang_timeout_s=3", "--set", "train.save_every=3", fault="teardown:1:0", steps=3)
    code, stdout, stderr = finish(proc, timeout=60)
    assert code == 0, stderr
    warned = re.search(rf"^warning: rank 1 on {HOST} \(pid \d+\) was done \(exit code 0\) but still tearing down "
                       r"3 s later; ended it$", stderr, re.M)
    assert warned, stderr
    with open(out / "logs" / "rank1.log") as f:  # the same word ends its log (it ended mid-teardown)
        assert f.read().splitlines()[-1].endswith(" rank1 " + warned.group(0))
    assert "rank 0" not in stderr  # rank 0 closed normally
    from core.checkpoint_io import model_state_dict
    assert model_state_dict(str(out / "checkpoints" / "step-3"))


@pytest.mark.slow
def test_a_rank_that_crashes_in_its_teardown_after_it_was_done_does_not_fail_the_run(tmp_path):
    # Rank 1 trains, saves, is done, then aborts closing its process group (seen in a test run: gloo's C++
    # "terminate called without an active exception", SIGABRT). Its work is saved: a warning, not a failure, and
    # rank 0 is not killed for it.
    out = tmp_path / "run"
    proc = start(out, "--set", "train.save_every=3", fault="abort:1:0", steps=3)
    code, stdout, stderr = finish(proc, timeout=60)
    assert code == 0, stderr
    assert re.search(rf"^warning: rank 1 on {HOST} \(pid \d+\) was done \(exit code 0\) but its teardown ended "
                     r"with SIGABRT; counted as done$", stderr, re.M), stderr
    assert "died" not in stderr and "rank 0" not in stderr
    from core.checkpoint_io import model_state_dict
    assert model_state_dict(str(out / "checkpoints" / "step-3"))


@pytest.mark.slow
def test_workers_die_with_their_launcher_killed_by_sigkill(tmp_path):
    proc = start(tmp_path / "run", fault="slow:-1:20", steps=100000)
    wait_for_log(tmp_path / "run", 1, r"step 3/")
    ranks = ranks_of(proc, tmp_path / "run")
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, [p.pid for p in alive]


@pytest.mark.slow
def test_frozen_rank_is_named_by_the_watchdog_and_others_dump_stacks(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "--set", "dist.hang_timeout_s=3", fault="slow:-1:20", steps=100000)
    wait_for_log(out, 1, r"step 3/")
    ranks = ranks_of(proc, out)
    ranks[1].suspend()  # SIGSTOP: the process, its heartbeat thread included, stops
    t0 = time.monotonic()
    code, _, stderr = finish(proc, timeout=60)
    # The timeout, a beat interval, 2 s for the others to read the verdict, the launcher's 2 s of grace, exits
    assert time.monotonic() - t0 < 3 + 7
    assert code == errors.EXIT_CRASH
    assert re.match(rf"hang detected by the watchdog: rank 1 on {HOST} stopped responding \(last heard at step \d+, "
                    r"[34] s ago: frozen or dead; rank 0 is (at|evaluating at|saving) step \d+\)", stderr), stderr
    with open(out / "logs" / "rank0.log") as f:
        log0 = f.read()
    # Rank 0 waits in whichever collective of the loop comes next (train_step's, the log window's in log_train):
    # its dumped stack shows the Trainer's frames.
    assert "Python stacks of rank 0" in log0 and re.search(r'trainer\.py", line \d+ in \w+', log0), log0[-3000:]
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)


@pytest.mark.slow
def test_each_node_of_one_rank_ended_by_its_watchdog_says_the_verdict_once(tmp_path):
    """Nodes of one rank each, each its own console (main.py runs the rank in its own process, with a forked watcher
    for a SIGKILL). Rank 1's main thread hangs; the watchdogs end both nodes with os._exit. Node 0 said nothing at
    all: identical final words were printed once across the run (as under srun), and node 1 said it first. Or, when
    it spoke, its watcher added that rank 0 "was killed without a word (SIGKILL: ...)"."""
    common = ("--set", "dist.nodes=2", "--set", "dist.master_addr=127.0.0.1",
              "--set", f"dist.master_port={free_port()}", "--set", "dist.hang_timeout_s=3")
    nodes = [start(tmp_path / f"n{i}", *common, "--set", f"dist.node_rank={i}", fault="hang:1:4", procs=1,
                   steps=100000) for i in range(2)]
    try:  # (each until its watcher, which shares its stderr, ended too)
        ended = [finish(node, timeout=90) for node in nodes]
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
    for code, _, stderr in ended:
        assert code == errors.EXIT_CRASH
        said = [line for line in stderr.splitlines() if line.startswith(("error: ", "hang detected"))]
        assert len(said) == 1 and said[0].startswith("hang detected by the watchdog: no progress for 3 s at step 4 "
                                                     "(every rank stuck"), stderr[-3000:]


@pytest.mark.slow
def test_hung_main_thread_is_detected_with_every_ranks_stack(tmp_path):
    """Rank 0 hangs, so its trackers are closed marked failed by its watchdog: its os._exit left MLflow's run RUNNING
    (where another rank hangs, rank 0's collective fails as that rank leaves, and the crash closes them)."""
    import mlflow
    out = tmp_path / "run"
    code, _, stderr = finish(start(out, "--set", "dist.hang_timeout_s=3", "--set", "log.report_to=[mlflow]",
                                   fault="hang:0:4"), timeout=60)
    assert code == errors.EXIT_CRASH
    assert len(stderr.splitlines()) == 1, stderr  # every rank saw the verdict; said once (MLflow's INFO lines: none)
    assert "no progress for 3 s at step 4" in stderr
    with open(out / "logs" / "rank0.log") as f:
        assert "faulty_main.py" in f.read()  # rank 0's stack shows where it hangs
    held = mlflow.MlflowClient(f"sqlite:///{out}/mlflow.db").get_run(json.load(open(out / "trackers.json"))["mlflow"])
    assert held.info.status == "FAILED" and held.data.metrics["train/loss"] > 0


# ==============================================================================================================
# User mistakes: one line, exit 2, before training
# ==============================================================================================================
def test_same_user_error_on_every_rank_is_printed_once(tmp_path):
    code, _, stderr = finish(start(tmp_path / "run", "--set", "data.dataset=mnist",
                                   "--set", f"data.data_dir={tmp_path}/none", "--set", "data.download=false"))
    assert code == errors.EXIT_USER_ERROR
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("error: "), stderr


def test_port_in_use_is_one_line_with_the_fix(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, stderr = finish(start(tmp_path / "run", "--set", f"dist.master_port={port}"))
    assert code == errors.EXIT_USER_ERROR
    assert stderr.strip() == (f"error: dist.master_port {port} is already in use on this machine (another run?); "
                              f"pick a free one, e.g. --set dist.master_port={port + 1}")


@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_master_addr_that_does_not_resolve_is_one_line_at_once(tmp_path, capsys, node_rank):
    """A typo in dist.master_addr: torch would retry the name until dist.timeout_s (30 min by default), printing
    C++ warnings and stack frames, then fail. Refused before any rank starts, naming the key."""
    cfg = make_config(tmp_path / "run", dist={"strategy": "ddp", "nodes": 2, "node_rank": node_rank,
                                              "procs_per_node": 1, "master_addr": "no-such-node.invalid"},
                      train={"max_steps": 1})
    started = time.monotonic()
    assert main.run(cfg) == errors.EXIT_USER_ERROR
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: dist.master_addr 'no-such-node.invalid' "), err
    assert "does not resolve" in err and "node 0" in err, err


def test_a_master_addr_that_does_not_resolve_under_srun_is_one_line_at_once(tmp_path, capfd, monkeypatch):
    """Under srun (every rank started at once: its variables, simulated), the same typo waited dist.timeout_s
    behind torch's C++ warnings and stack frames, then blamed ranks that were not started."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")):
            monkeypatch.delenv(k)
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(k, v)
    cfg = make_config(tmp_path / "run", dist={"strategy": "ddp", "master_addr": "no-such-node.invalid",
                                              "timeout_s": 3}, train={"max_steps": 1})
    started = time.monotonic()
    assert main.run(cfg) == errors.EXIT_USER_ERROR
    assert time.monotonic() - started < 3
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: dist.master_addr 'no-such-node.invalid' "), err
    assert "does not resolve" in err, err


def test_node_0_given_another_machines_address_is_one_line_at_once(tmp_path, capfd, monkeypatch):
    """dist.master_addr of node 0 (ours, then srun's rank 0) names another machine: its store listened here while its
    ranks connected there, waiting dist.timeout_s behind C++ stack frames. Node 0 can tell: the address is none of
    its own (bind: EADDRNOTAVAIL). 192.0.2.1 is TEST-NET-1, no machine's."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")):
            monkeypatch.delenv(k)
    line = (f"error: dist.master_addr '192.0.2.1' is not an address of this machine ({socket.gethostname()}), node 0, "
            "which hosts the rendezvous there; set it to one of node 0's addresses, as the other nodes reach it")
    for srun in (False, True):
        if srun:
            for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}.items():
                monkeypatch.setenv(k, v)
        cfg = make_config(tmp_path / f"run{srun}", dist={"strategy": "ddp", "master_addr": "192.0.2.1", "timeout_s": 3,
                                                         **({} if srun else {"nodes": 2, "procs_per_node": 1})},
                          train={"max_steps": 1})
        started = time.monotonic()
        assert main.run(cfg) == errors.EXIT_USER_ERROR
        assert time.monotonic() - started < 2
        assert capfd.readouterr().err.strip() == line

def test_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cfg = make_config(tmp_path / "file", train={"max_steps": 1})
    assert main.run(cfg) == errors.EXIT_USER_ERROR
    assert capsys.readouterr().err.strip() == f"error: output_dir {str(tmp_path / 'file')!r} is a file, not a directory"
    cfg = make_config(tmp_path / "file" / "sub", train={"max_steps": 1})
    assert main.run(cfg) == errors.EXIT_USER_ERROR
    assert "is not a writable directory" in capsys.readouterr().err


def test_finished_run_says_already_complete(tmp_path, capsys):
    cfg = make_config(tmp_path, train={"max_steps": 3, "eval_every": 0})
    assert main.run(cfg) == 0
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    capsys.readouterr()
    assert main.run(cfg) == 0
    out = capsys.readouterr().out
    assert (f"already complete at step 3 ({tmp_path}/checkpoints/step-3): this run ends at step 3 (max_steps=3 "
            "ends before epochs=") in out
    assert "another output_dir or --set train.start_over=true" in out
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before
    cfg = make_config(tmp_path / "elsewhere", train={"max_steps": 3, "eval_every": 0,
                                                     "resume": str(tmp_path / "checkpoints" / "step-3")})
    assert main.run(cfg) == 0  # the checkpoint it goes on from, not this output_dir's latest (none: it said None)
    assert f"already complete at step 3 ({tmp_path}/checkpoints/step-3): this run" in capsys.readouterr().out


def run_stopped_in_step(monkeypatch, cfg, step: int) -> int:
    """main.run(cfg) with a stop request arriving during `step`, as a SIGTERM then does; its exit code."""
    train_step = trainer.Trainer.train_step

    def stop_in_step(self, batches):
        if self.state.step + 1 == step:
            monkeypatch.setattr(faults.stop_request, "reason", "SIGTERM")
        return train_step(self, batches)

    monkeypatch.setattr(trainer.Trainer, "train_step", stop_in_step)
    try:
        return main.run(cfg)
    finally:
        monkeypatch.setattr(trainer.Trainer, "train_step", train_step)
        monkeypatch.setattr(faults.stop_request, "reason", None)


def test_a_stop_at_an_evaluation_step_is_evaluated_by_the_resumed_run(tmp_path, monkeypatch):
    """A stop saves before its step's evaluation (it must be quick); the resumed run makes that evaluation first,
    so patience counts it: early stopping ends at the uninterrupted run's step, on its parameters."""
    train = {"max_steps": 100, "eval_every": 5, "save_every": 0, "patience": 2, "lr": 1e-12, "schedule": "constant"}
    assert main.run(make_config(tmp_path / "full", train=train)) == 0  # dev flat: stops early at step 15
    cfg = make_config(tmp_path / "stopped", train=train)
    assert run_stopped_in_step(monkeypatch, cfg, 10) == errors.EXIT_STOPPED
    assert main.run(cfg) == 0
    assert "step 10 dev: loss=" in open(tmp_path / "stopped" / "logs" / "rank0.log").read()
    from core import checkpoint, checkpoint_meta
    full, resumed = (checkpoint_meta.read(checkpoint.latest(str(tmp_path / run))) for run in ("full", "stopped"))
    assert full["step"] == resumed["step"] == 15 and full["state"] == resumed["state"]
    a, b = load_model_state(tmp_path / "full", 15), load_model_state(tmp_path / "stopped", 15)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_evaluation_left_by_a_stop_that_ends_the_resumed_run_is_ranked_on_the_dev_subset(tmp_path, monkeypatch):
    """train.eval_batches: stopped in step 4 (an evaluation step), resumed with max_steps 4, the evaluation the stop
    left is the run's last: it read the whole split and ranked its value against the subset's (step 2's). Now it is
    ranked on the subset, as at the end of an uninterrupted run, and the whole split is reported after it."""
    train = {"epochs": 0, "max_steps": 6, "eval_every": 2, "save_every": 2, "eval_batches": 1, "eval_batch_size": 16,
             "lr": 1e-12, "schedule": "constant"}  # the weights do not move: every subset value is equal
    assert run_stopped_in_step(monkeypatch, make_config(tmp_path, train=train), 4) == errors.EXIT_STOPPED
    assert main.run(make_config(tmp_path, train={**train, "max_steps": 4})) == 0
    dev = re.findall(r"step 4 dev: .*samples=(\d+)", open(tmp_path / "logs" / "rank0.log").read())
    assert dev == ["16", "225"], dev
    state = json.load(open(tmp_path / "checkpoints" / "step-4" / "meta.json"))["state"]
    assert (state["best_step"], state["evals_without_improvement"], state["eval_due"]) == (2, 1, False)


def test_a_stop_between_two_training_lines_leaves_the_next_line_as_the_uninterrupted_run_s(tmp_path, monkeypatch):
    """Stopped after step 7 with a line every 5 steps: the resumed run's step-10 line averaged steps 8-10 alone (and
    differed from the uninterrupted run's, which averages 6-10). The checkpoint keeps the window's loss now: every
    line and value the trackers hold are the uninterrupted run's, bit for bit."""
    import csv
    train = {"max_steps": 10, "epochs": 0, "eval_every": 5, "save_every": 5, "log_every": 5}
    log = {"report_to": ["csv"], "tensorboard": None}
    assert main.run(make_config(tmp_path / "full", train=train, log=log)) == 0
    cfg = make_config(tmp_path / "stopped", train=train, log=log)
    assert run_stopped_in_step(monkeypatch, cfg, 7) == errors.EXIT_STOPPED
    assert main.run(cfg) == 0

    def losses(run):
        with open(tmp_path / run / "metrics.csv", newline="") as f:
            return [(r["step"], r["value"]) for r in csv.DictReader(f) if r["tag"] in ("train/loss", "dev/loss")]
    assert losses("stopped") == losses("full") and len(losses("full")) == 4


def test_the_same_command_goes_on_after_a_stop_under_an_explicit_resume_path(tmp_path, monkeypatch, capsys):
    """train.resume: PATH, stopped, then the same command: it goes on from its own newest checkpoint (it used to
    start from PATH again). Going back to PATH beside later checkpoints it did not write is refused (pruning used
    to delete the step it had just saved, keeping the later ones)."""
    train = {"max_steps": 12, "eval_every": 0, "save_every": 4, "keep_last": 5}
    assert main.run(make_config(tmp_path / "full", train=train)) == 0
    start = str(tmp_path / "full" / "checkpoints" / "step-4")
    cfg = make_config(tmp_path / "branch", train={**train, "resume": start, "keep_last": 1})
    assert run_stopped_in_step(monkeypatch, cfg, 6) == errors.EXIT_STOPPED
    assert main.run(cfg) == 0
    assert f"resumed from {tmp_path}/branch/checkpoints/step-6 at step 6" in capsys.readouterr().out
    a, b = load_model_state(tmp_path / "full", 12), load_model_state(tmp_path / "branch", 12)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert main.run(make_config(tmp_path / "full", train={**train, "resume": start, "keep_last": 1})) == 2
    assert capsys.readouterr().err == (f"error: train.resume: {start} is older than {tmp_path}/full/checkpoints/"
                                       "step-12, which was not written from it (resume, test mode and pruning would "
                                       "take it for this run's): resume it into another output_dir, or move the "
                                       "later checkpoints aside\n")
    assert sorted(os.listdir(tmp_path / "full" / "checkpoints")) == ["step-12", "step-4", "step-8"]


def test_a_run_that_stopped_early_says_to_raise_patience_and_goes_on_when_it_is(tmp_path, capsys):
    """Run again after early stopping, it said to raise train.max_steps, which changes nothing."""
    train = {"max_steps": 100, "eval_every": 5, "save_every": 0, "patience": 2, "lr": 1e-12, "schedule": "constant"}
    assert main.run(make_config(tmp_path, train=train)) == 0  # dev flat: stops early at step 15
    capsys.readouterr()
    assert main.run(make_config(tmp_path, train={**train, "max_steps": 200})) == 0
    out = capsys.readouterr().out
    assert (f"already complete at step 15 ({tmp_path}/checkpoints/step-15): it stopped early (train.patience=2); "
            "nothing to do. To train longer raise train.patience (0: never stop early); for a new run") in out
    assert main.run(make_config(tmp_path, train={**train, "patience": 3})) == 0
    assert "early stopping at step 20: no improvement of accuracy in 3 evaluations" in capsys.readouterr().out


def test_time_limit_and_signal_config():
    assert config.parse_duration("1-02:03:04") == 86400 + 2 * 3600 + 3 * 60 + 4
    assert config.parse_duration("05:00") == 300 and config.parse_duration(90) == 90
    from wiring import checked_config_from_dict
    from core.errors import ConfigError
    with pytest.raises(ConfigError, match="train.time_limit"):
        checked_config_from_dict({"train": {"time_limit": "3 hours"}})
    with pytest.raises(ConfigError, match="train.stop_signal"):
        checked_config_from_dict({"train": {"stop_signal": "SIGKILL"}})


# ==============================================================================================================
# Non-finite steps never reach the parameters
# ==============================================================================================================
def make_trainer(tmp_path, **train):
    from core import process_group
    from wiring import build_trainer
    cfg = make_config(tmp_path, train={"max_steps": 10, "eval_every": 0, **train})
    return build_trainer(cfg, process_group.init(cfg, 0, 1, 0))


def test_a_nan_dev_metric_is_saved_as_null_and_the_checkpoint_loads(tmp_path):
    """An evaluation that diverged (dev loss NaN) still saves a checkpoint its own reader accepts: meta.json is
    strict JSON, the NaN written as null (the reader refuses NaN, which JSON does not allow)."""
    from core import checkpoint, checkpoint_meta
    tr = make_trainer(tmp_path)
    tr.state.step = 1
    tr.save_checkpoint({"loss": float("nan"), "accuracy": 0.5, "f1": float("inf")})
    tr.finish_save()
    meta = checkpoint_meta.read(checkpoint.latest(str(tmp_path)))
    assert meta["metrics"] == {"loss": None, "accuracy": 0.5, "f1": None}
    assert checkpoint_meta.best_recorded(str(tmp_path)) == checkpoint.latest(str(tmp_path))
    tr.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nan_step_leaves_parameters_and_optimizer_state_unchanged(tmp_path, precision):
    tr = make_trainer(tmp_path, precision=precision)
    stream = tr.micro_batches()
    tr.train_step([next(stream)])  # the optimizer has state now
    params = copy.deepcopy(tr.strategy.raw_model.state_dict())
    opt = copy.deepcopy(tr.strategy.optimizer.state_dict())
    loss_sum = tr.task.loss_sum
    tr.task.loss_sum = lambda model, batch: loss_sum(model, batch) * float("nan")
    _, _, norm, updated, _ = tr.train_step([next(stream)])
    assert norm != norm and not updated  # nan
    assert max_diff(tr.strategy.raw_model.state_dict(), params) == 0
    after = tr.strategy.optimizer.state_dict()["state"]
    assert all(torch.equal(after[k][n], opt["state"][k][n]) for k in after for n in after[k])
    tr.task.loss_sum = loss_sum
    _, _, norm, updated, _ = tr.train_step([next(stream)])  # and training goes on
    assert norm == norm and updated and max_diff(tr.strategy.raw_model.state_dict(), params) > 0


def test_diverged_run_stops_with_exit_4_keeping_good_checkpoints(tmp_path, capsys):
    cfg = make_config(tmp_path, train={"max_steps": 50, "eval_every": 0, "save_every": 1, "lr": 1e6,
                                       "max_bad_steps": 3})
    assert main.run(cfg) == errors.EXIT_DIVERGED
    err = capsys.readouterr().err
    m = re.search(r"training diverged: 3 steps in a row up to step (\d+) had a non-finite gradient norm .*; last "
                  r"checkpoint: (\S+) ", err)
    assert m, err
    from core import checkpoint
    found = checkpoint.complete_checkpoints(str(tmp_path))
    assert found and m.group(2) == found[-1][1]
    for _, path in found:  # every checkpoint written is finite
        assert all(torch.isfinite(v).all() for v in torch.load(os.path.join(path, "model.pt")).values())


def test_nan_is_never_best(tmp_path):
    tr = make_trainer(tmp_path, best_metric="accuracy")
    assert tr.track_best({"accuracy": 0.5})[0]
    assert not tr.track_best({"accuracy": float("nan")})[0]
    assert tr.state.best_value == 0.5


def test_a_stop_amid_non_finite_steps_resumes_their_count(tmp_path, monkeypatch):
    """Steps 3-6 are NaN, max_bad_steps 3: the run diverges at step 5. Stopped after step 4, the resumed run used to
    count again from 0, get past the bad steps and train on to the end."""
    cfg = make_config(tmp_path, train={"max_steps": 10, "eval_every": 0, "max_bad_steps": 3})
    train_step = trainer.Trainer.train_step

    def nan_in_steps_3_to_6(self, batches):
        step, loss_sum = self.state.step + 1, self.task.loss_sum
        if step == 4:  # as a SIGTERM during step 4 does (the resumed run starts at step 5)
            monkeypatch.setattr(faults.stop_request, "reason", "SIGTERM")
        if 3 <= step <= 6:
            self.task.loss_sum = lambda model, batch: loss_sum(model, batch) * float("nan")
        try:
            return train_step(self, batches)
        finally:
            self.task.loss_sum = loss_sum

    monkeypatch.setattr(trainer.Trainer, "train_step", nan_in_steps_3_to_6)
    assert main.run(cfg) == errors.EXIT_STOPPED
    monkeypatch.setattr(faults.stop_request, "reason", None)
    assert main.run(cfg) == errors.EXIT_DIVERGED
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert "training diverged: 3 steps in a row up to step 5 had a non-finite gradient norm" in log


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_by_every_rank(tmp_path):
    out = tmp_path / "run"
    code, _, stderr = finish(start(out, fault="nan:1:3", steps=6))
    assert code == 0, stderr
    for rank in (0, 1):
        with open(out / "logs" / f"rank{rank}.log") as f:
            assert "step 3: gradient norm is nan: update skipped (1 in a row" in f.read()
    assert all(torch.isfinite(v).all() for v in load_model_state(out, 6).values())


def test_resuming_with_another_lr_or_length_warns_and_uses_the_new_lr(tmp_path, capsys):
    assert main.run(make_config(tmp_path, train={"max_steps": 4, "eval_every": 0, "schedule": "constant"})) == 0
    capsys.readouterr()
    cfg = make_config(tmp_path, train={"max_steps": 8, "eval_every": 0, "schedule": "constant", "lr": 5e-4,
                                       "log_every": 1, "clip_grad_norm": 1.0, "precision": "bf16"})
    assert main.run(cfg) == 0
    out = capsys.readouterr().out
    assert ("resuming with train.lr 0.001 -> 0.0005, train.max_steps 4 -> 8: the learning-rate schedule changes "
            "from step 4 on (now 8 steps in all: max_steps=8 ends before epochs=20)") in out
    assert ("resuming with train.clip_grad_norm 0.0 -> 1.0, train.precision fp32 -> bf16: the run differs from the "
            "saved one's from step 4 on") in out  # (they used to change it silently)
    import conftest
    assert conftest.logged(tmp_path, "lr")[-4:] == [5e-4] * 4


def test_resuming_with_another_best_metric_ranks_anew_and_says_so(tmp_path, capsys):
    """The best accuracy so far used to be compared with dev losses (`best dev loss=0.09778`), and patience stopped
    a run whose loss improved at every evaluation."""
    train = {"max_steps": 10, "eval_every": 5, "save_every": 0}
    assert main.run(make_config(tmp_path, train=train)) == 0
    capsys.readouterr()
    assert main.run(make_config(tmp_path, train={**train, "max_steps": 20, "best_metric": "loss", "patience": 1})) == 0
    out = capsys.readouterr().out
    assert ("resuming with train.best_metric accuracy (max) -> loss (min): the best checkpoint and train.patience "
            "count from step 10 on") in out
    from core import checkpoint, checkpoint_meta
    meta = checkpoint_meta.read(checkpoint.latest(str(tmp_path)))
    assert meta["step"] == 20 and meta["state"]["best_step"] == 20  # the loss went down: no early stop
    assert meta["state"]["best_value"] == meta["metrics"]["loss"]


def test_resuming_with_other_per_rank_batches_takes_the_same_samples_and_says_what_differs(tmp_path, capsys):
    """The same global batch cut otherwise (here one micro-batch of 32 as two of 16): each step takes the same
    samples, so the run ends where the uninterrupted one does; the warning used to say the data order changed."""
    train, model = {"max_steps": 8, "eval_every": 0, "save_every": 4, "keep_last": 5}, {"dropout": 0}
    assert main.run(make_config(tmp_path / "full", train=train, model=model)) == 0
    os.makedirs(tmp_path / "resumed" / "checkpoints")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-4", tmp_path / "resumed" / "checkpoints" / "step-4")
    capsys.readouterr()
    resumed = make_config(tmp_path / "resumed", train={**train, "batch_size": 16, "grad_accum_steps": 2}, model=model)
    assert main.run(resumed) == 0
    assert ("resuming with per-rank batches [16] instead of [32]: random draws such as dropout's differ from here "
            "on") in capsys.readouterr().out
    assert max_diff(load_model_state(tmp_path / "full", 8), load_model_state(tmp_path / "resumed", 8)) < 1e-6


class DictStore(dict):
    """The two store calls Watchdog._check makes, over a dict of key -> str."""
    def check(self, keys):
        return all(k in self for k in keys)

    def multi_get(self, keys):
        return [self[k].encode() for k in keys]


def test_a_stop_or_end_under_torchrun_is_said_by_rank_0_alone(monkeypatch, capsys):
    """Under torchrun, SIGTERM to rank 1: both ranks printed `stopped by SIGTERM at step 74; saved step-74; ...`,
    and rank 1 a C++ stack (`TCPStore recvValue failed ... Connection reset by peer`): rank 0, which hosts the
    store, had said it and exited, so rank 1's question to the store failed and it said the line again. Every rank
    ends alike after a stop or the end, so rank 0 says it alone; a failure is still asked of the store."""
    class StoreGone:
        def first_to_say(self, line):
            return True  # (what first_to_say answers when the store is gone)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)  # torchrun's (a rank main.py runs alone always says its word)
    monkeypatch.setattr(faults.report, "watchdog", StoreGone())
    monkeypatch.setattr(faults.report, "sink", None)
    monkeypatch.setattr(faults.report, "log", None)
    line = "stopped by SIGTERM at step 74; saved step-74; run the same command to resume"
    for rank in (1, 0):
        monkeypatch.setattr(faults.progress, "rank", rank)
        for code, what in ((errors.EXIT_STOPPED, line), (errors.EXIT_OK, "done: 6 steps"), (errors.EXIT_CRASH, "boom")):
            assert faults.report(code, what) == code
    said = capsys.readouterr()
    assert said.out.splitlines() == [line, "done: 6 steps"] and said.err.splitlines() == ["boom", "boom"]
    # before the group (no watchdog): torchrun ends rank 1, waiting for a rank 0 refused in one line (output_dir in
    # use), with SIGTERM: its `stopped by SIGTERM while rank 1 ... waited` was a second line beside the refusal
    monkeypatch.setattr(faults.report, "watchdog", None)
    monkeypatch.setattr(faults.progress, "rank", 1)
    waited = "stopped by SIGTERM while rank 1 on vm waited 1 s for the other ranks at env://: nothing was trained"
    assert faults.report(errors.EXIT_STOPPED, waited) == errors.EXIT_STOPPED
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("LOCAL_RANK", "0")  # (the first rank of another node says its own)
    assert faults.report(errors.EXIT_STOPPED, waited) == errors.EXIT_STOPPED
    assert capsys.readouterr().out == waited + "\n"


def test_watchdog_names_every_rank_that_fell_silent_together(monkeypatch):
    """Ranks 1 and 2 (one node) stop beating half an interval apart: the verdict names both, not the first."""

    store, clock = DictStore(), [0.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])
    w = heartbeat.Watchdog(store, SimpleNamespace(rank=0, world_size=3), timeout=4, log_path="/dev/null")
    monkeypatch.setattr(faults.progress, "phase", "train")
    monkeypatch.setattr(faults.progress, "step", 7)  # (rank 0's own, as its heartbeat says)
    beats = {0: 0, 1: 0, 2: 0}
    verdict = None
    while verdict is None and clock[0] < 20:
        for r in beats:  # rank 1 falls silent at t=2, rank 2 half an interval later
            if not (r == 1 and clock[0] >= 2) and not (r == 2 and clock[0] >= 2.5):
                beats[r] += 1
            store[f"hb/{r}"] = f"{beats[r]} {beats[r]} {beats[r]} train host{r}"
        verdict = w._check([0, 1, 2])
        clock[0] += w.interval
    assert verdict is not None and verdict.startswith("ranks 1, 2 on host1, host2 stopped responding (last heard at "
                                                      "step 2, "), verdict
    assert "rank 0 is at step 7)" in verdict  # where the run is, beside where the silent ranks were


def test_watchdog_names_a_rank_frozen_before_its_first_beat(monkeypatch):
    """Every rank beats once as its watchdog starts; a rank whose heartbeat never shows up counts as silent from
    the first look (it used to count as "still starting" for ever: a rank frozen early was never named)."""

    store, clock = DictStore(), [0.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])
    w = heartbeat.Watchdog(store, SimpleNamespace(rank=0, world_size=2), timeout=4, log_path="/dev/null")
    verdict = None
    while verdict is None and clock[0] < 20:
        store["hb/0"] = f"{int(clock[0] * 4)} 0 0 train host0"
        verdict = w._check([0, 1])
        clock[0] += w.interval
    assert 4 < clock[0] - w.interval <= 4 + w.interval, clock[0]  # (the clock moved on after the verdict)
    assert verdict.startswith("rank 1 on a host it never named stopped responding (last heard at step 0, "), verdict


def test_a_rank_that_ended_after_its_report_is_not_named_lost(monkeypatch):
    """torchrun, 3 ranks, rank 0 killed: rank 2 said `lost rank 0 ...` and exited; rank 1, whose collective failed
    a moment later, said `lost ranks 0, 2, which stopped responding (died or froze)`: rank 2 had stopped beating
    because it had ended, after its own report. A watchdog that stops beats once more, `ended`: not lost."""

    class Store(DictStore):
        def set(self, key, value):
            self[key] = value

    store = Store({"hb/0": f"7 7 4 train {HOST}"})  # rank 0: dead, silent
    monkeypatch.setattr(faults.progress, "phase", "train")
    ranks = [heartbeat.Watchdog(store, SimpleNamespace(rank=r, world_size=3, rendezvous=None), timeout=0.4,
                                log_path="/dev/null") for r in (1, 2)]
    for w in ranks:
        w._write_beat()  # as start() does
    ranks[1].thread.start()  # (rank 1's would watch rank 0: it stays a caller here)
    ranks[1].stop()  # rank 2 reported and ends
    assert store["hb/2"].split()[3] == "ended"
    assert ranks[0].silent_ranks() == [0]
    assert ranks[0].lost_peers(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by "
                                            "peer")) == "lost rank 0, which stopped responding (died or froze); "


def test_watchdog_says_when_a_silent_rank_was_last_heard_and_where_the_reporter_is(monkeypatch):
    """Rank 1 watches rank 0, whose last heartbeat said step 5; rank 1 trained on to step 40. The line said `rank 0
    ... stopped responding at step 5 (their last heartbeat; none for 4 s ...)`: no word of where the run was, and a
    step that reads as where rank 0 froze. Now when rank 0 was last heard, and the step of the rank that says so."""

    store, clock = DictStore(), [0.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(faults.progress, "step", 40)
    monkeypatch.setattr(faults.progress, "phase", "train")
    w = heartbeat.Watchdog(store, SimpleNamespace(rank=1, world_size=2), timeout=4, log_path="/dev/null")
    store["hb/0"] = "9 9 5 train host0"
    verdict = None
    while verdict is None and clock[0] < 20:
        verdict = w._check([0])
        clock[0] += w.interval
    assert verdict == ("rank 0 on host0 stopped responding (last heard at step 5, 5 s ago: frozen or dead; rank 1 is "
                       "at step 40); see logs/rank*.log for the others' stacks"), verdict

def test_the_watchdogs_own_connection_to_a_store_that_never_answers_gives_up(tmp_path):
    """The watchdog opens a store connection of its own as training starts: a store host frozen (or a link cut) just
    then held the rank in TCPStore's connect for ever, before its watchdog could say anything."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match=rf"did not answer a call for 1 s: its host \(rank 0, or "
                                                        rf"torchrun's agent\).*\(connect at tcp://127.0.0.1:{port}, "):
            heartbeat.open_store(SimpleNamespace(rendezvous=f"tcp://127.0.0.1:{port}"), op_timeout=1.0)
        assert time.monotonic() - started < 2
    store_calls_end()

def test_watchdog_sees_a_frozen_store_host(tmp_path, monkeypatch):
    """The process hosting the rendezvous store (rank 0 under our launcher) freezes: it keeps its connections
    open and never answers, and TCPStore's own timeout does not cover that (check/get/add wait for ever; tested
    on torch 2.13). The watchdog gives its store calls a deadline of its own and says so within its timeout."""
    port = free_port()
    host = store_host(port)
    try:
        client, w = watchdog_of_rank_1(tmp_path, port, timeout=2, host_line=False)
        verdicts = []
        monkeypatch.setattr(w, "_give_up", lambda verdict: (verdicts.append(verdict), w._stop.set()))
        w._write_beat()
        client.set("hb/0", f"1 1 1 train {HOST}")
        w.thread.start()
        time.sleep(1.5)
        assert not verdicts and w.unreachable_since is None  # the store answers
        host.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        w.thread.join(timeout=15)
        # where, from which host and step (was: only "froze or died", when a cut network does the same)
        assert verdicts and verdicts[0].startswith(f"the rendezvous store stopped answering for 2 s (tcp://127.0.0.1:"
                                                   f"{port}, seen from {HOST} {faults.progress.where()}): "), verdicts
        assert "or the network to it is down" in verdicts[0], verdicts
        assert time.monotonic() - t0 < 2 + 2 * 1.0 + 1.5  # the timeout, the call that found out, a beat
    finally:
        host.kill()
        store_calls_end()


@pytest.mark.slow
def test_watchdog_of_a_store_host_that_died_prints_no_cpp_stack(tmp_path, monkeypatch, capfd):
    """The store's host killed (kill -9 of rank 0): each heartbeat's store call printed torch's C++ warning with its
    c10 stack frames on stderr, once a beat, until the verdict. The watchdog's own connection to the store's port
    tells it the host is gone: no call is made, and the verdict says gone, not frozen. It came only after
    dist.hang_timeout_s (600 s by default), waited for a store known gone: now within a store call's time."""
    port = free_port()
    host = store_host(port)
    try:
        client, w = watchdog_of_rank_1(tmp_path, port, timeout=60)
        w.interval = 0.5  # (as a timeout of 2 s would have it)
        verdicts = []
        monkeypatch.setattr(w, "_give_up", lambda verdict: (verdicts.append(verdict), w._stop.set()))
        w._write_beat()
        client.set("hb/0", f"1 1 1 train {HOST}")
        w.thread.start()
        time.sleep(1.25)  # (between two beats: a call under way as the host dies still meets it)
        assert not verdicts and not w.store_gone()
        monkeypatch.setattr(faults.stop_request, "reason", "SIGTERM")  # torchrun's agent died: its workers stop and
        host.kill()  # save, their watchdogs let them (dist.hang_timeout_s)
        w.thread.join(timeout=2.5)
        assert not verdicts and w.store_gone()
        monkeypatch.setattr(faults.stop_request, "reason", None)  # no stop: not waited for
        t0 = time.monotonic()
        w.thread.join(timeout=15)
        assert time.monotonic() - t0 < 2 * w.interval + 1.0  # a beat: the store has been gone longer than a call's time
        assert verdicts and verdicts[0].endswith("the process hosting it (rank 0, or torchrun's agent) is gone (it "
                                                 "closed its connections)"), verdicts
        assert verdicts[0].startswith(f"the rendezvous store stopped answering (tcp://127.0.0.1:{port}, seen from "
                                      f"{HOST} "), verdicts  # (not `for 60 s`)
        with pytest.raises(dist.DistNetworkError, match="the rendezvous store is gone"):
            w.ask(lambda: client.get("hb/0"), "get")
    finally:
        host.kill()
        store_calls_end()
    assert "frame #" not in capfd.readouterr().err


# ==============================================================================================================
# Repeated and hang-up signals: the save the first signal started always completes; only SIGKILL ends it sooner
# ==============================================================================================================
def start_in(out, tmpdir, *extra, procs=2, **popen):
    """`start` with a private temporary folder (TMPDIR: where the launcher keeps its reports folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_", "FAULT"))}
    env.update(OMP_NUM_THREADS="1", FAULT="slow:-1:300", TMPDIR=str(tmpdir))
    os.makedirs(tmpdir, exist_ok=True)
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "start_new_session": True, **popen}
    return subprocess.Popen([sys.executable, "tests/faulty_main.py", *args(out, *extra, procs=procs, steps=400)],
                            cwd=ROOT, env=env, text=True, **popen)


def assert_stopped_and_saved(out, tmpdir, ranks, code, reason):
    import json
    assert code == errors.EXIT_STOPPED
    with open(out / "logs" / "rank0.log") as f:
        m = re.search(rf"stopped by {reason} at step (\d+); saved step-\1; run the same command to resume", f.read())
    assert m
    with open(out / "checkpoints" / f"step-{m.group(1)}" / "meta.json") as f:
        assert json.load(f)["step"] == int(m.group(1))
    assert load_model_state(out, m.group(1))
    assert not [p for p in os.listdir(tmpdir) if p.startswith("trainer-reports-")], os.listdir(tmpdir)
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, [p.pid for p in alive]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "ctrl-c"])
def test_a_repeated_stop_signal_does_not_abort_the_save(tmp_path, how):
    # Schedulers send SIGTERM twice, people press Ctrl-C again: the stop goes on, with one line per repeat.
    out, tmpdir = tmp_path / "run", tmp_path / "tmp"
    proc = start_in(out, tmpdir)
    wait_for_log(out, 0, r"step 3/400")
    ranks = ranks_of(proc, out)
    for i in range(3):
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground process group
        else:
            proc.send_signal(signal.SIGTERM)
        if i == 0:  # a stop that takes long (a slow file system, say) is not cut short; and every repeat comes
            ranks[1].suspend()  # while the run is still stopping, however fast this machine is
        time.sleep(0.2)
        if i == 1:
            time.sleep(11)
            ranks[1].resume()
    code, stdout, stderr = finish(proc)
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    again = (f"{name} again: already stopping: a checkpoint is saved, then the run exits; SIGKILL ends it at once, "
             f"without saving (kill -9 {proc.pid})")
    assert stdout.count(again) == 2, stdout
    assert_stopped_and_saved(out, tmpdir, ranks, code, name)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "terminal"])
def test_sighup_stops_gracefully_and_leaves_no_reports_folder(tmp_path, how):
    # "terminal": the run's terminal hangs up, as when an ssh session drops: the kernel sends SIGHUP and every
    # later write to the terminal fails; the run must still save and exit 3.
    import fcntl
    import pty
    import select
    import termios
    out, tmpdir = tmp_path / "run", tmp_path / "tmp"
    if how == "kill":
        proc = start_in(out, tmpdir)
    else:
        master, tty = pty.openpty()
        proc = start_in(out, tmpdir, stdin=tty, stdout=tty, stderr=tty, start_new_session=False,
                        preexec_fn=lambda: (os.setsid(), fcntl.ioctl(0, termios.TIOCSCTTY, 0)))
        os.close(tty)
    try:
        deadline = time.monotonic() + 60
        while not (out / "logs" / "rank0.log").exists() or "step 3/400" not in (out / "logs" / "rank0.log").read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            if how == "terminal" and select.select([master], [], [], 0.1)[0]:
                os.read(master, 65536)  # (a terminal nobody reads fills up and blocks its writers)
            time.sleep(0.05)
        ranks = ranks_of(proc, out)
    finally:
        if how == "terminal":
            os.close(master)  # the hang-up
    if how == "kill":
        proc.send_signal(signal.SIGHUP)
        code, stdout, stderr = finish(proc)
        assert "Traceback" not in stderr, stderr
        assert re.search(r"^stopped by SIGHUP at step \d+; saved step-\d+", stdout, re.M), stdout
    else:
        code = proc.wait(timeout=60)
    assert_stopped_and_saved(out, tmpdir, ranks, code, "SIGHUP")


def test_stop_request_ignores_repeats_and_sighup_stops(tmp_path):
    # In a rank (and under torchrun or srun, where each rank hears the signals itself): the first stop signal sets
    # the request, the same or another one again only logs a line, nothing raises.
    import logging
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)}
    request, records = faults.StopRequest(), []
    request.log = logging.getLogger("test_stop_request")
    request.log.addHandler(handler := logging.Handler())
    handler.emit = lambda record: records.append(record.getMessage())
    try:
        request.install("SIGHUP", None)  # train.stop_signal may name SIGHUP, a stop signal anyway
        assert request.vote() == 0.0
        os.kill(os.getpid(), signal.SIGHUP)
        for signum in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # (the handler runs at the next bytecode of this thread)
        assert request.reason == "SIGHUP" and request.vote() == 1.0
        deadline = time.monotonic() + 10  # (the lines are written by the request's own thread)
        while len(records) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(records) == 4 and records[0].startswith("SIGHUP received: stopping after the current step")
        assert records[1:] == [faults.already_stopping(n) for n in ("SIGINT", "SIGINT", "SIGTERM")]
    finally:
        request.log.removeHandler(handler)
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_stop_signal_while_a_line_is_being_written_does_not_write_into_it():
    # CI's finding: a second Ctrl-C landed while the first one's line was being flushed, the handler logged into the
    # same file again, and logging printed "reentrant call inside BufferedWriter" with a traceback. The handler only
    # queues its line; the request's thread writes it once the line being written is done.
    import logging
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    request, records, writing = faults.StopRequest(), [], []
    request.log = logging.getLogger("test_stop_request_reentry")
    request.log.addHandler(handler := logging.Handler())

    def emit(record):
        assert not writing, "a log line was written while another was being written (from a signal handler)"
        writing.append(record)
        if len(records) == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the signal lands inside this write
            time.sleep(0.05)
        records.append(record.getMessage())
        writing.clear()
    handler.emit = emit
    try:
        request.install(None, None)
        request.log.warning("step 3/400")
        deadline = time.monotonic() + 10
        while len(records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert records[0] == "step 3/400" and records[1].startswith("SIGTERM received"), records
        assert request.reason == "SIGTERM"
    finally:
        request.log.removeHandler(handler)
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_stop_signal_after_the_ranks_are_gone_does_not_kill_main_py(tmp_path, monkeypatch):
    """The fault drill's finding: a fourth SIGTERM, as the ranks had saved and exited, killed `python main.py`
    (exit -15, not 3: no requeue). As a program it now ignores them once its ranks are gone; in-process callers
    get their own handlers back."""
    from resilience.launcher import Supervisor
    cfg = make_config(tmp_path, dist={"strategy": "ddp", "procs_per_node": 2})
    before = signal.getsignal(signal.SIGTERM)
    for program, expected in ((False, before), (True, signal.SIG_IGN)):
        monkeypatch.setattr(faults, "ignore_late_signals", program)
        s = Supervisor(cfg, [], worker=None)
        s.previous_handlers = {signal.SIGTERM: before}
        s.close()
        assert signal.getsignal(signal.SIGTERM) == expected
        signal.signal(signal.SIGTERM, before)


def store_calls_end(timeout: float = 10.0) -> None:
    """Wait for the store calls a test left waiting (StoreCall's threads) to fail, once their store is gone: their C++
    warnings would land in a later test's captured stderr."""
    deadline = time.monotonic() + timeout
    for t in [t for t in threading.enumerate() if t.name == "store-call"]:
        t.join(max(0.0, deadline - time.monotonic()))


def watchdog_of_rank_1(tmp_path, port: int, timeout: float, host_line: bool = True):
    """(its store client, the watchdog) of rank 1 of 2 on the store at `port`, store calls of 1 s; `host_line`: with
    its own connection to the store's port, as training opens it."""
    ctx = SimpleNamespace(rank=1, world_size=2, rendezvous=f"tcp://127.0.0.1:{port}")
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1), wait_for_workers=False)
    w = heartbeat.Watchdog(client, ctx, timeout=timeout, log_path=str(tmp_path / "log"), op_timeout=1.0)
    if host_line:
        w.host_line = heartbeat.open_host_line(ctx, 1.0)
    return client, w


def store_host(port: int) -> subprocess.Popen:
    """A process that hosts a TCPStore on `port` and then does nothing else (SIGSTOP it: a frozen store host)."""
    host = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; s = d.TCPStore("
                             f"'127.0.0.1', {port}, is_master=True, wait_for_workers=False); print(1, flush=True); "
                             "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert host.stdout.readline().strip() == "1"
    return host


@pytest.mark.slow  # 4 runs of main.py (2 start 2 ranks): ~20 s
def test_a_stop_signal_during_predict_or_test_mode_ends_it_as_ctrl_c_does(tmp_path):
    """SIGTERM (scancel, a preemption, kill) during a predict killed it: exit 143, predictions.csv.tmp left, and the
    watcher's line blamed SIGKILL `at step 0` (under ddp: `rank N died from SIGTERM at step 0`, twice, exit 1). Test
    mode likewise. Now it ends as Ctrl-C does: one line naming the signal and what it was doing, 128 + its number,
    no temporary file, the earlier predictions.csv whole."""
    from PIL import Image
    from tasks.image import load_digits_split
    out = tmp_path / "run"
    assert main.run(make_config(out, train={"max_steps": 3, "epochs": 0, "eval_every": 0})) == 0
    images = load_digits_split()[2]
    os.makedirs(tmp_path / "new")
    for i in range(40):
        Image.fromarray((images[i] * 255 / 16).astype("uint8"), "L").save(tmp_path / "new" / f"{i:02d}.png")
    (out / "predictions.csv").write_text("earlier\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_", "FAULT"))}
    env.update(OMP_NUM_THREADS="1", FAULT="slowinfer:-1:300")  # every batch, and every split, 0.3 s
    ddp = ["--set", "dist.strategy=ddp", "--set", "dist.procs_per_node=2", "--set", f"dist.master_port={free_port()}"]
    for mode, signum, extra, doing in (("predict", signal.SIGTERM, [], "while predicting (mode predict)"),
                                       ("predict", signal.SIGHUP, ddp, "while predicting (mode predict)"),
                                       ("test", signal.SIGTERM, [], "while testing (mode test)")):
        if (out / "logs" / "rank0.log").exists():
            (out / "logs" / "rank0.log").unlink()
        proc = subprocess.Popen([sys.executable, "tests/faulty_main.py", "--params", str(out / "config.yml"),
                                 "--set", f"mode={mode}", "--set", f"predict.input={tmp_path / 'new'}",
                                 "--set", "train.eval_batch_size=4", *extra], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        wait_for_log(out, 0, "predicting the inputs of|testing ")
        for _ in range(10):  # (to main.py alone, as `kill PID`; its launcher passes it on to the ranks)
            proc.send_signal(signum)  # again and again, as schedulers do: the second raised into the cleanup
            time.sleep(0.001)
        code, stdout, stderr = finish(proc)
        assert "already stopping" not in stdout  # (what a training run says of a repeat: it saves first)
        name = signal.Signals(signum).name
        assert (code, stderr.strip().splitlines()) == (128 + signum, [f"interrupted by {name} {doing} on {HOST}"]), \
            (mode, extra, code, stderr)
        assert not [name for name in os.listdir(out) if name.endswith(".tmp")], (mode, extra)
        assert not (out / "test_results.json").exists()  # (dev's, if it was evaluated before the signal: whole)
        assert not (out / "dev_results.json").exists() or json.loads((out / "dev_results.json").read_text())
        assert (out / "predictions.csv").read_text() == "earlier\n"
    # Under ddp, a signal as the ranks start (they start with it blocked: it comes as they unblock it) was
    # `rank N exited with code 1 at step 0 without a report`, twice, after two KeyboardInterrupt tracebacks.
    # (Ctrl-C alike: `interrupted while predicting`, 130.)
    proc = subprocess.Popen([sys.executable, "tests/faulty_main.py", "--params", str(out / "config.yml"),
                             "--set", "mode=predict", "--set", f"predict.input={tmp_path / 'new'}", *ddp],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    while not [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(proc)
    assert (code, stderr.strip().splitlines()) == (
        143, [f"interrupted by SIGTERM while predicting (mode predict) on {HOST}"]), stderr
    assert (out / "predictions.csv").read_text() == "earlier\n"


def test_the_launcher_says_what_a_rank_that_does_not_train_was_doing(tmp_path, capsys):
    """A predict's rank killed without a word (kill -9, the kernel's OOM killer) was said `died from SIGKILL ... at
    step 0`, one that exited without a report `... at step 0 without a report`: a predict has no step."""
    from main import RankPlace
    from resilience import launcher
    cfg = make_config(tmp_path, mode="predict", predict={"input": str(tmp_path)}, dist={"strategy": "ddp"})
    supervisor = launcher.Supervisor(cfg, [RankPlace(rank=r, local_rank=r, world=2, local_procs=2) for r in (0, 1)],
                                     None)
    supervisor.report_dir = str(tmp_path)  # (no rank left a report)
    supervisor.procs = supervisor.exit_order = [SimpleNamespace(pid=11, exitcode=-signal.SIGKILL),
                                                SimpleNamespace(pid=12, exitcode=7)]
    supervisor.finished[0] = supervisor.finished[1] = -1
    assert supervisor.summarize() == 1
    assert capsys.readouterr().err.splitlines() == [
        f"rank 0 on {HOST} (pid 11) died from SIGKILL (killed by the kernel: out of memory?, or kill -9) while "
        "predicting (mode predict)",
        f"rank 1 on {HOST} (pid 12) exited with code 7 while predicting (mode predict) without a report (see "
        "logs/rank1.log)"]


def test_a_stop_signal_as_a_predict_or_test_starts_ends_it_in_one_line(tmp_path, monkeypatch, capsys):
    """A signal main.py caught before it read the config (catch_early) was delivered again once the config said the
    mode does not stop on it: SIGTERM then killed a predict, test or export without a word (143), Ctrl-C raised a
    KeyboardInterrupt traceback. Now one line, as later on."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                                              signal.SIGUSR2)}
    monkeypatch.setattr(faults, "stop_request", faults.StopRequest())
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (as in a terminal: a background job ignores it)
        os.makedirs(tmp_path / "checkpoints")  # (test mode and export refuse an output_dir without one)
        for mode, signum in (("predict", signal.SIGTERM), ("test", signal.SIGINT), ("export", signal.SIGHUP)):
            faults.stop_request.catch_early()
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # (the handler runs at the next bytecode of this thread)
            assert faults.stop_request.reason == signal.Signals(signum).name
            code = main.main(["--set", f"output_dir={tmp_path}", "--set", f"mode={mode}",
                              "--set", f"predict.input={tmp_path}"])
            by = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
            assert (code, capsys.readouterr().err.splitlines()) == (
                128 + signum, [f"interrupted{by} {faults.doing(mode)} on {HOST}"])
            faults.stop_request.reason = None
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_signal_as_the_launcher_starts_a_predict_s_ranks_is_no_training_stop(tmp_path, capsys):
    """A stop signal that came as main.py's launcher was about to start a predict's ranks (none started) said
    `stopped by SIGTERM before training began: nothing was trained`, exit 3 (a requeue): it is an interruption."""
    from main import RankPlace
    from resilience import launcher
    cfg = make_config(tmp_path, mode="predict", predict={"input": str(tmp_path)}, dist={"strategy": "ddp"})
    supervisor = launcher.Supervisor(cfg, [RankPlace(rank=r, local_rank=r, world=2, local_procs=2) for r in (0, 1)],
                                     None)
    supervisor.signals_seen.append(signal.SIGTERM)  # (as if forward() had heard it)
    assert supervisor.supervise() == 143
    assert capsys.readouterr().err.splitlines() == [f"interrupted by SIGTERM while predicting (mode predict) on {HOST}"]
    assert not supervisor.procs[0].pid and not supervisor.procs[1].pid  # none started


def test_the_launcher_ends_a_killed_ranks_log_only_if_that_rank_opened_it(tmp_path):
    """A rank killed (kill -9, the OOM killer, the launcher after another rank failed) left its log ending mid-step;
    the launcher writes its last line, but only into a log whose last start line names that rank's pid: not one an
    earlier run left (a rank killed before it opened its own), nor a log that is not there."""
    from resilience.launcher import Supervisor
    (tmp_path / "logs").mkdir()
    for r, pid in ((0, 11), (1, 99)):  # rank 1's log is an earlier run's: pid 99, not 12
        (tmp_path / "logs" / f"rank{r}.log").write_text(f"10:00:00 rank{r} rank {r} on {HOST}: pid {pid}, local rank "
                                                         f"{r} of 3, 3 ranks in all, train\n10:00:01 rank{r} step 1"
                                                         + "\n" * r)  # (rank 0's last line cut short by the kill)
    sup = SimpleNamespace(cfg=SimpleNamespace(output_dir=str(tmp_path)),
                          places=[SimpleNamespace(rank=r) for r in range(3)],
                          procs=[SimpleNamespace(pid=11 + r) for r in range(3)])
    for i in range(3):
        Supervisor.end_log(sup, i, f"rank {i} ended")
    lines = (tmp_path / "logs" / "rank0.log").read_text().splitlines()
    assert lines[-2] == "10:00:01 rank0 step 1" and lines[-1].endswith(" rank0 rank 0 ended"), lines
    assert (tmp_path / "logs" / "rank1.log").read_text().splitlines()[-1] == "10:00:01 rank1 step 1"
    assert not (tmp_path / "logs" / "rank2.log").exists()


@pytest.mark.slow
def test_a_collective_that_fails_as_the_store_host_dies_asks_the_store_nothing(tmp_path, capfd):
    """kill -9 of rank 0: a survivor's collective failed at once, and asking the store which peers were silent met
    the store as its host's connections were still closing: torch's C++ warning with its stack frames on stderr
    (1 run in 25 of the 3-rank kill). The watchdog's own connection is given a moment to say the host is gone."""
    port = free_port()
    host = store_host(port)
    try:
        client, w = watchdog_of_rank_1(tmp_path, port, timeout=60)
        w._write_beat()
        client.set("hb/0", f"1 1 1 train {HOST}")
        host.kill()  # (the collective with it fails at once; its store's connections close as it exits)
        said = w.lost_peers(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    finally:
        host.kill()
        store_calls_end()
    assert said == "lost rank 0, which is gone (the rendezvous store it hosted closed its connections); ", said
    assert "frame #" not in capfd.readouterr().err
