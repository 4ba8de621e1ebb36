"""The training stall of one checkpoint: train.async_save false vs true, measured side by side in one run.

    python benchmarks/bench_async_save.py [--params 110] [--rounds 3] [--dir /tmp/bench_async_save]

A model of --params million fp32 parameters (a stack of square Linear layers) with AdamW state (so 16 bytes per
parameter are saved: model.pt and optimizer.pt), one process, through the same code a run uses
(ReplicatedStrategy.save / start_save and checkpoint.start_write / PendingWrite.finish). The stall is the time the
training loop is held by a save: all of it when synchronous; the host copy and the thread's start when
asynchronous (copy to the host, then, after --train-s seconds of training, publishing it at the next save).
Saves alternate sync, async, sync, ... for --rounds rounds. Both include the fsyncs that make a checkpoint durable.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core import checkpoint  # noqa: E402
from core.distributed import DistContext  # noqa: E402
from strategies.replicated import ReplicatedStrategy  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=110, help="millions of parameters")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bench_async_save")
    p.add_argument("--train-s", type=float, default=10, help="training time between two saves (async: the write's)")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args(argv)
    if args.tiny:  # seconds, not a measurement
        args.params, args.rounds, args.train_s = 1, 1, 0.1
    width = 2048
    layers = max(1, round(args.params * 1e6 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # AdamW state exists: what a real checkpoint holds
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    strategy = ReplicatedStrategy(model, model, optimizer, ctx)
    shutil.rmtree(args.dir, ignore_errors=True)
    stall = {"sync": [], "async": []}
    step = 0
    for _ in range(args.rounds):
        for mode in ("sync", "async"):
            step += 1
            start = time.perf_counter()
            write = strategy.start_save if mode == "async" else (lambda d: strategy.save(d) or (lambda: None))
            pending = checkpoint.start_write(args.dir, step, ctx, write, {"step": step, "state": {}})
            held = time.perf_counter() - start
            if mode == "async":  # training goes on; the next save publishes this one
                time.sleep(args.train_s)
            start = time.perf_counter()
            pending.finish()
            stall[mode].append(held + time.perf_counter() - start)
            checkpoint.prune(args.dir, 1, keep=set())
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(args.dir) for f in fs) / 2**30
    shutil.rmtree(args.dir, ignore_errors=True)
    n = sum(t.numel() for t in model.parameters()) / 1e6
    print(f"{n:.0f}M parameters + AdamW state, {size:.2f} GiB per checkpoint, {args.rounds} rounds, "
          f"{os.cpu_count()} cores")
    for mode, values in stall.items():
        print(f"stall {mode:<5} {', '.join(f'{v:.2f}' for v in values)} s  (median {statistics.median(values):.2f} s)")
    print(f"stall ratio sync / async: {statistics.median(stall['sync']) / statistics.median(stall['async']):.1f}x")


if __name__ == "__main__":
    main()
