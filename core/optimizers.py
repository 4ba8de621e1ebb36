"""The optimizer every strategy makes: train.optimizer by name (a torch.optim class, or one listed in OPTIMIZERS)
with the keyword arguments it gets, its parameter groups and kernel (optimizer_recipe), and fp16's loss scaler.

lr comes from train.lr, weight decay from train.weight_decay (per parameter group: param_groups), betas and
eps from train.betas / train.eps when they are set and the class takes them in that shape; the class's own
keywords come from train.optimizer_args; fused/foreach (train.optimizer_impl) only where the class accepts them.
Everything is checked when the config is read (check_config), so a wrong name or keyword is one line at start.
"""
from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from core.distributed import DistContext
from core.errors import ConfigError


# ---- The recipe the strategies share --------------------------------------------------------------------------
def optimizer_recipe(model: nn.Module, train_cfg, keep_empty: bool = False,
                     fused_ok: bool = True) -> tuple[list[dict], type, dict]:
    """(param groups, optimizer class, kwargs): train.optimizer by name (below). Weight decay
    applies to matrices only, not biases and norms. fused_ok=False: the caller's wrapper cannot run the fused
    kernel (train.optimizer_impl auto: foreach)."""
    groups = param_groups(model, train_cfg.weight_decay, keep_empty)
    params = [p for g in groups for p in g["params"]]
    # -----> another optimizer: train.optimizer names any torch.optim class (train.optimizer_args: its own
    # keywords); a hand-written one is listed in OPTIMIZERS (below) and must accept (param groups, lr=...,
    # its optimizer_args) and weight_decay, betas, eps, fused, foreach only if it implements them.
    cls = resolve(train_cfg.optimizer)
    # torch 2.13 has DTensor rules for the fused Adam/AdamW kernels only (not aten._fused_sgd_): FSDP2's sharded
    # parameters take foreach with the others (fused AdamW: tested under fsdp).
    if cls not in (torch.optim.Adam, torch.optim.AdamW) and any(isinstance(p, DTensor) for p in params):
        fused_ok = False
    if 0 < sum(isinstance(p, DTensor) for p in params) < len(params):
        # tp: split matrices are DTensors, the rest plain tensors; a foreach or fused kernel takes one kind at a
        # time, and it runs per parameter group.
        groups = [{**g, "params": [p for p in g["params"] if isinstance(p, DTensor) == dt]}
                  for g in groups for dt in (True, False)]
        groups = [g for g in groups if g["params"] or keep_empty]
    kernel = optimizer_kernel(train_cfg.optimizer_impl, params, fused_ok, cls)
    return groups, cls, {**arguments(cls, train_cfg), **kernel}


def param_groups(model: nn.Module, weight_decay: float, keep_empty: bool = False) -> list[dict]:
    """Weight decay for matrices, none for biases and norms. The order of the parameters here is the order of
    the optimizer's state in a replicated checkpoint (optimizer.pt indexes parameters 0, 1, ... in it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"] or keep_empty]


def optimizer_kernel(impl: str, params: list, fused_ok: bool = True, cls: type = torch.optim.AdamW) -> dict:
    """The optimizer's implementation switch (train.optimizer_impl) as the keyword arguments `cls` takes of fused
    and foreach. auto: fused where the device and the class have the kernel (PyTorch's own CPU default runs one
    small op per tensor, slower), else foreach where the class has it."""
    takes = keywords(cls)
    device_ok = all(p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
                    for p in params)
    if impl == "fused" and not (device_ok and fused_ok and "fused" in takes):
        where = (f"{cls.__name__}" if "fused" not in takes else
                 "this strategy's optimizer wrapper" if device_ok else f"device {params[0].device.type}")
        raise ConfigError(f"train.optimizer_impl: fused is not supported by {where}; use auto or foreach")
    if impl == "auto":
        impl = "fused" if device_ok and fused_ok and "fused" in takes else "foreach"
    return {k: v for k, v in {"fused": impl == "fused", "foreach": impl == "foreach"}.items() if k in takes}


def make_scaler(cfg, ctx: DistContext) -> Optional[torch.amp.GradScaler]:
    """Dynamic loss scaling, needed for fp16 only (bf16 has fp32's range)."""
    return torch.amp.GradScaler(ctx.device.type) if cfg.train.precision == "fp16" else None


# ---- train.optimizer by name: what it may name, and the check of its keywords ---------------------------------------
# -----> a hand-written optimizer: list it here by name (train.optimizer: MyOpt). It must be a
# torch.optim.Optimizer subclass whose __init__ takes the parameter groups first, then `lr` and the keywords of
# train.optimizer_args (and `weight_decay`, `betas`, `eps`, `fused`, `foreach` if it implements them).
OPTIMIZERS: dict[str, type] = {}

# Arguments that differ from torch's defaults unless optimizer_args says otherwise: plain SGD (momentum 0) rarely
# trains these models well.
DEFAULT_ARGS = {"SGD": {"momentum": 0.9}}

# Refused by name, with the reason: the Trainer's step() passes no closure and the gradients are dense.
REFUSED = {"LBFGS": "needs a closure that recomputes the loss at each step(); the Trainer's step has none",
           "SparseAdam": "takes sparse gradients only; these models' gradients are dense",
           "Muon": "takes 2-D parameters only, and every model here has biases and norms"}

# Keys train.* sets, which optimizer_args may not set again.
FROM_TRAIN = {"lr": "train.lr", "weight_decay": "train.weight_decay", "fused": "train.optimizer_impl",
              "foreach": "train.optimizer_impl", "params": "the model"}
TRAIN_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8}  # TrainConfig's; at these, each class keeps its own


def choices() -> dict[str, type]:
    """Every optimizer train.optimizer can name: torch.optim's classes, then OPTIMIZERS."""
    found = {name: cls for name, cls in vars(torch.optim).items()
             if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}
    return {**found, **OPTIMIZERS}


def resolve(name: str) -> type:
    """The class train.optimizer names, case-insensitively (`adamw` is AdamW); ValueError naming the choices."""
    table = choices()
    by_lower = {n.lower(): n for n in table}
    canonical = by_lower.get(str(name).lower())
    if canonical is None or canonical in REFUSED:
        usable = ", ".join(sorted(n for n in table if n not in REFUSED))
        why = f"{canonical} {REFUSED[canonical]}" if canonical in REFUSED else f"{name!r} is not a torch.optim class"
        raise ValueError(f"{why}; choose one of {usable}")
    return table[canonical]


def keywords(cls: type) -> dict:
    """{keyword: default} of cls.__init__, params left out."""
    return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()
            if n not in ("self", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def takes_from_train(cls: type, key: str) -> bool:
    """Whether cls takes train.betas (a pair of numbers) or train.eps (a number) as they are: Adafactor's eps is
    a pair, for one, which optimizer_args gives instead."""
    default = keywords(cls).get(key, inspect.Parameter.empty)
    if key == "betas":
        return isinstance(default, tuple) and len(default) == 2 and all(isinstance(d, float) for d in default)
    return isinstance(default, float)


def from_train(cls: type, t) -> dict:
    """lr, and betas/eps where set (not at TrainConfig's defaults) and the class takes them in that shape."""
    takes = keywords(cls)
    args = {"lr": t.lr} if "lr" in takes else {}
    for key, default in TRAIN_DEFAULTS.items():
        value = getattr(t, key)
        if value != default and takes_from_train(cls, key):
            args[key] = tuple(value) if key == "betas" else value
    return args


def arguments(cls: type, t) -> dict:
    """The keyword arguments the optimizer gets (fused/foreach apart): train.*'s, then optimizer_args'."""
    own = {k: tuple(v) if isinstance(v, list) else v for k, v in (t.optimizer_args or {}).items()}
    return {**from_train(cls, t), **DEFAULT_ARGS.get(cls.__name__, {}), **own}


def plan_line(optimizer, t) -> str:
    """The plan's line: the class and the arguments it got (betas/eps: the class's own where train.* left them),
    and its implementation. `optimizer`: the optimizer, or a sharding wrapper around it (OSS, ZeRO: .optim)."""
    inner = getattr(optimizer, "optim", optimizer)
    cls, used = type(inner), inner.defaults
    shown = {k: used[k] for k in ("lr", *TRAIN_DEFAULTS) if k in used and k in keywords(cls)}
    shown.update(arguments(cls, t))
    if "weight_decay" in keywords(cls):
        shown["weight_decay"] = f"{t.weight_decay:g} on matrices"
    impl = "fused" if used.get("fused") else "foreach" if used.get("foreach") else "for_loop"
    text = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    return f"optimizer {cls.__name__}({text}), {impl}"


def value_problem(value, default) -> str:
    """What is wrong with `value` for a keyword whose default in the class's signature is `default` ("" if
    nothing): a number must be a finite number (NaN would train to a NaN loss at step 1), a flag a flag, a
    tuple of numbers as many finite numbers."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if number(value) and not math.isfinite(value):
        return "not a finite number"
    if isinstance(default, bool):
        return "" if isinstance(value, bool) else "not true or false"
    if number(default) and value is not None:
        return "" if number(value) else "not a number"
    if isinstance(default, tuple) and default and all(number(d) or d is None for d in default):
        if not (isinstance(value, (list, tuple)) and len(value) == len(default)):
            return f"not a list of {len(default)} numbers"
        bad = [v for v in value if v is not None and not (number(v) and math.isfinite(v))]
        return f"holds {bad[0]!r}, not a finite number" if bad else ""
    return ""


def check_config(cfg, fail) -> None:
    """train.optimizer, train.optimizer_args, set (wiring.READER_CHECKS): the class exists and takes what it gets."""
    t = cfg.train
    try:
        cls = resolve(t.optimizer)
    except ValueError as e:
        fail("train.optimizer", str(e))
    takes, name = keywords(cls), cls.__name__
    for key, default in TRAIN_DEFAULTS.items():
        value = getattr(t, key)
        if value != default and not takes_from_train(cls, key):
            fail(f"train.{key}", f"is for adamw only and the optimizers that take it; {name} does not take it "
                 f"in that form: leave it at {default}" + (" (set its own eps in train.optimizer_args)"
                                                           if key in takes else ""))
    if t.weight_decay and "weight_decay" not in takes:
        fail("train.weight_decay", f"is {t.weight_decay:g} but {name} has no weight decay; set it to 0")
    own = t.optimizer_args or {}
    for key in own:
        if key in FROM_TRAIN or (key in TRAIN_DEFAULTS and takes_from_train(cls, key)):
            fail("train.optimizer_args", f"sets {key}, which comes from {FROM_TRAIN.get(key, 'train.' + key)}: "
                                         "set it there")
        if key not in takes:
            usable = ", ".join(k for k in takes if k not in FROM_TRAIN and not (
                k in TRAIN_DEFAULTS and takes_from_train(cls, k))) or "none"
            fail("train.optimizer_args", f"{key!r} is not a keyword of {name}; its keywords: {usable}"[:200])
        wrong = value_problem(own[key], takes[key])
        if wrong:
            fail(f"train.optimizer_args.{key}", f"is {own[key]!r}"[:80] + f": {wrong} ({name}'s default: "
                                                 f"{takes[key]!r})")
    if t.optimizer_impl in ("fused", "foreach") and t.optimizer_impl not in takes:
        fail("train.optimizer_impl", f"{t.optimizer_impl}: {name} has no such implementation; use auto")
    try:  # the values themselves: the class's own checks (a negative momentum, nesterov without momentum, ...)
        cls([torch.nn.Parameter(torch.zeros(2, 2))], **arguments(cls, t))
    except (ValueError, TypeError, RuntimeError) as e:
        fail("train.optimizer_args", f"{name} refuses them: {str(e).strip().splitlines()[0][:120]}")
