"""pipe: pipeline parallelism with torch.distributed.pipelining. See docs/pipeline.md.

The task lists its model as a chain of layers (`Task.pipeline_layers`): layer i's output is layer i+1's input.
The chain is cut into stages, one per rank of a pipeline (two with the interleaved schedules), and each rank
frees the parameters of the stages it does not hold. A batch is cut into micro-batches that flow through the
stages: while stage 1 computes micro-batch 0, stage 0 already computes micro-batch 1. The schedule (gpipe, 1f1b,
...) is the order in which each stage runs the forwards and backwards of its micro-batches.

Several pipelines (world size / (pp_stages x tp)) can train side by side, each on its own share of the global
batch, like DDP ranks. With dist.tp > 1 each stage's blocks are split over a tp group (strategies/tp.py's plan, on
the modules the stage holds). Rank layout: a ("pp", "dp", "tp") device mesh (strategies/mesh.py), rank = (stage x
pipelines + pipeline) x tp + tp_index. The replicas of one stage and their tp groups are neighbours, so on nodes of
pipelines x tp GPUs they share a node and the all-reduces (the heavy traffic) stay inside it; only activations
cross nodes, each rank sending to the rank of the next stage with its own pipeline and tp index.

What the Trainer sees is the usual `Strategy`, plus `step()` (forward + backward of one batch through the
schedule) and `eval_batch()`; everything about stages stays in this file.
"""
from __future__ import annotations

import fnmatch
import math
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from core import checkpoint_io, distributed
from core.checkpoint_dcp import dcp_load
from core.distributed import DistContext
from core.rank_timing import left_as_it_was, synchronize, time_forward_backward
from core.errors import DataError
from core.model_parts import averaged_entries
from data_loader import split_proportional
from strategies import mesh as meshes
from core.optimizers import optimizer_recipe
from strategies.base import Strategy
from strategies.fp16 import sharded_scaler
from strategies.fsdp import clip_mixed, fsdp2_policy, local, need_dcp_folders, state_in_dcp_boxes, sum_over_replicas
from strategies.tp import (TaskWithPlainLosses, sum_grads, loss_context, parallelize_keeping_frozen,
                           sum_partial_grads, task_plan)

# Schedules by the names users know them. The interleaved ones hold two smaller stages per rank ("looped": rank
# r holds stages r and r + pp_stages) and so need twice as many layers.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "zero_bubble": "ScheduleInterleavedZeroBubble"}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}


def check_config(cfg, world: int, fail) -> int:
    """The pipe settings fit the world size and the batch; returns the number of pipelines."""
    d, t = cfg.dist, cfg.train
    if t.compile or cfg.model.activation_checkpointing:
        fail("train.compile" if t.compile else "model.activation_checkpointing",
             "is not available with dist.strategy: pipe (its stages run the layers themselves)")
    if d.pp_stages < 1 or world % (d.pp_stages * d.tp):
        fail("dist.pp_stages", f"is {d.pp_stages}; it must divide the world size ({world} processes"
                               f"{f' / dist.tp {d.tp}' if d.tp > 1 else ''}) into pipelines")
    if d.pp_microbatches < 1:
        fail("dist.pp_microbatches", f"must be >= 1, got {d.pp_microbatches}")
    if d.pp_schedule != "gpipe" and d.pp_microbatches < d.pp_stages:
        fail("dist.pp_microbatches", f"must be >= dist.pp_stages ({d.pp_stages}) for {d.pp_schedule}, got "
                                     f"{d.pp_microbatches}")
    if d.pp_schedule in ("interleaved_1f1b", "zero_bubble") and d.pp_microbatches % d.pp_stages:
        fail("dist.pp_microbatches", f"must be a multiple of dist.pp_stages ({d.pp_stages}) for {d.pp_schedule}, "
                                     f"got {d.pp_microbatches}")
    if not d.reshard_after_forward and d.pp_dp != "fsdp":
        fail("dist.reshard_after_forward", "is read under pipe with dist.pp_dp: fsdp only (ddp keeps each stage "
                                           "whole), where it would do nothing; remove it")
    pipelines = world // (d.pp_stages * d.tp)
    if d.pp_schedule == "zero_bubble" and d.pp_dp == "fsdp" and pipelines > 1:
        # (its backward split in two under FSDP2 ended ~1e-3 away from one process, the CNN's and the LMs', silently)
        fail("dist.pp_schedule", "zero_bubble with dist.pp_dp: fsdp over several pipelines does not train as one "
                                 "process does; use interleaved_1f1b, or dist.pp_dp: ddp")
    if t.batch_size == "auto" and d.pp_dp == "fsdp" and pipelines > 1:
        fail("train.batch_size", "auto under pipe needs dist.pp_dp: ddp (fsdp replicas compute in lockstep, so "
                                 "no pipeline's own speed can be measured); give one size per pipeline")
    g, m = t.global_batch_size, d.pp_microbatches
    if t.batch_size == "auto" and g is not None and (g % m or g < pipelines * m):
        fail("train.global_batch_size", f"is {g}; with batch_size auto under pipe it must be a multiple of "
                                        f"dist.pp_microbatches={m}, at least {pipelines} x {m} (a micro-batch "
                                        "set per pipeline)")
    sizes = t.batch_size if isinstance(t.batch_size, list) else [t.batch_size]
    if any(isinstance(b, int) and b % d.pp_microbatches for b in sizes):
        fail("train.batch_size", f"{t.batch_size} per pipeline: each must divide into dist.pp_microbatches="
                                 f"{d.pp_microbatches} equal micro-batches (a pipeline stage needs constant shapes)")
    split = d.pp_split
    if isinstance(split, str) and split not in ("even", "auto"):
        fail("dist.pp_split", f"must be even, auto or a list of layer counts per stage, got {split!r}")
    if isinstance(split, list):
        v = 2 if d.pp_schedule in ("interleaved_1f1b", "zero_bubble") else 1
        if len(split) != v * d.pp_stages or not all(isinstance(n, int) and n >= 1 for n in split):
            fail("dist.pp_split", f"must list {v * d.pp_stages} positive layer counts ({v} stage(s) per rank with "
                                  f"{d.pp_schedule}), got {split}")
    return pipelines


class Stage(nn.Module):
    """A run of consecutive layers of the chain, called as one module by the pipeline."""

    def __init__(self, layers: list[nn.Module], slowdown: float = 1.0):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.slowdown = slowdown  # dist.simulate_slowdown of this rank
        self.shapes_pass_next = False  # set before the schedule's first step (PipeStrategy.step)

    def forward(self, *carry):
        if self.shapes_pass_next:
            # torch's schedule first runs each stage once to learn the shapes passed between stages (past the first
            # stage, on uninitialised memory); in eval mode it adds nothing to BatchNorm's statistics, draws nothing.
            self.shapes_pass_next, training = False, self.training
            self.eval()
            try:
                return self.forward(*carry)
            finally:
                self.train(training)
        start = time.perf_counter()
        for layer in self.layers:
            carry = layer(*carry)
            carry = carry if isinstance(carry, tuple) else (carry,)
        if self.slowdown > 1 and torch.is_grad_enabled():
            if carry[0].is_cuda:
                torch.cuda.synchronize(carry[0].device)
            # A device `slowdown` times slower, simulated: the forward also waits for the backward's extra time
            # (backward ~ 2x forward). Busy, not asleep, as in balance.py.
            end = time.perf_counter() + 3 * (self.slowdown - 1) * (time.perf_counter() - start)
            while time.perf_counter() < end:
                pass
        return carry if len(carry) > 1 else carry[0]


class PipeStrategy(Strategy):
    checkpoint_format = "sharded-pipe"  # DCP folders model_dcp/ and optimizer_dcp/ keyed by whole-model names
    resumes_from = ("sharded-pipe", "full", "sharded-dcp")  # full: a replicated strategy's model.pt and
    # optimizer.pt, by name; sharded-dcp: fsdp's folders, which hold the same names as pipe's

    pipelined = True
    replica = "pipeline"  # each pipeline reads its own share of the global batch
    drop_last = True  # a smaller last batch would change the shapes the stages expect

    def __init__(self, full_model: nn.Module, stages: dict[int, nn.Module], optimizer, cfg, ctx: DistContext,
                 mesh: meshes.Mesh, scaler, tied: list, unowned: set,
                 replicated_order: list, layers_per_stage: list[int], stage_params: list[int], aliases: dict):
        local = nn.ModuleList(stages.values())  # the unwrapped stages: what eval and train()/eval() modes see
        super().__init__(local, local, optimizer, ctx, scaler)
        d = cfg.dist
        self.full_model, self.stages, self.cfg, self.mesh = full_model, stages, cfg, mesh
        self.pp, self.pipelines = d.pp_stages, mesh["dp"].size()
        self.stage_rank, self.pipeline, self.tp_index = (mesh[n].get_local_rank() for n in ("pp", "dp", "tp"))
        self.n_stages = d.pp_stages * STAGES_PER_RANK[d.pp_schedule]
        # A forward is an all-gather over the replicas with pp_dp fsdp; with tp, a collective over the tp group.
        self.forward_is_collective = self.replicas_wait_for_each_other = d.pp_dp == "fsdp" and self.pipelines > 1
        self.replica_group = mesh["tp"].get_group() if d.tp > 1 else None
        # What the Trainer reads to share out the data (see trainer.train_step): each pipeline reads its own
        # share of the global batch; the gradient all-reduce sums over the pipelines.
        self.data_rank, self.data_shares = self.pipeline, self.pipelines
        self.reports = self.tp_index == 0  # a tp group computes one loss: one of its ranks reports it
        self.sums_by_hand = d.pp_dp == "ddp" and self.pipelines > 1  # (reduce_grads)
        self.counts_its_batch = self.stage_rank == 0 and self.reports  # one rank per pipeline counts its samples
        self.seed_offset = ctx.rank - self.tp_index  # a tp group draws the same dropout masks
        self.batch_multiple = d.pp_microbatches  # a pipeline's batch is cut into this many micro-batches
        self.tied = tied
        self.layers_per_stage, self.stage_params = layers_per_stage, stage_params  # what the plan shows
        self.replicated_order = replicated_order  # parameter names in a replicated optimizer.pt's order
        # A tied weight's other names -> its first (GPT-2's lm_head.weight -> transformer.wte.weight): under pp_dp
        # fsdp each stage's copy is its own object; the average and optimizer state name it as one process does.
        self.aliases = aliases
        # Whole-model names of this rank's tensors: checkpoints use them, so any layout (or one process) reads them.
        # Tensors that no layer holds (an unused head, say) are kept and saved by the first stage.
        mine = {id(t) for m in stages.values() for t in [*m.parameters(), *m.buffers()]}
        self.names = [k for k, v in full_model.state_dict(keep_vars=True).items()
                      if id(v) in mine or (k in unowned and self.stage_rank == 0)]
        self.loss_weight = 1.0
        self.first_shapes: Optional[dict] = None  # the first step's batch (check_shapes)
        pp_group = mesh["pp"].get_group()  # this rank's pipeline and tp index, one rank per stage
        # Imported here, not at the top: it loads TorchDynamo, 0.7-1 s in every rank of every run, pipe or not.
        from torch.distributed import pipelining
        pipe_stages = [pipelining.PipelineStage(stages[i], i, self.n_stages, ctx.device, group=pp_group)
                       for i in sorted(stages)]
        schedule_cls = getattr(pipelining, SCHEDULES[d.pp_schedule])
        if STAGES_PER_RANK[d.pp_schedule] == 1:
            pipe_stages = pipe_stages[0]
        # scale_grads=False: the loss is already summed and divided by the global count (see loss_fn).
        self.schedule = schedule_cls(pipe_stages, n_microbatches=d.pp_microbatches, loss_fn=self.loss_fn,
                                     scale_grads=False)
        self.is_last = self.n_stages - 1 in stages
        self.task = None

    def plan_lines(self) -> list[str]:
        d = self.cfg.dist
        per_rank = STAGES_PER_RANK[d.pp_schedule]

        def where(i: int) -> str:
            held = self.mesh.root.mesh[i % self.pp]  # the ranks of stage i: its pipelines x tp (neighbours)
            return f"ranks {int(held.min())}-{int(held.max())}" if held.numel() > 1 else f"rank {int(held)}"
        lines = [f"  pipe: {self.pipelines} pipeline(s) of {self.pp * d.tp} ranks, {self.n_stages} stages "
                 f"({per_rank} per rank), schedule {d.pp_schedule}, {d.pp_microbatches} micro-batches per batch, "
                 f"replicas synced by {d.pp_dp if self.pipelines > 1 else '-'}",
                 f"  layers per stage {self.layers_per_stage} ({d.pp_split} split), parameters per stage "
                 f"[{', '.join(f'{n / 1e6:.3g}M' for n in self.stage_params)}]: " + ", ".join(
                     f"stage {i} on {where(i)}" for i in range(self.n_stages)),
                 *meshes.plan_lines(self.mesh),
                 "  a stage's replicas and tp groups are neighbours (one node); inputs keep one shape every step "
                 "(text padded to data.max_length)"]
        return lines

    def loss_fn(self, output, target):
        loss = self.task.loss_from_output(output, target).float() * self.loss_weight
        return self.scaler.scale(loss) if self.scaler else loss

    def forward_backward(self, task, batches: list[dict], loss_weight, autocast) -> torch.Tensor:
        """Each batch through the schedule (forward and backward of all its micro-batches); dist.simulate_slowdown
        is applied per stage inside it. Returns the pipeline's summed loss on its last stage (0 elsewhere)."""
        total = sum((self.step(task, batch, loss_weight, autocast) for batch in batches),
                    torch.zeros((), device=self.ctx.device))
        self.reduce_grads()
        return total if self.reports else torch.zeros_like(total)

    def reduce_grads(self) -> None:
        """pp_dp ddp: each stage's replicas sum their gradients here, once per step, in one all-reduce over the "dp"
        dimension (FSDP did it during the last backward: shard_over_replicas); first, under sequence parallelism,
        the norms' gradients are summed over the tp group."""
        if self.cfg.dist.tp > 1:
            sum_partial_grads(self.raw_model.parameters())
        if self.sums_by_hand:
            sum_grads(self.raw_model.parameters(), self.mesh["dp"])

    def step(self, task, batch: dict, loss_weight: float, autocast) -> torch.Tensor:
        """Forward and backward of one batch through the schedule: this rank's stages, all micro-batches. Returns
        the summed loss of this pipeline's batch on its last stage (0 on the other ranks)."""
        # (dist.loss_parallel: the task's plain losses of DTensor logits)
        self.task, self.loss_weight = TaskWithPlainLosses(task), loss_weight
        if self.first_shapes is None:  # the first step: the schedule learns the stages' shapes first (Stage.forward)
            for stage in self.stages.values():
                stage.shapes_pass_next = True
        self.check_shapes(batch)
        if self.scaler:  # fp16: only the last stage scales a loss, but every rank's scaler unscales its gradients
            self.scaler.scale(torch.zeros((), device=self.ctx.device))  # (this sets up its scale, equal everywhere)
        losses = []
        args = task.pipeline_inputs(batch) if 0 in self.stages else ()
        target = task.pipeline_target(batch) if self.is_last else None
        with autocast(), loss_context(self.mesh):
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if not losses:
            return torch.zeros((), device=self.ctx.device)
        total = torch.stack([x.detach().float() for x in losses]).sum()
        if self.scaler:
            total = total / self.scaler.get_scale()
        return total / loss_weight

    def check_shapes(self, batch: dict) -> None:
        """A stage learns the shapes it receives on the first step and cannot take others later (the failure
        would be a size mismatch deep in gloo/NCCL). Every rank of a pipeline reads the same batch, so all of
        them stop here together with a message that says why."""
        shapes = {k: tuple(v.shape) for k, v in batch.items()}
        if self.first_shapes is None:
            self.first_shapes = shapes
        elif shapes != self.first_shapes:
            changed = ", ".join(f"{k} {self.first_shapes.get(k)} -> {s}" for k, s in shapes.items()
                                if self.first_shapes.get(k) != s)
            raise DataError(f"pipe: the batch shapes changed ({changed}); pipeline stages need the same shapes "
                            f"every step: give the task fixed-length inputs (data.max_length) and batch sizes "
                            f"divisible by dist.pp_microbatches")

    def sync_tied_grads(self) -> None:
        """A parameter used by layers of two stages (GPT-2's token embedding is also its output projection) has a
        copy on each stage's rank (two on one rank when pp_dp fsdp shards its stages apart): add up their gradients
        so all copies take the same update, as the one tensor would."""
        for group, copies, _ in self.tied:
            grads = [local(p.grad) for p in copies if p.grad is not None]  # (pp_dp fsdp: copies sharded alike)
            if not grads or (group is None and len(grads) == 1):
                continue
            total = sum(grads[1:], grads[0].clone())
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                g.copy_(total)

    def grad_norm(self, clip_to: float) -> torch.Tensor:
        """The global norm over all stages: each piece of a gradient counted once among the ranks of its stage,
        which hold it whole (ddp replicas, a tp group) or in pieces (tp-split, fsdp-sharded): strategies/fsdp.py's
        clip_mixed. A tied parameter counts on its first stage only (both copies are clipped)."""
        self.sync_tied_grads()  # here: once per optimizer step, after all accumulation batches
        second = {id(p) for _, copies, first in self.tied for p in (copies[1:] if first else copies)}
        return clip_mixed(list(self.raw_model.parameters()), clip_to, self.ctx,
                          holders=self.ctx.world_size // self.pp, uncounted=second)

    def share_buffers(self) -> None:
        """A stage's replicas (one per pipeline) take the first pipeline's buffers; the ranks of a tp group hold the
        same pieces of them."""
        if self.pipelines > 1:
            buffers = [local(b) for stage in self.stages.values() for b in stage.buffers()]
            distributed.broadcast_tensors(self.ctx, buffers, group=self.mesh["dp"].get_group())

    @torch.no_grad()
    def eval_batch(self, task, batch: dict, autocast) -> dict:
        """Forward only, one stage after the other (no micro-batches: evaluation has no backward to overlap, and
        its last batch may be smaller). The last stage computes the task's results; the other ranks return {}."""
        def run(i: int, inputs: tuple):
            with autocast():
                return self.stages[i](*inputs)
        carry = self.through_stages(task.pipeline_inputs(batch), run)
        if not (self.is_last and (self.reports or self.mesh.loss_parallel)):
            return {}
        with loss_context(self.mesh):  # every rank of the tp group takes part in a loss-parallel cross-entropy
            out = TaskWithPlainLosses(task).eval_from_output(carry[0] if len(carry) == 1 else carry, batch)
        return out if self.reports else {}

    def seconds_per_sample(self, task, batch: dict, steps: int, stop_reason=lambda: None) -> float:
        """This rank's forward + backward seconds per sample through its own stages (train.batch_size auto).
        The stages' inputs travel once, as in eval_batch; then every rank times its stages alone, `steps` times
        after an untimed pass, without the schedule: a replica's gradient all-reduce would make every pipeline
        wait for the slowest. Gradients are dropped; dropout draws and buffers are left as they were; a stop signal
        (`stop_reason`) ends it (core/rank_timing.time_forward_backward)."""
        inputs = {}

        def run(i: int, carry: tuple):
            inputs[i] = carry  # what forward_backward times stage i on
            return self.stages[i](*carry)
        with torch.no_grad():
            self.through_stages(task.pipeline_inputs(batch), run)

        def forward_backward(_) -> float:
            start = time.perf_counter()
            for i, stage in self.stages.items():
                out = stage(*(c.detach().requires_grad_(c.is_floating_point()) for c in inputs[i]))
                out = out if isinstance(out, tuple) else (out,)
                torch.stack([o.float().sum() for o in out if o.is_floating_point()]).sum().backward()
            synchronize(self.ctx.device)
            return time.perf_counter() - start

        seconds = time_forward_backward(self, self.ctx, forward_backward, steps, stop_reason)
        return seconds / steps / len(next(iter(batch.values())))

    def through_stages(self, carry: tuple, run: Callable[[int, tuple], object]) -> tuple:
        """`carry` (a batch's pipeline_inputs) forward through this rank's stages in order, `run(i, inputs)` running
        stage i: its inputs come from the rank of stage i - 1, its outputs go to that of stage i + 1, unless this
        rank holds that stage too. The outputs of this rank's last stage."""
        for i in sorted(self.stages):
            if i > 0 and i - 1 not in self.stages:  # (one stage per pipeline, interleaved: all stages are here)
                carry = recv_tensors(self.rank_of(i - 1), self.ctx.device)
            out = run(i, carry)
            carry = out if isinstance(out, tuple) else (out,)
            if i < self.n_stages - 1 and i + 1 not in self.stages:
                send_tensors(carry, self.rank_of(i + 1))
        return carry

    def rank_of(self, stage: int) -> int:
        """The rank holding `stage` in this rank's pipeline, at this rank's tp index."""
        return int(self.mesh.root.mesh[stage % self.pp, self.pipeline, self.tp_index])

    # ---- checkpoints: every rank writes its own stages' tensors under whole-model names, nothing gathered ----
    def model_state(self) -> dict:
        full = self.full_model.state_dict()
        return {k: full[k] for k in self.names}

    def optimizer_state(self) -> dict:
        return get_optimizer_state_dict(self.full_model, self.optimizer)

    def averaged_entries(self) -> dict[str, torch.Tensor]:
        """train.ema_decay: what this rank's stages hold of the average's entries, by whole-model names (a list: the
        copies of a tied weight that pp_dp fsdp made of one parameter in two stages of this rank, averaged as one)."""
        mine = {id(t) for m in self.stages.values() for t in [*m.parameters(), *m.buffers()]}
        entries: dict[str, list] = {}
        for name, t in averaged_entries(self.full_model).items():
            if id(t) in mine:
                entries.setdefault(self.aliases.get(name, name), []).append(t)
        return {name: ts if len(ts) > 1 else ts[0] for name, ts in entries.items()}

    def parameter_names(self) -> dict[int, list[str]]:
        """id(parameter) -> its names in the whole model (checkpoint_io.parameter_names), a tied weight's copy's
        first name included: under pp_dp fsdp the copy is its own object, named by its own layer alone."""
        return {i: names + [self.aliases[n] for n in names if n in self.aliases]
                for i, names in checkpoint_io.parameter_names(self.full_model).items()}

    def save(self, directory: str) -> None:
        # state_in_dcp_boxes: tp's strided splits (GPT-2's q|k|v) as boxes DCP can write.
        dcp.save(state_in_dcp_boxes(self.model_state()), checkpoint_id=os.path.join(directory, "model_dcp"))
        # Only the per-parameter state: param_groups list this stage's names and differ between ranks (the
        # learning rate comes back with the scheduler).
        dcp.save({"state": state_in_dcp_boxes(self.optimizer_state()["state"])},
                 checkpoint_id=os.path.join(directory, "optimizer_dcp"))

    def load(self, directory: str, meta: dict) -> None:
        if os.path.isfile(os.path.join(directory, "model.pt")):  # written by none/dp/ddp/oss
            return self.load_replicated(directory)
        need_dcp_folders(directory, "pipe", "fsdp")
        swaps = []  # (a tp split in strides, its copy in boxes): DCP reads into the copy, copied back below
        # in place: parameters
        dcp_load(state_in_dcp_boxes(self.model_state(), swaps), os.path.join(directory, "model_dcp"))
        # A tied weight's copy reads the state saved under its first name, which every layout writes.
        state = {self.aliases.get(k, k): v for k, v in self.optimizer_state()["state"].items()}
        dcp_load({"state": state_in_dcp_boxes(state, swaps)}, os.path.join(directory, "optimizer_dcp"))
        for original, boxed in swaps:
            original.copy_(boxed)
        # By name into this run's groups (torch's set_optimizer_state_dict drops the hyperparameters of an empty
        # group that is not the last, as tp's split of the groups makes: KeyError 'weight_decay' at the next step).
        checkpoint_io.load_optimizer_by_name(self.optimizer, state, self.parameter_names(), directory)

    def load_replicated(self, directory: str) -> None:
        """A replicated checkpoint: each rank reads the whole model.pt and optimizer.pt and keeps its stages'
        tensors, found by name (the host briefly holds the whole model, as when it was built)."""
        whole = checkpoint_io.load_file(directory, "model.pt")
        mine = self.model_state()
        missing = [k for k in mine if k not in whole]
        if missing:
            raise KeyError(f"Missing key(s) in state_dict: {', '.join(missing[:3])}")
        with torch.no_grad():
            for k, t in mine.items():
                value = whole[k]
                if value.shape != t.shape:
                    raise RuntimeError(f"size mismatch for {k}: copying a param with shape {tuple(value.shape)} "
                                       f"from checkpoint, the shape in current model is {tuple(t.shape)}")
                t.copy_(checkpoint_io.shard_like(value, t))  # pp_dp fsdp: this replica's shard of it
        by_name = checkpoint_io.optimizer_state_by_name(directory, self.replicated_order)
        names = self.parameter_names()
        held = {n for p in self.raw_model.parameters() for n in names[id(p)]}
        checkpoint_io.load_optimizer_by_name(self.optimizer, {n: v for n, v in by_name.items() if n in held}, names,
                                             directory)


def send_tensors(tensors: tuple, dst: int) -> None:
    dist.send_object_list([[(t.shape, t.dtype) for t in tensors]], dst=dst)
    for t in tensors:
        dist.send(t.contiguous(), dst=dst)


def recv_tensors(src: int, device: torch.device) -> tuple:
    meta = [None]
    dist.recv_object_list(meta, src=src)
    out = []
    for shape, dtype in meta[0]:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src)
        out.append(t)
    return tuple(out)


def split_layers(n_layers: int, n_stages: int, split) -> list[int]:
    """Layers per stage: `even`, or the user's list."""
    if isinstance(split, list):
        if sum(split) != n_layers:
            raise DataError(f"dist.pp_split: {split} adds up to {sum(split)} layers but the task's model has "
                            f"{n_layers}")
        return list(split)
    if n_layers < n_stages:
        raise DataError(f"dist.pp_stages: the model has {n_layers} layers, too few for {n_stages} stages")
    return split_proportional(n_layers, [1] * n_stages, minimum=1)


def auto_split(layers: list[nn.Module], example: tuple, n_stages: int, cfg, ctx: DistContext) -> list[int]:
    """pp_split auto: every rank times forward + backward of each layer on one micro-batch (slowed by its
    dist.simulate_slowdown factor); stage s then runs on the slowest of its replicas, and the chain is cut so
    that the slowest stage is as fast as it can be (contiguous stages, minimising the maximum)."""
    factor = cfg.dist.simulate_slowdown[ctx.rank] if cfg.dist.simulate_slowdown else 1.0
    times = [math.inf] * len(layers)
    with left_as_it_was(nn.ModuleList(layers), ctx.device):  # timing trains nothing: no BatchNorm statistics
        measure(layers, example, times, factor, ctx.device)
    per_stage = ctx.world_size // n_stages  # a stage's ranks are neighbours: its replicas and their tp groups
    every = [None] * ctx.world_size
    dist.all_gather_object(every, times)
    cost = [[max(t[i] for t in every[s * per_stage:(s + 1) * per_stage]) for i in range(len(layers))]
            for s in range(n_stages)]
    return min_max_partition(cost)


def measure(layers: list[nn.Module], example: tuple, times: list[float], factor: float, device) -> None:
    """Fill `times` with each layer's forward + backward seconds (x factor), the fastest of three passes. One
    layer at a time goes to the device and back: the whole model may not fit there."""
    carry = example
    for i, layer in enumerate(layers):
        home = next((t.device for t in layer.parameters()), device)
        layer.to(device)
        for _ in range(3):  # the fastest of three: the first pays for allocations
            inputs = tuple(c.detach().requires_grad_(c.is_floating_point()) for c in carry)
            start = time.perf_counter()
            out = layer(*inputs)
            out = out if isinstance(out, tuple) else (out,)
            floats = [o for o in out if o.is_floating_point() and o.requires_grad]
            if floats:
                torch.stack([o.float().sum() for o in floats]).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i] = min(times[i], (time.perf_counter() - start) * factor)
        layer.zero_grad(set_to_none=True)
        layer.to(home)
        carry = tuple(o.detach() for o in out)


def min_max_partition(cost: list[list[float]]) -> list[int]:
    """Cut layers 0..n-1 into len(cost) contiguous non-empty runs; run s costs sum(cost[s][its layers]).
    Returns the run lengths minimising the largest run's cost (dynamic programming over cut points)."""
    p, n = len(cost), len(cost[0])
    best = [[math.inf] * (n + 1) for _ in range(p + 1)]  # best[s][i]: stages 0..s-1 take layers 0..i-1
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for s in range(1, p + 1):
        for i in range(s, n - (p - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], sum(cost[s - 1][j:i]))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(p, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return sizes[::-1]


def apply_pipe(model: nn.Module, cfg, ctx: DistContext, task, train_set) -> Strategy:
    """Build this rank's stages of the task's layer chain (build_stages), shard each over its replicas under pp_dp
    fsdp (shard_over_replicas), and make the Strategy: the optimizer over this rank's stages and the schedule."""
    d = cfg.dist
    mesh = meshes.pipe_mesh(ctx, d.pp_stages, d.tp)
    # The order in which a replicated optimizer lists the parameters, by name: reading its optimizer.pt needs it
    # (taken before freeing: the groups depend on the tensors' shapes).
    order = checkpoint_io.replicated_order(model)
    aliases = {n: names[0] for names in checkpoint_io.parameter_names(model).values() for n in names[1:]}
    stages, shared, unowned, split, stage_params = build_stages(model, cfg, ctx, task, train_set, mesh)
    shard_over_replicas(stages, cfg, mesh)
    # Both weight-decay groups always exist (one may be empty on a stage), so every rank's optimizer and the
    # scheduler saved by rank 0 have the same number of groups.
    groups, cls, kwargs = optimizer_recipe(nn.ModuleList(stages.values()), cfg.train, keep_empty=True)
    # FSDP replaced the objects, one per stage (one object for all of a rank's stages without FSDP)
    tied = [(group, list({id(p): p for p in (stages[i].get_parameter(name) for i, name in copies)}.values()), first)
            for group, copies, first in shared]
    return PipeStrategy(model, stages, cls(groups, **kwargs), cfg, ctx, mesh, sharded_scaler(cfg, ctx),
                        tied, unowned, order, split, stage_params, aliases)


def build_stages(model: nn.Module, cfg, ctx: DistContext, task, train_set, mesh: meshes.Mesh) -> tuple:
    """Cut the chain into stages (stage_sizes), keep this rank's (looped placement: stages r, r + pp_stages, ...),
    free the others' tensors, move what is kept to the device and split its blocks over "tp". Returns (this rank's
    stages by index, its tied parameters' (group, stage, name), the state-dict keys no layer holds, layers per
    stage, parameters per stage)."""
    d = cfg.dist
    stage_rank = mesh["pp"].get_local_rank()
    # -----> a task cuts its model into a chain of layers in Task.pipeline_layers (tasks/base.py).
    layers = task.pipeline_layers(model)
    n_stages = d.pp_stages * STAGES_PER_RANK[d.pp_schedule]
    sizes = stage_sizes(layers, n_stages, cfg, ctx, task, train_set)
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    chunks = [layers[s:s + n] for s, n in zip(starts, sizes)]
    factor = d.simulate_slowdown[ctx.rank] if d.simulate_slowdown else 1.0
    stages = {i: Stage(chunks[i], factor) for i in range(n_stages) if i % d.pp_stages == stage_rank}
    shared = tied_groups(chunks, stages, mesh)
    covered = {id(t) for chunk in chunks for layer in chunk for t in [*layer.parameters(), *layer.buffers()]}
    unowned = {k for k, v in model.state_dict(keep_vars=True).items() if id(v) not in covered}
    # What each stage holds (a tied weight in each of its stages): the device memory its rank needs for them.
    stage_params = [sum(p.numel() for p in {id(p): p for layer in chunk for p in layer.parameters()}.values())
                    for chunk in chunks]
    free_other_stages(model, stages, unowned if stage_rank == 0 else set())  # the first stage keeps the unowned
    # The Trainer built the model on the CPU: only now, with the other stages emptied, does it go to the device,
    # so a GPU never holds more than its stages (the host held the whole model while it was built).
    model.to(ctx.device)
    if d.tp > 1:
        apply_stage_tp(model, stages, task, cfg, mesh)
    return stages, shared, unowned, sizes, stage_params


def stage_sizes(layers: list[nn.Module], n_stages: int, cfg, ctx: DistContext, task, train_set) -> list[int]:
    """Layers per stage: dist.pp_split even or a list (split_layers), or auto: timed on one micro-batch of the
    training set (auto_split)."""
    d = cfg.dist
    if d.pp_split != "auto":
        return split_layers(len(layers), n_stages, d.pp_split)
    if STAGES_PER_RANK[d.pp_schedule] != 1:
        raise DataError(f"dist.pp_split: auto needs one stage per rank (gpipe or 1f1b), not {d.pp_schedule}")
    mb = cfg.train.batch_size if isinstance(cfg.train.batch_size, int) else min(cfg.train.batch_size)
    mb //= d.pp_microbatches
    example = task.collate([train_set[i] for i in range(mb)])
    example = task.pipeline_inputs({k: v.to(ctx.device) for k, v in example.items()})
    return auto_split(layers, example, n_stages, cfg, ctx)


def tied_groups(chunks: list[list[nn.Module]], stages: dict[int, nn.Module], mesh: meshes.Mesh) -> list:
    """A parameter held by several stages (tied weights) has a copy in each (one object on a rank until FSDP
    shards each stage's apart): held on several stage ranks, it gets a process group per pipeline and tp index to add
    up the copies' gradients. Every rank builds every group, in the same order (new_group's rule). Returns this
    rank's tied parameters as (group or None: all its stages are on this rank, [(stage index, name inside that
    stage) of each copy here, in stage order], whether its first stage is here)."""
    rank_at = mesh.root.mesh  # rank_at[stage, pipeline, tp index]
    pp, pipelines, tp = rank_at.shape
    stage_rank, pipeline, tp_index = (mesh[n].get_local_rank() for n in ("pp", "dp", "tp"))
    holders: dict[int, list] = {}  # parameter id -> the stages that hold it, in order
    for i, chunk in enumerate(chunks):
        for layer in chunk:
            for p in layer.parameters():
                held = holders.setdefault(id(p), [])
                held.extend([i] if i not in held else [])
    shared = []
    for pid, held in holders.items():
        ranks, group = sorted({i % pp for i in held}), None
        if len(held) < 2:
            continue
        if len(ranks) > 1:
            for j, t in ((j, t) for j in range(pipelines) for t in range(tp)):
                new = dist.new_group([int(rank_at[r, j, t]) for r in ranks])
                group = new if (j, t) == (pipeline, tp_index) else group
        if stage_rank in ranks:
            copies = [(i, next(n for n, q in stages[i].named_parameters() if id(q) == pid)) for i in held
                      if i in stages]
            shared.append((group, copies, held[0] in stages))
    return shared


def free_other_stages(model: nn.Module, stages: dict[int, nn.Module], also_kept: set) -> None:
    """The parameters and buffers of the stages this rank does not hold become empty tensors (the state-dict
    keys in `also_kept` stay)."""
    kept = {id(t) for m in stages.values() for t in [*m.parameters(), *m.buffers()]}
    kept |= {id(v) for k, v in model.state_dict(keep_vars=True).items() if k in also_kept}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in kept:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def shard_over_replicas(stages: dict[int, nn.Module], cfg, mesh: meshes.Mesh) -> None:
    """pp_dp fsdp over several pipelines: FSDP2 shards each stage over its replicas ("dp"), in place. (pp_dp ddp
    wraps nothing: PipeStrategy.reduce_grads sums the replicas' gradients once per step. DDP would all-reduce at every
    micro-batch's backward, its forward being outside no_sync, adding up the earlier sums again.)"""
    d = cfg.dist
    if mesh["dp"].size() > 1 and d.pp_dp == "fsdp":
        policy = fsdp2_policy(cfg.train.precision)
        for stage in stages.values():
            sum_over_replicas(fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=d.reshard_after_forward,
                                          mp_policy=policy))


def apply_stage_tp(model: nn.Module, stages: dict[int, nn.Module], task, cfg, mesh: meshes.Mesh) -> None:
    """Tensor parallelism on this rank's stages: the task's plan (keyed on the whole model's module names, with
    wildcards) applied to the modules the stages hold, over the "tp" dimension; the other stages' are empty."""
    held = {id(m) for stage in stages.values() for m in stage.modules()}
    plan = task_plan(model, cfg, task, mesh)
    mine = {name: style for name, module in model.named_modules() if id(module) in held
            for key, style in plan.items() if fnmatch.fnmatchcase(name, key)}
    parallelize_keeping_frozen(model, mesh["tp"], mine)
