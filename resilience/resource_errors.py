"""Running out of memory or of shared memory, named as such in one line with what to lower; and a one-process run
killed by the kernel (no launcher above it to say so) reported by a small watcher process."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import select
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from core.disk_errors import chain, disk_problem
from core.errors import first_line
from resilience import faults

SHM_DIR = "/dev/shm"  # where DataLoader workers pass batches and multiprocessing makes its semaphores
SHM_WORDS = ("shared memory", "/dev/shm", "unable to write to file </torch_", "unable to open shared memory")
OOM_WORDS = ("can't allocate memory", "cannot allocate memory", "not enough memory", "out of memory")


def failure_line(exc: BaseException, output_dir: str) -> Optional[str]:
    """A failure the user can fix, in one line, else None: resources first (a full /dev/shm is no full disk; out of
    memory: the step and what to lower), then a full disk or a read-only file (core/disk_errors.py)."""
    return resource_problem(exc) or disk_problem(exc, output_dir)


def resource_problem(exc: BaseException) -> Optional[str]:
    """The one line for `exc` when shared memory (/dev/shm) or memory ran out, anywhere in its chain; else None."""
    for e in chain(exc):
        if is_shared_memory(e):
            quiet_broken_loaders()
            return (f"shared memory ({SHM_DIR}{free_space(SHM_DIR)}) is full {faults.progress.where()} "
                    f"({first_line(e, limit=80)}): lower data.num_workers (0 needs none), or give the run a "
                    f"larger {SHM_DIR} (docker run --shm-size=8g) or free it")
        if is_out_of_memory(e):
            return (f"out of memory {faults.progress.where()} ({what_failed(e)}): lower "
                    "train.batch_size, the model's size (model.*) or data.num_workers, or shard the model "
                    "(dist.strategy: fsdp)")
    return None


def is_shared_memory(e: BaseException) -> bool:
    """A full /dev/shm: ENOSPC naming a file there, or raised while multiprocessing or a DataLoader set up their
    shared memory (a semaphore names no file), or torch's own words for its shared memory files."""
    text = str(e)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
        if e.filename is not None and os.fsdecode(e.filename).startswith(SHM_DIR + "/"):
            return True
        if e.filename is None and any(os.sep + "multiprocessing" + os.sep in frame.filename
                                      or "torch/utils/data" in frame.filename
                                      for frame in traceback.extract_tb(e.__traceback__)):
            return True
    return isinstance(e, RuntimeError) and any(w in text for w in SHM_WORDS) and \
        any(w in text for w in ("No space left", "Bus error", "out of shared memory", "raise your shared memory"))


def what_failed(e: BaseException) -> str:
    """`could not allocate 244.1 MiB` where torch's allocator says how much (its line is 150 characters of
    location first), else the error's first line."""
    found = re.search(r"allocate (\d+) bytes", str(e))
    if found:
        return f"{type(e).__name__}: could not allocate {size(int(found.group(1)))}"
    found = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]i?B)", str(e))  # CUDA's words
    return f"{type(e).__name__}: could not allocate {found.group(1)}" if found else first_line(e, limit=80)


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
        return True
    if isinstance(e, OSError) and e.errno == errno.ENOMEM:
        return True
    return isinstance(e, RuntimeError) and any(w in str(e) for w in OOM_WORDS)


def free_space(path: str) -> str:
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    return f": {size(st.f_blocks * st.f_frsize)}, {size(st.f_bavail * st.f_frsize)} free"


def size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def quiet_broken_loaders() -> None:
    """A DataLoader whose workers could not start fails again in its __del__ (torch: an AttributeError on a half-made
    iterator), after the one line: such errors are dropped; any other unraisable error prints as before."""
    global _previous_unraisablehook
    if _previous_unraisablehook is not None:  # installed once per process, however many errors are classified
        return
    _previous_unraisablehook = previous = sys.unraisablehook

    def hook(args):
        if "DataLoaderIter" not in getattr(args.object, "__qualname__", repr(args.object)):
            previous(args)
    sys.unraisablehook = hook


_previous_unraisablehook = None  # the hook quiet_broken_loaders wraps, once it has


# ---- a one-process run killed by the kernel -----------------------------------------------------------------
AfterAKill = Callable[[Callable[[str], None]], None]  # what the watcher does after its line, given how to say one


@contextlib.contextmanager
def reports_a_kill(output_dir: str, rank: Optional[int] = None, after_a_kill: Optional[AfterAKill] = None,
                   mode: str = "train"):
    """Around a run in this process with no launcher above it: a forked watcher waits for this process and, if it
    ends without leaving the block (SIGKILL: the kernel's out-of-memory killer, a memory cgroup, kill -9), prints
    the line a launcher prints for its ranks, with the step reached, then calls after_a_kill(a way to say a line).
    `rank`: this process's rank when it is one of several (a node that runs one rank of a multi-node run); None:
    the run's only process; `mode`: the run's (one that does not train has no step to name). Forked before torch
    is loaded."""
    if not hasattr(os, "fork"):
        yield
        return
    shared = mmap.mmap(-1, mmap.PAGESIZE)
    steps = (ctypes.c_int64 * 1).from_buffer(shared)
    # The exit code once the run ended by its own means without leaving the block (its watchdog's os._exit), else -1
    codes = (ctypes.c_int32 * 1).from_buffer(shared, ctypes.sizeof(steps))
    codes[0] = -1
    done_r, done_w = os.pipe()
    parent, kills = os.getpid(), oom_kills()
    pid = os.fork()
    if pid == 0:  # the watcher
        os.close(done_w)
        watch(parent, done_r, steps, codes, kills, output_dir, rank, after_a_kill, mode)
    os.close(done_r)
    previous = faults.progress.shared, faults.progress.slot, faults.progress.codes
    faults.progress.shared, faults.progress.slot, faults.progress.codes = steps, 0, codes
    try:
        yield
    finally:
        faults.progress.shared, faults.progress.slot, faults.progress.codes = previous
        os.write(done_w, b"x")
        os.close(done_w)
        os.waitpid(pid, 0)
        del steps, codes
        shared.close()


def watch(parent: int, done_r: int, steps, codes, kills: Optional[int], output_dir: str, rank: Optional[int],
          after_a_kill: Optional[AfterAKill] = None, mode: str = "train") -> None:
    """The watcher's whole life: never returns. It ignores the signals a terminal or scheduler sends the group."""
    try:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_IGN)
        while os.getppid() == parent:
            if select.select([done_r], [], [], 0.5)[0]:
                if os.read(done_r, 1):
                    os._exit(0)  # the run left the block: it ended by its own means
                time.sleep(0.5)  # (the pipe's end closed by every holder: the parent is gone, or going)
        if codes[0] >= 0:
            os._exit(0)  # it said why it ended (the watchdog's verdict) and left with os._exit, not by a kill
        after = oom_kills()
        why = ("killed by the kernel: out of memory (its memory cgroup counted an OOM kill)"
               if kills is not None and after is not None and after > kills else
               "killed without a word (SIGKILL: the kernel's out-of-memory killer?, or kill -9)")
        who = "the run" if rank is None else f"rank {rank}"
        where = faults.doing(mode) or f"at step {steps[0]}"
        os.write(2, (f"error: {who} (pid {parent} on {faults.HOST}) was {why} {where}; see "
                     f"{os.path.join(output_dir, 'logs', f'rank{rank or 0}.log')}\n").encode(errors="replace"))
        if after_a_kill is not None:  # its lines as the one above: os.write, not a copy of the parent's buffers
            after_a_kill(lambda line: os.write(1, f"{line}\n".encode(errors="replace")))
    finally:
        os._exit(0)


def oom_kills() -> Optional[int]:
    """How many processes the kernel has killed for memory in this process's memory cgroup (v2 memory.events,
    v1 memory.oom_control); None where unreadable."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        candidates = ([f"/sys/fs/cgroup{path}/memory.events"] if controllers == "" else
                      [f"/sys/fs/cgroup/memory{path}/memory.oom_control"] if "memory" in controllers.split(",") else [])
        for name in candidates:
            try:
                with open(name) as f:
                    for entry in f.read().splitlines():
                        key, _, value = entry.partition(" ")
                        if key == "oom_kill":
                            return int(value)
            except (OSError, ValueError):
                continue
    return None


def thread_exception(args) -> None:
    """threading.excepthook in a rank. A thread's full disk (TensorBoard's writer thread) goes to the log file
    only: its owner raises it again in the main thread, which reports it in one line. Anything else: as Python
    prints it."""
    if faults.report.log is not None and disk_problem(args.exc_value, "") is not None and \
            resource_problem(args.exc_value) is None:
        faults.report.log.error(f"thread {args.thread.name if args.thread else '?'}: {first_line(args.exc_value)}",
                         extra={"file_only": True})
        return
    threading.__excepthook__(args)
