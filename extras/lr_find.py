"""`mode: lr_find`: a learning-rate range test (Leslie Smith's; Lightning's lr_find, fastai's lr_find).

    python main.py --params X --set mode=lr_find          # -> output_dir/lr_find.csv, lr_find.png, a suggested lr

The run's own Trainer takes `lr_find.steps` optimizer steps on the training batches, the learning rate growing
exponentially from `lr_find.min` to `lr_find.max`, and stops once the loss diverges. Each step's loss is the global
one (summed over every rank, as the training line's), so it runs under any strategy. The suggestion is where the
smoothed loss falls fastest (the steepest descent against log lr), which is a starting point, not an answer: read
the plot. Nothing is saved but the two files: the weights are spoiled by the high rates, on purpose. A stop signal
(Ctrl-C) or train.time_limit ends the sweep after its step, the files written (exit code 3).
"""
from __future__ import annotations

import csv
import dataclasses
import math
import os
from typing import Optional

import numpy as np

from core import distributed
from core.errors import Stopped

SMOOTHING = 0.98  # the exponential average of the losses (debiased): a single batch's loss is noisy
DIVERGED = 4.0  # stop once the smoothed loss is this many times its lowest
SKIP_FIRST, SKIP_LAST = 10, 1  # the suggestion ignores the flat start and the divergence at the end (Lightning's)


def as_training(cfg):
    """The config the sweep's Trainer is built from: the run's own, as a fresh training run starts (no resume)."""
    return dataclasses.replace(cfg, mode="train", train=dataclasses.replace(cfg.train, resume=False))


def sweep(trainer) -> dict:
    """Run the sweep on this rank (every rank calls it); rank 0 writes the files. Returns lrs, losses, the
    smoothed losses and the suggestion (None when the sweep was too short to suggest one)."""
    cfg, ctx, optimizer = trainer.cfg.lr_find, trainer.ctx, trainer.strategy.optimizer
    base = trainer.train_cfg.lr
    factors = [g.get("initial_lr", g["lr"]) / base for g in optimizer.param_groups]  # groups keep their ratios
    stream = trainer.micro_batches()
    lrs, losses, smoothed, average, lowest = [], [], [], 0.0, math.inf
    for i in range(cfg.steps):
        lr = cfg.min * (cfg.max / cfg.min) ** (i / (cfg.steps - 1))
        for group, factor in zip(optimizer.param_groups, factors):
            group["lr"] = lr * factor
        batches = [next(stream) for _ in range(trainer.train_cfg.grad_accum_steps)]
        loss_sum, count, _, _, stop_asked = trainer.train_step(batches)
        total = distributed.all_reduce_sum(ctx, loss_sum.detach().float().reshape(1)).item()  # every rank's loss
        loss = total / count
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        smooth = average / (1 - SMOOTHING ** (i + 1))
        lrs.append(lr), losses.append(loss), smoothed.append(smooth)
        if stop_asked or not math.isfinite(smooth) or smooth > DIVERGED * lowest:
            break  # every rank sees the same global loss and votes: all stop at the same step
        lowest = min(lowest, smooth)
    result = {"lrs": lrs, "losses": losses, "smoothed": smoothed, "suggestion": suggest(lrs, smoothed)}
    if ctx.is_main:
        write(trainer.cfg.output_dir, result, trainer.log)
    if stop_asked:  # a signal or the time limit, on any rank: exit code 3, as a training run's stop
        reason = next((r for r in distributed.gather_objects(ctx, trainer.hooks.stop_reason()) if r), "a signal")
        raise Stopped(f"lr_find stopped by {reason} after {len(lrs)} of {cfg.steps} steps; lr_find.csv holds them")
    return result


def suggest(lrs: list[float], smoothed: list[float]) -> Optional[float]:
    """The lr where the smoothed loss falls fastest against log lr, the flat start and the divergence left out."""
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    # The divergence begins at the lowest smoothed loss: after a spike the average decays back steeply too, but
    # that is the spike fading from it, not the model learning faster.
    lowest = finite.index(min(finite, key=lambda i: smoothed[i])) if finite else 0
    window = finite[SKIP_FIRST:min(len(finite) - SKIP_LAST, lowest + 1)]
    if len(window) < 2:
        return None
    slopes = np.gradient(np.array([smoothed[i] for i in window]), np.log(np.array([lrs[i] for i in window])))
    return lrs[window[int(np.argmin(slopes))]]


def write(output_dir: str, result: dict, log) -> None:
    """lr_find.csv (every step), lr_find.png (loss against lr, log scale, the suggestion marked) and one line."""
    path = os.path.join(output_dir, "lr_find.csv")
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["step", "lr", "loss", "smoothed_loss"])
        for i, row in enumerate(zip(result["lrs"], result["losses"], result["smoothed"]), 1):
            out.writerow([i, *(f"{v:.6g}" for v in row)])
    picture = plot(output_dir, result)
    lr, n = result["suggestion"], len(result["lrs"])
    said = f"suggested lr {lr:.3g} (the steepest fall of the loss)" if lr else \
        "no suggestion: the loss fell for too few steps (lower lr_find.min, or more lr_find.steps)"
    log.info(f"lr_find: {said}; {n} steps from {result['lrs'][0]:.3g} to {result['lrs'][-1]:.3g}: {path}"
             + (f", {picture}" if picture else ""))


def plot(output_dir: str, result: dict) -> Optional[str]:
    """lr_find.png, or None with one line where matplotlib is missing (the CSV has the numbers)."""
    try:
        import matplotlib  # optional: only this picture needs it
        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        print("note: lr_find.png needs matplotlib (python -m pip install matplotlib); lr_find.csv has the numbers")
        return None
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    axes.plot(result["lrs"], result["losses"], color="0.75", linewidth=1, label="loss")
    axes.plot(result["lrs"], result["smoothed"], color="C0", label="smoothed")
    if result["suggestion"]:
        i = result["lrs"].index(result["suggestion"])
        axes.plot([result["suggestion"]], [result["smoothed"][i]], "o", color="C3", markersize=8,
                  label=f"suggested lr {result['suggestion']:.3g}")
    axes.set_xscale("log")
    axes.set_xlabel("learning rate")
    axes.set_ylabel("training loss")
    smooth = [v for v in result["smoothed"] if math.isfinite(v)]
    low = min([v for v in result["losses"] if math.isfinite(v)] + smooth, default=None)
    if smooth and low is not None:  # the divergence at the end would squash the rest
        axes.set_ylim(low - 0.05 * abs(low) - 0.05, max(smooth[0], min(smooth)) * 1.5 + 0.05)
    axes.legend()
    axes.grid(True, which="both", alpha=0.3)
    path = os.path.join(output_dir, "lr_find.png")
    figure.savefig(path, dpi=100, bbox_inches="tight")
    pyplot.close(figure)
    return path
