"""When things go wrong: stop requests (signals, time limit), where a rank is, and how a failure is reported.

A stop signal or train.time_limit stops every rank after the same step, once a checkpoint is saved; every failure
is reported once, naming the rank, the host and the step; a user mistake (a full disk included) is one line. The
rules and the exit codes (core/errors.py): docs/faults.md. Hung ranks: heartbeat.py.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import signal
import socket
import sys
import termios
import threading
import time
import traceback
from typing import Optional

from core.errors import EXIT_CRASH, EXIT_OK, EXIT_STOPPED, EXIT_USER_ERROR, first_line, stopped_before_training
from core.launch_env import first_on_node, launcher_env

HOST = socket.gethostname()


# ---- Where this rank is --------------------------------------------------------------------------------------
class Progress:
    """What this rank is doing: read by the watchdog thread, by crash reports, and (shared memory) by the launcher
    when this rank dies without a word."""

    def __init__(self):
        self.rank, self.step, self.ticks, self.phase = 0, 0, 0, "setup"
        self.shared, self.slot = None, 0  # main.py's spawn: a shared array of steps, one slot per local rank
        self.codes = None  # main.py's spawn, reports_a_kill: shared exit codes, set when a rank is done (finished())

    def phase_starts(self, step: int, phase: str) -> None:
        """`step`: the optimizer step being computed (or evaluated, or saved)."""
        self.step, self.phase = step, phase
        self.ticks += 1
        if self.shared is not None:
            self.shared[self.slot] = step

    def finished(self, code: int) -> None:
        """This rank is done (`code`: its exit code) and only tears down from here: the launcher may end it if
        that hangs (launcher.Supervisor). Also said by the watchdog just before its os._exit."""
        if self.codes is not None:
            self.codes[self.slot] = code

    def where(self) -> str:
        return {"setup": "before training (setup)", "train": f"at step {self.step}",
                "eval": f"evaluating at step {self.step}", "save": f"saving step {self.step}",
                "done": f"after the last step ({self.step})",
                "predict": "while predicting (mode predict)"}.get(self.phase, f"at step {self.step}")


progress = Progress()


# ---- Stop requests: signals and the time limit ---------------------------------------------------------------
def stop_signals(extra_signal: Optional[str]) -> list[str]:
    """The signals that stop a run after a checkpoint: SIGTERM (schedulers), SIGINT (Ctrl-C), SIGHUP (a terminal or
    an ssh session that closed) and train.stop_signal (which may name one of them again)."""
    return list(dict.fromkeys(("SIGTERM", "SIGINT", "SIGHUP") + ((extra_signal,) if extra_signal else ())))


A_CHECKPOINT = "a checkpoint is saved"  # what a stop keeps, as its line says it (StopRequest.kept)

# What main.py catches before its config is read: the stop signals, and every one train.stop_signal may name.
EARLY_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def already_stopping(name: str, pid: Optional[int] = None) -> str:
    """The line for a stop signal that comes while the run is already stopping (see StopRequest); `pid`: the
    process whose SIGKILL ends the whole run (main.py's launcher)."""
    return (f"{name} again: already stopping: a checkpoint is saved, then the run exits; SIGKILL ends it at "
            f"once, without saving" + (f" (kill -9 {pid})" if pid else ""))


class StopRequest:
    """Set by a signal handler or the time limit; the Trainer votes it into the step's all-reduce, so all ranks
    stop after the same step. A stop signal again only logs a line (schedulers and people send them twice): the
    save must not be lost to it; SIGKILL ends a run at once.

    The handler logs nothing itself: a signal that lands while this thread is inside a log handler's write would
    write into the same file again ("reentrant call inside BufferedWriter"). It queues its line (SimpleQueue is
    safe in a signal handler), and a thread of its own writes it."""

    def __init__(self):
        self.reason: Optional[str] = None
        self.deadline: Optional[float] = None
        self.log: Optional[logging.Logger] = None
        self.lines: queue.SimpleQueue = queue.SimpleQueue()  # (message, extra) the handler has to say
        self.before_early: dict = {}  # signal -> its handler before catch_early (main.py), put back by keep_early
        self.kept = A_CHECKPOINT  # what a stop keeps (install): lr_find's sweep keeps its curve

    def catch_early(self) -> None:
        """main.py's first act, before torch loads: a stop signal while it starts (the config checked, torch
        loading, the ranks starting) is recorded, not death by it (exit 143 or 138: a crash to a job script, no
        requeue); main.py then stops before training begins (stopped_before_start)."""
        for name in EARLY_STOP_SIGNALS:
            self.before_early[getattr(signal, name)] = signal.signal(getattr(signal, name), self._handle)

    def keep_early(self, names: list[str]) -> None:
        """Once the config is read: the signals caught early that do not stop this run (not in `names`) get their
        handling back, and one of them that came meanwhile is delivered again, as if never caught."""
        for signum, handler in self.before_early.items():
            if signal.Signals(signum).name not in names:
                signal.signal(signum, handler)
                if self.reason == signal.Signals(signum).name:
                    self.reason = None
                    signal.raise_signal(signum)
        self.before_early = {}

    def install(self, extra_signal: Optional[str], time_limit_s: Optional[float], used_s: float = 0.0,
                kept: Optional[str] = None) -> None:
        """First thing in a rank (before torch is imported), so that a signal during setup is not lost. Unblocks
        the signals, which launcher.Supervisor blocks while it starts its ranks: one sent before now is handled now.
        used_s: the time limit's seconds used before this start (elastic.time_used: torchrun's restarts). `kept`:
        what the stop keeps, as its line says it (None: a checkpoint)."""
        self.kept = kept or A_CHECKPOINT
        self.deadline = time.monotonic() + time_limit_s - used_s if time_limit_s is not None else None
        signums = [getattr(signal, name) for name in stop_signals(extra_signal)]
        for signum in signums:
            signal.signal(signum, self._handle)
        threading.Thread(target=self._say_lines, name="stop-signal-lines", daemon=True).start()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            detach_hung_up_terminal()
        if self.reason is not None and self.reason != "time limit":
            # (under main.py's launcher, it says this on the console: here, the log file only)
            self.lines.put((already_stopping(name), {"file_only": report.sink is not None}))
            return
        self.reason = name
        self.lines.put((f"{name} received: stopping after the current step, once {self.kept} (a stop "
                        f"signal again does not stop it sooner; SIGKILL ends the run at once, without saving)", {}))

    def _say_lines(self) -> None:
        while True:
            line, extra = self.lines.get()
            if self.log:  # (a signal before the run's log exists is still obeyed; its line is not written)
                self.log.warning(line, extra=extra)

    def vote(self) -> float:
        """1.0 if this rank wants to stop (a signal came, or the time limit is reached), else 0.0."""
        if self.reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.reason = "time limit"
        return 0.0 if self.reason is None else 1.0


stop_request = StopRequest()


class Interrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C's included) in a run that does not train (test mode, predict, export): nothing to save,
    so it ends as Ctrl-C does (temporary files removed on the way out), exit code 128 + the signal's number
    (docs/faults.md)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def listen(mode: str, extra_signal: Optional[str], dev_run: bool) -> None:
    """Once main.py has read the config: which signals stop this run, and how. A training run or an lr sweep saves a
    checkpoint and exits 3 (SLURM requeues it); test, predict, export and a dev run have nothing to save and end as
    Ctrl-C ends them (docs/faults.md)."""
    names = stop_signals(extra_signal)
    stop_request.keep_early(names)
    if mode not in ("train", "lr_find") or dev_run:
        interrupt_on(names)


def interrupt_on(names: list[str]) -> None:
    """Each signal of `names` raises Interrupted, as Ctrl-C raises KeyboardInterrupt: death by SIGTERM left
    predictions.csv.tmp, and a kill report that could only guess SIGKILL."""
    for name in names:
        signal.signal(getattr(signal, name), raise_interrupted)
    if stop_request.reason in names:  # one caught as main.py started (catch_early): raised now, as keep_early does
        signal.raise_signal(getattr(signal, stop_request.reason))


def raise_interrupted(signum, frame) -> None:
    if signum == signal.SIGHUP:
        detach_hung_up_terminal()  # (its line must still be said: on a hung-up terminal, a write fails)
    # Once: the same signal again (schedulers send two) or Ctrl-C must not raise into the cleanup and its line.
    for name in EARLY_STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Interrupted(signum)


def doing(mode: str) -> Optional[str]:
    """What a run that does not train was doing, for the line that ends it (no step to name); None: one that trains."""
    return {"predict": "while predicting (mode predict)", "test": "while testing (mode test)",
            "export": "while exporting (mode export)"}.get(mode)

# Set by `python main.py`: a stop signal as the ranks are gone must not turn exit code 3 into death by SIGTERM.
ignore_late_signals = False


def no_stdin() -> None:
    """Nothing in a run waits on a prompt (transformers asks before running a model folder's code, and a "y" piped
    in would answer it): stdin, Python's and file descriptor 0, reads as empty from here on."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)


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


# ---- Reporting a failure: once, by rank and host -------------------------------------------------------------
class Reporter:
    """Where this rank's final word goes: under main.py's own spawn, a file the launcher reads; else the console,
    identical lines from several ranks once under torchrun or srun (heartbeat.Watchdog.first_to_say)."""

    def __init__(self):
        self.sink = None  # a rank of main.py's own spawn: launcher.leave_report, to a file the launcher reads
        self.log: Optional[logging.Logger] = None
        self.watchdog = None  # set by start_watchdog

    def __call__(self, code: int, line: str, detail: str = "") -> int:
        if self.log:  # the log file only: the console gets it below, once
            try:
                (self.log.info if console(code) is sys.stdout else self.log.error)(
                    line + ("\n" + detail if detail else ""), extra={"file_only": True})
            except OSError:  # the log file cannot take it (a full disk: run_log.LogFile): the console still does
                pass
        if self.sink is not None:
            self.sink(code, line, detail)
        elif launcher_env() is None:  # a rank main.py runs in its own process has its node's console to itself
            say(code, line, detail)
        elif code in (EXIT_OK, EXIT_STOPPED):  # (under torchrun or srun: every rank ends alike)
            # Rank 0 says it: the store it hosts may be gone by the time the others would ask it (said twice, with
            # a C++ stack). Before the ranks meet (no watchdog), the first rank of each node says its own.
            if progress.rank == 0 if self.watchdog is not None else first_on_node():
                say(code, line, detail)
        elif self.watchdog is None or self.watchdog.first_to_say(line):
            say(code, line, detail)
        return code


report = Reporter()


def stopped_before_start(reason: str) -> int:
    """A stop signal (`reason`, its name) came before anything that could save was started: its one line, exit 3."""
    return report(EXIT_STOPPED, stopped_before_training(reason))


def interrupted(e: KeyboardInterrupt, mode: str) -> int:
    """The one line of a run ended by Ctrl-C, or of one that does not train ended by a stop signal (`e`), said by
    its rank where there is one (identical from every rank: said once); returns its exit code."""
    by = f" by {e}" if isinstance(e, Interrupted) and str(e) != "SIGINT" else ""  # (Ctrl-C: 'interrupted')
    return report(getattr(e, "exit_code", 130), f"interrupted{by} {doing(mode) or progress.where()} on {HOST}")


def console(code: int):
    """Where a final word with exit code `code` is printed: stdout for an end as planned (finished, stopped and
    saved), stderr for a failure."""
    return sys.stdout if code in (EXIT_OK, EXIT_STOPPED) else sys.stderr


def say(code: int, line: str, detail: str = "") -> None:
    """Print one final word (by this rank, or by main.py's launcher for its ranks); details go to stderr."""
    print(line, file=console(code), flush=True)
    if detail:
        print(detail, file=sys.stderr, flush=True)


def crash_report(exc: BaseException, watchdog) -> int:
    """`rank R on HOST failed at step S: ...` with the traceback, to the log and the launcher. If the error came
    from a collective whose peers vanished, name the ranks that stopped beating."""
    lost = watchdog.lost_peers(exc) if watchdog is not None else ""
    line = f"rank {progress.rank} on {HOST} failed {progress.where()}: {lost}{first_line(exc, limit=300)}"
    return report(EXIT_CRASH, line, "".join(traceback.format_exception(exc)).rstrip())


def user_error(line: str, watchdog) -> int:
    """Report a user mistake this rank met (`line`: `error: ...`, a full disk for one), exit code 2. With peers
    and a watchdog, the first failing rank's line is the one said, and every rank leaves at once
    (Watchdog.leave_together), before a peer's next collective fails with a traceback."""
    if watchdog is not None:
        line = watchdog.first_failure(line)
    report(EXIT_USER_ERROR, line)
    if watchdog is not None:
        watchdog.leave_together()
    return EXIT_USER_ERROR
