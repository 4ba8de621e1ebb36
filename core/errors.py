"""The ways a run can end besides success, as exception classes and exit codes. Every layer raises these, so they
live apart from the config schema and the fault handling (resilience/faults.py reports them)."""
from __future__ import annotations

import os
import sys

EXIT_OK, EXIT_CRASH, EXIT_USER_ERROR, EXIT_STOPPED, EXIT_DIVERGED = 0, 1, 2, 3, 4  # (and 130: Ctrl-C in test mode)


class UserError(Exception):
    """A mistake in what the user gave us (config, data, checkpoint): one line, exit code 2, no traceback."""


class ConfigError(UserError):
    """A user mistake in the configuration. Its message is one line naming the file and the key."""


class DataError(UserError):
    """Missing or malformed data. Its message names the file (and line, where there is one)."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or unreadable. Its message names the path."""


class Unloadable(CheckpointError):
    """A checkpoint whose files are missing, empty, truncated, malformed or refused (they would run code).
    `resume: auto` then falls back to an older checkpoint. Other CheckpointErrors (a checkpoint that does not fit
    this model or optimizer) stop the run: the older checkpoints of the same run would not fit either."""


def unreadable(e: OSError, path: str) -> CheckpointError:
    """The error for a file of checkpoint `path` that could not be opened or read (`e`). Gone, or a folder in its
    place: the checkpoint's content, Unloadable. Anything else (no permission, a failing disk, EIO) is the
    machine's, not the bytes': a CheckpointError, so that resume: auto stops instead of setting a good checkpoint
    aside and going back to an older one."""
    where = os.fsdecode(e.filename) if e.filename is not None else path
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return Unloadable(f"{where}: unreadable ({e.strerror or e})")
    return CheckpointError(f"{where}: cannot be read ({e.strerror or e}): the disk or the permissions, not the "
                           "checkpoint's content; fix that and run the same command again (nothing was set aside)")


class Stopped(Exception):
    """Raised by the Trainer once every rank has agreed to stop and the checkpoint is saved."""
    exit_code = EXIT_STOPPED


def stopped_before_training(reason: str, during: str = "") -> str:
    """The line of a run stopped by `reason` (a signal's name) before its first step: nothing to save."""
    return (f"stopped by {reason}{during} before training began: nothing was trained, nothing needed saving; run the "
            "same command to start again (it resumes from the last checkpoint, if there is one)")


class Diverged(Exception):
    """Raised by the Trainer when training produced too many non-finite steps in a row (or parameters)."""
    exit_code = EXIT_DIVERGED


def first_line(e: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message` (cut at `limit`): an exception in one line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:limit]}" if lines else type(e).__name__


def warn_on_stderr(text: str) -> None:
    """A warning line on stderr, where no log is at hand: what a `note`/`warn` callback does by default."""
    print(f"warning: {text}", file=sys.stderr, flush=True)


def printable(text: str) -> str:
    """`text` as UTF-8 holds it: the bytes of a file name that are not UTF-8 (a zip of Latin-1 names unpacked as
    bytes; Python reads them as lone surrogates, which no UTF-8 file or console takes) shown as \\xe9."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name makes
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
