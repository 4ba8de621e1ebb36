"""Our own launcher: one process per device on this node, watched (main.py uses it unless torchrun or srun
started the ranks). Unlike torch.multiprocessing.spawn, it names the rank that failed and how, passes signals on so
that the ranks stop together after saving, and takes the others down when one fails.

To follow a training step, read rank_main() only: each rank is a process that runs `worker(cfg, place)` (wiring.py).
The Supervisor below matters when a rank fails, a signal comes or the run ends.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from typing import Callable, Optional

from core import process_end, trackers
from core.atomic_write import write_beside
from core.config import Config
from core.errors import EXIT_CRASH, EXIT_OK, EXIT_STOPPED, UserError
from resilience import faults
from resilience.faults import HOST, already_stopping, detach_hung_up_terminal, say, stop_signals

GRACE_S = 2.0  # after a rank fails, how long the others get to report before they are killed
EXIT_GRACE_S = 60.0  # a rank that is done may take this long (at most dist.hang_timeout_s) to tear down and exit


# ---- What each rank's process runs -----------------------------------------------------------------------------------
def rank_main(cfg: Config, place, worker: Callable, report_dir: str, steps, finished, parent_pid: int) -> None:
    """What a started rank runs: tie it to the Supervisor (die with it, report to it), then be one rank
    (`worker(cfg, place)`: wiring.worker)."""
    # A spawned process spawns too: data.num_workers would start as fresh interpreters, importing everything again
    # (seconds each: benchmarks/RESULTS.md). The platform's default instead, as torchrun's ranks have.
    mp.set_start_method(None, force=True)
    set_parent_death_signal(parent_pid)
    os.setpgrp()  # out of the terminal's process group: one Ctrl-C reaches us once, forwarded by the Supervisor
    faults.no_stdin()  # (multiprocessing gives Python's stdin /dev/null; file descriptor 0 too)
    faults.progress.shared = steps
    faults.progress.slot = place.local_rank
    faults.progress.codes = finished
    faults.report.sink = functools.partial(leave_report, report_dir, place.rank)
    if cfg.mode not in ("train", "lr_find"):  # (these unblock the stop signals once their handlers are in)
        names = stop_signals(cfg.train.stop_signal)
        faults.interrupt_on(names)
        try:  # one forwarded while this rank started comes now: said as the rank says it (rank_run.RankRun)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [getattr(signal, name) for name in names])
        except KeyboardInterrupt as e:
            process_end.end_process(faults.interrupted(e, cfg.mode))
    process_end.end_process(worker(cfg, place))


def set_parent_death_signal(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when the process that started it dies, even by kill -9, so workers never
    train on as orphans. (No-op elsewhere.)"""
    try:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_CRASH)


def leave_report(report_dir: str, rank: int, code: int, line: str, detail: str) -> None:
    """A rank's last word (faults.report), into the file the Supervisor reads (written aside, then renamed)."""
    report = {"rank": rank, "code": code, "line": line, "detail": detail, "time": time.time()}
    write_beside(os.path.join(report_dir, f"rank{rank}.json"), lambda f: json.dump(report, f))


# ---- The Supervisor: starts the ranks, then watches them (a step never passes through it) ----------------------------
class Supervisor:
    """Start this node's ranks and watch them until all have exited; supervise() returns the run's exit code.

    A rank's last word comes from its report file, else from its signal or exit code and step; identical lines are
    printed once. A failed rank takes the others down within GRACE_S seconds, and the ranks die with this process
    (set_parent_death_signal). A rank that is done but whose teardown hangs or crashes counts with the exit code it
    finished with, so that a stuck process group cannot turn a finished run into a failure.
    """

    def __init__(self, cfg: Config, places: list, worker: Callable) -> None:
        self.cfg, self.worker = cfg, worker  # worker(cfg, place): one rank (wiring.worker)
        self.places = places  # one main.RankPlace per rank of this node
        self.signums = [getattr(signal, n) for n in stop_signals(cfg.train.stop_signal)]
        self.exit_grace = min(EXIT_GRACE_S, cfg.dist.hang_timeout_s) or EXIT_GRACE_S
        self.mpc = mp.get_context("spawn")
        # Shared with the ranks, so that they stay readable after a rank died:
        self.steps = self.mpc.Array("q", len(places), lock=False)  # each rank's current step
        self.finished = self.mpc.Array("i", [-1] * len(places), lock=False)  # its exit code once done (pre-teardown)
        self.procs = []  # one process per rank, in the order of places
        self.report_dir = None  # a temporary folder for the ranks' last words, removed by close()
        self.previous_handlers = {}  # signal -> our caller's handler, put back by close()
        self.exit_order = []  # the processes in the order they exited: the first one that failed is the cause
        self.done_at = {}  # rank index -> when we first saw it done and still running (tearing down)
        self.stuck = {}  # rank index -> the exit code it was done with, if its teardown hung or crashed
        self.signals_seen = []  # every stop signal received, in order (the handler only records it)
        self.said_again = 1  # how many of them have had their line: the first needs none
        self.kill_at = None  # once a rank failed: when the ranks still running are killed

    def supervise(self) -> int:
        self.previous_handlers = {n: signal.signal(n, self.forward) for n in self.signums}
        try:
            stopped = self.spawn_ranks()
            if stopped and self.cfg.mode not in ("train", "lr_find"):  # nothing to save: as Ctrl-C ends it
                return faults.interrupted(faults.Interrupted(getattr(signal, stopped)), self.cfg.mode)
            if stopped:
                return faults.stopped_before_start(stopped)
            self.watch()
            self.warn_about_teardowns()
            code = self.summarize()
            if self.rank_0_died():  # its trackers closed nothing: their runs stay open in their stores
                trackers.end_runs_left_running(self.cfg)
            return code
        finally:
            self.close()

    def spawn_ranks(self) -> Optional[str]:
        """Start every rank. They start with the stop signals blocked (the mask is inherited) and unblock them once
        their handlers are in (faults.StopRequest.install): a signal forwarded while a rank starts up waits. A stop
        signal before they start (main.py's catch_early, or one forward had no rank to pass on to) starts none:
        its name then."""
        self.report_dir = tempfile.mkdtemp(prefix="trainer-reports-")  # (in supervise's try: removed whatever happens)
        self.procs.extend(self.mpc.Process(target=rank_main, name=f"rank{place.rank}",
                                           args=(self.cfg, place, self.worker, self.report_dir, self.steps,
                                                 self.finished,
                                                 os.getpid()))
                          for place in self.places)
        # The first start would start multiprocessing's resource tracker, which unblocks SIGINT and SIGTERM here as
        # it does: then the ranks would start with them open. Started first, it is left alone by the starts.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, self.signums)
        try:
            came = faults.stop_request.reason or next((signal.Signals(n).name for n in self.signals_seen), None)
            if came:
                return came
            with environment(rank_environment(self.cfg, len(self.places))):  # spawn: each rank starts with it
                for p in self.procs:
                    p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return None

    def forward(self, signum, frame) -> None:
        """The signal handler. The ranks run in their own process group: only we hear the terminal's Ctrl-C, and we
        pass it on. (watch() says a repeat: no printing inside a signal handler.)"""
        if signum == signal.SIGHUP:
            detach_hung_up_terminal()
        self.signals_seen.append(signum)
        for p in self.procs:
            if p.pid and p.exitcode is None:
                os.kill(p.pid, signum)

    def watch(self) -> None:
        """Look at the ranks every half second, or as soon as one exits, until none is left."""
        while True:
            self.say_repeated_signals()
            alive = [p for p in self.procs if p.exitcode is None]
            self.note_exits()
            if not alive:
                break
            self.end_hung_teardowns()
            self.take_down_after_a_failure(alive)
            wait([p.sentinel for p in alive], timeout=0.5)
        for p in self.procs:
            p.join()

    def say_repeated_signals(self) -> None:
        if self.cfg.mode not in ("train", "lr_find"):  # nothing to save: the ranks end at the first, and ignore these
            return
        for signum in self.signals_seen[self.said_again:]:  # the ranks go on with their save
            print(already_stopping(signal.Signals(signum).name, os.getpid()), flush=True)
        self.said_again = max(self.said_again, len(self.signals_seen))

    def note_exits(self) -> None:
        for i, p in enumerate(self.procs):
            if p.exitcode is not None and p not in self.exit_order:
                self.exit_order.append(p)
            if self.teardown_failed(i):
                self.stuck[i] = self.finished[i]  # crashed after it was done (a C++ abort closing gloo, say)

    def teardown_failed(self, i: int) -> bool:
        """Rank i was done, then ended by anything but its own return. (We never SIGKILL a rank that is done,
        unless its teardown hangs or another rank failed.)"""
        p = self.procs[i]
        return self.finished[i] >= 0 and p.exitcode not in (None, self.finished[i], -signal.SIGKILL)

    def end_hung_teardowns(self) -> None:
        for i, p in enumerate(self.procs):
            if p.exitcode is None and self.finished[i] >= 0 and i not in self.stuck:
                if time.monotonic() - self.done_at.setdefault(i, time.monotonic()) > self.exit_grace:
                    self.stuck[i] = self.finished[i]
                    p.kill()

    def take_down_after_a_failure(self, alive: list) -> None:
        """Once a rank failed, the others get GRACE_S seconds to report (their peer is gone), then are killed."""
        failed = [p for p in self.exit_order if self.exit_code(p) not in (EXIT_OK, EXIT_STOPPED)]
        if failed and self.kill_at is None:
            self.kill_at = time.monotonic() + GRACE_S
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            for p in alive:
                p.kill()

    def exit_code(self, p) -> int:
        """What a rank's process counts as: the exit code it was done with if its teardown hung or crashed."""
        return self.stuck.get(self.procs.index(p), p.exitcode)

    def warn_about_teardowns(self) -> None:
        for i, code in self.stuck.items():
            p = self.procs[i]
            if p.exitcode == -signal.SIGKILL:
                what = f"still tearing down {self.exit_grace:.0f} s later; ended it"
            elif code in (EXIT_OK, EXIT_STOPPED):  # (after a failure, its report says what matters)
                what = "its teardown ended with " + (signal.Signals(-p.exitcode).name if p.exitcode < 0 else
                                                     f"exit code {p.exitcode}") + "; counted as done"
            else:
                continue
            line = f"warning: rank {self.places[i].rank} on {HOST} (pid {p.pid}) was done (exit code {code}) but {what}"
            print(line, file=sys.stderr, flush=True)
            self.end_log(i, line)  # (its log ended with its last line before the teardown)

    def summarize(self) -> int:
        """Print each distinct final word once; return the exit code of the first rank that failed (else 0, or 3
        when stopped)."""
        reports = self.read_reports()
        first_failed = next((p for p in self.exit_order if self.exit_code(p) not in (EXIT_OK, EXIT_STOPPED)), None)
        said = set()
        # The cause first (a rank killed without a report, say), then its consequences in the order they were said
        in_order = sorted(range(len(self.procs)), key=lambda j: (self.procs[j] is not first_failed,
                                                                 reports.get(j, {}).get("time", float("inf"))))
        for i in in_order:
            p = self.procs[i]
            rank = self.places[i].rank
            where = faults.doing(self.cfg.mode) or f"at step {self.steps[i]}"  # (predict has no step)
            if i in reports:
                code, line, detail = reports[i]["code"], reports[i]["line"], reports[i]["detail"]
            elif self.exit_code(p) and self.exit_code(p) < 0:
                if first_failed is not None and p is not first_failed and p.exitcode == -signal.SIGKILL:
                    cause = self.places[self.procs.index(first_failed)].rank  # killed by us, after it failed
                    self.end_log(i, f"rank {rank} on {HOST} (pid {p.pid}) was ended by the launcher {where} (SIGKILL), "
                                    f"as rank {cause} on {HOST} had failed first")
                    continue
                # The kernel's OOM killer sends SIGKILL, and a rank that runs out of memory leaves no report.
                oom = " (killed by the kernel: out of memory?, or kill -9)" if p.exitcode == -signal.SIGKILL else ""
                code, detail = EXIT_CRASH, ""
                line = f"rank {rank} on {HOST} (pid {p.pid}) died from {signal.Signals(-p.exitcode).name}{oom} {where}"
            elif self.exit_code(p):
                code, detail = EXIT_CRASH, ""
                line = (f"rank {rank} on {HOST} (pid {p.pid}) exited with code {p.exitcode} {where} without a report "
                        f"(see logs/rank{rank}.log)")
            else:
                continue
            if i not in reports:  # its log ended without a word (kill -9, the OOM killer)
                self.end_log(i, line)
            if line not in said:  # the same final word from several ranks: once
                said.add(line)
                say(code, line, detail)
        if first_failed is None:
            return max(self.exit_code(p) for p in self.procs)
        i = self.procs.index(first_failed)
        return reports[i]["code"] if i in reports else EXIT_CRASH

    def end_log(self, i: int, line: str) -> None:
        """`line` as the last line of rank i's log, a rank that ended without writing why (killed), in the log's
        format; only into a log this rank opened (its last start line names its pid): not one an earlier run left."""
        rank = self.places[i].rank
        path = os.path.join(self.cfg.output_dir, "logs", f"rank{rank}.log")
        with contextlib.suppress(OSError):  # (no log, or a full disk: the console has the line all the same)
            with open(path, errors="replace") as f:
                text = f.read()
            pids = re.findall(rf" rank{rank} rank {rank} on \S+: pid (\d+), ", text)
            if pids and int(pids[-1]) == self.procs[i].pid:
                with open(path, "a") as f:  # (on a line of its own, after one the kill cut short)
                    f.write(("" if text.endswith("\n") else "\n") + f"{time.strftime('%H:%M:%S')} rank{rank} {line}\n")

    def rank_0_died(self) -> bool:
        """The run's rank 0 is here and was killed before it was done (kill -9, the kernel's OOM killer, a segfault,
        or by us after another rank failed): past every `finally`, it closed no tracker."""
        return any(place.rank == 0 and self.finished[i] < 0 and (self.procs[i].exitcode or 0) < 0
                   for i, place in enumerate(self.places))

    def read_reports(self) -> dict:
        """Rank index -> the report its rank left (faults.report), for those that left one."""
        reports = {}
        for i, place in enumerate(self.places):
            path = os.path.join(self.report_dir, f"rank{place.rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    reports[i] = json.load(f)
        return reports

    def close(self) -> None:
        """However supervise() ends (a failure to start, an exception, a signal): no rank left running, no folder
        left."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:  # pid None: never started (p.start() itself failed)
                p.kill()
        if self.report_dir is not None:
            shutil.rmtree(self.report_dir, ignore_errors=True)
        for n, handler in self.previous_handlers.items():
            signal.signal(n, signal.SIG_IGN if faults.ignore_late_signals else handler)


def rank_environment(cfg: Config, nprocs: int) -> dict:
    """OMP_WAIT_POLICY=PASSIVE for CPU ranks sharing a host: idle OpenMP threads spin on the cores the other ranks
    need (benchmarks/RESULTS.md, "OpenMP waiting"). OpenMP reads it as torch loads, so a rank starts with it."""
    on_cpu = cfg.dist.device == "cpu" or (cfg.dist.device == "auto" and not cfg.dist.on_gpu())
    if nprocs < 2 or "OMP_WAIT_POLICY" in os.environ or not on_cpu:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


@contextlib.contextmanager
def environment(extra: dict):
    """os.environ with `extra` set, for processes started inside the block; restored after."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- The config's dist.* launch keys, and the port, checked before anything starts -----------------------------------
def check_config(cfg: Config, fail) -> None:
    """The nodes, their processes and where they meet, when set (config.validate asks, before the world size)."""
    d = cfg.dist
    if d.nodes < 1:
        fail("dist.nodes", f"must be >= 1, got {d.nodes}")
    if not 0 <= d.node_rank < d.nodes:
        fail("dist.node_rank", f"must be in [0, nodes-1] = [0, {d.nodes - 1}], got {d.node_rank}")
    if not 0 < d.master_port < 65536:
        fail("dist.master_port", f"must be a TCP port (1-65535), got {d.master_port}")
    procs = d.procs_per_node
    if isinstance(procs, list):
        if len(procs) != d.nodes:
            fail("dist.procs_per_node", f"lists {len(procs)} nodes but dist.nodes is {d.nodes}")
        if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in procs):
            fail("dist.procs_per_node", f"must hold positive integers, got {procs}")
    elif procs is not None and procs < 1:
        fail("dist.procs_per_node", f"must be >= 1, got {procs}")
    if d.init_method != "tcp" and not d.init_method.startswith("file://"):
        fail("dist.init_method", f"must be `tcp` or a `file:///path`, got {d.init_method!r}")
    if d.master_addr and d.init_method != "tcp":  # (not the port: a file shared with tcp runs may well set one)
        fail("dist.master_addr", f"is not read with dist.init_method {d.init_method} (the ranks meet in that file); "
                                 "remove it")
    if d.nodes > 1 and d.init_method == "tcp" and not d.master_addr:
        fail("dist.master_addr", "must be set when dist.nodes > 1 (the address of node 0)")


RENDEZVOUS_QUIET_S = 10  # a file:// rendezvous untouched this long is an ended run's (watchdogs beat every <= 1 s)


def check_rendezvous(cfg: Config, world: int) -> None:
    """Where the ranks will meet, checked before this node's ranks start, instead of a timeout or a traceback from
    inside torch: master_addr names a machine and node 0's port is free (tcp); a file:// rendezvous's folder is
    there, and on one node no file is left by an earlier run (check_rendezvous_file)."""
    if cfg.dist.strategy in ("none", "dp"):  # one process, no process group
        return
    if cfg.dist.init_method.startswith("file://"):
        check_rendezvous_file(cfg)
    elif world > 1:
        check_master_addr(cfg)
        check_port_free(cfg)


def check_srun_rendezvous(cfg: Config, rank: int) -> None:
    """Under srun, every rank of every node started at once: the address alone is checked before they meet (a port
    or a rendezvous file may already be their own, rank 0's), and by rank 0 that it is its own."""
    if cfg.dist.strategy not in ("none", "dp") and cfg.dist.init_method == "tcp":
        check_master_addr(cfg)
        if rank == 0 and bind_error(cfg.dist.master_addr or "127.0.0.1", 0) == errno.EADDRNOTAVAIL:
            raise not_node_0(cfg)


def check_rendezvous_file(cfg: Config) -> None:
    """dist.init_method file:///path: its folder must be here (each rank would otherwise fail on its own, with a line
    that blames the other ranks); on one node a file an earlier run left is removed: its ranks end without the
    teardown in which torch removes it, and new ranks would wait dist.timeout_s in it for peers long gone."""
    d = cfg.dist
    path = d.init_method[len("file://"):]
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise UserError(f"dist.init_method {d.init_method}: the folder {folder} does not exist on {HOST}; the ranks "
                        "meet through a file there: create it, or mount the file system every node shares")
    if d.nodes == 1 and os.path.isfile(path):  # every rank starts below, from this process: none uses it yet
        written = time.time() - os.path.getmtime(path)
        if written < RENDEZVOUS_QUIET_S:  # a live run's watchdog writes into it every second
            raise UserError(f"dist.init_method {d.init_method}: the file was written {written:.0f} s ago, by a "
                            "run going on? Give this run a file of its own")
        os.remove(path)
        print(f"note: removed {path}, the rendezvous file an earlier run left (the ranks meet in a new one)",
              flush=True)


def check_master_addr(cfg: Config) -> None:
    """A master_addr that does not resolve (a typo): torch would retry it until dist.timeout_s, 30 minutes by
    default, printing C++ warnings, then fail."""
    d = cfg.dist
    if not d.master_addr:
        return
    try:
        socket.getaddrinfo(d.master_addr, d.master_port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"dist.master_addr {d.master_addr!r} does not resolve to an address on {HOST} ({e.strerror}); "
                        "set it to node 0's host name or IP address, as this machine can reach it") from None


def check_port_free(cfg: Config) -> None:
    """Node 0 hosts the rendezvous on master_addr:master_port. If another program (often another run) holds the
    port, or master_addr is another machine's (node 0's ranks would wait dist.timeout_s for it), say so before
    starting, with the fix."""
    d = cfg.dist
    problem = bind_error(d.master_addr or "127.0.0.1", d.master_port) if d.node_rank == 0 else None
    if problem == errno.EADDRNOTAVAIL:
        raise not_node_0(cfg)
    if problem == errno.EADDRINUSE:
        raise UserError(f"dist.master_port {d.master_port} is already in use on this machine (another run?); pick a "
                        f"free one, e.g. --set dist.master_port={d.master_port + 1}")


def not_node_0(cfg: Config) -> UserError:
    return UserError(f"dist.master_addr {cfg.dist.master_addr!r} is not an address of this machine ({HOST}), node 0, "
                     "which hosts the rendezvous there; set it to one of node 0's addresses, as the other nodes reach "
                     "it")


def port_in_use(host: str, port: int) -> bool:
    """Another program holds host:port here."""
    return bind_error(host, port) == errno.EADDRINUSE


def bind_error(host: str, port: int) -> Optional[int]:
    """The errno of binding host:port here, or None: EADDRINUSE (another program holds it), EADDRNOTAVAIL (host
    is another machine's address)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno
    return None
