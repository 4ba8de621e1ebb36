"""oss: optimizer state sharded over ranks (ZeRO-1), and gradients too with dist.shard_grads (ZeRO-2), with
fairscale's OSS / ShardedDataParallel or PyTorch's ZeroRedundancyOptimizer. See docs/sharded.md."""
from __future__ import annotations

import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from torch import nn

from core.distributed import DistContext
from core.optimizers import make_scaler, optimizer_recipe
from strategies.base import Strategy
from strategies.replicated import ddp_wrap
from strategies.fp16 import sharded_scaler
from strategies.replicated import ReplicatedStrategy


class OSSStrategy(ReplicatedStrategy):
    """Optimizer state sharded over ranks (ZeRO-1; ZeRO-2 when gradients are sharded too). Each rank updates
    only the parameters it owns, then broadcasts them, so parameters stay whole and replicated. The model is
    DDP or fairscale's ShardedDataParallel: both have the no_sync() that Strategy.no_sync uses."""

    def grad_norm(self, clip_to: float) -> torch.Tensor:
        if isinstance(self.optimizer, OSS):  # grads may exist only on their owner: norm over shards, all-reduced
            return self.optimizer.clip_grad_norm(clip_to)
        return super().grad_norm(clip_to)  # ZeroRedundancyOptimizer: DDP grads are whole on every rank

    def save(self, directory: str) -> None:
        # Gather the optimizer shards on rank 0: optimizer.pt is then an ordinary state dict indexed over all
        # parameters, which any world size (and oss_impl) can load, every rank keeping its own part.
        if isinstance(self.optimizer, OSS):
            self.optimizer.consolidate_state_dict(recipient_rank=0)
        else:
            self.optimizer.consolidate_state_dict(to=0)
        super().save(directory)


def apply_oss(model: nn.Module, cfg, ctx: DistContext, task=None, train_set=None) -> Strategy:
    """Optimizer state sharding. fairscale OSS (default) with DDP gradients = ZeRO-1; with dist.shard_grads,
    fairscale ShardedDataParallel reduces each gradient to its owner only = ZeRO-2. dist.oss_impl: torch uses
    PyTorch's ZeroRedundancyOptimizer with DDP (ZeRO-1)."""
    model = model.to(ctx.device)
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    if cfg.dist.oss_impl == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer  # slow to import: oss_impl torch runs only
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)
    else:
        optimizer = OSS(groups, optim=cls, **kwargs)
    if cfg.dist.shard_grads:  # config.validate allows it with fairscale OSS only
        # No reduce buckets: bucketed gradients are views into ShardedDataParallel's buffers, which the trainer's
        # zero_grad(set_to_none=True) would detach, and the next step would reduce stale buffers. Unbucketed,
        # each gradient is reduced to its owner and freed elsewhere, which is also what saves the memory.
        wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=0)
        wrapped._world_size_scaling = 1.0  # summed over the ranks, as every strategy's (fairscale's averages)
        return OSSStrategy(wrapped, model, optimizer, ctx, sharded_scaler(cfg, ctx))
    return OSSStrategy(ddp_wrap(model, ctx), model, optimizer, ctx, make_scaler(cfg, ctx))


def check_config(cfg, fail) -> None:
    """dist.shard_grads, set (config.validate asks): fairscale's ShardedDataParallel under oss."""
    d = cfg.dist
    if d.strategy != "oss" or d.oss_impl != "fairscale":
        fail("dist.shard_grads", "needs dist.strategy: oss with dist.oss_impl: fairscale (PyTorch's "
                                 "ZeroRedundancyOptimizer shards optimizer state only; use fsdp to shard more)")
