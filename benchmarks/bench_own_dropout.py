"""What each rank's own dropout masks cost (strategies/tp.PerRankDropout): a training step of a random GPT-2 under a tp
plan with dropout 0.1, with and without the plan's PerRankDropout entries, timed interleaved.

    python benchmarks/bench_own_dropout.py [--layers 4] [--width 256] [--heads 8] [--batch 8] [--seq 128] [--rounds 20]

One gloo CPU process on a tp mesh of size 1 (the hooks do the same work at any tp size: one integer drawn, the
generators' states saved, seeded and restored per region). The figure is the ratio of the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def build(args, own: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import GPT2Config, GPT2LMHeadModel
    from strategies.tp import PerRankDropout
    from tasks.lm_models import tp_plan
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                                       n_head=args.heads, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1,
                                       bos_token_id=0, eos_token_id=0))
    plan = tp_plan(model, 1)
    if not own:  # the plan as it was: the split styles only
        plan = {k: (s.inner if isinstance(s, PerRankDropout) else s) for k, s in plan.items()}
        plan = {k: s for k, s in plan.items() if s is not None}
    return parallelize_module(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), plan).train()


def step(model, ids) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("width", 256), ("heads", 8), ("batch", 8), ("seq", 128), ("rounds", 20)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.layers, args.width, args.heads, args.batch, args.seq, args.rounds = 1, 32, 2, 2, 16, 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29741")
    dist.init_process_group("gloo", rank=0, world_size=1)
    models = {"own": build(args, True), "shared": build(args, False)}
    ids = torch.randint(1024, (args.batch, args.seq))
    times = {k: [] for k in models}
    for _ in range(args.rounds + 2):  # interleaved; the first two rounds warm up
        for k, m in models.items():
            times[k].append(step(m, ids))
    own, shared = (statistics.median(times[k][2:]) for k in ("own", "shared"))
    print(f"median step: own masks {own * 1e3:.1f} ms, shared {shared * 1e3:.1f} ms, ratio {own / shared:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
