"""fsdp: parameters, gradients and optimizer state all sharded (ZeRO-3), with PyTorch's FSDP2 (`fully_shard`) or
fairscale's FullyShardedDataParallel (CUDA only), and the fairscale workarounds. See docs/sharded.md."""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from core import checkpoint_io
from core.checkpoint_dcp import dcp_load
from core.checkpoint_io import load_file
from core.distributed import DistContext
from core.errors import CheckpointError
from strategies import mesh as meshes
from strategies.activation_checkpointing import model_blocks
from core.model_parts import trained_names, trains_part
from core.optimizers import optimizer_recipe
from strategies.base import Strategy
from strategies.fp16 import sharded_scaler


class FSDPStrategy(Strategy):
    """PyTorch FSDP2 (`fully_shard`, ZeRO-3): parameters, gradients and optimizer state are DTensors sharded
    along dim 0; each unit's parameters are all-gathered just for its forward and backward."""
    forward_is_collective = True  # a forward pass is a collective (the all-gather)
    replicas_wait_for_each_other = True
    checkpoint_format = "sharded-dcp"  # torch.distributed.checkpoint folders model_dcp/ and optimizer_dcp/
    resumes_from = ("sharded-dcp", "full", "sharded-pipe")

    def __init__(self, model, raw_model, optimizer, ctx, scaler=None, mesh=None):
        super().__init__(model, raw_model, optimizer, ctx, scaler)
        self.mesh = mesh  # with dist.tp or dist.dp_replicate > 1: the device mesh (strategies/mesh.py)
        self.save_groups = None  # train.async_save: DCP's own process groups, made at the first start_save
        if mesh is not None:  # a tp group reads one share of the batch, reports once, draws the same dropout masks
            dp, tp = mesh["dp"], mesh["tp"]
            self.data_rank, self.data_shares = dp.get_local_rank(), dp.size()
            self.counts_its_batch = tp.get_local_rank() == 0
            self.seed_offset = ctx.rank - tp.get_local_rank()  # (inside the split matrices: tp.PerRankDropout)
            self.replica_group = tp.get_group() if tp.size() > 1 else None  # balance.py times the group together
            self.replica = "tp group" if tp.size() > 1 else "rank"

    def plan_lines(self) -> list[str]:
        return meshes.plan_lines(self.mesh) if self.mesh is not None else []

    def no_sync(self):
        @contextlib.contextmanager
        def local_grads():  # accumulate unsharded gradients locally; reduce-scatter on the last micro-batch
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        return local_grads()

    def compile(self) -> None:
        # Per block, and the block's forward only: FSDP2's hooks around it (all-gather before, reduce-scatter
        # after) stay outside the compiled code, and the state-dict keys stay the same. Under tp the blocks are
        # already split: the compiled code includes DTensor's hooks on their layers (the tp all-reduces).
        for unit in model_blocks(self.model) or [self.model]:  # no blocks (the CNN): the root's forward
            unit.forward = torch.compile(unit.forward)

    def grad_norm(self, clip_to: float) -> torch.Tensor:
        if self.mesh is not None:  # parameters on several meshes (tp-split, whole ones sharded over dp only)
            return clip_mixed(list(self.model.parameters()), clip_to, self.ctx)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip_to)
        # On DTensor gradients the norm is a DTensor whose local value covers this shard only; full_tensor()
        # reduces it to the global norm (clipping itself already used the global one).
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def save(self, directory: str) -> None:
        # Every rank writes its own shards, nothing gathered (tp splits in strides: state_in_dcp_boxes). get_state_dict
        # keys the entries by the plain model's parameter names, so the files do not depend on the world size.
        model_sd, optim_sd = (state_in_dcp_boxes(sd) for sd in self.state_dicts())
        dcp.save(model_sd, checkpoint_id=os.path.join(directory, "model_dcp"))
        dcp.save(optim_sd, checkpoint_id=os.path.join(directory, "optimizer_dcp"))

    def start_save(self, directory: str):
        """DCP's async_save: each rank's shards are copied to the host now, and written by DCP's threads (one per
        folder). Those threads run DCP's own collectives, so each goes over a process group of its own: not the
        training's, and not the other thread's (two threads on one group could pair different collectives)."""
        if self.save_groups is None:
            self.save_groups = [dist.new_group(backend="gloo") for _ in range(2)]
        model_sd, optim_sd = (state_in_dcp_boxes(sd) for sd in self.state_dicts())
        futures = [dcp.async_save(sd, checkpoint_id=os.path.join(directory, name), process_group=group)
                   for sd, name, group in ((model_sd, "model_dcp", self.save_groups[0]),
                                           (optim_sd, "optimizer_dcp", self.save_groups[1]))]
        return lambda: [f.result() for f in futures]

    def load(self, directory: str, meta: dict) -> None:
        # Load into this run's sharding (the world size may differ from the one that saved): DCP reads just
        # the pieces each rank's shards need. pipe's folders hold the same names (each stage's tensors).
        if os.path.isfile(os.path.join(directory, "model.pt")):  # none/dp/ddp/oss wrote it
            return self.load_full(directory, meta)
        need_dcp_folders(directory, "fsdp", "pipe")
        if trains_part(self.raw_model):
            checkpoint_io.check_lora_checkpoint(self.raw_model, directory, meta)
        model_sd, optim_sd = self.state_dicts()
        # dcp_load, not dcp.load: DCP's own unpickling could run a crafted checkpoint's code (checkpoint_dcp.py).
        swaps = []
        dcp_load(state_in_dcp_boxes(model_sd, swaps), os.path.join(directory, "model_dcp"))
        # The per-parameter state only: layouts group parameters differently (pipe per stage, tp splits DTensors
        # from the rest), so this run's groups stay, and the learning rate comes back with the scheduler.
        dcp_load({"state": state_in_dcp_boxes(optim_sd["state"], swaps)}, os.path.join(directory, "optimizer_dcp"))
        for original, boxed in swaps:  # in place, into model_sd and optim_sd
            original.copy_(boxed)
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=self.state_options())

    def state_dicts(self) -> tuple[dict, dict]:
        """The model's and optimizer's state as DCP writes and reads them (state_options). Under LoRA, the model's
        entries that train only: torch keeps a frozen weight tied to another under its second name (GPT-2's
        lm_head.weight, the token embedding), which test mode would refuse and which would fill the folder."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.state_options())
        if trains_part(self.raw_model):
            trained = trained_names(self.raw_model)
            model_sd = {k: v for k, v in model_sd.items() if k in trained}
        return model_sd, optim_sd

    def state_options(self):
        """What get_state_dict / set_state_dict cover: every entry, or under LoRA the parameters that train (the
        frozen base is not in the checkpoint: core.model_parts.state_to_save)."""
        part = trains_part(self.raw_model)
        return StateDictOptions(ignore_frozen_params=part, strict=not part)

    def load_full(self, directory: str, meta: dict) -> None:
        """A replicated strategy's model.pt and optimizer.pt: every rank reads them whole and keeps its shard of
        each tensor, cut locally (checkpoint_io.shard_like, no communication; the host holds the whole model
        meanwhile, as when it was built). The optimizer state is matched to the parameters by name."""
        mine = self.raw_model.state_dict()
        whole = checkpoint_io.load_file(directory, "model.pt")
        checkpoint_io.load_state(self.raw_model, {k: checkpoint_io.shard_like(v, mine[k]) if k in mine else v
                                                  for k, v in whole.items()}, directory, meta)
        by_name = checkpoint_io.optimizer_state_by_name(directory, checkpoint_io.replicated_order(self.raw_model))
        checkpoint_io.load_optimizer_by_name(self.optimizer, by_name, checkpoint_io.parameter_names(self.raw_model),
                                             directory)


class FairscaleFSDPStrategy(Strategy):
    """fairscale FullyShardedDataParallel (CUDA only). model.pt is gathered at save time (fairscale cannot
    write sharded files that another world size reads); the optimizer is saved as one shard per rank."""
    forward_is_collective = True
    replicas_wait_for_each_other = True
    checkpoint_format = "sharded-fairscale"
    resumes_from = ("sharded-fairscale",)

    def grad_norm(self, clip_to: float) -> torch.Tensor:
        return self.model.clip_grad_norm_(clip_to)  # the global norm over all shards

    def save(self, directory: str) -> None:
        full = self.model.state_dict()  # collective: every rank takes part in the gather
        if self.ctx.is_main:
            torch.save(full, os.path.join(directory, "model.pt"))
        torch.save(self.optimizer.state_dict(), os.path.join(directory, f"optimizer-rank{self.ctx.rank}.pt"))

    def load(self, directory: str, meta: dict) -> None:
        saved = meta.get("world_size")
        if saved != self.ctx.world_size:
            raise CheckpointError(f"{directory}: fairscale FSDP optimizer shards were written by {saved} ranks, "
                                  f"this run has {self.ctx.world_size}; resume with {saved} processes")
        self.model.load_state_dict(load_file(directory, "model.pt"))
        self.optimizer.load_state_dict(load_file(directory, f"optimizer-rank{self.ctx.rank}.pt"))


def need_dcp_folders(directory: str, strategy: str, other: str) -> None:
    """The sharded folders fsdp and pipe load from, or one line: which is missing, what `strategy` resumes from."""
    for name in ("model_dcp", "optimizer_dcp"):
        if not os.path.isfile(os.path.join(directory, name, ".metadata")):
            raise CheckpointError(f"{directory}/{name}: missing; {strategy} resumes from checkpoints that {strategy}, "
                                  f"{other} or a replicated strategy wrote (test mode reads any checkpoint)")


def state_in_dcp_boxes(state: dict, swaps: list = None) -> dict:
    """`state` (nested dicts) for DCP, which writes one box of a tensor per rank. A tp plan's split in strides
    (_StridedShard: GPT-2's q|k|v, where rank r holds [q_r | k_r | v_r], tasks/gpt2_tp.py) is not one, so such a
    DTensor is replaced by a copy split in plain blocks (gathered over the tp group), and (original, copy) goes to
    `swaps`. FSDP2's own strides over a tp split of the same dimension (placements to their right) make boxes."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            value = state_in_dcp_boxes(value, swaps)
        elif isinstance(value, DTensor):
            places = list(value.placements)
            boxed = [Shard(p.dim) if isinstance(p, _StridedShard) and not any(
                isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim for q in places[i + 1:]) else p
                for i, p in enumerate(places)]
            if boxed != places:
                copy = value.redistribute(placements=boxed)
                if swaps is not None:
                    swaps.append((value, copy))
                value = copy
        out[key] = value
    return out


def clip_mixed(params: list, max_norm: float, ctx: DistContext, holders: int = 0,
               uncounted: frozenset = frozenset()) -> torch.Tensor:
    """Clip to (and return) the global gradient norm when parameters are held in different ways: split over a tp
    group, sharded by FSDP, or whole on every rank. Each rank adds up its local squares, each divided by the number
    of ranks that hold the same piece, and one all-reduce sums them. `holders`: the ranks that hold a parameter
    (all by default; under pipe, its stage's); `uncounted`: ids of parameters clipped but counted elsewhere."""
    square = torch.zeros((), device=ctx.device)
    for p in params:
        if p.grad is None or id(p) in uncounted:
            continue
        copies = holders or ctx.world_size
        if isinstance(p.grad, DTensor):  # the ranks outside its mesh, and those along its Replicate dimensions
            m = p.grad.device_mesh
            copies = copies // m.size() * math.prod(m.size(i) for i, pl in enumerate(p.grad.placements)
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


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (the same storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def fsdp2_policy(precision: str):
    """FSDP2 mixed precision: compute in train.precision (bf16/fp16), reduce gradients and step in fp32."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, cfg, ctx: DistContext, task=None, train_set=None) -> Strategy:
    """Fully sharded data parallel: FSDP2 (shard, below), over every rank or, with dist.dp_replicate > 1, over
    the shards of each replica (HSDP). dist.fsdp_impl fairscale: fairscale's FullyShardedDataParallel (CUDA
    only). With dist.tp > 1, strategies/tp.py splits the blocks first and then calls shard()."""
    model = model.to(ctx.device)
    d, precision = cfg.dist, cfg.train.precision
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if d.fsdp_impl == "fairscale":
        from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP  # (fairscale runs only)

        # The weight-decay groups are built first: without flattening, fairscale shards each parameter in
        # place (p.data becomes the shard), so the same Parameter objects remain in the groups.
        groups, cls, kwargs = optimizer_recipe(model, cfg.train)
        wrap = lambda m: FairscaleFSDP(m, reshard_after_forward=d.reshard_after_forward,  # noqa: E731
                                       compute_device=ctx.device, flatten_parameters=False,
                                       mixed_precision=low is not None, compute_dtype=low,
                                       fp32_reduce_scatter=low is not None)
        for unit in model_blocks(model):
            replace_module(model, unit, wrap(unit))
        model.register_forward_hook(join_output_grads)
        root = wrap(model)
        root.set_gradient_divide_factors(1.0, 1.0, recursive=True)  # summed over the ranks, as every strategy's
        return FairscaleFSDPStrategy(root, root, cls(groups, **kwargs), ctx, sharded_scaler(cfg, ctx))
    mesh = meshes.build_mesh(ctx, 1, d.dp_replicate) if d.dp_replicate > 1 else None  # HSDP: replicas of shards
    return shard(model, cfg, ctx, mesh, FSDPStrategy)


def shard(model: nn.Module, cfg, ctx: DistContext, mesh: Optional[meshes.Mesh], parallel: type) -> Strategy:
    """FSDP2's fully_shard per model_blocks() and then the root (fsdp2_policy), over the mesh's dp dimension
    (None: over all ranks); returns `parallel` (FSDPStrategy, or tp's FSDPxTPStrategy) with its optimizer."""
    d = cfg.dist
    policy, dp_mesh = fsdp2_policy(cfg.train.precision), meshes.fsdp_mesh(mesh) if mesh is not None else None
    for unit in model_blocks(model):
        sum_over_replicas(fully_shard(unit, mesh=dp_mesh, reshard_after_forward=d.reshard_after_forward,
                                      mp_policy=policy))
    sum_over_replicas(fully_shard(model, mesh=dp_mesh, reshard_after_forward=d.reshard_after_forward, mp_policy=policy))
    # The optimizer is built after sharding, on the DTensor parameters (the same names and shapes as before).
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    return parallel(model, model, cls(groups, **kwargs), ctx, sharded_scaler(cfg, ctx), mesh)


def sum_over_replicas(unit: FSDPModule) -> None:
    """FSDP2's reduce-scatter sums the gradients over the ranks, as ddp's do (replicated.sum_gradients), where by
    default it averages (a plain sum and a division by 1: gloo has no pre-multiplied sum)."""
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)


class _JoinGrads(torch.autograd.Function):
    """Identity on several tensors. Its backward runs once, when all of their gradients are in."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def join_output_grads(module: nn.Module, inputs, output):
    """Forward hook on the model under fairscale FSDP's root. fairscale readies the root for backward in a hook
    on each output tensor and frees each parameter as soon as its gradient is done. With two outputs (BERT's MLM
    and NSP logits), the NSP head's gradients can be done, and freed, before the MLM output's hook runs, which
    then fails (`assert self.has_full_params`). Through one identity node, every output's hook runs first."""
    found = []

    def visit(x, replace=None):
        if isinstance(x, torch.Tensor):
            if replace is not None:
                return replace.get(id(x), x)
            if x.requires_grad:
                found.append(x)
            return x
        if isinstance(x, dict):  # in place: keeps dict subclasses such as transformers' ModelOutput intact
            for k in list(x.keys()):
                x[k] = visit(x[k], replace)
            return x
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(visit(v, replace) for v in x)
        return x

    visit(output)
    if len(found) < 2:
        return output
    return visit(output, {id(t): j for t, j in zip(found, _JoinGrads.apply(*found))})


def replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put `new` where `old` sits inside `root` (fairscale wraps modules instead of changing them in place)."""
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return


def check_config(cfg, fail) -> None:
    """dist.fsdp_impl or dist.dp_replicate, set (config.validate asks)."""
    d, t = cfg.dist, cfg.train
    if d.dp_replicate > 1 and (d.strategy != "fsdp" or d.fsdp_impl != "torch"):
        fail("dist.dp_replicate", "is HSDP: it needs dist.strategy fsdp (FSDP2)")
    if d.strategy == "fsdp" and d.fsdp_impl == "fairscale" and not d.on_gpu():
        fail("dist.fsdp_impl", "is fairscale, whose FullyShardedDataParallel needs CUDA; use fsdp_impl: torch on CPU")
    if d.strategy == "fsdp" and d.fsdp_impl == "fairscale" and (t.compile or cfg.model.activation_checkpointing):
        fail("train.compile" if t.compile else "model.activation_checkpointing",
             "needs dist.fsdp_impl: torch (FSDP2 wraps the blocks in place; fairscale's FSDP replaces them)")
