"""What a rank holds: the bytes of its parameters, gradients and optimizer state (tests, benchmarks, the tutorial;
not the product: no run needs it)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from strategies.base import Strategy


def state_bytes(strategy: Strategy) -> dict[str, int]:
    """Bytes of model state held by this rank right now: parameters, gradients, optimizer state (local shards
    only; tensors sharing storage counted once). Library-internal buffers are not visible here: DDP's gradient
    buckets, FSDP's transient all-gather buffers."""

    def nbytes(tensors) -> int:
        storages = {}
        for t in tensors:
            t = t.to_local() if isinstance(t, DTensor) else t
            if t is not None and t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    params = list(strategy.model.parameters())
    local_opt = getattr(strategy.optimizer, "optim", strategy.optimizer)  # OSS, ZeroRedundancyOptimizer: this rank's
    state = [v for s in local_opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer": nbytes(state)}
