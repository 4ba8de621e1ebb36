"""How a process that loaded torch ends (a rank, or main.py's own process): the project's exit handlers, then
`os._exit`, without the interpreter's teardown. In that teardown gloo's threads, still held by torch, can abort a
run that was done, and it takes ~1 s (benchmarks/RESULTS.md, "A rank aborting after the run was done", "Ending
main.py's process as its ranks end").

Python's atexit handlers do not run when a process ends this way (the atexit module has no public call that runs
them), so what a part of this project needs done at exit it registers here with `at_end`: the temporary folders
W&B makes as it is imported, for example (its service the tracker stops as it closes). The same list also runs at
an ordinary interpreter exit (a test that called main.main() in its own process), through atexit, so a handler runs
once either way.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import shutil
import sys
import tempfile
from types import ModuleType
from typing import Callable

from core.errors import first_line

HANDLERS: list = []  # the project's exit handlers, run last-registered first, each once


def at_end(handler: Callable[[], None]) -> None:
    """Run `handler()` when this process ends (end_process, or an ordinary exit)."""
    HANDLERS.append(handler)


def run_handlers() -> None:
    """Each registered handler once, last first. One that fails is named in one line; the others still run."""
    while HANDLERS:
        handler = HANDLERS.pop()
        try:
            handler()
        except Exception as e:  # an exit handler must not keep the process from ending with its code
            name = getattr(handler, "__qualname__", None) or repr(handler)
            print(f"warning: exit handler {name} failed: {first_line(e, limit=160)}", file=sys.stderr, flush=True)


atexit.register(run_handlers)  # an ordinary exit runs the list too (it is empty after end_process)


def end_process(code: int) -> None:
    """End this process with `code`: the project's exit handlers, logging's flush, the streams, then os._exit."""
    run_handlers()
    logging.shutdown()  # (what logging's own atexit handler does)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def alive(pid: int) -> bool:
    """Whether process `pid` of this host has not ended (another user's counts): what a process that ended left
    (a roll call's claim, an export's temporary folder) is stale."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def import_with_own_temp_folder(name: str) -> ModuleType:
    """`import name` for a library whose import makes temporary folders that only its atexit handler removes (W&B
    makes wandb-media and wandb-artifacts): the import runs with Python's temporary folder set to one of ours, which
    at_end removes with whatever the library put there. Imported already: the module as it is."""
    if name in sys.modules:
        return sys.modules[name]
    folder = tempfile.mkdtemp(prefix=f"{name}-import-")

    def remove_temp_folder():
        if os.path.isdir(folder):  # (gone already if an earlier exit ran this)
            shutil.rmtree(folder)

    at_end(remove_temp_folder)
    previous, tempfile.tempdir = tempfile.tempdir, folder
    try:
        return importlib.import_module(name)
    finally:
        tempfile.tempdir = previous
