"""Checkpoint directories: `output_dir/checkpoints/step-N/`, written atomically, never overwritten in place.

A checkpoint is written into a hidden temporary directory and renamed to `step-N` only once every file is
there, with `meta.json` written last. So a crash (or a full disk) during a save leaves the previous checkpoints
untouched, and resume only ever sees complete ones. Files:
    model.pt, optimizer.pt   strategy-dependent (see strategies.Parallel.save); model.pt is a plain state dict
    model_dcp/, optimizer_dcp/  fsdp instead: sharded torch.distributed.checkpoint folders (docs/sharded.md)
    state.pt                 scheduler, grad scaler, RNG states of every rank
    meta.json                step, epoch and position inside it, metrics, best so far, config (human-readable)
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from typing import Callable, Optional

import torch

from config import CheckpointError
from distributed import DistContext, barrier, broadcast_object

STEP_DIR = re.compile(r"^step-(\d+)$")


def root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def is_complete(path: str) -> bool:
    return STEP_DIR.match(os.path.basename(os.path.normpath(path))) is not None and \
        os.path.isfile(os.path.join(path, "meta.json"))


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first. Temporary and half-written ones are ignored."""
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


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a complete checkpoint (no meta.json)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}/meta.json: unreadable ({e})") from None


def best(output_dir: str) -> Optional[str]:
    """The checkpoint the latest run recorded as best on dev (falls back to the latest checkpoint)."""
    last = latest(output_dir)
    if last is None:
        return None
    best_step = read_meta(last)["state"].get("best_step")
    candidate = os.path.join(root(output_dir), f"step-{best_step}")
    return candidate if best_step is not None and is_complete(candidate) else last


def write(output_dir: str, step: int, ctx: DistContext, write_files: Callable[[str], None], meta: dict) -> str:
    """Collective: every rank calls it. `write_files(tmp_dir)` runs on every rank (sharded strategies write
    their own pieces); rank 0 then writes meta.json and renames the directory into place."""
    final = os.path.join(root(output_dir), f"step-{step}")
    tmp = None
    if ctx.is_main:
        os.makedirs(root(output_dir), exist_ok=True)
        tmp = os.path.join(root(output_dir), f".tmp-step-{step}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
    tmp = broadcast_object(ctx, tmp)
    write_files(tmp)
    barrier(ctx)
    if ctx.is_main:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same step saved again (e.g. right after a resume): keep the old one
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, final)
    barrier(ctx)
    return final


def prune(output_dir: str, keep_last: int, keep: set[int]) -> None:
    """Delete complete checkpoints older than the last `keep_last`, except the steps in `keep` (the best)."""
    found = complete_checkpoints(output_dir)
    for step, path in found[:-keep_last] if keep_last else found:
        if step not in keep:
            shutil.rmtree(path, ignore_errors=True)


def load_file(path: str, name: str):
    """torch.load with weights_only=True: loading a checkpoint never runs code from it."""
    full = os.path.join(path, name)
    if not os.path.exists(full):
        raise CheckpointError(f"{full}: missing from the checkpoint")
    try:
        return torch.load(full, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, foreign pickle, ...
        raise CheckpointError(f"{full}: cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None


@contextlib.contextmanager
def fits_model(path: str, cfg=None):
    """Wrap the loading of `path` into this run's model (and optimizer): if the checkpoint was made for another
    model (a changed model.* setting, another preset or task), fail in one line that names the checkpoint, the
    first mismatch, and the settings that differ from the run that saved it, instead of PyTorch's long list."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except (RuntimeError, ValueError, KeyError, CheckpointException) as e:
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e  # DCP: per rank
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        if isinstance(cause, RuntimeError) and not any(
                w in str(cause) for w in ("state_dict", "size mismatch", "Missing key", "Unexpected key")):
            raise  # not a mismatch (a failing collective, say): keep the original error
        details = lines[1:] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[:1]
        what = (details[0] if details else type(cause).__name__)[:160]
        more = f" (+{len(details) - 1} more)" if len(details) > 1 else ""
        raise CheckpointError(f"{path}: does not fit this model: {what}{more}{_settings_changed(path, cfg)}") \
            from None


def _settings_changed(path: str, cfg) -> str:
    """'; saved with model.hidden=128 (now 64)': the task and model.* settings that differ from the saving run."""
    if cfg is None or not os.path.isfile(os.path.join(path, "meta.json")):
        return ""
    saved = read_meta(path).get("config") or {}
    now = cfg.to_dict()
    diffs = [f"task={saved['task']!r} (now {now['task']!r})"] if saved.get("task", now["task"]) != now["task"] else []
    diffs += [f"model.{k}={v!r} (now {now['model'][k]!r})" for k, v in (saved.get("model") or {}).items()
              if k in now["model"] and v != now["model"][k]]
    return f"; it was saved with {', '.join(diffs)}" if diffs else ""


def load_model(model: torch.nn.Module, path: str, cfg=None) -> None:
    """The weights of any checkpoint (whatever strategy wrote it) into a plain model: test mode, generate.py."""
    with fits_model(path, cfg):
        model.load_state_dict(model_state_dict(path))


def model_state_dict(path: str) -> dict:
    """A plain `{name: tensor}` state dict from any checkpoint, whatever strategy wrote it."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.exists(os.path.join(path, "model.pt")) and os.path.isdir(os.path.join(path, "model_dcp")):
        return dcp_model_state_dict(os.path.join(path, "model_dcp"))
    return load_file(path, "model.pt")


def dcp_model_state_dict(dcp_dir: str) -> dict:
    """Assemble the shards of a torch.distributed.checkpoint folder (fsdp) into one plain state dict, in this
    process, without a process group: its keys are the plain model's parameter names."""
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dcp_to_torch_save(dcp_dir, os.path.join(tmp, "model.pt"))
        except Exception as e:  # missing shard files, truncated metadata, ...
            raise CheckpointError(f"{dcp_dir}: cannot be read as a sharded checkpoint "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        return load_file(tmp, "model.pt")
