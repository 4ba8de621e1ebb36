"""Heterogeneous clusters: give a slow rank a smaller share of the global batch.

With `train.batch_size: auto`, every rank times forward+backward on a few real batches of equal size before
training, the speeds are gathered, and `train.global_batch_size` is split in proportion to them. Then all ranks
finish their micro-batch at about the same time, so the fast ones do not sit idle at the gradient all-reduce.
The Trainer divides the summed loss by the global sample count, so each optimizer step is still the exact mean
gradient over the global batch, whatever the split.

`dist.simulate_slowdown` makes chosen ranks artificially slower, so all of this can be tried on one laptop CPU.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Optional

import torch

import distributed as D
from data_loader import GlobalBatchSampler, split_proportional


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a host clock measures it (CPU work is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowdown(cfg, ctx: D.DistContext):
    """Context manager for one micro-batch's forward+backward. With dist.simulate_slowdown, it then sleeps
    (factor - 1) x the time the block took, so this rank behaves like a device `factor` times slower.
    On the micro-batch that syncs gradients the timed block also holds the wait for the other ranks; the slowed
    rank is normally the last to arrive, so that wait is small."""
    factor = cfg.dist.simulate_slowdown[ctx.rank] if cfg.dist.simulate_slowdown else 1.0
    if factor == 1.0:
        return contextlib.nullcontext()  # the normal case: no timing, and no GPU synchronisation
    return _sleep_after(factor, ctx.device)


@contextlib.contextmanager
def _sleep_after(factor: float, device: torch.device):
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    time.sleep((factor - 1.0) * (time.perf_counter() - start))


def measure_speed(trainer, batch_size: int, steps: int) -> float:
    """This rank's samples/s for forward+backward on real training batches of `batch_size`.

    One untimed batch first (it pays for allocations and lazy initialisation), then the median of `steps` timed
    ones (robust to a hiccup of a shared machine). The run must not notice: gradients stay local (no_sync) and
    are dropped, there is no optimizer step, and buffers and the random state are restored afterwards.
    """
    par, task, ctx, cfg = trainer.par, trainer.task, trainer.ctx, trainer.cfg
    dataset = trainer.datasets["train"]
    sampler = GlobalBatchSampler(len(dataset), [batch_size] * ctx.world_size, ctx.rank, cfg.seed)
    batches = sampler.batches(epoch=0)
    buffers = [b.detach().clone() for b in par.raw_model.buffers()]  # e.g. batch-norm running statistics
    model, times = par.model, []
    was_training = model.training
    model.train()
    devices = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), par.no_sync():
        for i in range(steps + 1):
            batch = trainer.to_device(task.collate([dataset[j] for j in batches[i % len(batches)]]))
            synchronize(ctx.device)
            start = time.perf_counter()
            with slowdown(cfg, ctx):
                with trainer.autocast():
                    loss = task.loss_sum(model, batch)
                loss.float().backward()
            synchronize(ctx.device)
            times.append(time.perf_counter() - start)
    par.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for b, saved in zip(par.raw_model.buffers(), buffers):
            b.copy_(saved)
    model.train(was_training)
    return batch_size / statistics.median(times[1:])


def auto_batch_sizes(trainer, stored: Optional[list]) -> tuple[list[int], str]:
    """(per-rank batch sizes for `train.batch_size: auto`, a line for the plan). Collective: all ranks call it.

    `stored`: the sizes a resumed checkpoint trained with. They are reused as they are, so the current epoch
    continues in exactly the same data order (re-measuring could give a different split).
    """
    t, ctx = trainer.t, trainer.ctx
    if stored is not None and len(stored) == ctx.world_size and sum(stored) == t.global_batch_size:
        return list(stored), f"batch_size auto: per-rank batches {stored} reused from the checkpoint"
    if ctx.world_size == 1:
        return [t.global_batch_size], "batch_size auto: one rank takes the whole global batch"
    equal = t.global_batch_size // ctx.world_size
    speeds = D.gather_objects(ctx, measure_speed(trainer, equal, t.balance_steps))
    sizes = split_proportional(t.global_batch_size, speeds, minimum=1)  # same inputs, same answer on every rank
    shown = ", ".join(f"{s:.0f}" for s in speeds)
    return sizes, f"batch_size auto: measured samples/s per rank [{shown}] (batch {equal}) -> per-rank batches {sizes}"
