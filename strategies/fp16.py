"""fp16 loss scaling for strategies whose ranks hold different gradients (shards, tp pieces, pipeline stages).
Replicated strategies use torch.amp.GradScaler as it is (core/optimizers.make_scaler)."""
from __future__ import annotations

from types import SimpleNamespace

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from core.distributed import DistContext


def sharded_scaler(cfg, ctx: DistContext):
    """fp16 loss scaling when ranks hold different gradients: every rank must skip the same steps, so the
    overflow flag is all-reduced over the world. PyTorch's ShardedGradScaler does this on CPU and GPU; fairscale's
    copy of it moves the flag to CUDA and so cannot run on CPU."""
    if cfg.train.precision != "fp16":
        return None

    class LocalPiecesScaler(ShardedGradScaler):
        """Unscales and checks each rank's own pieces of DTensor gradients: torch's one kernel per device cannot
        take tp-split DTensors and whole tensors in one list (the flag's all-reduce covers the rest)."""

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            # torch's code reads only param_groups[i]["params"][j].grad: it gets the local pieces (same storage)
            groups = [{"params": [SimpleNamespace(grad=p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                                  for p in g["params"]]} for g in optimizer.param_groups]
            flags = super()._unscale_grads_(SimpleNamespace(param_groups=groups), inv_scale, found_inf, allow_fp16)
            # 0-d views, as GradScaler's own flags: fused AdamW subtracts the flag from each 0-d step count, which
            # ShardedGradScaler's shape [1] cannot broadcast into. (The views share storage: the all-reduce fills it.)
            return {device: flag.view(()) for device, flag in flags.items()}
    return LocalPiecesScaler(ctx.device.type)
