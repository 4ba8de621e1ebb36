"""What every strategy returns: a `Strategy`, the one object the Trainer talks to. Also the optimizer recipe the
strategies share (fp16 loss scaling for sharded ones: fp16.py; the bytes a rank holds: memory.py)."""
from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from core.distributed import DistContext
from core.errors import ConfigError
from strategies import optimizers


def optimizer_recipe(model: nn.Module, train_cfg, keep_empty: bool = False,
                     fused_ok: bool = True) -> tuple[list[dict], type, dict]:
    """(param groups, optimizer class, kwargs): train.optimizer by name (strategies/optimizers.py). Weight decay
    applies to matrices only, not biases and norms. fused_ok=False: the caller's wrapper cannot run the fused
    kernel (train.optimizer_impl auto: foreach)."""
    groups = param_groups(model, train_cfg.weight_decay, keep_empty)
    params = [p for g in groups for p in g["params"]]
    # -----> another optimizer: train.optimizer names any torch.optim class (train.optimizer_args: its own
    # keywords); a hand-written one is listed in optimizers.OPTIMIZERS and must accept (param groups, lr=...,
    # its optimizer_args) and weight_decay, betas, eps, fused, foreach only if it implements them.
    cls = optimizers.resolve(train_cfg.optimizer)
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
    return groups, cls, {**optimizers.arguments(cls, train_cfg), **kernel}


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
    small op per tensor: benchmarks/RESULTS.md, "Speed: this Trainer vs Hugging Face's Trainer"), else foreach where the class has it."""
    takes = optimizers.keywords(cls)
    device_ok = all(p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
                    for p in params)
    if impl == "fused" and not (device_ok and fused_ok and "fused" in takes):
        where = (f"{cls.__name__}" if "fused" not in takes else
                 "this strategy's optimizer wrapper" if device_ok else f"device {params[0].device.type}")
        raise ConfigError(f"train.optimizer_impl: fused is not supported by {where}; use auto or foreach")
    if impl == "auto":
        impl = "fused" if device_ok and fused_ok and "fused" in takes else "foreach"
    return {k: v for k, v in {"fused": impl == "fused", "foreach": impl == "foreach"}.items() if k in takes}


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, innermost first: what FSDP shards as units of their own (one all-gather each) and
    activation checkpointing recomputes. Every member of an nn.ModuleList, i.e. the blocks of a transformer
    (BERT's encoder.layer, BART's encoder.layers and decoder.layers, GPT-2's h); FSDP's root takes the rest."""
    units = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    return units[::-1]


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
        # model: what forward runs (ddp: ddp_wrap(raw_model), below); raw_model: the module inside, what is saved.
        self.model, self.raw_model, self.optimizer, self.ctx, self.scaler = model, raw_model, optimizer, ctx, scaler
        # How the data is shared out: this rank reads share `data_rank` of `data_shares` of each global batch, and
        # its samples count toward the global count. The gradient all-reduce averages over `grad_average_over` ranks
        # (the Trainer multiplies the loss by it to undo the average). Under pipe, the ranks of one pipeline read
        # the same batch: one share per pipeline.
        self.data_rank, self.data_shares, self.grad_average_over = ctx.rank, ctx.world_size, ctx.world_size
        self.reports_for_replica = True
        # Dropout's random stream: its own per rank, except that ranks computing the same activations (a tp group)
        # must draw the same masks.
        self.random_stream = ctx.rank

    @property
    def can_be_timed_alone(self) -> bool:
        """Whether one rank's forward+backward runs without the other ranks (so it can be timed on its own): not
        when a forward is a collective (sharded parameters, tp) or goes through a pipeline."""
        return not (self.forward_is_collective or self.pipelined)

    @property
    def eval_model(self) -> nn.Module:
        """What evaluation runs: the plain module, or the wrapper when a forward pass is a collective."""
        return self.model if self.forward_is_collective else self.raw_model

    def plan_lines(self) -> list[str]:
        """Lines the run's plan adds for this strategy."""
        return []

    def no_sync(self):
        """Accumulation micro-batches keep their gradients local: DDP's no_sync() (ddp_wrap, below), else nothing."""
        return self.model.no_sync() if hasattr(self.model, "no_sync") else contextlib.nullcontext()

    def forward_backward(self, task, batches: list[dict], scale, autocast) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of one step (on the device), each loss multiplied by
        `scale`; gradients are synced on the last one only. Returns the summed loss of the batches, or 0 where
        this rank's batch does not count (another rank of its tp group reports the same loss)."""
        total = torch.zeros((), device=self.ctx.device)
        for i, batch in enumerate(batches):
            sync = contextlib.nullcontext() if i == len(batches) - 1 else self.no_sync()
            with sync:
                with autocast():
                    loss_sum = task.loss_sum(self.model, batch)
                loss = loss_sum.float() * scale
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss_sum.detach().float()
        self.reduce_grads()
        return total if self.reports_for_replica else torch.zeros_like(total)

    def reduce_grads(self) -> None:
        """Called after a step's last backward. DDP and FSDP reduce gradients during backward: nothing to do."""

    def eval_batch(self, task, batch: dict, autocast) -> dict:
        """One evaluation batch's results (task.eval_batch); {} where another rank reports the same results."""
        with autocast():
            out = task.eval_batch(self.eval_model, batch)
        return out if self.reports_for_replica else {}

    def compile(self) -> None:
        """train.compile: torch.compile the model in place (Module.compile: same module, same state-dict keys).
        Under ddp/oss that is the DDP wrapper, so TorchDynamo splits the graph at DDP's gradient buckets."""
        self.model.compile()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (no-op for max_norm = inf) and return the norm before clipping."""
        if math.isinf(max_norm):  # the Trainer wants the norm every step (NaN check): skip clipping's extra pass
            return torch.nn.utils.get_total_norm([p.grad for p in self.raw_model.parameters() if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)

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

    def load(self, directory: str) -> None:
        """Reads a checkpoint of any strategy into this rank's part of the model and optimizer (each strategy's own:
        core/checkpoint_io.py reads the files)."""
        raise NotImplementedError


# ---- LoRA (tasks/lora.py): a checkpoint holds only what trains, plus a reference to the frozen base -------------
def trains_part(model: torch.nn.Module) -> bool:
    """Whether only some of the model trains (LoRA's adapters and head), so checkpoints hold just that part."""
    return getattr(model, "lora_base", None) is not None


def trained_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def state_to_save(model: torch.nn.Module) -> dict:
    """What a checkpoint holds of the model: its state dict, or under LoRA the entries that train."""
    state = model.state_dict()
    if trains_part(model):
        names = trained_names(model)
        state = {k: v for k, v in state.items() if k in names}
    return state


def lora_base_entry(model: torch.nn.Module) -> dict:
    """meta.json's reference to the frozen base the checkpoint's adapters were trained on ({} without LoRA)."""
    return {"lora_base": model.lora_base} if trains_part(model) else {}


def make_scaler(cfg, ctx: DistContext) -> Optional[torch.amp.GradScaler]:
    """Dynamic loss scaling, needed for fp16 only (bf16 has fp32's range)."""
    return torch.amp.GradScaler(ctx.device.type) if cfg.train.precision == "fp16" else None


def ddp_wrap(model: nn.Module, ctx: DistContext, group=None) -> nn.Module:
    """The `model` of ddp and oss (GPU: device_ids names this rank's; CPU: none; `group`: the ranks, default all). Its
    hooks all-reduce (average) the gradients in buckets while backward runs; no_sync() keeps them local."""
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, process_group=group)
