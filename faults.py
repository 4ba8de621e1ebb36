"""When things go wrong: stop requests (signals, time limit), hung and dead ranks, and how a failure is reported.

A week of GPU time meets preemption, a frozen node, a NaN, a full disk. The rules this file implements:
- a signal (SIGTERM, SIGINT, SIGHUP, train.stop_signal) or train.time_limit stops every rank at the same step
  boundary, after a checkpoint is saved (the Trainer folds the request into an all-reduce each step already does);
  the same signals again while stopping only print a line: nothing but SIGKILL aborts the save;
- a rank that stops responding is named within dist.hang_timeout_s by a watchdog thread that beats through the
  rendezvous store; the live ranks dump their Python stacks to their logs and exit;
- every failure is reported once, naming the rank, the host and the step; a user mistake is one line, and so is
  a full disk or a read-only folder (disk_problem), said by every rank, which then leave together.

Exit codes of `python main.py` (scripts/slurm_job.sh requeues on 3):
    0  finished, or nothing left to do
    1  crashed: a bug, a dead or hung rank (the failing rank's traceback is printed and in its log)
    2  a user mistake (config, data, checkpoint), a full disk or a read-only folder: one line `error: ...`
    3  stopped by a signal or by train.time_limit, after saving a checkpoint: run the same command to resume
    4  training diverged: train.max_bad_steps non-finite steps in a row; nothing more was saved
    130    Ctrl-C where there is nothing to save (test mode)
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import termios
import threading
import time
import traceback
from typing import Optional

EXIT_OK, EXIT_CRASH, EXIT_USER_ERROR, EXIT_STOPPED, EXIT_DIVERGED = 0, 1, 2, 3, 4
HOST = socket.gethostname()


class Stopped(Exception):
    """Raised by the Trainer once every rank has agreed to stop and the checkpoint is saved."""
    exit_code = EXIT_STOPPED


class Diverged(Exception):
    """Raised by the Trainer when training produced too many non-finite steps in a row (or parameters)."""
    exit_code = EXIT_DIVERGED


# ==============================================================================================================
# Where this rank is
# ==============================================================================================================
class Progress:
    """What this rank is doing. Read by the watchdog thread, by crash reports, and (through shared memory) by
    the launching process when this rank dies without a word. Updating it costs a few attribute writes."""

    def __init__(self):
        self.rank, self.step, self.ticks, self.phase = 0, 0, 0, "setup"
        self.shared, self.slot = None, 0  # main.py's spawn: a shared array of steps, one slot per local rank
        self.codes = None  # main.py's spawn: a shared array of exit codes, set when a rank is done (finished())

    def at(self, step: int, phase: str) -> None:
        """Called as the rank works: `step` is the optimizer step being computed (or evaluated, or saved)."""
        self.step, self.phase = step, phase
        self.ticks += 1
        if self.shared is not None:
            self.shared[self.slot] = step

    def finished(self, code: int) -> None:
        """This rank is done (`code`: its exit code) and only tears down from here: the launcher may end it if
        that hangs (launcher.Supervisor)."""
        if self.codes is not None:
            self.codes[self.slot] = code

    def where(self) -> str:
        return {"setup": "before training (setup)", "train": f"at step {self.step}",
                "eval": f"evaluating at step {self.step}", "save": f"saving step {self.step}",
                "done": f"after the last step ({self.step})"}.get(self.phase, f"at step {self.step}")


progress = Progress()


# ==============================================================================================================
# Stop requests: signals and the time limit
# ==============================================================================================================
def stop_signals(extra_signal: Optional[str]) -> list[str]:
    """The signals that stop a run after a checkpoint: SIGTERM (schedulers), SIGINT (Ctrl-C), SIGHUP (a terminal or
    an ssh session that closed) and train.stop_signal (which may name one of them again)."""
    return list(dict.fromkeys(("SIGTERM", "SIGINT", "SIGHUP") + ((extra_signal,) if extra_signal else ())))


def already_stopping(name: str, pid: Optional[int] = None) -> str:
    """The line for a stop signal that comes while the run is already stopping (see StopRequest); `pid`: the
    process whose SIGKILL ends the whole run (main.py's launcher)."""
    return (f"{name} again: already stopping: a checkpoint is saved, then the run exits; SIGKILL ends it at "
            f"once, without saving" + (f" (kill -9 {pid})" if pid else ""))


class StopRequest:
    """Set by a signal handler or the time limit; the Trainer votes it into the step's all-reduce, so all ranks
    stop after the same step. The stop signals again while stopping only log a line: schedulers and people send
    them twice (SLURM at preemption with GraceTime 0, an impatient Ctrl-C), and the save must not be lost to
    that; SIGKILL, which no process can catch, is the way to end a run at once."""

    def __init__(self):
        self.reason: Optional[str] = None
        self.deadline: Optional[float] = None
        self.log: Optional[logging.Logger] = None

    def install(self, extra_signal: Optional[str], time_limit_s: Optional[float]) -> None:
        """First thing in a rank (before torch is imported), so that a signal during setup is not lost. Unblocks
        the signals, which launcher.Supervisor blocks while it starts its ranks: one sent before now is handled now."""
        self.deadline = time.monotonic() + time_limit_s if time_limit_s else None
        signums = [getattr(signal, name) for name in stop_signals(extra_signal)]
        for signum in signums:
            signal.signal(signum, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            detach_hung_up_terminal()
        if self.reason is not None and self.reason != "time limit":
            if self.log:  # (under main.py's launcher, it says this on the console: here, the log file only)
                self.log.warning(already_stopping(name),
                                 extra={"file_only": report.report_dir is not None})
            return
        self.reason = name
        if self.log:
            self.log.warning(f"{name} received: stopping after the current step, once a checkpoint is saved "
                             f"(a stop signal again does not stop it sooner; SIGKILL ends the run at once, "
                             f"without saving)")

    def vote(self) -> float:
        """1.0 if this rank wants to stop (a signal came, or the time limit is reached), else 0.0."""
        if self.reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.reason = "time limit"
        return 0.0 if self.reason is None else 1.0


stop_request = StopRequest()

# Set by `python main.py`, whose process ends once the run is over: a stop signal that comes as the ranks are gone
# is then ignored (launcher.Supervisor.close), not left to kill it and turn exit code 3 into death by SIGTERM.
# (Tests run main.run in their own process: theirs get their handlers back.)
ignore_late_signals = False


def parse_duration(value) -> Optional[float]:
    """train.time_limit: seconds (a number) or 'HH:MM:SS' / 'MM:SS' / 'D-HH:MM:SS' as SLURM writes it."""
    if value is None or value == 0:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts) or (days and not days.isdigit()):
        raise ValueError(text)
    seconds = 0.0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds + 86400 * int(days or 0)


def detach_hung_up_terminal() -> None:
    """After the terminal hung up (an ssh session that dropped: SIGHUP), every write to it fails (EIO), the final
    line's included: stdout and stderr on it go to /dev/null instead, so that the run still saves and exits 3."""
    for fd in (1, 2):
        try:
            termios.tcgetattr(fd)
        except termios.error as e:  # ENOTTY: not a terminal; EIO: a terminal that hung up
            if e.args[0] == errno.EIO:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


def set_parent_death_signal(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when the process that started it dies, even by kill -9, so workers never
    train on as orphans. (No-op elsewhere.)"""
    try:
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_CRASH)


# ==============================================================================================================
# Reporting a failure: once, by rank and host
# ==============================================================================================================
class Reporter:
    """Where this rank's final word goes. Under main.py's own spawn, into a file the launcher reads (it prints
    identical lines from several ranks once). Under torchrun or srun there is no such launcher: the rank prints
    itself, and identical lines are printed once through the rendezvous store."""

    def __init__(self):
        self.report_dir: Optional[str] = None
        self.log: Optional[logging.Logger] = None
        self.store = None

    def __call__(self, code: int, line: str, detail: str = "") -> int:
        if self.log:  # the log file only: the console gets it below, once
            try:
                (self.log.info if console(code) is sys.stdout else self.log.error)(
                    line + ("\n" + detail if detail else ""), extra={"file_only": True})
            except OSError:  # the log file cannot take it (a full disk: run_log.LogFile): the console still does
                pass
        if self.report_dir:
            record = {"rank": progress.rank, "code": code, "line": line, "detail": detail, "time": time.time()}
            tmp = os.path.join(self.report_dir, f".rank{progress.rank}.json")
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, os.path.join(self.report_dir, f"rank{progress.rank}.json"))
        elif self._first_to_say(line):
            say(code, line, detail)
        return code

    def _first_to_say(self, line: str) -> bool:
        if self.store is None:
            return True
        import hashlib
        try:
            key = "said/" + hashlib.sha1(line.encode()).hexdigest()
            return Call(lambda: self.store.add(key, 1)).result(10.0) == 1
        except Exception:  # the store is gone or frozen with its host: better said twice than never
            return True


report = Reporter()


def console(code: int):
    """Where a final word with exit code `code` is printed: stdout for an end as planned (finished, stopped and
    saved), stderr for a failure."""
    return sys.stdout if code in (EXIT_OK, EXIT_STOPPED) else sys.stderr


def say(code: int, line: str, detail: str = "") -> None:
    """Print one final word (by this rank, or by main.py's launcher for its ranks); details go to stderr."""
    print(line, file=console(code), flush=True)
    if detail:
        print(detail, file=sys.stderr, flush=True)


def first_line(e: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message` (cut at `limit`): an exception in one line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:limit]}" if lines else type(e).__name__


def crash_report(exc: BaseException, watchdog: Optional["Watchdog"]) -> int:
    """`rank R on HOST failed at step S: ...` with the traceback, to the log and the launcher. If the error came
    from a collective whose peers vanished, name the ranks that stopped beating."""
    summary = first_line(exc, limit=300)
    lost = watchdog.silent_ranks() if watchdog is not None and looks_like_lost_peer(exc) else None
    if lost:
        summary = f"lost {ranks_text(lost)}, which stopped responding (died or froze); {summary}"
    line = f"rank {progress.rank} on {HOST} failed {progress.where()}: {summary}"
    return report(EXIT_CRASH, line, "".join(traceback.format_exception(exc)).rstrip())


def user_error(line: str, watchdog: Optional["Watchdog"]) -> int:
    """Report a user mistake this rank met (`line`: `error: ...`, a full disk for one), exit code 2. With peers
    and a watchdog, the first failing rank's line is the one said, and every rank leaves at once
    (Watchdog.leave_together), before a peer's next collective fails with a traceback."""
    if watchdog is not None:
        line = watchdog.first_failure(line)
    report(EXIT_USER_ERROR, line)
    if watchdog is not None:
        watchdog.leave_together()
    return EXIT_USER_ERROR


def looks_like_lost_peer(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(w in text for w in ("connection closed", "connection reset", "broken pipe", "timed out",
                                   "timeout", "nccl", "gloo"))


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# ==============================================================================================================
# A full disk, or a file or folder this run may not write
# ==============================================================================================================
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # counted only with a file named: EPERM has other causes


def disk_problem(exc: BaseException, output_dir: str) -> Optional[str]:
    """The one line for `exc` when a full disk (or quota) or a read-only file or folder caused it: an OSError
    with such an errno anywhere in its chain (TensorBoard, the logs, config.yml, *_results.json, the tokenizer,
    checkpoints/). It names the file (else output_dir) and what to do; None for any other error."""
    error = next((e for e in chain(exc) if isinstance(e, OSError) and
                  (e.errno in NO_SPACE or (e.errno in NOT_WRITABLE and e.filename is not None))), None)
    if error is None:
        return None
    where = os.fsdecode(error.filename) if error.filename is not None else f"a file in output_dir {output_dir}"
    if error.errno in NOT_WRITABLE and not os.path.lexists(where):  # what could not be made: its folder is at fault
        where = os.path.dirname(os.path.abspath(where))
    todo = ("free some space" if error.errno in NO_SPACE else
            "make it writable for this run (or choose another output_dir)")
    return (f"{where}: {error.strerror or os.strerror(error.errno)}: {todo}, then run the same command again "
            f"(the checkpoints saved so far are intact)")


def chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, nearest first."""
    seen = []
    while exc is not None and not any(exc is e for e in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


@contextlib.contextmanager
def naming(path: str):
    """Inside it, an OSError that names no file names `path`: a full disk is often noticed only as a buffer is
    flushed (a file's close, a writer thread), by an error without a file name."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or os.strerror(e.errno), path) from e


def thread_exception(args) -> None:
    """threading.excepthook in a rank. A thread's full disk (TensorBoard's writer thread) goes to the log file
    only: its owner raises it again in the main thread, which reports it in one line. Anything else: as Python
    prints it."""
    if report.log is not None and disk_problem(args.exc_value, "") is not None:
        report.log.error(f"thread {args.thread.name if args.thread else '?'}: {first_line(args.exc_value)}",
                         extra={"file_only": True})
        return
    threading.__excepthook__(args)


# ==============================================================================================================
# The watchdog: heartbeats through the rendezvous store
# ==============================================================================================================
class Watchdog:
    """A daemon thread per rank. Every `interval` seconds it writes this rank's heartbeat (a beat counter, the
    Progress ticks, step and phase) into the rendezvous store and looks for a verdict. Rank 0's thread checks
    everyone (rank 1's checks rank 0): a rank whose beat has not changed for `timeout` seconds is frozen or dead
    (SIGSTOP, a stuck node); if every rank is training but none has made progress for `timeout`, the run is
    hung. The verdict goes into the store; every live rank then dumps its Python stacks into its log and exits
    with code 1, so the launcher (or torchrun, or srun) ends the run. Beats come from a thread, so a long step
    is not a hang; the GIL is released by every collective and kernel, so a busy rank still beats."""

    def __init__(self, store, ctx, timeout: float, log_path: str, op_timeout: float = 10.0):
        self.store, self.ctx, self.timeout, self.log_path = store, ctx, timeout, log_path
        self.op_timeout = op_timeout  # how long the thread waits for one beat's store calls (Call) before giving up
        self.interval = min(1.0, timeout / 4)
        self.beat = 0
        self.seen: dict[int, tuple] = {}  # rank -> (beat, ticks, t_beat_changed, t_ticks_changed)
        self.unreachable_since: Optional[float] = None
        self.announced = False  # this rank wrote the verdict into the store
        self.peer_failure: Optional[str] = None  # another rank's user error (first_failure), read by the thread
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    @classmethod
    def start(cls, cfg, ctx) -> Optional["Watchdog"]:
        timeout = cfg.dist.hang_timeout_s
        if not ctx.distributed or not timeout:
            return None
        op_timeout = max(2.0, min(10.0, timeout / 2))
        store = open_store(ctx, op_timeout=op_timeout)
        w = cls(store, ctx, timeout, os.path.join(cfg.output_dir, "logs", f"rank{ctx.rank}.log"), op_timeout)
        w._write_beat()  # the first beat now: a rank frozen from here on is seen by the others (see _check)
        w.thread.start()
        return w

    def stop(self) -> None:
        """Stop the thread and wait for it (a store call it made may stay behind, blocked: see Call)."""
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=self.op_timeout + self.interval + 1.0)

    # ---- the thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        call = None  # the thread of the last beat's store calls
        while not self._stop.wait(self.interval):
            try:
                if call is None or not call.is_alive():  # (else it is still waiting for the store: wait more)
                    call = Call(self._beat_once)
                verdict = call.result(self.op_timeout)
                self.unreachable_since = None
                if self.peer_failure is not None:
                    self._follow_peer()
            except Exception as e:  # the store does not answer: its host (rank 0, or torchrun's agent) froze
                now = time.monotonic()
                self.unreachable_since = self.unreachable_since or now
                if now - self.unreachable_since < self.timeout or self._stop.is_set():
                    continue
                verdict = (f"the rendezvous store stopped answering for {self.timeout:g} s: the process hosting "
                           f"it (rank 0, or torchrun's agent) froze or died ({type(e).__name__})")
            if verdict and not self._stop.is_set():
                if self.announced:  # rank 0 hosts the store (under our launchers): give the others time to read
                    self._stop.wait(2 * self.interval + 0.5)  # the verdict, rather than a store that vanished
                self._give_up(verdict)

    def _write_beat(self) -> None:  # (TCPStore's set does not wait for an answer)
        self.beat += 1
        self.store.set(f"hb/{self.ctx.rank}", f"{self.beat} {progress.ticks} {progress.step} {progress.phase} {HOST}")

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
            live = [r for r in ranks if r not in frozen]
            on = ", ".join(sorted({hosts[r] for r in frozen}))
            now_at = f"; rank {live[0]} is at step {steps[live[0]]}" if live else ""
            return (f"{ranks_text(frozen)} on {on} stopped responding at step {steps[frozen[0]]} (their last "
                    f"heartbeat{now_at}; none for {self.timeout:g} s: frozen or dead); see logs/rank*.log for the "
                    f"others' stacks")
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
            os._exit(EXIT_CRASH)

    # ---- a rank's user error: one line, every rank leaves -------------------------------------------------
    def first_failure(self, line: str) -> str:
        """Called by a rank that met a user error (faults.user_error): stop this thread and put `line` in the
        store for the other ranks' watchdogs, unless a rank did first. Returns the line to say: the first one
        (two ranks writing to one full disk name their own log files; the first is the cause)."""
        self.stop()
        try:
            return Call(lambda: self.store.compare_set("failed", "", line)).result(self.op_timeout).decode()
        except Exception:  # the store is gone (its host left): the peers fail at their next collective
            return line

    def leave_together(self) -> None:
        """Count this rank as leaving, then wait until every rank does (at most two beats and a store call's
        time): no rank ends (its connections, or the store it hosts) while a peer still waits on it."""
        try:
            Call(lambda: self.store.add("left", 1)).result(self.op_timeout)
            deadline = time.monotonic() + 2 * self.interval + self.op_timeout
            while time.monotonic() < deadline and \
                    Call(lambda: self.store.add("left", 0)).result(self.op_timeout) < self.ctx.world_size:
                time.sleep(0.05)
            if self.ctx.rank == 0:  # it hosts the store: the others' last look at it comes first
                time.sleep(0.2)
        except Exception:
            pass  # the store is gone: nobody left to wait for

    def _follow_peer(self) -> None:
        """Another rank met a user error: say its line and leave with it, from this thread (the main thread
        waits in a collective for that rank)."""
        try:
            report(EXIT_USER_ERROR, self.peer_failure)
            self.leave_together()
        finally:
            os._exit(EXIT_USER_ERROR)

    def silent_ranks(self, wait: Optional[float] = None) -> Optional[list[int]]:
        """Ranks whose heartbeat does not move during `wait` seconds (used after a collective failed, to name
        the peers that died). None if the store cannot tell."""
        try:
            keys = [f"hb/{r}" for r in range(self.ctx.world_size)]
            before = [v.split()[0] for v in Call(lambda: self.store.multi_get(keys)).result(self.op_timeout)]
            time.sleep(wait if wait is not None else 3 * self.interval + 0.5)
            after = [v.split()[0] for v in Call(lambda: self.store.multi_get(keys)).result(self.op_timeout)]
        except Exception:
            return None
        return [r for r in range(self.ctx.world_size) if before[r] == after[r] and r != self.ctx.rank]


class Call(threading.Thread):
    """fn() in a thread of its own, so that the caller can stop waiting for it. For store calls: a frozen store
    host (SIGSTOP, a stuck node) keeps its connections open and never answers, and TCPStore's own timeout does not
    cover that (torch 2.13: get, check, multi_get and add then wait for ever; set does not wait). A call that does
    not come back stays behind, blocked, in a daemon thread that holds none of our locks."""

    def __init__(self, fn):
        super().__init__(name="store-call", daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except Exception as e:
            self.error = e

    def result(self, timeout: float):
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError(f"no answer in {timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.value


def open_store(ctx, op_timeout: float):
    """A store connection of the watchdog's own, with a short timeout, so that a frozen store host makes the
    watchdog notice instead of blocking it as long as the process group's timeout (dist.timeout_s)."""
    import torch.distributed as dist
    from urllib.parse import urlparse
    timeout = datetime.timedelta(seconds=op_timeout)
    address = None
    if ctx.rendezvous and ctx.rendezvous.startswith("tcp://"):
        u = urlparse(ctx.rendezvous)
        address = (u.hostname, u.port)
    elif ctx.rendezvous == "env://":
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if address is not None:
        store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout, wait_for_workers=False)
    else:  # file:// rendezvous: the process group's own FileStore (files do not freeze with a process)
        from torch.distributed import distributed_c10d as c10d
        store = c10d._get_default_store()
    # Under torchrun a restart (which main.py allows only with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) gets a new
    # store: no earlier verdict in it. (Not the restart count as a prefix: agents count theirs differently.)
    return dist.PrefixStore("trainer-watchdog/", store)
