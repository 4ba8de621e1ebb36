"""The heartbeat watchdog of a run with several ranks (start_watchdog, dist.hang_timeout_s): names a rank
that froze or died, or a run that hangs."""
from __future__ import annotations

import datetime
import faulthandler
import hashlib
import os
import threading
import time
from typing import Callable, Optional
from urllib.parse import urlparse

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from core.errors import EXIT_CRASH, EXIT_USER_ERROR, first_line, warn_on_stderr
from core.store_call import StoreCall, StoreHostLine
from resilience.faults import HOST, progress, report, stop_request

STORE_HOST = "rank 0, or torchrun's agent"  # who hosts the rendezvous store, said when it does not answer


class Watchdog:
    """A daemon thread per rank writes its heartbeat (beat counter, progress ticks, step, phase) into the rendezvous
    store every `interval` seconds. Rank 0 checks everyone, rank 1 checks rank 0: a beat unchanged for `timeout` is
    a frozen or dead rank, progress unchanged on every rank is a hung run. The verdict goes into the store and
    every live rank dumps its stacks and exits with code 1. Beats come from a thread (collectives and kernels release
    the GIL), so a long step is not a hang."""

    def __init__(self, store, ctx, timeout: float, log_path: str, op_timeout: float = 10.0):
        self.store, self.ctx, self.timeout, self.log_path = store, ctx, timeout, log_path
        self.op_timeout = op_timeout  # how long the thread waits for one beat's store calls before giving up
        self.interval = min(1.0, timeout / 4)
        self.beat = 0
        self.seen: dict[int, tuple] = {}  # rank -> (beat, ticks, t_beat_changed, t_ticks_changed)
        self.unreachable_since: Optional[float] = None
        self.announced = False  # this rank wrote the verdict into the store
        self.peer_failure: Optional[str] = None  # another rank's user error (first_failure), read by the thread
        self.before_exit: Optional[Callable[[], None]] = None  # run before its os._exit (rank_run: the trackers)
        self.host_line: Optional[StoreHostLine] = None  # tells the store's host is gone (start())
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    @classmethod
    def start(cls, cfg, ctx) -> "Watchdog":
        timeout = cfg.dist.hang_timeout_s
        op_timeout = max(2.0, min(10.0, timeout / 2))
        store = open_store(ctx, op_timeout=op_timeout)
        w = cls(store, ctx, timeout, os.path.join(cfg.output_dir, "logs", f"rank{ctx.rank}.log"), op_timeout)
        w.host_line = open_host_line(ctx, op_timeout)
        w._write_beat()  # the first beat now: a rank frozen from here on is seen by the others (see _check)
        w.thread.start()
        return w

    def stop(self) -> None:
        """Stop the thread and wait for it (a store call it made may stay behind, blocked: see StoreCall)."""
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=self.op_timeout + self.interval + 1.0)
        try:  # a last beat: this rank ended (after its own report), the others do not count it lost (silent_ranks)
            self.ask(lambda: self._write_beat("ended"), "set", 1.0)
        except Exception:
            pass  # the store is gone or frozen: nobody to tell

    def ask(self, fn, what: str, timeout_s: Optional[float] = None):
        """fn()'s value, calls to the store, given up after op_timeout (a frozen store host never answers)."""
        if self.store_gone():
            raise dist.DistNetworkError(f"the rendezvous store is gone: its host ({STORE_HOST}) closed its "
                                        f"connections ({what} at {self.ctx.rendezvous})")
        return StoreCall(fn, what, self.ctx.rendezvous, STORE_HOST).result(timeout_s or self.op_timeout)

    def store_gone(self) -> bool:
        """Whether the store's host is gone (it died): then no store call is made (each would print torch's C++
        warning, stack frames and all, on stderr)."""
        return self.host_line is not None and self.host_line.host_gone()

    # ---- the thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        call = None  # the thread of the last beat's store calls
        while not self._stop.wait(self.interval):
            try:
                if self.store_gone():
                    raise dist.DistNetworkError("the rendezvous store's host closed its connections")
                if call is None or not call.is_alive():  # (else it is still waiting for the store: wait more)
                    call = StoreCall(self._beat_once, "a heartbeat", self.ctx.rendezvous, STORE_HOST)
                verdict = call.result(self.op_timeout)
                self.unreachable_since = None
                if self.peer_failure is not None:
                    self._follow_peer()
            except Exception as e:  # the store does not answer: its host (rank 0, or torchrun's agent) froze
                now = time.monotonic()
                self.unreachable_since = self.unreachable_since or now
                # A host known gone is not waited for: a store call's time, in which the main thread's collective
                # fails and says so itself (a frozen one may come back: dist.hang_timeout_s). Unless the rank is
                # stopping: torchrun's agent, which hosts the store, died and signalled it; its save takes what it takes
                gone = self.store_gone()
                patience = min(self.op_timeout, self.timeout) if gone and stop_request.reason is None else self.timeout
                if now - self.unreachable_since < patience or self._stop.is_set():
                    continue
                # (no rank named: the line stays the same for every rank of this node, said once by the launcher)
                why = ("is gone (it closed its connections)" if gone else
                       f"froze or died, or the network to it is down ({type(e).__name__})")
                verdict = (f"the rendezvous store stopped answering{'' if gone else f' for {self.timeout:g} s'} "
                           f"({self.ctx.rendezvous}, seen from {HOST} {progress.where()}): the process hosting it "
                           f"({STORE_HOST}) {why}")
            if verdict and not self._stop.is_set():
                self._close_before_exit()  # before the others leave (the launcher ends this rank GRACE_S after them)
                if self.announced:  # rank 0 hosts the store (under our launchers): give the others time to read
                    self._stop.wait(2 * self.interval + 0.5)  # the verdict, rather than a store that vanished
                self._give_up(verdict)

    def _write_beat(self, phase: Optional[str] = None) -> None:  # (TCPStore's set does not wait for an answer)
        self.beat += 1
        self.store.set(f"hb/{self.ctx.rank}",
                       f"{self.beat} {progress.ticks} {progress.step} {phase or progress.phase} {HOST}")

    def _beat_once(self) -> Optional[str]:
        """Write this rank's heartbeat; return the verdict in the store, or the one this rank comes to."""
        self._write_beat()
        if self.store.check(["failed"]):  # another rank met a user error (first_failure): leave with it
            self.peer_failure = self.store.get("failed").decode()
            return None
        verdict = self.store.get("verdict").decode() if self.store.check(["verdict"]) else None
        if verdict is None and self.ctx.rank in (0, 1):
            verdict = self._check(list(range(self.ctx.world_size)) if self.ctx.rank == 0 else [0])
            if verdict:
                self.store.set("verdict", verdict)
                self.announced = True
        return verdict

    def _check(self, ranks: list[int]) -> Optional[str]:
        now = time.monotonic()
        # Every rank beats once as its watchdog starts, right after the process group formed (start()): a rank
        # with no heartbeat yet is silent from the first time this rank looked (frozen before its first beat).
        beaten = [r for r in ranks if self.store.check([f"hb/{r}"])]
        raw = dict(zip(beaten, self.store.multi_get([f"hb/{r}" for r in beaten]))) if beaten else {}
        phases, steps, hosts = {}, {}, {}
        for r in ranks:
            beat, ticks, step, phase, host = raw[r].decode().split() if r in raw else ("-", "-", "0", "start", "")
            hosts[r] = host or "a host it never named"
            b0, t0, tb, tt = self.seen.get(r, (None, None, now, now))
            self.seen[r] = (beat, ticks, now if beat != b0 else tb, now if ticks != t0 else tt)
            phases[r], steps[r] = phase, int(step)
        silent = {r: now - self.seen[r][2] for r in ranks}
        if max(silent.values()) > self.timeout:
            # Beats come once an interval, so ranks that fell silent together (a node) cross the timeout up to an
            # interval apart: name every rank that has missed nearly as many beats, not only the first one.
            frozen = [r for r in ranks if silent[r] > self.timeout - self.interval]
            on = ", ".join(sorted({hosts[r] for r in frozen}))
            # (their step is that of their last heartbeat, which may be many steps behind where they froze)
            return (f"{ranks_text(frozen)} on {on} stopped responding (last heard at step {steps[frozen[0]]}, "
                    f"{silent[frozen[0]]:.0f} s ago: frozen or dead; rank {self.ctx.rank} is {progress.where()}); "
                    "see logs/rank*.log for the others' stacks")
        if len(ranks) > 1 and all(phases[r] in ("train", "eval") for r in ranks) and \
                all(now - self.seen[r][3] > self.timeout for r in ranks):
            behind = [r for r in ranks if steps[r] == min(steps.values())]
            who = ranks_text(behind) if len(behind) < len(ranks) else "every rank"
            return (f"no progress for {self.timeout:g} s at step {min(steps.values())} ({who} stuck; "
                    f"dist.hang_timeout_s); Python stacks of every rank are in logs/rank*.log")
        return None

    def _give_up(self, verdict: str) -> None:
        """Dump this rank's Python stacks to its log, report, and leave at once: the main thread is stuck in
        a collective that will not return."""
        try:
            with open(self.log_path, "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} rank{self.ctx.rank} watchdog: {verdict}\n"
                        f"Python stacks of rank {self.ctx.rank} ({progress.where()}):\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            report(EXIT_CRASH, f"hang detected by the watchdog: {verdict}")  # the same line on every rank
        finally:
            progress.finished(EXIT_CRASH)  # said: not a kill without a word (resource_errors.reports_a_kill)
            os._exit(EXIT_CRASH)

    def _close_before_exit(self) -> None:
        """before_exit() (rank 0's trackers closed marked failed, as after a crash, not left RUNNING), waited for at
        most a store call's time: a tracker's server that does not answer does not keep this rank."""
        if self.before_exit is None:
            return
        failed: list = []

        def close():
            try:
                self.before_exit()
            except Exception as e:  # (said, and this rank leaves all the same: the run's own line comes next)
                failed.append(first_line(e))
        closing = threading.Thread(target=close, name="close-trackers", daemon=True)
        closing.start()
        closing.join(self.op_timeout)
        if failed or closing.is_alive():
            why = failed[0] if failed else f"no answer within {self.op_timeout:g} s"
            warn_on_stderr(f"rank {self.ctx.rank} on {HOST}: the trackers were not closed ({why})")

    # ---- a rank's user error: one line, every rank leaves -------------------------------------------------
    def first_failure(self, line: str) -> str:
        """A rank met a user error (faults.user_error): stop this thread and put `line` in the store for the other
        ranks' watchdogs, unless a rank did first. Returns the first line, the cause, for every rank to say."""
        self.stop()
        try:
            return self.ask(lambda: self.store.compare_set("failed", "", line), "compare_set").decode()
        except Exception:  # the store is gone (its host left): the peers fail at their next collective
            return line

    def leave_together(self) -> None:
        """Count this rank as leaving, then wait until every rank does (at most two beats and a store call's
        time): no rank ends (its connections, or the store it hosts) while a peer still waits on it."""
        try:
            self.ask(lambda: self.store.add("left", 1), "add")
            deadline = time.monotonic() + 2 * self.interval + self.op_timeout
            while time.monotonic() < deadline and \
                    self.ask(lambda: self.store.add("left", 0), "add") < self.ctx.world_size:
                time.sleep(0.05)
            if self.ctx.rank == 0:  # it hosts the store: the others' last look at it comes first
                time.sleep(0.2)
        except Exception:
            pass  # the store is gone: nobody left to wait for

    def _follow_peer(self) -> None:
        """Another rank met a user error: say its line and leave with it, from this thread (the main thread
        waits in a collective for that rank)."""
        try:
            self._close_before_exit()
            report(EXIT_USER_ERROR, self.peer_failure)
            self.leave_together()
        finally:
            progress.finished(EXIT_USER_ERROR)
            os._exit(EXIT_USER_ERROR)

    def first_to_say(self, line: str) -> bool:
        """Whether this rank is the first to say `line` (faults.report under torchrun or srun: identical final
        words of several ranks are printed once)."""
        try:
            key = "said/" + hashlib.sha1(line.encode()).hexdigest()
            return self.ask(lambda: self.store.add(key, 1), "add", 10.0) == 1
        except Exception:  # the store is gone or frozen with its host: better said twice than never
            return True

    def lost_peers(self, exc: BaseException) -> str:
        """'lost rank 2, which stopped responding (died or froze); ' when `exc` came from a collective whose peers
        stopped beating, or whose store's host is gone (rank_run.RankRun.reported), else ''."""
        text = str(exc).lower()
        if not any(w in text for w in ("connection closed", "connection reset", "broken pipe", "timed out",
                                       "timeout", "nccl", "gloo")):
            return ""
        if self.host_line is not None:  # a dying store host closes its connections one by one, maybe ours after the
            self.host_line.host_gone(wait_s=self.interval)  # collective's: asked first, it prints torch's C++ stack
        lost = self.silent_ranks()
        if self.store_gone():  # (rank 0 hosts it; under torchrun, rank 0 or torchrun's agent)
            return ("lost the process hosting the rendezvous store (rank 0, or torchrun's agent), which is gone (it "
                    "closed its connections); " if self.ctx.rendezvous == "env://" else
                    "lost rank 0, which is gone (the rendezvous store it hosted closed its connections); ")
        return f"lost {ranks_text(lost)}, which stopped responding (died or froze); " if lost else ""

    def silent_ranks(self) -> Optional[list[int]]:
        """Ranks whose heartbeat does not move for three beats (after a collective failed: the peers that died).
        None if the store cannot tell."""
        try:
            keys = [f"hb/{r}" for r in range(self.ctx.world_size)]
            before = [v.decode().split() for v in self.ask(lambda: self.store.multi_get(keys), "multi_get")]
            time.sleep(3 * self.interval + 0.5)
            after = [v.decode().split() for v in self.ask(lambda: self.store.multi_get(keys), "multi_get")]
        except Exception:
            return None
        # (a rank that ended, after its own report, is not lost: its last beat says so, Watchdog.stop)
        return [r for r in range(self.ctx.world_size)
                if before[r][0] == after[r][0] and after[r][3] != "ended" and r != self.ctx.rank]


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def store_address(ctx) -> Optional[tuple]:
    """(host, port) of the rendezvous store over tcp:// or torchrun's env://; None for a file://."""
    if ctx.rendezvous and ctx.rendezvous.startswith("tcp://"):
        u = urlparse(ctx.rendezvous)
        return u.hostname, u.port
    if ctx.rendezvous == "env://":
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return None


def open_host_line(ctx, op_timeout: float) -> Optional[StoreHostLine]:
    """The watchdog's StoreHostLine to the store's host; None for a file:// rendezvous, or if it takes no connection
    now (then a store call finds out, as before)."""
    address = store_address(ctx)
    try:
        return StoreHostLine(address, op_timeout) if address is not None else None
    except OSError:
        return None


def open_store(ctx, op_timeout: float):
    """A store connection of the watchdog's own, with a short timeout, so that a frozen store host makes the
    watchdog notice instead of blocking it as long as the process group's timeout (dist.timeout_s)."""
    timeout = datetime.timedelta(seconds=op_timeout)
    address = store_address(ctx)
    if address is not None:  # (a frozen store host, or a cut link, never answers the connect either)
        store = StoreCall(lambda: dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout,
                                                wait_for_workers=False), "connect", ctx.rendezvous, STORE_HOST
                          ).result(op_timeout)
    else:  # file:// rendezvous: the process group's own FileStore (files do not freeze with a process)
        store = c10d._get_default_store()
    # Under torchrun a restart (allowed only with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) gets a new store.
    return dist.PrefixStore("trainer-watchdog/", store)


def start_watchdog(cfg, ctx) -> Optional[Watchdog]:
    """The heartbeat watchdog of a run with several ranks and dist.hang_timeout_s, else None (one rank has no peer
    to watch). Crash reports ask it which peers stopped beating (faults.report.watchdog)."""
    if ctx.world_size < 2 or not cfg.dist.hang_timeout_s:
        return None
    report.watchdog = Watchdog.start(cfg, ctx)
    return report.watchdog
