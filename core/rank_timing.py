"""Timing a rank's work, for what batch_size auto (extras/balance.py) and pipe's stage split (strategies/pipeline.py)
measure: forward+backward timed on each rank without the run noticing, and every rank kept busy until all have
measured (ranks that share a CPU would otherwise look faster than they are in training)."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from core.distributed import DistContext, gather_objects
from core.errors import Stopped, stopped_before_training


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a host clock measures it (CPU work is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward_backward(strategy, ctx: DistContext, forward_backward: Callable[[int], float], steps: int,
                          stop_reason: Callable[[], Optional[str]] = lambda: None) -> float:
    """The seconds of `steps` calls forward_backward(1..steps), after an untimed forward_backward(0) (it pays for
    allocations and lazy initialisation); then busy until every rank has measured. The run does not notice: the
    random state is forked, gradients are dropped, buffers (batch-norm statistics, say) are put back.
    `stop_reason` (Hooks.stop_reason): once a stop signal came, this rank times no more (it could take minutes);
    every rank learns it as all have measured, and all raise Stopped."""
    group, seconds, stopping = strategy.replica_group, 0.0, False
    with left_as_it_was(strategy.raw_model, ctx.device):
        forward_backward(0)
        for i in range(1, steps + 1):
            stopping = not all_true(stop_reason() is None, group, ctx.device)  # (a tp group's forward is collective)
            if stopping:
                break
            seconds += forward_backward(i)
        stopped = busy_until_all_measured(ctx, lambda: forward_backward(steps + 1), group, stopping)
    strategy.optimizer.zero_grad(set_to_none=True)
    if stopped:  # (every rank's reason: the one a rank that heard none says too)
        reason = next(r for r in gather_objects(ctx, stop_reason()) + ["a signal"] if r)
        raise Stopped(stopped_before_training(reason, " while timing forward+backward (train.precision or "
                                                      "train.batch_size auto)"))
    return seconds


@contextlib.contextmanager
def left_as_it_was(model: nn.Module, device: torch.device):
    """Forward passes inside that train nothing: the random state is forked (dropout draws), and the buffers
    (batch-norm statistics, say) are put back."""
    buffers = [b.detach().clone() for b in model.buffers()]
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        yield
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)


def busy_until_all_measured(ctx: DistContext, work: Callable[[], object], group=None, stopping: bool = False) -> bool:
    """Repeat `work` (untimed) until every rank has its numbers. Where ranks share a CPU (a laptop, the tests), a
    rank that stopped early would hand its share to the others and make them look faster than they are in
    training, where all ranks compute at once. `group`: ranks whose `work` is one collective (a tp group); they
    decide together, each round, whether to go on, so that none of them starts a round the others skip.
    `stopping`: this rank (its whole group) stopped timing for a stop signal: it waits, idle. Returns whether any
    rank was stopping (the same on every rank)."""
    if not ctx.distributed:
        return stopping
    votes = torch.tensor(float(stopping), device=ctx.device)
    done = dist.all_reduce(votes, async_op=True)
    while not stopping and not all_true(done.is_completed(), group, ctx.device):
        work()
    done.wait()
    return bool(votes.item())


def all_true(flag: bool, group, device: torch.device) -> bool:
    """`flag` on every rank of `group` (one all-reduce over it), or this rank's flag where group is None."""
    if group is None:
        return flag
    both = torch.tensor(float(flag), device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    return bool(both.item())
