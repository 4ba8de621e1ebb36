"""Replicated strategies: every rank holds the whole model and optimizer. `none` (one process), `dp` (DataParallel:
one process, several GPUs), `ddp` (DistributedDataParallel: one process per device, gradients all-reduced)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from core import checkpoint_io
from core.distributed import DistContext
from core.optimizers import make_scaler, optimizer_recipe
from strategies.async_save import start_save
from strategies.base import Strategy


class ReplicatedStrategy(Strategy):
    def start_save(self, directory: str):
        return start_save(self, directory)  # train.async_save: a writer thread

    def load(self, directory: str, meta: dict) -> None:
        """model.pt and optimizer.pt, or a pipe or fsdp checkpoint, into the whole model."""
        checkpoint_io.load_whole(self.raw_model, self.optimizer, directory, meta)


def apply_none(model: nn.Module, cfg, ctx: DistContext, task=None, train_set=None) -> Strategy:
    model = model.to(ctx.device)
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    return ReplicatedStrategy(model=model, raw_model=model, optimizer=cls(groups, **kwargs), ctx=ctx,
                              scaler=make_scaler(cfg, ctx))


def apply_dp(model: nn.Module, cfg, ctx: DistContext, task=None, train_set=None) -> Strategy:
    """DataParallel: one process scatters each batch over all local GPUs. Simple, but the GIL and the
    gather on GPU 0 make it slower than ddp; kept because it needs no launcher at all."""
    model = model.to(ctx.device)
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    wrapped = nn.DataParallel(model) if torch.cuda.device_count() > 1 and ctx.device.type == "cuda" else model
    return ReplicatedStrategy(model=wrapped, raw_model=model, optimizer=cls(groups, **kwargs), ctx=ctx,
                              scaler=make_scaler(cfg, ctx))


def apply_ddp(model: nn.Module, cfg, ctx: DistContext, task=None, train_set=None) -> Strategy:
    """DistributedDataParallel: one process per device, gradients all-reduced (summed: sum_gradients) in buckets
    during backward. The step itself is the base class's (strategies/base.py: Strategy.forward_backward). With
    dist.tp > 1: strategies/tp.py's apply_tp_ddp."""
    model = model.to(ctx.device)
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    # `model` runs the forward (here the DDP wrapper); `raw_model` is the module itself, which is saved
    return ReplicatedStrategy(model=ddp_wrap(model, ctx), raw_model=model, optimizer=cls(groups, **kwargs), ctx=ctx,
                              scaler=make_scaler(cfg, ctx))  # a loss scaler for fp16 only


def ddp_wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """The `model` of ddp and oss (GPU: device_ids names this rank's; CPU: none). Its hooks all-reduce the gradients
    in buckets while backward runs (sum_gradients); no_sync() keeps them local."""
    wrapped = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    wrapped.register_comm_hook(None, sum_gradients)  # None: all ranks
    return wrapped


def sum_gradients(group, bucket):  # (no annotations: DDP checks them, and this file's are strings)
    """DDP's all-reduce of one bucket (a dist.GradBucket) of gradients: a sum over the ranks (DDP's own averages).
    Each rank's loss is already divided by the global batch's count (Trainer.train_step): the sum is its mean."""
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])
