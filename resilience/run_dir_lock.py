"""output_dir before any rank starts: a writable folder (else one line now, not a traceback at the first save hours
later), held by one run at a time. Torch-free: main.py checks this before it loads torch. What an earlier run left in
the folder: run_dir.py."""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time

from core.errors import UserError


def check_output_dir(path: str) -> None:
    """A mistake here would otherwise surface as a traceback from every rank, or at the first save."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"output_dir {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(f"output_dir {path!r} is not a writable directory ({e.strerror})") from None
    logs = os.path.join(path, "logs")
    if os.path.lexists(logs) and not os.path.isdir(logs):  # (else each rank's log file fails: a traceback each)
        raise UserError(f"{logs}: not a folder (each rank writes its log there): move it away, or use another "
                        "output_dir")
    # checkpoints/ too, if there: a read-only one would otherwise be found at the first save, hours later
    for folder in (path, os.path.join(path, "checkpoints")):
        if os.path.isdir(folder):
            try:
                probe = os.path.join(folder, f".write-test-{os.getpid()}")
                with open(probe, "w"):
                    pass
                os.remove(probe)
            except OSError as e:
                name = "output_dir" if folder == path else "checkpoint folder"
                raise UserError(f"{name} {folder!r} is not a writable directory ({e.strerror}): make it writable "
                                f"for this run, or choose another output_dir") from None


def hold_output_dir(path: str, what: str = "run"):
    """One run per output_dir: an exclusive lock on output_dir/.lock for as long as this process lives (the
    kernel drops it when the process ends, however it ends, so a lock is never stale). A second run is refused
    in one line naming the holder; two runs in one folder would resume, save and prune each other's steps.
    what="predict": one predict per output_dir (.predict.lock, beside a training run's): two would write one
    predictions.csv.tmp, each deleting or renaming the other's."""
    name = ".lock" if what == "run" else f".{what}.lock"
    f = open(os.path.join(path, name), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"output_dir {path!r} is in use by another {what} ({holder}); wait for it to end, or use "
                        "another output_dir") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
    except OSError as e:  # a full disk: said now, not at the first save
        with contextlib.suppress(OSError):  # (the unwritten line fails the close too; the file is closed)
            f.close()
        raise UserError(f"output_dir {path!r}: {e.strerror} (writing its {name}): free some space, then run the same "
                        "command again") from None
    return f
