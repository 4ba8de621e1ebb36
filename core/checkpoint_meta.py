"""A checkpoint's meta.json, read as data from disk, possibly edited or crafted (read): what
json.load may build is bounded, and every value a reader uses (a path built from it, a number printed or compared)
is checked before anyone does."""
from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Callable, Optional

from core import checkpoint
from core.checkpoint import STEP_DIR
from core.errors import Unloadable, unreadable, warn_on_stderr

META_REQUIRED = {"step": int, "state": dict}  # what resume and test mode read from meta.json without a default
META_OPTIONAL = {"config": dict, "vocabulary_sha256": str}  # read with .get(), then looked into or compared
META_MAX_BYTES = 16 << 20  # a real one is a few KB (it holds the config)
META_MAX_DEPTH = 32  # a real one nests 4 deep; deeper JSON makes json.load and any recursive reader overflow
MAX_COUNT = 2 ** 53  # steps, epochs, batches: far beyond any run, and exact as a float
STATE_COUNTS = ("epoch", "batch_in_epoch", "sample_in_epoch", "evals_without_improvement", "bad_steps")  # counters


def read(path: str) -> dict:
    """meta.json of checkpoint `path`, bounded in size and depth, with every value that is read checked (or
    Unloadable, naming the file and the key; a CheckpointError where the machine cannot read it: unreadable)."""
    full = os.path.join(path, "meta.json")
    try:
        if not stat.S_ISREG(os.lstat(full).st_mode):  # read before the files are checked: a FIFO would block open()
            raise Unloadable(f"{full}: unreadable (not a regular file: a symlink, FIFO, socket or device; a checkpoint "
                             "holds its own files only)")
        with open(full, "rb") as f:
            data = f.read(META_MAX_BYTES + 1)
    except FileNotFoundError:
        raise Unloadable(f"{path}: not a complete checkpoint (no meta.json)") from None
    except OSError as e:  # a failing disk or no permission stops the run: the content may be fine (unreadable)
        raise unreadable(e, full) from None
    if len(data) > META_MAX_BYTES:
        raise Unloadable(f"{full}: unreadable (larger than {META_MAX_BYTES >> 20} MiB; a real one is a few KB)")
    if _json_depth(data) > META_MAX_DEPTH:  # before json.load, whose recursion it would overflow
        raise Unloadable(f"{full}: unreadable (JSON nested deeper than {META_MAX_DEPTH} levels)")
    try:
        meta = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit number
        raise Unloadable(f"{full}: unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise Unloadable(f"{full}: unreadable (a JSON {type(meta).__name__}, not an object)")
    present = {k: t for k, t in META_OPTIONAL.items() if meta.get(k) is not None}
    for key, kind in {**META_REQUIRED, **present}.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            what = "missing" if key not in meta else f"not a{'n' if kind is int else ''} {kind.__name__}"
            raise Unloadable(f"{full}: unreadable (`{key}` is {what})")
    problem = _meta_problem(meta, os.path.basename(os.path.normpath(path)))
    if problem:
        raise Unloadable(f"{full}: unreadable ({problem})")
    return meta



def saved_train(meta: dict) -> dict:
    """The train section a checkpoint was saved with (meta.json's `config`, checked by read() to be an object);
    {} for one written without it."""
    return (meta.get("config") or {}).get("train") or {}


def best(output_dir: str, best_step: Optional[int]) -> tuple[Optional[str], bool]:
    """The checkpoint of step `best_step` (the best on dev), or the latest where that one is gone or unknown
    (best_recorded reads the step from the latest checkpoint's meta.json); and whether a best step's is gone."""
    last = checkpoint.latest(output_dir)
    if last is None:
        return None, False
    candidate = os.path.join(checkpoint.root(output_dir), f"step-{best_step}")
    if best_step is not None and checkpoint.is_complete(candidate):
        return candidate, False
    return last, best_step is not None


def best_recorded(output_dir: str, note: Optional[Callable[[str], None]] = None,
                  named_by: str = "test.checkpoint") -> Optional[str]:
    """The checkpoint the latest one records as best on dev (else the latest): what test, export, predict and
    generate read when no checkpoint is named. A best that is gone (deleted, or left incomplete) is said in one
    `note` (default: a line on stderr) before the latest stands in for it; `named_by`: how to name another."""
    last = checkpoint.latest(output_dir)
    best_step = read(last)["state"].get("best_step") if last else None
    path, gone = best(output_dir, best_step)
    if gone:
        (note or warn_on_stderr)(
            f"the best checkpoint, step-{best_step} (as {os.path.basename(last)} records it), is gone from "
            f"{checkpoint.root(output_dir)}: reading the latest, {os.path.basename(last)}, instead (to read another: "
            f"{named_by})")
    return path


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _json_depth(data: bytes) -> int:
    """How deeply the JSON text `data` nests arrays and objects (brackets inside strings not counted)."""
    depth = deepest = 0
    for token in re.finditer(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]', data):
        t = token.group()
        if t in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif t in (b"]", b"}"):
            depth -= 1
    return deepest


def _count(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_COUNT


def _finite(value) -> bool:
    try:  # a 400-digit int is no float either
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        return False


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _meta_problem(meta: dict, name: str) -> str:
    """What is wrong with the values of a parsed meta.json whose checkpoint directory is called `name` ("" if
    nothing): each value is one the readers (resume, test and export mode, best(), the strategies) use."""
    step, state = meta["step"], meta["state"]
    m = STEP_DIR.match(name)
    if not _count(step):
        return f"`step` is {_shown(step)}, not a step number"
    if m and int(m.group(1)) != step:
        return f"`step` is {step} but the directory is {name}"
    if "step" in state and not (_count(state["step"]) and state["step"] == step):
        return f"`state.step` is {_shown(state['step'])} but `step` is {step}"  # the step a resume continues at
    for key in STATE_COUNTS:
        if key in state and not _count(state[key]):
            return f"`state.{key}` is {_shown(state[key])}, not a count from 0 to {MAX_COUNT}"
    if not isinstance(state.get("eval_due", False), bool):  # (a string would be true)
        return f"`state.eval_due` is {_shown(state['eval_due'])}, not true or false"
    best_step = state.get("best_step")
    if best_step is not None and not (_count(best_step) and best_step <= step):
        return f"`state.best_step` is {_shown(best_step)}, not a step of this run (0 to {step})"
    for key in ("best_value", "best_loss"):  # compared with each evaluation's (a string would fail at a tie)
        if state.get(key) is not None and not _finite(state[key]):
            return f"`state.{key}` is {_shown(state[key])}, not a finite number"
    ranked = state.get("best_k", [])
    if not (isinstance(ranked, list) and all(
            isinstance(r, list) and len(r) == 3 and _finite(r[0]) and (r[1] is None or _finite(r[1]))
            and _count(r[2]) and r[2] <= step for r in ranked)):
        return f"`state.best_k` is {_shown(ranked)}, not a list of [value, loss, step] of this run"
    kinds = {"metrics": dict, "format": str, "strategy": str, "batch_sizes": list, "signature": str}
    for key, kind in kinds.items():
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            return f"`{key}` is {_shown(meta[key])}, not a {kind.__name__}"
    if meta.get("world_size") is not None and not _count(meta["world_size"], low=1):
        return f"`world_size` is {_shown(meta['world_size'])}, not a number of processes"
    if meta.get("train_samples") is not None and not _count(meta["train_samples"]):  # (resume compares it)
        return f"`train_samples` is {_shown(meta['train_samples'])}, not a number of samples"
    if not all(_count(b) for b in meta.get("batch_sizes") or []):
        return f"`batch_sizes` is {_shown(meta['batch_sizes'])}, not a list of batch sizes"
    if meta.get("config") is not None and not isinstance(meta["config"].get("train", {}), dict):
        return "`config.train` is not an object"
    optimizer = meta.get("optimizer")
    if optimizer is not None and not (isinstance(optimizer, dict) and all(
            isinstance(k, str) and _plain(v) for k, v in optimizer.items())):
        return f"`optimizer` is {_shown(optimizer)}, not an object of hyperparameters (numbers, flags, lists)"
    return ""


def _plain(value) -> bool:
    """A value a hyperparameter holds and JSON writes back the same: a flag, a finite number, a short string,
    None, or a list of those."""
    if isinstance(value, list):
        return len(value) <= 8 and all(_plain(v) and not isinstance(v, list) for v in value)
    return value is None or isinstance(value, bool) or _finite(value) or (isinstance(value, str) and len(value) < 64)


# What changes a run's result, compared when a checkpoint is resumed (besides the global batch, which resume.py
# compares): settings that only change speed or memory are left out.
RESULT_SETTINGS = ("task", "seed", "model", "data")
NOT_RESULT = {"model.activation_checkpointing", "model.channels_last", "data.num_workers", "data.download"}


def differences(saved: dict, now: dict, keys: tuple[str, ...] = RESULT_SETTINGS,
                compared: Optional[tuple[dict, dict]] = None) -> list[str]:
    """["seed=1 (now 2)", "model.hidden=128 (now 64)"]: the settings among `keys` (a top-level key, or a whole
    section) where the config `saved` with a checkpoint differs from `now`. Keys the saved one lacks are skipped.
    `compared`: the two as compared, where not as written (a resume reads a null model key as what it builds,
    Task.model_built); the settings that differ there are shown as written (null, not the value built from it),
    except those written alike (model.heads null in both, under another model.name), unless only they differ."""
    found = _differing(*(compared or (saved, now)), keys)
    written = {name: (was, is_) for name, was, is_ in _differing(saved, now, keys)}
    if compared and any(name in written for name, _, _ in found):
        found = [(name, *written[name]) for name, _, _ in found if name in written]
    return [f"{name}={was!r} (now {is_!r})" for name, was, is_ in found]


def _differing(saved: dict, now: dict, keys: tuple[str, ...]) -> list[tuple[str, object, object]]:
    """(setting, saved value, value now) for each setting of differences()."""
    found = []
    for key in keys:
        if key not in saved:
            continue
        if isinstance(now[key], dict):
            was = saved[key] if isinstance(saved[key], dict) else {}
            found += [(f"{key}.{k}", was[k], v) for k, v in now[key].items()
                      if k in was and was[k] != v and f"{key}.{k}" not in NOT_RESULT]
        elif saved[key] != now[key]:
            found.append((key, saved[key], now[key]))
    return found
