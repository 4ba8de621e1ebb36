"""Reading a checkpoint's files into a model and optimizer, whatever strategy and world size wrote them.

Loading never runs code from a checkpoint: `.pt` files go through torch.load(weights_only=True) (load_file), and
DCP folders through checkpoint_dcp.py. A checkpoint made for another model
fails in one line (fits_model). Optimizer state travels between strategies by parameter name. Before any of it is
read, every file is checked against the sizes and sha256 that meta.json records (verify, checkpoint_hashes.py).
"""
from __future__ import annotations

import contextlib
import os
import socket
import unicodedata
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, distribute_tensor

from core import checkpoint_hashes, checkpoint_signing, ema
from core.checkpoint_dcp import dcp_cause, dcp_model_state_dict
from core.checkpoint import hyperparameters, latest
from core.checkpoint_meta import differences, read as read_meta, saved_train
from core.distributed import DistContext, broadcast_object, gather_objects
from core.errors import CheckpointError, Unloadable, first_line, unreadable, warn_on_stderr
from core.model_parts import trained_names, trains_part
from core.optimizers import param_groups


def load_file(path: str, name: str, keys: tuple[str, ...] = ()):
    """torch.load with weights_only=True: loading a checkpoint never runs code from it. `keys`: the entries the
    loaded dict must have."""
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        raise Unloadable(f"{full}: missing from the checkpoint")
    if os.path.getsize(full) == 0:
        raise Unloadable(f"{full}: empty (0 bytes)")
    try:
        obj = torch.load(full, map_location="cpu", weights_only=True)
    except OSError as e:  # no permission, a failing disk: not the file's bytes (unreadable)
        raise unreadable(e, full) from None
    except Exception as e:  # truncated file, foreign pickle, ...
        raise Unloadable(f"{full}: cannot be loaded ({first_line(e)})") from None
    missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise Unloadable(f"{full}: cannot be loaded (no {', '.join(missing)} in it)")
    return obj


def verify(path: str, ctx: Optional[DistContext] = None, note: Optional[Callable[[str], None]] = None,
           cfg=None, meta: Optional[dict] = None) -> dict:
    """Before loading checkpoint `path`: raise Unloadable naming the first of its files that is missing, extra or
    not what meta.json recorded (checkpoint_hashes.py), or, with a signing key (checkpoint_signing.py), a missing
    or wrong signature. One whose files cannot be verified (no meta.json, an unreadable one, or one without the
    `files` record: an older version) is refused too, unless the config's allow_unverified: then it loads after
    one `note` (default: a line on stderr). With `ctx` it is collective: rank 0 reads meta.json and the files, the
    first rank of every other node checks its node's files by that record too (node_problem), every rank raises.
    `cfg`: the run's config (None: the defaults, and the environment's key). `meta`: meta.json as the caller read
    it (a resume: rank 0's), checked as it is, not read again. Returns meta.json as read for the check, so that
    nothing reads it again (with ctx, rank 0's on every rank; {} where there is none that can be read and
    allow_unverified loads it anyway)."""
    main = ctx is None or ctx.is_main
    config = cfg.to_dict() if cfg is not None else {}
    secret = checkpoint_signing.key(config)  # on every rank: a key file that cannot be read fails on all
    try:
        meta, found = _files_problem(path, secret, meta) if main else ({}, None)
    except CheckpointError as e:  # a file the machine cannot read (errors.unreadable): said on every rank
        meta, found = {}, ("problem" if isinstance(e, Unloadable) else "unreadable", str(e))
    if ctx is not None:  # every rank reads by the record rank 0 checked, none by its own meta.json
        meta, found = broadcast_object(ctx, (meta, found))
        found = found or node_problem(path, ctx, meta)
    kind, line = found or ("", "")
    if kind == "unreadable":
        raise CheckpointError(line)
    if kind == "problem" or (kind == "unverified" and not config.get("allow_unverified")):
        raise Unloadable(line if kind == "problem" else f"{line}; to load it anyway, set allow_unverified: true")
    if kind == "unverified" and main:
        (note or warn_on_stderr)(
            f"loading {path} unverified (allow_unverified: true): {line}")
    return meta


def node_problem(path: str, ctx: DistContext, meta: dict) -> Optional[tuple[str, str]]:
    """Collective: the first problem that the first rank of a node other than rank 0's finds in its node's files by
    rank 0's record `meta` (a node may hold its own copy: no shared file system), naming the host; None if none."""
    found = None
    if ctx.local_rank == 0 and not ctx.is_main and isinstance(meta.get("files"), dict):
        try:
            line = checkpoint_hashes.problem(path, meta["files"])
            found = ("problem", f"{line} (as rank {ctx.rank} on {socket.gethostname()} reads it)") if line else None
        except CheckpointError as e:  # a file this machine cannot read (errors.unreadable)
            found = ("problem" if isinstance(e, Unloadable) else "unreadable", str(e))
    return next((f for f in gather_objects(ctx, found) if f is not None), None)


def _files_problem(path: str, secret: Optional[bytes],
                   meta: Optional[dict] = None) -> tuple[dict, Optional[tuple[str, str]]]:
    """meta.json (`meta` where the caller read it; {} if it cannot be read) and ("problem", line), ("unverified",
    line) or None (all files as recorded, and signed where `secret`)."""
    if os.path.islink(os.path.normpath(path)):  # as checkpoint.is_complete: never a checkpoint of ours
        return {}, ("problem", checkpoint_hashes.linked_checkpoint_refused(path))
    if not os.path.isdir(path):
        return {}, None  # the loader names it
    try:
        link = checkpoint_hashes.first_symlink(path)  # refused even where allow_unverified would load the rest
    except OSError as e:
        raise unreadable(e, path) from None
    if link:
        return {}, ("problem", checkpoint_hashes.symlink_refused(link))
    newest = latest(path) or (latest(os.path.dirname(path)) if os.path.basename(path) == "checkpoints" else None)
    if meta is None and newest and not os.path.exists(os.path.join(path, "meta.json")):  # allow_unverified: no help
        return {}, ("problem", f"{path}: a folder of checkpoints, not one: name one of its step-N folders (the "
                               f"newest: {newest})")
    try:
        meta, why = (read_meta(path) if meta is None else meta), None
    except Unloadable as e:
        meta, why = None, f"its files cannot be verified: {e}"
    if meta is not None and meta.get("files") is None:
        why = f"{os.path.join(path, 'meta.json')}: holds no record of the files (`files`: an older version saved " \
              "it), so they cannot be verified"
    if secret is not None:  # a key set: nothing loads unsigned, allow_unverified or not
        wrong = why if meta is None else checkpoint_signing.problem(path, meta, secret)
        if wrong:
            return {}, ("problem", wrong)
    if why:
        return meta or {}, ("unverified", why)
    found = checkpoint_hashes.problem(path, meta["files"])
    return meta, (("problem", found) if found else None)


@contextlib.contextmanager
def fits_model(path: str, cfg, meta: dict):
    """Wrap the loading of `path` into this run's model (and optimizer): if the checkpoint was made for another
    model (a changed model.* setting, another preset or task), fail in one line that names the checkpoint, the
    first mismatch, and the settings that differ from the run that saved it, instead of PyTorch's long list.
    `meta`: its meta.json as verified."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, CheckpointException) as e:
        dcp_failed = isinstance(e, CheckpointException)
        cause = dcp_cause(e)
        if isinstance(cause, CheckpointError):  # from our DCP reader or planner: a refused pickle, ...
            raise cause from None
        mismatch = any(w in str(cause).lower() for w in ("state_dict", "size mismatch", "mismatch sizes",
                                                          "missing key", "unexpected key"))
        if isinstance(cause, OSError):  # a shard the machine cannot read, or one gone (unreadable)
            raise unreadable(cause, path) from None
        if dcp_failed and not mismatch:  # DCP could not read its own files: a missing or truncated shard, ...
            raise Unloadable(f"{path}: cannot be loaded ({first_line(cause)})") from None
        if isinstance(cause, RuntimeError) and not mismatch:
            raise  # not a mismatch (a failing collective, say): keep the original error
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        details = lines[1:] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[:1]
        what = (details[0] if details else type(cause).__name__)[:160]
        more = f" (+{len(details) - 1} more)" if len(details) > 1 else ""
        raise CheckpointError(f"{path}: does not fit this model: {what}{more}{_settings_changed(cfg, meta)}") \
            from None


@contextlib.contextmanager
def configured_hyperparameters(optimizer: torch.optim.Optimizer, saved: Optional[dict], changes: list[str]):
    """Around a strategy's load: this run's optimizer hyperparameters (momentum, betas, weight decay, ...: what its
    groups held before) apply after it, as under every strategy (optimizer.load_state_dict would keep the saved
    ones; fsdp and pipe keep this run's groups). `changes` gets "momentum 0.9 -> 0.5" for each one that differs
    from the saved run's (`saved`: meta.json's `optimizer`; an older checkpoint: what the load brought back)."""
    configured = [{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
                  for group in optimizer.param_groups]
    yield
    loaded = hyperparameters(optimizer.param_groups)
    for group, values in zip(optimizer.param_groups, configured):
        group.update(values)
    was = saved if saved is not None else loaded
    now = hyperparameters(optimizer.param_groups)
    changes += [f"{key} {was[key]} -> {now[key]}" for key in sorted(now) if key in was and was[key] != now[key]]


def _settings_changed(cfg, meta: dict) -> str:
    """'; saved with model.hidden=128 (now 64)': the task and model.* settings that differ from the saving run
    (`meta`: its meta.json as verified; {} where none could be read)."""
    if cfg is None:
        return ""
    saved = meta.get("config")
    diffs = differences(saved if isinstance(saved, dict) else {}, cfg.to_dict(), ("task", "model"))
    return f"; it was saved with {', '.join(diffs)}" if diffs else ""


def load_model(model: torch.nn.Module, path: str, cfg=None, note=None, label_names=None,
               vocabulary_sha256=None) -> str:
    """The weights of any checkpoint (whatever strategy wrote it) into a plain model (generate.py); its files are
    verified first (one that cannot be is refused, or with cfg.allow_unverified loaded after a `note`; default: a
    line on stderr). Returns which weights it read: trained, or ema (load_verified)."""
    return load_verified(model, path, verify(path, note=note, cfg=cfg), cfg, label_names, vocabulary_sha256)


def load_verified(model: torch.nn.Module, path: str, meta: dict, cfg=None, label_names=None,
                  vocabulary_sha256=None) -> str:
    """load_model after verify(path) returned `meta`: test mode, predict and export take what they need (the step,
    the classes) from that record too, so that meta.json is read once and no second, unverified read is used.
    `label_names`, `vocabulary_sha256`: a classifier's classes and the task's vocabulary now (check_label_names,
    check_vocabulary). Returns which weights it read: trained, or ema (test.weights, weights_to_read)."""
    check_label_names(path, label_names, meta)
    check_vocabulary(path, vocabulary_sha256, meta)
    with fits_model(path, cfg, meta):
        load_state(model, model_state_dict(path), path, meta)
    weights = weights_to_read(path, cfg, meta)
    if weights == "ema":  # the average train.ema_decay kept, over the weights
        if not os.path.isfile(os.path.join(path, "ema.pt")):
            raise CheckpointError(f"test.weights is ema, but {path} holds no weight average (ema.pt): it was "
                                  "written without train.ema_decay")
        ema.load_into(model, load_file(path, "ema.pt"), path)
    return weights


def weights_to_read(path: str, cfg, meta: dict) -> str:
    """test.weights for this checkpoint (`meta`: its meta.json, as verify read it). auto: the weights whose dev
    scores picked the best, i.e. the average where its run picked by it (train.eval_ema, or a best_metric of the
    average such as ema_loss), as Lightning's weight averaging hands on the average; else the trained weights (and
    where no meta.json says how it picked: allow_unverified)."""
    asked = cfg.test.weights if cfg is not None else "trained"
    if asked != "auto":
        return asked
    if not os.path.isfile(os.path.join(path, "ema.pt")):
        return "trained"
    train = saved_train(meta)
    picked_by_average = train.get("eval_ema") is True or str(train.get("best_metric")).startswith("ema_")
    return "ema" if picked_by_average else "trained"


def why_average(cfg) -> str:
    """Why the weight average was read: asked for, or test.weights auto after a run that picked its best by it."""
    return "test.weights ema" if cfg.test.weights == "ema" else "test.weights auto: the run picked its best by it"


def check_label_names(path: str, names: Optional[list], meta: dict) -> None:
    """A classifier's outputs mean the classes it was trained on (meta.json `label_names`; `meta`: as read): data
    whose classes were renamed, added or reordered since would put every answer under another name, silently.
    Refused in one line."""
    if not names:  # not a classifier
        return
    saved = recorded_label_names(path, meta)
    if saved is None:  # written before the names were recorded, or unverified and allowed
        return
    # in one Unicode form: an older image_folder run recorded the `é` macOS wrote decomposed as it was on disk
    saved, now = composed(saved), composed([str(n) for n in names])
    if saved == now:
        return
    i = next(i for i in range(max(len(saved), len(now))) if i >= min(len(saved), len(now)) or saved[i] != now[i])
    was, named = (repr(side[i]) if i < len(side) else "nothing" for side in (saved, now))
    listed = ", ".join(saved)
    raise CheckpointError(f"{path}: trained on {len(saved)} classes, the data now names {len(now)}: output {i} was "
                          f"{was}, the data names {named}; give the data the classes it was trained on "
                          f"({listed if len(listed) <= 80 else listed[:77] + '...'}), or train again")


def composed(names: list) -> list:
    """Names in one Unicode form (NFC): `é` and e + U+0301 are one name."""
    return [unicodedata.normalize("NFC", n) for n in names]


def check_vocabulary(path: str, sha256: Optional[str], meta: dict) -> None:
    """The vocabulary read now (output_dir's tokenizer, or csv_text's vocabulary.json) is the one the checkpoint was
    trained with (meta.json `vocabulary_sha256`; `meta`: as read): another run's would read every input as other
    ids, silently."""
    if sha256 is None:  # inputs without a vocabulary
        return
    saved = meta.get("vocabulary_sha256")
    if saved is None or saved == sha256:  # (None: written before it was recorded)
        return
    raise CheckpointError(f"{path}: trained with another vocabulary than the one output_dir holds (its tokenizer, or "
                          f"csv_text's vocabulary.json): every input would be read as other ids; use the output_dir "
                          f"it was trained in, or train again")


def recorded_label_names(path: str, meta: dict) -> Optional[list[str]]:
    """A classifier's class names as its checkpoint records them (meta.json `label_names`, in output order; `meta`:
    as read); None where none are (not a classifier, classes known by number, written before they were recorded,
    no meta.json that can be read and allow_unverified)."""
    saved = meta.get("label_names")
    if saved is not None and (not isinstance(saved, list) or not all(isinstance(n, str) for n in saved)):
        raise Unloadable(f"{path}/meta.json: unreadable (`label_names` is not a list of names)")
    return saved


def load_state(model: torch.nn.Module, state: dict, path: str, meta: dict) -> None:
    """load_state_dict; under LoRA, after checking the base (`meta`: meta.json as verified) and that
    `state` holds exactly the entries that train, it loads them over the base's weights (non-strictly: the base is
    not in the file)."""
    if not trains_part(model):
        model.load_state_dict(state)
        return
    check_lora_checkpoint(model, path, meta)
    names = trained_names(model)
    if set(state) != names:
        odd = sorted(set(state) - names) or sorted(names - set(state))
        what = "holds" if set(state) - names else "lacks"
        raise CheckpointError(f"{path}: {what} {odd[0]} (+{len(odd) - 1} more): not the entries this LoRA run "
                              f"trains ({len(names)}); was it written with other model.lora_* settings?")
    model.load_state_dict(state, strict=False)


def check_lora_checkpoint(model: torch.nn.Module, path: str, meta: dict) -> None:
    """A checkpoint's adapters are read onto the base they were trained on: the same weights (by hash; the folder
    may have moved), else one line naming both. `meta`: meta.json as verified."""
    saved, now = meta.get("lora_base"), model.lora_base
    if not isinstance(saved, dict) or not isinstance(saved.get("sha256"), str):
        raise CheckpointError(f"{path}: holds no LoRA base reference (meta.json `lora_base`): it was not written by a "
                              "LoRA run; use it with model.lora_rank: 0")
    if saved["sha256"] != now["sha256"]:
        raise CheckpointError(f"{path}: its LoRA adapters were trained on {saved.get('pretrained_dir')} "
                              f"({saved.get('bytes')} bytes of weights, sha256 {saved['sha256'][:12]}), but "
                              f"model.pretrained_dir {now['pretrained_dir']} holds other weights ({now['bytes']} "
                              f"bytes, sha256 {now['sha256'][:12]}); point model.pretrained_dir at that base")


def model_state_dict(path: str) -> dict:
    """A plain `{name: tensor}` state dict from any checkpoint, whatever strategy wrote it."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.exists(os.path.join(path, "model.pt")) and os.path.isdir(os.path.join(path, "model_dcp")):
        return dcp_model_state_dict(os.path.join(path, "model_dcp"))
    return load_file(path, "model.pt")


# ---- from one strategy's checkpoint to another's: parameters and optimizer state by whole-model name ----------
# Replicated strategies index the optimizer's state 0, 1, ...; pipe keys it by name: names bridge the two.
def load_whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str, meta: dict) -> None:
    """A checkpoint of any strategy into a whole (replicated) model and its optimizer: model.pt and optimizer.pt,
    or pipe's and fsdp's DCP folders of shards keyed by whole-model names, assembled here in every rank; the
    optimizer state is then matched to this optimizer's parameters by name. `meta`: its meta.json as verified."""
    load_state(model, model_state_dict(directory), directory, meta)
    if not os.path.isdir(os.path.join(directory, "optimizer_dcp")):
        optimizer.load_state_dict(load_file(directory, "optimizer.pt"))
    else:
        by_name = dcp_model_state_dict(os.path.join(directory, "optimizer_dcp")).get("state", {})
        load_optimizer_by_name(optimizer, by_name, parameter_names(model), directory)


def replicated_order(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s parameters in the order a replicated optimizer.pt indexes them (param_groups'),
    first name of a tied weight: how a checkpoint of none/dp/ddp/oss is read by name."""
    names = parameter_names(model)
    return [names[id(p)][0] for g in param_groups(model, 0.0) for p in g["params"]]


def optimizer_state_by_name(path: str, order: list[str]) -> dict[str, dict]:
    """{parameter name: its optimizer state} from `path`'s optimizer.pt; `order`: the names of the parameters in
    the replicated optimizer's order. (A pipe checkpoint's optimizer_dcp/ is by name already.)"""
    saved = load_file(path, "optimizer.pt", keys=("state", "param_groups"))
    indices = [i for group in saved["param_groups"] for i in group["params"]]
    if len(indices) != len(order):
        raise CheckpointError(f"{path}/optimizer.pt: holds {len(indices)} parameters, this model has {len(order)}")
    name = dict(zip(indices, order))
    return {name[i]: state for i, state in saved["state"].items()}


def load_optimizer_by_name(optimizer: torch.optim.Optimizer, by_name: dict[str, dict],
                           names: dict[int, list[str]], path: str) -> None:
    """Load state keyed by parameter name into `optimizer`, whose parameters are known by `names` (id -> every
    name of that tensor: a tied weight has two, and the saving side may have used either). Wrappers that shard
    the state (OSS, ZeroRedundancyOptimizer) take this full dict and keep their own part."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, p in enumerate(params):
        found = [n for n in names[id(p)] if n in by_name]
        if not found:
            if by_name:  # state for some parameters but not this one: another model
                raise CheckpointError(f"{path}: no optimizer state for {names[id(p)][0]}")
            continue
        state[i] = {key: shard_like(value, p) for key, value in by_name[found[0]].items()}
    groups, start = [], 0
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def shard_like(value, param):
    """A whole tensor as `param` holds it: FSDP2's parameters (DTensors) hold a shard, cut here from the whole
    tensor every rank has read (no communication). Anything else (a step count, a plain tensor) as it is."""
    if isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def parameter_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> all its names in `model` (tied weights have several), first name first."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names
