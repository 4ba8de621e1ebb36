"""Tensor parallelism (dist.tp): each transformer block's matrix multiplications split over the ranks of a tp group,
as in Megatron-LM, with DTensor's parallelize_module.

In a block, q, k, v and the MLP's first layer are split by output columns (ColwiseParallel): every rank of the group
computes its own attention heads and its own slice of the MLP's hidden units from the same input. The attention
output projection and the MLP's second layer are split by input rows (RowwiseParallel): each rank multiplies its
slice, and one all-reduce adds up the partial results. So a block's forward costs two all-reduces (its backward four,
one per column-split layer), and each rank holds 1/tp of the block's matrices; embeddings, norms and heads stay
whole on every rank.
The task names the layers (Task.tp_plan). docs/mesh.md draws it.

tp composes with a data-parallel strategy over the mesh's other dimension: fsdp (FSDP2 shards over "dp",
strategies/fsdp.py) or ddp (TPParallel below: gradients averaged over "dp" after the step's last backward).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from distributed import DistContext
from strategies import mesh as meshes
from strategies.base import Parallel, optimizer_recipe, sharded_scaler
from strategies.fsdp import FSDPParallel


def apply_tp(model: nn.Module, cfg, ctx: DistContext, task) -> meshes.Mesh:
    """Split the model's blocks over tp groups (in place); returns the (dp, tp) mesh for the data-parallel
    strategy applied next."""
    mesh = meshes.build_mesh(ctx, cfg.dist.tp, cfg.dist.dp_replicate)
    parallelize_module(model, mesh["tp"], task.tp_plan(model, cfg.dist.tp))
    return mesh


class TPParallel(FSDPParallel):
    """ddp x tp. Gradients accumulate locally over a step's micro-batches; reduce_grads then averages them over
    the dp dimension in one all-reduce of a flat buffer (DDP itself cannot hold DTensor parameters). Checkpoints:
    FSDPParallel's DCP folders, which any strategy and test mode read."""

    def __init__(self, model: nn.Module, optimizer, ctx: DistContext, scaler, mesh: meshes.Mesh):
        super().__init__(model, model, optimizer, ctx, scaler, mesh)  # the mesh's roles; clipping: clip_mixed

    def no_sync(self):
        return contextlib.nullcontext()  # nothing is synced before reduce_grads anyway

    def compile(self) -> None:
        Parallel.compile(self)

    def reduce_grads(self) -> None:
        if self.data_world == 1:
            return
        grads = [local(p.grad) for p in self.raw_model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.mesh["dp"].get_group())
        flat /= self.data_world
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (the same storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def clip_mixed(params: list, max_norm: float, ctx: DistContext) -> torch.Tensor:
    """Clip to (and return) the global gradient norm when parameters are held in different ways: split over a tp
    group, sharded by FSDP, or whole on every rank. Each rank adds up its local squares, each divided by the number
    of ranks that hold the same piece, and one all-reduce sums them."""
    square = torch.zeros((), device=ctx.device)
    for p in params:
        if p.grad is None:
            continue
        copies = ctx.world_size
        if isinstance(p.grad, DTensor):  # the ranks outside its mesh, and those along its Replicate dimensions
            m = p.grad.device_mesh
            copies = ctx.world_size // m.size() * math.prod(m.size(i) for i, pl in enumerate(p.grad.placements)
                                                             if pl.is_replicate())
        square += local(p.grad).detach().float().pow(2).sum() / copies
    dist.all_reduce(square)
    norm = square.sqrt()
    if not math.isinf(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                local(p.grad).mul_(coef.to(p.grad.dtype))
    return norm


def apply_tp_ddp(model: nn.Module, cfg, ctx: DistContext, task) -> Parallel:
    mesh = apply_tp(model, cfg, ctx, task)
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    return TPParallel(model, cls(groups, **kwargs), ctx, sharded_scaler(cfg, ctx), mesh)  # ranks skip together
