"""One `apply_<strategy>()` function per way of spreading the model over devices, chosen from `STRATEGIES`.

Each takes the plain model (already on its device) and a recipe for the optimizer, and returns a `Parallel`:
what the training step calls, the optimizer, how to skip gradient sync during accumulation, how to clip, and how
to save and load model and optimizer state. The Trainer only talks to `Parallel`, so a new strategy is one new
function here.
"""
from __future__ import annotations

import contextlib
import math
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
    checkpoint_format = "full"  # recorded in meta.json; a format containing "sharded" resumes only under itself

    def __init__(self, model: nn.Module, raw_model: nn.Module, optimizer: torch.optim.Optimizer,
                 ctx: DistContext, scaler: Optional[torch.amp.GradScaler] = None):
        self.model, self.raw_model, self.optimizer, self.ctx, self.scaler = model, raw_model, optimizer, ctx, scaler

    def no_sync(self):
        """Context for accumulation micro-batches: gradients stay local until the last micro-batch."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (no-op for max_norm = inf) and return the norm before clipping."""
        if math.isinf(max_norm):  # the Trainer wants the norm every step (NaN check): skip clipping's extra pass
            return torch.nn.utils.get_total_norm([p.grad for p in self.raw_model.parameters() if p.grad is not None])
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
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    return DDPParallel(ddp_wrap(model, ctx), model, cls(groups, **kwargs), ctx, make_scaler(cfg, ctx))


def ddp_wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DistributedDataParallel on this rank's device (GPU: device_ids names it; CPU: none)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


# ---- sharded strategies: oss (ZeRO-1/2) and fsdp (ZeRO-3); see docs/sharded.md ------------------------------
def sharded_scaler(cfg, ctx: DistContext):
    """fp16 loss scaling when ranks hold different gradients: every rank must skip the same steps, so the
    overflow flag is all-reduced. PyTorch's ShardedGradScaler does this on CPU and GPU; fairscale's copy of it
    moves the flag to CUDA and so cannot run on CPU."""
    if cfg.train.precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    return ShardedGradScaler(ctx.device.type)


class OSSParallel(DDPParallel):
    """Optimizer state sharded over ranks (ZeRO-1; ZeRO-2 when gradients are sharded too). Each rank updates
    only the parameters it owns, then broadcasts them, so parameters stay whole and replicated. The model is
    DDP or fairscale's ShardedDataParallel: both have DDP's no_sync()."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        from fairscale.optim import OSS
        if isinstance(self.optimizer, OSS):  # grads may exist only on their owner: norm over shards, all-reduced
            return self.optimizer.clip_grad_norm(max_norm)
        return super().clip_grad_norm(max_norm)  # ZeroRedundancyOptimizer: DDP grads are whole on every rank

    def save(self, directory: str) -> None:
        # Gather the optimizer shards on rank 0: optimizer.pt is then an ordinary state dict indexed over all
        # parameters, which any world size (and oss_impl) can load, every rank keeping its own part.
        from fairscale.optim import OSS
        if isinstance(self.optimizer, OSS):
            self.optimizer.consolidate_state_dict(recipient_rank=0)
        else:
            self.optimizer.consolidate_state_dict(to=0)
        super().save(directory)


def apply_oss(model: nn.Module, cfg, ctx: DistContext) -> Parallel:
    """Optimizer state sharding. fairscale OSS (default) with DDP gradients = ZeRO-1; with dist.shard_grads,
    fairscale ShardedDataParallel reduces each gradient to its owner only = ZeRO-2. dist.oss_impl: torch uses
    PyTorch's ZeroRedundancyOptimizer with DDP (ZeRO-1)."""
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    if cfg.dist.oss_impl == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)
    else:
        from fairscale.optim import OSS
        optimizer = OSS(groups, optim=cls, **kwargs)
    if cfg.dist.shard_grads:  # config.validate allows it with fairscale OSS only
        from fairscale.nn.data_parallel import ShardedDataParallel
        # No reduce buckets: bucketed gradients are views into ShardedDataParallel's buffers, which the trainer's
        # zero_grad(set_to_none=True) would detach, and the next step would reduce stale buffers. Unbucketed,
        # each gradient is reduced to its owner and freed elsewhere, which is also what saves the memory.
        wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=0)
        return OSSParallel(wrapped, model, optimizer, ctx, sharded_scaler(cfg, ctx))
    return OSSParallel(ddp_wrap(model, ctx), model, optimizer, ctx, make_scaler(cfg, ctx))


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards as units of their own (one all-gather each), innermost first: every member of
    an nn.ModuleList, i.e. the blocks of a transformer (BERT's encoder.layer, BART's encoder.layers and
    decoder.layers, GPT-2's h). The root takes whatever is left (embeddings, heads; all of the CNN)."""
    units = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    return units[::-1]


class FSDPParallel(Parallel):
    """PyTorch FSDP2 (`fully_shard`, ZeRO-3): parameters, gradients and optimizer state are DTensors sharded
    along dim 0; each unit's parameters are all-gathered just for its forward and backward."""
    eval_lockstep = True  # a forward pass is a collective (the all-gather)
    checkpoint_format = "sharded-dcp"  # torch.distributed.checkpoint folders model_dcp/ and optimizer_dcp/

    def no_sync(self):
        @contextlib.contextmanager
        def local_grads():  # accumulate unsharded gradients locally; reduce-scatter on the last micro-batch
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        return local_grads()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        # On DTensor gradients the norm is a DTensor whose local value covers this shard only; full_tensor()
        # reduces it to the global norm (clipping itself already used the global one).
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def save(self, directory: str) -> None:
        # Every rank writes its own shards: nothing is gathered. get_state_dict keys the entries by the plain
        # model's parameter names, so the files do not depend on the world size.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save(model_sd, checkpoint_id=os.path.join(directory, "model_dcp"))
        dcp.save(optim_sd, checkpoint_id=os.path.join(directory, "optimizer_dcp"))

    def load(self, directory: str) -> None:
        # Load into this run's sharding (the world size may differ from the one that saved): DCP reads just
        # the pieces each rank's shards need.
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from checkpoint import dcp_load
        from config import CheckpointError
        for name in ("model_dcp", "optimizer_dcp"):
            if not os.path.isfile(os.path.join(directory, name, ".metadata")):
                raise CheckpointError(f"{directory}/{name}: missing; fsdp resumes only from checkpoints that "
                                      "fsdp wrote (test mode reads any checkpoint)")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        # dcp_load, not dcp.load: DCP itself unpickles .metadata (and non-tensor entries) with plain pickle,
        # so a crafted checkpoint could run code; checkpoint.dcp_load refuses it in one line instead.
        dcp_load(model_sd, os.path.join(directory, "model_dcp"))
        dcp_load(optim_sd, os.path.join(directory, "optimizer_dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


class FairscaleFSDPParallel(Parallel):
    """fairscale FullyShardedDataParallel (CUDA only). model.pt is gathered at save time (fairscale cannot
    write sharded files that another world size reads); the optimizer is saved as one shard per rank."""
    eval_lockstep = True
    checkpoint_format = "sharded-fairscale"

    def no_sync(self):
        return self.model.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.model.clip_grad_norm_(max_norm)  # the global norm over all shards

    def save(self, directory: str) -> None:
        full = self.model.state_dict()  # collective: every rank takes part in the gather
        if self.ctx.is_main:
            torch.save(full, os.path.join(directory, "model.pt"))
        torch.save(self.optimizer.state_dict(), os.path.join(directory, f"optimizer-rank{self.ctx.rank}.pt"))

    def load(self, directory: str) -> None:
        from checkpoint import read_meta
        from config import CheckpointError
        saved = read_meta(directory).get("world_size")
        if saved != self.ctx.world_size:
            raise CheckpointError(f"{directory}: fairscale FSDP optimizer shards were written by {saved} ranks, "
                                  f"this run has {self.ctx.world_size}; resume with {saved} processes")
        self.model.load_state_dict(load_file(directory, "model.pt"))
        self.optimizer.load_state_dict(load_file(directory, f"optimizer-rank{self.ctx.rank}.pt"))


def apply_fsdp(model: nn.Module, cfg, ctx: DistContext) -> Parallel:
    """Fully sharded data parallel. Default: PyTorch's fully_shard (FSDP2) per fsdp_units() and then the root,
    computing in train.precision (bf16/fp16) while reducing gradients and stepping in fp32.
    dist.fsdp_impl: fairscale uses fairscale's FullyShardedDataParallel (CUDA only)."""
    d, precision = cfg.dist, cfg.train.precision
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if d.fsdp_impl == "fairscale":
        from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP
        # The weight-decay groups are built first: without flattening, fairscale shards each parameter in
        # place (p.data becomes the shard), so the same Parameter objects remain in the groups.
        groups, cls, kwargs = optimizer_recipe(model, cfg.train)
        wrap = lambda m: FairscaleFSDP(m, reshard_after_forward=d.reshard_after_forward,  # noqa: E731
                                       compute_device=ctx.device, flatten_parameters=False,
                                       mixed_precision=low is not None, compute_dtype=low,
                                       fp32_reduce_scatter=low is not None)
        for unit in fsdp_units(model):
            replace_module(model, unit, wrap(unit))
        model.register_forward_hook(join_output_grads)
        root = wrap(model)
        return FairscaleFSDPParallel(root, root, cls(groups, **kwargs), ctx, sharded_scaler(cfg, ctx))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    for unit in fsdp_units(model):
        fully_shard(unit, reshard_after_forward=d.reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=d.reshard_after_forward, mp_policy=policy)
    # The optimizer is built after sharding, on the DTensor parameters (the same names and shapes as before).
    groups, cls, kwargs = optimizer_recipe(model, cfg.train)
    return FSDPParallel(model, model, cls(groups, **kwargs), ctx, sharded_scaler(cfg, ctx))


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


def state_bytes(par: Parallel) -> dict[str, int]:
    """Bytes of model state held by this rank right now: parameters, gradients, optimizer state (local shards
    only; tensors sharing storage counted once). Library-internal buffers are not visible here: DDP's gradient
    buckets, FSDP's transient all-gather buffers."""
    from torch.distributed.tensor import DTensor

    def nbytes(tensors) -> int:
        storages = {}
        for t in tensors:
            t = t.to_local() if isinstance(t, DTensor) else t
            if t is not None and t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    params = list(par.model.parameters())
    local_opt = getattr(par.optimizer, "optim", par.optimizer)  # OSS / ZeroRedundancyOptimizer: this rank's part
    state = [v for s in local_opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer": nbytes(state)}


# -----> add a strategy: write apply_<name>() above and list it here (and in config.DistConfig.strategy).
STRATEGIES: dict[str, Callable[[nn.Module, object, DistContext], Parallel]] = {
    "none": apply_none,
    "dp": apply_dp,
    "ddp": apply_ddp,
    "oss": apply_oss,
    "fsdp": apply_fsdp,
}
