"""One `apply_<strategy>()` function per way of spreading the model over devices, chosen from `STRATEGIES` below.

Each takes the plain model (already on its device) and the config, and returns a `Parallel` (base.py): what the
training step calls, the optimizer, how to skip gradient sync during accumulation, how to clip, and how to save
and load model and optimizer state. The Trainer only talks to `Parallel`, so a new strategy is one new function.

One file per family, each readable on its own:
  replicated.py  none, dp, ddp      every rank holds everything; DDP all-reduces gradients
  zero.py        oss                optimizer state (and gradients) sharded: ZeRO-1/2
  fsdp.py        fsdp               parameters too: ZeRO-3 (FSDP2, fairscale FSDP)
  pipeline.py    pipe               the layers cut into stages on different ranks, micro-batches flow through
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from distributed import DistContext
from strategies.base import Parallel, state_bytes  # noqa: F401  (state_bytes: for tests and benchmarks)
from strategies.fsdp import apply_fsdp, join_output_grads  # noqa: F401
from strategies.pipeline import apply_pipe
from strategies.replicated import apply_ddp, apply_dp, apply_none
from strategies.zero import apply_oss

# -----> add a strategy: write apply_<name>() in a file here, list it below (and in config.DistConfig.strategy).
STRATEGIES: dict[str, Callable[[nn.Module, object, DistContext], Parallel]] = {
    "none": apply_none,
    "dp": apply_dp,
    "ddp": apply_ddp,
    "oss": apply_oss,
    "fsdp": apply_fsdp,
    "pipe": apply_pipe,
}
