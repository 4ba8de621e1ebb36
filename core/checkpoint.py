"""Checkpoint directories: `output_dir/checkpoints/step-N/`, written atomically, never overwritten in place.

A checkpoint is written into a hidden temporary directory `.tmp-step-N-*` and renamed to `step-N` only once every
file is there and on disk (each file, the directories and, after the rename, checkpoints/ itself are fsynced),
with `meta.json` written last. So a crash, a power loss or a full disk during a save leaves the previous
checkpoints untouched, and resume only ever sees complete ones. Pruning removes `meta.json` first, so a kill
halfway leaves a directory that resume ignores. What interrupted saves and prunes leave behind is removed when the
next run starts (run_dir.py), a prune's failed delete at the next prune too (half_deleted). Files:
    model.pt, optimizer.pt   strategy-dependent (see strategies/base.Strategy.save); model.pt is a plain state dict
    model_dcp/, optimizer_dcp/  fsdp instead: sharded torch.distributed.checkpoint folders (docs/sharded.md)
    state.pt                 scheduler, grad scaler, RNG states of every rank
    ema.pt                   train.ema_decay: the weights' moving average, a whole state dict (core/ema.py)
    meta.json                step, epoch and position inside it, metrics, best so far, config (human-readable),
                             a classifier's class names (`label_names`) and a text task's vocabulary's sha256
                             (`vocabulary_sha256`), both checked at every load (checkpoint_io),
                             and the size and sha256 of every other file (`files`), checked before loading
                             (checkpoint_io.verify)

This file is the directory protocol; reading the files inside one is checkpoint_io.py (and checkpoint_dcp.py for
the DCP folders); meta.json read as untrusted data, checkpoint_meta.py; which one a run resumes from, resume.py.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import uuid
from typing import Callable, Optional

from torch.distributed.checkpoint.api import CheckpointException

from core import checkpoint_hashes, checkpoint_signing, disk_errors
from core.distributed import DistContext, broadcast_object, gather_objects

# step-N exactly as the run writes it: step-04 (or other digits \d matches) would count as step 4 beside step-4;
# such a name is foreign, left alone by latest, prune and clean-up.
STEP = "(?:0|[1-9][0-9]*)"
STEP_DIR = re.compile(rf"^step-({STEP})$")
TMP_DIR = re.compile(rf"^\.tmp-step-{STEP}-")
REPLACED_DIR = re.compile(rf"^\.tmp-(step-{STEP})-replaced-")  # a published step-N moved aside as it is saved again


NOT_HYPERPARAMETERS = {"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"}
PLAIN = (bool, int, float, str, type(None))


def hyperparameters(param_groups: list[dict]) -> dict:
    """The optimizer's hyperparameters as meta.json's `optimizer` records them, for resume to compare. Left out:
    lr (the scheduler's) and the implementation switches; weight_decay is the largest group's, the rest the first's."""
    found = {}
    for group in param_groups:
        for key, value in group.items():
            value = list(value) if isinstance(value, tuple) else value
            parts = value if isinstance(value, list) else [value]
            if key in NOT_HYPERPARAMETERS or not all(isinstance(v, PLAIN) and not (
                    isinstance(v, float) and not math.isfinite(v)) for v in parts):  # what JSON writes and reads back
                continue
            found[key] = max(found.get(key, value), value) if key == "weight_decay" else found.get(key, value)
    return found


def root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def is_complete(path: str) -> bool:
    """A real directory `step-N` with meta.json. A symlink is never one: pruning would delete through it."""
    return STEP_DIR.match(os.path.basename(os.path.normpath(path))) is not None and \
        real_dir(path) and os.path.isfile(os.path.join(path, "meta.json"))


def real_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(os.path.normpath(path))


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first. Temporary and half-written ones are ignored, and
    so is a symlink (is_complete)."""
    base = root(output_dir)
    if not os.path.isdir(base):
        return []
    found = []
    for name in os.listdir(base):
        m = STEP_DIR.match(name)
        if m and is_complete(os.path.join(base, name)):
            found.append((int(m.group(1)), os.path.join(base, name)))
    return sorted(found)


def latest(output_dir: str) -> Optional[str]:
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def start_write(output_dir: str, step: int, ctx: DistContext, start_files: Callable[[str], Callable[[], None]],
                meta: dict) -> "PendingWrite":
    """Collective: every rank calls it. `start_files(tmp_dir)` starts writing this rank's files (sharded strategies
    write their own pieces) and returns a wait() that returns once they are written; with train.async_save,
    training goes on meanwhile. PendingWrite.finish() (collective too) waits for every rank, then rank 0 makes
    everything durable, writes meta.json and renames the directory into place. After each part every rank learns
    whether any rank failed, so none waits forever for a failed one: all of them raise (a full disk: one line;
    the temporary directory is removed and the earlier checkpoints are untouched)."""
    final = os.path.join(root(output_dir), f"step-{step}")
    tmp = broadcast_object(ctx, os.path.join(root(output_dir), f".tmp-step-{step}-{uuid.uuid4().hex[:8]}"))

    def make_tmp():
        if ctx.is_main:
            os.makedirs(tmp)

    waits = []
    _on_every_rank(ctx, make_tmp, final, tmp)
    _on_every_rank(ctx, lambda: waits.append(start_files(tmp)), final, tmp)
    return PendingWrite(ctx, final, tmp, waits[0], meta)


class PendingWrite:
    def __init__(self, ctx: DistContext, final: str, tmp: str, wait: Callable[[], None], meta: dict):
        self.ctx, self.final, self.tmp, self.wait, self.meta = ctx, final, tmp, wait, meta

    def finish(self) -> str:
        def publish():
            if self.ctx.is_main:
                _publish(self.tmp, self.final, self.meta)
        _on_every_rank(self.ctx, self.wait, self.final, self.tmp)
        _on_every_rank(self.ctx, publish, self.final, self.tmp)
        return self.final


def finite_json(value):
    """`value` with every NaN or infinite float replaced by None, so that it is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _publish(tmp: str, final: str, meta: dict) -> None:
    # Rank 0 makes every rank's finished files durable; meta.json goes last, holding each file's size and hash so
    # that a load can tell when one changed (checkpoint_io.verify).
    # A NaN dev loss (a diverged evaluation) is written as null: the reader takes strict JSON only (checkpoint_meta).
    meta = {**finite_json(meta), "files": checkpoint_hashes.record(tmp)}
    secret = checkpoint_signing.key(meta.get("config") or {})
    if secret:  # over meta.json's content, the files' hashes included (checkpoint_signing.py)
        meta["signature"] = checkpoint_signing.signature(meta, secret)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2, allow_nan=False)
    if not os.path.lexists(final):
        durable_rename(tmp, final)
        return
    # The same step saved again (a stop right after a resume). The new folder is on disk before the old one moves
    # aside, so a crash between the two renames leaves REPLACED_DIR, which run_dir.clean_stale puts back.
    make_durable(tmp)
    old = os.path.join(os.path.dirname(final), f".tmp-{os.path.basename(final)}-replaced-{uuid.uuid4().hex[:8]}")
    os.rename(final, old)
    os.rename(tmp, final)
    fsync(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old) if real_dir(old) else os.unlink(old)  # a link, or a stray file of that name: the name only


def durable_rename(tmp: str, final: str) -> None:
    """Rename the finished folder `tmp` to `final` so that a power loss never leaves `final` with truncated or
    empty files: the OS may write the rename to disk before the data. So the folder is made durable first, and the
    parent fsynced after (the rename itself). Also used by export.py."""
    make_durable(tmp)
    os.rename(tmp, final)
    fsync(os.path.dirname(os.path.abspath(final)))


def make_durable(folder: str) -> None:
    """fsync every file in `folder`, then every directory (the names of the files in it)."""
    for path, _, files in os.walk(folder):
        for name in files:
            fsync(os.path.join(path, name))
    for path, _, _ in os.walk(folder, topdown=False):
        fsync(path)


def fsync(path: str) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_every_rank(ctx: DistContext, part: Callable[[], None], final: str, tmp: str) -> None:
    """Run this rank's `part` of writing checkpoint `final`, then raise on every rank if it failed on any."""
    error = None
    try:
        part()
    except Exception as e:
        error = e
    except BaseException as e:  # DCP's CheckpointException is one; Ctrl-C, a second signal, exit: leave at once
        if not isinstance(e, CheckpointException):
            raise
        error = e
    status = None
    if error is not None:
        status = disk_errors.write_status(ctx.rank, error, final, tmp)
        if status[1]:  # no space: let the error go (disk_errors.write_failed says why)
            error = None
    failed = [s for s in gather_objects(ctx, status) if s is not None]
    if failed:
        disk_errors.write_failed(ctx, failed, final, tmp)  # a full disk or a read-only file: one line, every rank
        raise error or RuntimeError(f"rank {failed[0][0]} failed while writing {final}")


def prune(output_dir: str, keep_last: int, keep: set[int]) -> list[int]:
    """Delete complete checkpoints older than the last `keep_last`, except the steps in `keep` (the best); returns
    the steps deleted.
    meta.json goes first, and that reaches the disk before anything else is deleted: a kill halfway leaves a
    directory that resume ignores (and the next run removes), never one that looks complete and cannot load.
    Only real directories are deleted (complete_checkpoints lists no symlink): never what a link points to."""
    found, deleted = complete_checkpoints(output_dir), []
    for step, path in found[:-keep_last] if keep_last else found:
        if step not in keep and real_dir(path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, "meta.json"))
            fsync(path)
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(step)
    # A delete that failed halfway (a file held open on NFS) is tried again at each prune, not left until the next
    # run starts (run_dir.clean_stale): a week of saves would keep a checkpoint's disk per failure, without a word.
    for path in half_deleted(output_dir, below=found[-1][0] if found else 0):
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def half_deleted(output_dir: str, below: int) -> list[str]:
    """The real `step-N` directories without meta.json under step `below` (the newest complete one): prunes that
    did not finish. A newer one is not a prune's, and is left alone."""
    base = root(output_dir)
    paths = [(STEP_DIR.match(name), os.path.join(base, name)) for name in os.listdir(base)] \
        if os.path.isdir(base) else []
    return [path for m, path in paths if m and int(m.group(1)) < below and real_dir(path) and not is_complete(path)]
