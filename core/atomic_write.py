"""How a run writes its small files (config.yml, metrics.csv, trackers.json, *_results.json, predictions.csv, the
vocabulary, the launch record, a rank's last word): beside the final name, then renamed onto it, so that a full disk
or a kill halfway leaves the previous file whole, and never through a symlink or FIFO planted in output_dir."""
from __future__ import annotations

import contextlib
import os
from typing import IO, Callable

from core.disk_errors import name_unnamed_errors
from core.errors import UserError


def write_beside(path: str, write: Callable[[IO[str]], object]) -> None:
    """write(f) into `path`.tmp, then renamed onto `path`. A symlink or FIFO planted at either name is replaced,
    never followed; a folder at `path` is an error. Errors name `path`; no .tmp is left."""
    tmp = path + ".tmp"
    with name_unnamed_errors(path):
        try:
            if os.path.lexists(tmp):  # a kill's leftover, or planted: the file is made anew (O_EXCL), never followed
                os.remove(tmp)
            with open(tmp, "w", newline="", opener=lambda p, flags: os.open(p, flags | os.O_EXCL, 0o666)) as f:
                write(f)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)


def refuse_a_folder_at(path: str, what: str) -> None:
    """A folder where a mode writes its file (`what`: what it writes there): one line before the work, not
    write_beside's IsADirectoryError traceback after it (every input predicted, every split evaluated)."""
    if os.path.isdir(path):
        raise UserError(f"{path}: a folder, where {what}; move it away, or set another output_dir")
