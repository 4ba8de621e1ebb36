"""One `apply_<strategy>()` function per way of spreading the model over devices, chosen from `STRATEGIES`.

Each takes the plain model (already on its device) and a recipe for the optimizer, and returns a `Parallel`:
what the training step calls, the optimizer, how to skip gradient sync during accumulation, how to clip, and how
to save and load model and optimizer state. The Trainer only talks to `Parallel`, so a new strategy is one new
function here.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional

import torch
from torch import nn

from checkpoint import load_file
from distributed import DistContext


def optimizer_recipe(model: nn.Module, train_cfg) -> tuple[list[dict], type, dict]:
    """(param groups, optimizer class, kwargs). Weight decay applies to matrices only, not biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": train_cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    # -----> choose another optimizer here.
    if train_cfg.optimizer == "sgd":
        return groups, torch.optim.SGD, {"lr": train_cfg.lr, "momentum": 0.9}
    return groups, torch.optim.AdamW, {"lr": train_cfg.lr}


class Parallel:
    """A model prepared for a strategy. Defaults describe replicated strategies (none, dp, ddp): every rank
    holds the full state, and rank 0 alone writes it."""

    eval_lockstep = False  # True: every rank must run the same number of forward passes (sharded params)

    def __init__(self, model: nn.Module, raw_model: nn.Module, optimizer: torch.optim.Optimizer,
                 ctx: DistContext, scaler: Optional[torch.amp.GradScaler] = None):
        self.model, self.raw_model, self.optimizer, self.ctx, self.scaler = model, raw_model, optimizer, ctx, scaler

    def no_sync(self):
        """Context for accumulation micro-batches: gradients stay local until the last micro-batch."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (no-op for max_norm = inf) and return the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)

    # ---- checkpoints: files written into a checkpoint directory -----------------------------------------
    def save(self, directory: str) -> None:
        """Called on every rank; writes model.pt (a plain state dict) and optimizer.pt."""
        if self.ctx.is_main:
            torch.save(self.raw_model.state_dict(), os.path.join(directory, "model.pt"))
            torch.save(self.optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))

    def load(self, directory: str) -> None:
        self.raw_model.load_state_dict(load_file(directory, "model.pt"))
        self.optimizer.load_state_dict(load_file(directory, "optimizer.pt"))


def make_scaler(cfg, ctx: DistContext) -> Optional[torch.amp.GradScaler]:
    """Dynamic loss scaling, needed for fp16 only (bf16 has fp32's range)."""
    return torch.amp.GradScaler(ctx.device.type) if cfg.train.precision == "fp16" else None


def apply_none(model: nn.Module, cfg, ctx: DistContext) -> Parallel:
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    return Parallel(model, model, cls(groups, **kwargs), ctx, make_scaler(cfg, ctx))


def apply_dp(model: nn.Module, cfg, ctx: DistContext) -> Parallel:
    """DataParallel: one process scatters each batch over all local GPUs. Simple, but the GIL and the
    gather on GPU 0 make it slower than ddp; kept because it needs no launcher at all."""
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    wrapped = nn.DataParallel(model) if torch.cuda.device_count() > 1 and ctx.device.type == "cuda" else model
    return Parallel(wrapped, model, cls(groups, **kwargs), ctx, make_scaler(cfg, ctx))


class DDPParallel(Parallel):
    def no_sync(self):
        return self.model.no_sync()


def apply_ddp(model: nn.Module, cfg, ctx: DistContext) -> Parallel:
    """DistributedDataParallel: one process per device, gradients all-reduced (averaged) in buckets during
    backward. The Trainer scales the loss so that average is the mean over the global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    wrapped = DDP(model, device_ids=device_ids)
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    return DDPParallel(wrapped, model, cls(groups, **kwargs), ctx, make_scaler(cfg, ctx))


# -----> add a strategy: write apply_<name>() above and list it here (and in config.DistConfig.strategy).
STRATEGIES: dict[str, Callable[[nn.Module, object, DistContext], Parallel]] = {
    "none": apply_none,
    "dp": apply_dp,
    "ddp": apply_ddp,
}
