"""Tensor parallelism (dist.tp): each transformer block's matrix multiplications split over the ranks of a tp group,
as in Megatron-LM, with DTensor's parallelize_module.

In a block, q, k, v and the MLP's first layer are split by output columns (ColwiseParallel): every rank of the group
computes its own attention heads and its own slice of the MLP's hidden units from the same input. The attention
output projection and the MLP's second layer are split by input rows (RowwiseParallel): each rank multiplies its
slice, and one all-reduce adds up the partial results. So a block's forward costs two all-reduces (its backward four,
one per column-split layer), and each rank holds 1/tp of the block's matrices; embeddings, norms and heads stay
whole on every rank.
The task names the layers (Task.tp_plan). docs/mesh.md draws it.

Two options where the plan supports them (gpt2_lm: tasks/lm_models.tp_plan; BERT: sequence parallelism only,
tasks/text_common.bert_tp_plan). dist.sequence_parallel cuts the residual stream between the split matrices along
the positions (norms on 1/tp of them; the all-reduces become reduce-scatter + all-gather). dist.loss_parallel splits
the LM head by vocabulary and keeps its logits a DTensor, so the cross-entropy runs under DTensor's loss_parallel():
each rank holds logits for 1/tp of the vocabulary. Dropout on split data draws each rank's own masks (PerRankDropout).

tp composes with a data-parallel strategy over the mesh's other dimension: fsdp (FSDP2 shards over "dp",
strategies/fsdp.py) or ddp (DDPxTPStrategy below: gradients summed over "dp" after the step's last backward).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, loss_parallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from core.distributed import DistContext
from core.errors import ConfigError
from strategies import mesh as meshes
from core.optimizers import optimizer_recipe
from strategies.base import Strategy
from strategies.fp16 import sharded_scaler
from strategies.fsdp import FSDPStrategy, local, shard


def check_config(cfg, world: int, fail) -> int:
    """dist.tp fits the world size and the batch sizes; returns the number of tp groups (data-parallel replicas).
    (The strategies it composes with: core/config.DistConfig.check.)"""
    d, t = cfg.dist, cfg.train
    if world % d.tp:
        fail("dist.tp", f"is {d.tp}; it must divide the world size ({world} processes)")
    if t.batch_size == "auto" and d.strategy == "fsdp":  # ddp and pipe: balance.py times each tp group
        fail("train.batch_size", "auto is not available with fsdp x tp (fsdp's replicas compute in lockstep: no tp "
                                 "group's own speed can be measured); give one size per tp group, or use ddp")
    return world // d.tp


def apply_tp(model: nn.Module, cfg, ctx: DistContext, task) -> meshes.Mesh:
    """Split the model's blocks over tp groups (in place); returns the (dp, tp) mesh for the data-parallel
    strategy applied next."""
    mesh = meshes.build_mesh(ctx, cfg.dist.tp, cfg.dist.dp_replicate)
    parallelize_keeping_frozen(model, mesh["tp"], task_plan(model, cfg, task, mesh))
    return mesh


def parallelize_keeping_frozen(model: nn.Module, tp_mesh, plan: dict) -> None:
    """parallelize_module, and the parameters that were frozen (model.bias false's zeros) frozen again: torch's
    SequenceParallel registers each norm's parameters anew, trainable."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def task_plan(model: nn.Module, cfg, task, mesh: meshes.Mesh) -> dict:
    """The task's plan (Task.tp_plan), checked against dist.sequence_parallel and dist.loss_parallel, which the
    mesh then records (the start-up plan says them; loss_parallel decides the loss's context)."""
    d = cfg.dist
    mesh.sequence_parallel, mesh.loss_parallel = d.sequence_parallel, d.loss_parallel
    plan = task.tp_plan(model, d.tp)
    if d.sequence_parallel and not any(isinstance(style, SequenceParallel) for style in plan.values()):
        raise ConfigError(f"dist.sequence_parallel: the {cfg.task} task's tensor-parallel plan (Task.tp_plan) runs "
                          "no norm on sequence shards; use dist.sequence_parallel: false")
    if d.loss_parallel and not any(isinstance(style, ColwiseParallel) and not style.use_local_output
                                   for style in plan.values()):
        raise ConfigError(f"dist.loss_parallel: the {cfg.task} task's tensor-parallel plan (Task.tp_plan) keeps no "
                          "output split by vocabulary; use dist.loss_parallel: false")
    return plan


class PerRankDropout(ParallelStyle):
    """Dropout on data split over the tp group (each rank's own attention heads; under sequence parallelism its own
    positions) draws this rank's own masks, as one process draws a different mask for each piece; elsewhere the
    group shares one stream (Strategy.seed_offset), so replicated activations stay equal. Megatron's model-parallel
    RNG tracker without state of its own: entering the module's forward, every rank draws one integer from the
    shared stream (the same on all, so it advances alike) and seeds its stream with (integer, tp index); leaving
    (at the start of submodule `until`, whose output is whole again, or at the end) restores the shared stream.
    Nothing new to checkpoint, and activation checkpointing's recompute restores the shared stream first, so it
    draws the same masks. `inner`: the module's other style, applied first."""

    def __init__(self, inner: ParallelStyle | None = None, until: str | None = None):
        super().__init__()
        self.inner, self.until = inner, until

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        module = self.inner._apply(module, mesh) if self.inner else module
        shared = []  # the shared stream's state while this module's forward runs on the rank's own

        @torch.compiler.disable  # train.compile: streams are switched eagerly, between the compiled pieces
        def enter(*_):
            if module.training:  # evaluation draws nothing
                shared.append(own_stream(mesh))

        @torch.compiler.disable
        def leave(*_):
            if shared:
                for g, state in zip(generators(mesh.device_type), shared.pop()):
                    g.set_state(state)
        module.register_forward_pre_hook(enter)
        if self.until:
            module.get_submodule(self.until).register_forward_pre_hook(leave)
        module.register_forward_hook(leave, always_call=True)  # also when the forward raises
        return module


def own_stream(mesh) -> list:
    """Seed this rank's own stream from the shared one; returns the shared stream's state to restore."""
    base = int(torch.randint(2**48, ()))  # the CPU's stream, equal on the group's ranks: no device sync
    gens = generators(mesh.device_type)
    shared = [g.get_state() for g in gens]
    for g in gens:
        g.manual_seed(base * mesh.size() + mesh.get_local_rank())  # distinct from every other rank's
    return shared


def generators(device_type: str) -> list:
    """The generators dropout draws from: the CPU's and, on an accelerator, this rank's device's."""
    if device_type == "cpu":
        return [torch.default_generator]
    device = torch.get_device_module(device_type)
    return [torch.default_generator, device.default_generators[device.current_device()]]


class LossParallel:
    """dist.loss_parallel, for a Strategy on the mesh (ddp x tp, fsdp x tp): forward and backward run under
    loss_parallel(), which the cross-entropy of vocabulary-split logits needs, and the Trainer gets plain losses."""

    def forward_backward(self, task, *args):
        with self.loss_context():
            return super().forward_backward(TaskWithPlainLosses(task), *args)

    def eval_batch(self, task, *args):
        with self.loss_context():
            return super().eval_batch(TaskWithPlainLosses(task), *args)

    def loss_context(self):
        return loss_context(self.mesh)


def loss_context(mesh: meshes.Mesh):
    """loss_parallel() where the plan split the head by vocabulary (the loss's forward and backward run in it)."""
    return loss_parallel() if mesh.loss_parallel else contextlib.nullcontext()


class FSDPxTPStrategy(LossParallel, FSDPStrategy):
    """fsdp x tp: FSDP2 shards the split model over the mesh's dp dimension (strategies/fsdp.py)."""


class DDPxTPStrategy(LossParallel, FSDPStrategy):
    """ddp x tp. It shards nothing over dp: it subclasses FSDPStrategy for what DTensor parameters need (the mesh's
    data shares, clipping, DCP checkpoints any strategy reads, per-block compile). reduce_grads sums the
    gradients over dp in one all-reduce of a flat buffer, after the step's last backward (DDP cannot hold DTensors)."""
    replicas_wait_for_each_other = False  # nothing crosses dp before reduce_grads: each tp group can be timed alone

    def __init__(self, model: nn.Module, optimizer, ctx: DistContext, scaler, mesh: meshes.Mesh):
        super().__init__(model, model, optimizer, ctx, scaler, mesh)  # the mesh's roles; clipping: clip_mixed

    def no_sync(self):
        return contextlib.nullcontext()  # nothing is synced before reduce_grads anyway

    def reduce_grads(self) -> None:
        sum_partial_grads(self.raw_model.parameters())
        if self.data_shares > 1:
            sum_grads(self.raw_model.parameters(), self.mesh["dp"])


def sum_partial_grads(params) -> None:
    """Sequence parallelism: a norm's gradient on each rank is the sum over its own positions (a partial DTensor);
    summed over the tp group, every rank holds the whole gradient."""
    for p in params:
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=[Replicate()] * p.grad.device_mesh.ndim)


def sum_grads(params, dp) -> None:
    """Sum the gradients (this rank's pieces of them) over the `dp` mesh, in one all-reduce of a flat buffer."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp.get_group())
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


class TaskWithPlainLosses:
    """The task, with its losses and evaluation sums as plain tensors (the Trainer's sums and all-reduces): under
    loss_parallel, the cross-entropy of DTensor logits is a replicated DTensor."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return full_value(self.task.loss_sum(model, batch))

    def eval_batch(self, model: nn.Module, batch: dict) -> dict:
        return {k: full_value(v) for k, v in self.task.eval_batch(model, batch).items()}

    def loss_from_output(self, output, target) -> torch.Tensor:  # (pipe's last stage)
        return full_value(self.task.loss_from_output(output, target))

    def eval_from_output(self, output, batch: dict) -> dict:
        return {k: full_value(v) for k, v in self.task.eval_from_output(output, batch).items()}


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (differentiable), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---- tp first, then the data-parallel strategy over the mesh's dp dimension (wiring.STRATEGIES) ----------
def apply_tp_ddp(model: nn.Module, cfg, ctx: DistContext, task, train_set=None) -> Strategy:
    """ddp with dist.tp > 1: each replica is a tp group; gradients are summed over "dp" (DDPxTPStrategy)."""
    model = model.to(ctx.device)
    mesh = apply_tp(model, cfg, ctx, task)
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    return DDPxTPStrategy(model, cls(groups, **kwargs), ctx, sharded_scaler(cfg, ctx), mesh)  # ranks skip together


def apply_tp_fsdp(model: nn.Module, cfg, ctx: DistContext, task, train_set=None) -> Strategy:
    """fsdp with dist.tp > 1: the blocks split over "tp", then FSDP2 shards them over "dp" (2-D parameters)."""
    model = model.to(ctx.device)
    return shard(model, cfg, ctx, apply_tp(model, cfg, ctx, task), FSDPxTPStrategy)
