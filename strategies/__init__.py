"""How the model is spread over devices: `apply(model, cfg, ctx, task, train_set)` returns a `Parallel` (base.py),
the one object the Trainer talks to: forward and backward of a step's micro-batches, evaluation, the optimizer,
clipping, and saving and loading model and optimizer state.

One file per way, each readable on its own, imported only by the runs that use it:
  replicated.py  none, dp, ddp      every rank holds everything; DDP all-reduces gradients
  zero.py        oss                optimizer state (and gradients) sharded: ZeRO-1/2
  fsdp.py        fsdp               parameters too: ZeRO-3 (FSDP2, fairscale FSDP)
  pipeline.py    pipe               the layers cut into stages on different ranks, micro-batches flow through
  tp.py          dist.tp > 1        each block's matrices split over a tp group; composes with ddp, fsdp and pipe
  mesh.py        the device mesh (dp x tp, or pp x dp x tp) that tp and its partners share
  fp16.py        fp16 loss scaling when ranks hold different gradients; memory.py: the bytes a rank holds
  async_save.py  train.async_save for none, dp and ddp (a writer thread)
  activation_checkpointing.py  model.activation_checkpointing, applied before the strategy
"""
from __future__ import annotations

import importlib

from torch import nn

from distributed import DistContext
from strategies.base import Parallel

# -----> add a strategy: write apply_<name>(model, cfg, ctx, task, train_set) in a file here, list it below (and
# in config.DistConfig.strategy).
STRATEGIES: dict[str, str] = {
    "none": "strategies.replicated:apply_none",
    "dp": "strategies.replicated:apply_dp",
    "ddp": "strategies.replicated:apply_ddp",
    "oss": "strategies.zero:apply_oss",
    "fsdp": "strategies.fsdp:apply_fsdp",
    "pipe": "strategies.pipeline:apply_pipe",  # with dist.tp > 1 too: it splits each stage itself
    "ddp+tp": "strategies.tp:apply_tp_ddp",  # dist.tp > 1: tp first, then ddp or fsdp over the mesh's "dp"
    "fsdp+tp": "strategies.tp:apply_tp_fsdp",
}


def apply(model: nn.Module, cfg, ctx: DistContext, task, train_set) -> Parallel:
    """cfg.dist.strategy's apply_<name>() on the plain model (on the CPU: each strategy places it), after
    activation checkpointing (model.activation_checkpointing), whose blocks the strategy then wraps."""
    if cfg.model.activation_checkpointing:
        from strategies.activation_checkpointing import apply_ac
        apply_ac(model, cfg.task)
    key = cfg.dist.strategy + ("+tp" if cfg.dist.tp > 1 and cfg.dist.strategy in ("ddp", "fsdp") else "")
    module, name = STRATEGIES[key].split(":")
    return getattr(importlib.import_module(module), name)(model, cfg, ctx, task, train_set)
