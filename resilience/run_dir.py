"""One output_dir holds one run: what an earlier run left there, found when a run starts in a folder that has
checkpoints/ (resume.claim_output_dir); one where checkpoints/ is not a folder is refused.

- what interrupted saves and prunes left in checkpoints/ is removed (clean_stale);
- train.start_over moves the earlier run's files aside (move_run_aside);
- a fresh start (train.resume: false) beside another run's checkpoints is refused: test mode and resume would
  pick whichever checkpoint is best or newest, from either run.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from typing import Optional

from core import checkpoint, trackers


def claim(output_dir: str, train_cfg, log: logging.Logger) -> Optional[str]:
    """Rank 0, before any rank resumes or saves: clean up, move an old run aside (train.start_over), or return
    the line refusing a fresh start beside another run, or a checkpoints/ that is not a folder (None: output_dir is
    this run's)."""
    for path in restore_replaced(output_dir):
        log.warning(f"restored {path}: a save of the same step was interrupted between its two renames")
    for path in clean_stale(output_dir):
        log.info(f"removed {path}: left by an interrupted save or prune")
    if train_cfg.start_over:
        moved, aside = move_run_aside(output_dir)
        if moved:
            log.info(f"start over: moved the previous run's {', '.join(moved)} aside to {aside}")
    elif train_cfg.resume is False and checkpoint.latest(output_dir):
        return (f"{os.path.abspath(output_dir)} holds another run (latest {checkpoint.latest(output_dir)}) and "
                "train.resume is false: one folder holds one run; resume it (train.resume=auto), use another "
                "output_dir, or start over with --set train.start_over=true (moves the old run aside)")
    base = checkpoint.root(output_dir)
    if os.path.lexists(base) and not os.path.isdir(base):  # else the first save fails on it, maybe hours in
        return f"{base}: not a folder (this run saves its checkpoints there): move it away, or use another output_dir"
    return None


def restore_replaced(output_dir: str) -> list[str]:
    """A complete step-N moved aside (checkpoint.REPLACED_DIR) with no step-N in its place: the process died between
    the two renames of a step saved again. Put it back (the new copy, a `.tmp-step-N-*`, then goes with the stale)."""
    base, restored = checkpoint.root(output_dir), []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        m = checkpoint.REPLACED_DIR.match(name)
        final = os.path.join(base, m.group(1)) if m else None
        if m and checkpoint.real_dir(os.path.join(base, name)) and not os.path.lexists(final) and \
                os.path.isfile(os.path.join(base, name, "meta.json")):
            os.rename(os.path.join(base, name), final)
            checkpoint.fsync(base)
            restored.append(final)
    return restored


def clean_stale(output_dir: str) -> list[str]:
    """Remove what interrupted saves (`.tmp-step-*`) and prunes (a `step-N` without meta.json) left in
    checkpoints/; return the paths really removed. Run by claim(), before any rank saves: nothing reads them, and
    on a full disk they would take the space the next checkpoint needs. A symlink is never followed: a `.tmp-step-*`
    that is not a real folder (a link, a file) is unlinked (the name, not a link's target), a `step-N` one left."""
    base = checkpoint.root(output_dir)
    if not os.path.isdir(base):
        return []
    removed = []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if checkpoint.TMP_DIR.match(name) and not checkpoint.real_dir(path):
            with contextlib.suppress(OSError):
                os.unlink(path)
        elif checkpoint.real_dir(path) and (checkpoint.TMP_DIR.match(name) or (checkpoint.STEP_DIR.match(name) and not checkpoint.is_complete(path))):
            shutil.rmtree(path, ignore_errors=True)
        else:
            continue
        if not os.path.lexists(path):  # what could not be removed (a read-only folder) is not said to be
            removed.append(path)
    return removed


def unused_path(path: str) -> str:
    n, candidate = 1, path
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


# What belongs to one run (and *_results.json; predictions.csv: its checkpoint's labels). Kept in place: logs/ (each
# start's log says what it did), and the stores that hold many runs side by side (output_dir/wandb's run folders,
# mlflow.db): a new run is a new run there.
RUN_FILES = ("checkpoints", "tensorboard", "profile", "export", "config.yml", "predictions.csv", trackers.CSV_FILE,
             trackers.IDS_FILE)


def move_run_aside(output_dir: str) -> tuple[list[str], Optional[str]]:
    """train.start_over: move what the previous run left in output_dir (RUN_FILES) into
    output_dir/replaced-<date>-<time>/. Returns the names moved and where. Only these known names are touched:
    output_dir may be a folder that holds other things too."""
    names = [n for n in RUN_FILES if os.path.lexists(os.path.join(output_dir, n))]
    names += sorted(n for n in os.listdir(output_dir) if n.endswith("_results.json"))
    if not names:
        return [], None
    aside = unused_path(os.path.join(output_dir, time.strftime("replaced-%Y%m%d-%H%M%S")))
    os.makedirs(aside)
    for name in names:
        os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
    checkpoint.fsync(output_dir)
    return names, aside
