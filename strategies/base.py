"""What every strategy returns: a `Strategy`, the one object the Trainer talks to (the model as the strategy
wraps it, its optimizer and loss scaler, and how a step, an evaluation and a checkpoint go through them)."""
from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from core import distributed
from core.distributed import DistContext
from core.model_parts import averaged_entries, state_to_save


class Strategy:
    """A model prepared for a strategy. Defaults describe replicated strategies (none, dp, ddp): every rank
    holds the full state, and rank 0 alone writes it."""

    forward_is_collective = False  # True: every rank must run the same number of forward passes (sharded params)
    checkpoint_format = "full"  # recorded in meta.json
    resumes_from = ("full", "sharded-pipe", "sharded-dcp")  # the formats load() reads; others: refused in one line
    pipelined = False  # pipe: balance.py measures whole pipelines (strategies/pipeline.py)
    replicas_wait_for_each_other = False  # True: a forward waits for the others (sharded parameters): no auto batch
    replica_group = None  # ranks that time forward+backward together (a tp group: its forward is a collective)
    replica = "rank"  # what reads one share of the global batch: a rank, a pipeline (pipe), a tp group (tp)
    batch_multiple = 1  # a replica's batch is a multiple of this (pipe: its micro-batches)
    drop_last = False  # True: an epoch's smaller last batch is dropped (pipe: its stages need fixed shapes)

    def __init__(self, model: nn.Module, raw_model: nn.Module, optimizer: torch.optim.Optimizer,
                 ctx: DistContext, scaler: Optional[torch.amp.GradScaler] = None):
        # `model` runs the forward (under ddp, the DDP wrapper around raw_model); `raw_model` is what is saved.
        self.model, self.raw_model, self.optimizer, self.ctx, self.scaler = model, raw_model, optimizer, ctx, scaler
        # This rank reads share `data_rank` of `data_shares` of each global batch (under ddp: its rank, of the world
        # size). Every strategy sums the shares' gradients (replicated.sum_gradients), never averages them.
        self.data_rank, self.data_shares = ctx.rank, ctx.world_size
        # True: this rank's batch counts in the global count, its loss and results are reported; one rank per
        # replica (under ddp every rank; a tp group's first rank; a pipeline's first stage).
        self.counts_its_batch = True
        # Dropout's random stream: its own per rank, except that ranks computing the same activations (a tp group)
        # must draw the same masks.
        self.seed_offset = ctx.rank

    @property
    def can_be_timed_alone(self) -> bool:
        """Whether one rank's forward+backward runs without the other ranks (so it can be timed on its own): not
        when a forward is a collective (sharded parameters, tp) or goes through a pipeline."""
        return not (self.forward_is_collective or self.pipelined)

    def averaged_entries(self) -> dict[str, torch.Tensor]:
        """train.ema_decay: the parameters (and saved float buffers) this rank averages, by model.pt's names."""
        return averaged_entries(self.raw_model)

    @property
    def eval_model(self) -> nn.Module:
        """What evaluation runs: the plain module, or the wrapper when a forward pass is a collective."""
        return self.model if self.forward_is_collective else self.raw_model

    def plan_lines(self) -> list[str]:
        """Lines the run's plan adds for this strategy."""
        return []

    def no_sync(self):
        """Accumulation micro-batches keep their gradients local: DDP's no_sync() (replicated.ddp_wrap), else none."""
        return self.model.no_sync() if hasattr(self.model, "no_sync") else contextlib.nullcontext()

    def forward_backward(self, task, batches: list[dict], loss_weight, autocast) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of one step (on the device), each loss multiplied by
        `loss_weight`; gradients are synced on the last one only. Returns the summed loss of the batches, or 0 where
        this rank's batch does not count (another rank of its tp group reports the same loss)."""
        total = torch.zeros((), device=self.ctx.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1  # its backward syncs the gradients; the others' stay local (no_sync)
            with contextlib.nullcontext() if last else self.no_sync():
                with autocast():
                    loss_sum = task.loss_sum(self.model, batch)
                loss = loss_sum.float() * loss_weight
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss_sum.detach().float()
        self.reduce_grads()  # DDP's and FSDP's hooks summed the gradients during backward; tp and pipe do it here
        return total if self.counts_its_batch else torch.zeros_like(total)

    def reduce_grads(self) -> None:
        """Called after a step's last backward, for strategies that sum gradients themselves (tp, pipe). DDP and
        FSDP reduce gradients during backward: nothing to do."""

    def share_buffers(self) -> None:
        """Before an evaluation or a save: every rank takes rank 0's buffers (BatchNorm's running statistics, which
        each rank updates from its own batches), so all ranks evaluate and go on from the model saved. DDP does so
        before each training forward; FSDP never does. (A DTensor buffer is placed by its mesh, and left alone.)"""
        distributed.broadcast_tensors(self.ctx, [b for b in self.raw_model.buffers() if not isinstance(b, DTensor)])

    def eval_batch(self, task, batch: dict, autocast) -> dict:
        """One evaluation batch's results (task.eval_batch); {} where another rank reports the same results."""
        with autocast():
            out = task.eval_batch(self.eval_model, batch)
        return out if self.counts_its_batch else {}

    def compile(self) -> None:
        """train.compile: torch.compile the model in place (Module.compile: same module, same state-dict keys).
        Under ddp/oss that is the DDP wrapper, so TorchDynamo splits the graph at DDP's gradient buckets."""
        self.model.compile()

    def grad_norm(self, clip_to: float) -> torch.Tensor:
        """The global gradient norm, measured every step; the gradients are also clipped to `clip_to` unless it is
        inf. Under ddp every rank holds the summed gradients (in raw_model's parameters, which DDP wraps and does
        not copy), so its own norm is the global one (fsdp, oss and pipe override this: each rank holds a part)."""
        if math.isinf(clip_to):  # measuring alone: no clipping's extra pass over the gradients
            return torch.nn.utils.get_total_norm([p.grad for p in self.raw_model.parameters() if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip_to)

    # ---- checkpoints: files written into a checkpoint directory -----------------------------------------
    def save(self, directory: str) -> None:
        """Called on every rank; writes model.pt (a plain state dict) and optimizer.pt."""
        if self.ctx.is_main:
            torch.save(state_to_save(self.raw_model), os.path.join(directory, "model.pt"))
            torch.save(self.optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))

    def start_save(self, directory: str) -> Callable[[], None]:
        """train.async_save: start writing save()'s files and return a wait() that returns once they are written
        (raising what the writing raised). By default: save(), done before returning."""
        self.save(directory)
        return lambda: None

    def load(self, directory: str, meta: dict) -> None:
        """Reads a checkpoint of any strategy into this rank's part of the model and optimizer (each strategy's own:
        core/checkpoint_io.py reads the files). `meta`: its meta.json as rank 0 verified it (resume.verified_meta):
        what the checks read, never a rank's own read of meta.json."""
        raise NotImplementedError
