"""A full disk (or quota), a file or folder this run may not write, or no file descriptor left: how such an error
is recognised and the one line that says so, naming the file (or the limit) and what to do. Loaded only once
something has failed."""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
from typing import Optional

from core.errors import CheckpointError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # counted only with a file named: EPERM has other causes
TOO_MANY_FILES = (errno.EMFILE, errno.ENFILE)  # this process's limit (ulimit -n), or the system's


def disk_problem(exc: BaseException, output_dir: str) -> Optional[str]:
    """The one line for `exc` when a full disk (or quota) or a read-only file or folder caused it: an OSError
    with such an errno anywhere in its chain (TensorBoard, the logs, config.yml, *_results.json, the tokenizer,
    checkpoints/). It names the file (else output_dir) and what to do; None for any other error."""
    error = next((e for e in chain(exc) if isinstance(e, OSError) and
                  (e.errno in NO_SPACE + TOO_MANY_FILES or (e.errno in NOT_WRITABLE and e.filename is not None))),
                 None)
    if error is None:
        return None
    if error.errno in TOO_MANY_FILES:
        return too_many_files(error)
    where = os.fsdecode(error.filename) if error.filename is not None else f"a file in output_dir {output_dir}"
    if error.errno in NOT_WRITABLE and not os.path.lexists(where):  # what could not be made: its folder is at fault
        where = os.path.dirname(os.path.abspath(where))
    todo = ("free some space" if error.errno in NO_SPACE else
            "make it writable for this run (or choose another output_dir)")
    return (f"{where}: {error.strerror or os.strerror(error.errno)}: {todo}, then run the same command again "
            f"(the checkpoints saved so far are intact)")


def too_many_files(error: OSError) -> str:
    """The line for running out of file descriptors: which limit, and what to raise."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    where = f" opening {os.fsdecode(error.filename)}" if error.filename is not None else ""
    limit = (f"this process may open {soft} files at once (ulimit -n)" if error.errno == errno.EMFILE else
             "the system's limit of open files is reached (fs.file-max)")
    return (f"too many open files{where}: {limit}: raise it (ulimit -n 65536; docker --ulimit nofile=65536; "
            f"systemd LimitNOFILE=), then run the same command again (the checkpoints saved so far are intact)")


def handler_file(handler) -> str:
    """The file a logging handler writes to: its log file, or the file the console goes to (`> out.txt`,
    SLURM's --output), for an error that names none (run_log.StopsOnWriteError)."""
    if getattr(handler, "baseFilename", None):
        return handler.baseFilename
    try:
        return os.readlink(f"/proc/self/fd/{handler.stream.fileno()}")
    except (OSError, ValueError, AttributeError):
        return getattr(handler.stream, "name", "the console")


def chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, nearest first."""
    seen = []
    while exc is not None and not any(exc is e for e in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def no_space(error: BaseException, directory: str) -> bool:
    """Whether `error`, raised while writing into `directory`, comes from a full disk (or quota). An OSError
    says so by its errno (also inside DCP's CheckpointException); torch.save does not: on a full disk it raises
    RuntimeError('... unexpected pos ...', after 'basic_ios::clear: iostream error'). Then the free space
    decides: a write that failed for lack of space leaves (almost) none."""
    seen, stack = [], [error]
    while stack:
        e = stack.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno in NO_SPACE
        stack += [e.__cause__, e.__context__]
        stack += [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
    if isinstance(error, OSError):  # an OSError without an errno was raised on purpose, not by a full disk
        return False
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20


# ---- a checkpoint write that failed on some rank (checkpoint._on_every_rank) ---------------------------------
def write_status(rank: int, error: BaseException, final: str, tmp: str) -> tuple:
    """What this rank tells the others of its failed part of writing checkpoint `final` (temporary folder `tmp`):
    (rank, whether the disk is full, the line for a read-only file or None)."""
    return rank, no_space(error, tmp), disk_problem(error, final)


def write_failed(ctx, failed: list[tuple], final: str, tmp: str) -> None:
    """Every rank, once any failed (`failed`: their write_status): a full disk anywhere, or a read-only file, is
    the same one-line CheckpointError on every rank. The rank with a full disk has already let go of its error
    (checkpoint._on_every_rank): its traceback holds the frames of the failed torch.save, whose file (left open
    by torch) would keep its disk space after the rmtree below, until the garbage collector ran."""
    if any(full for _, full, _ in failed):
        if ctx.is_main:  # every rank is done with it
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"no space left on device writing {final} (the earlier checkpoints are intact: "
                              f"free some space and run the same command to resume)")
    not_writable = next((line for _, _, line in failed if line), None)
    if not_writable:  # checkpoints/ read-only (or a file in it)
        raise CheckpointError(not_writable)


@contextlib.contextmanager
def name_unnamed_errors(path: str):
    """Inside it, an OSError that names no file names `path`: a full disk is often noticed only as a buffer is
    flushed (a file's close, a writer thread), by an error without a file name."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or os.strerror(e.errno), path) from e
