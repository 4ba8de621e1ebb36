"""Per-rank model-state memory of the strategies, measured from the tensors each rank holds.

    python benchmarks/bench_sharded_memory.py [--procs 2 4] [--model bert-base|tiny]

For each strategy and world size, every rank builds BERT-base (BertForMaskedLM from a default BertConfig,
random init, ~110M parameters), wraps it with the project's strategy (strategies.STRATEGIES), runs one fp32
training step on a tiny batch (this is about memory, not speed) and then counts, before zero_grad, the bytes of
parameters, gradients and optimizer state it holds (strategies.state_bytes: local shards only). The table shows
rank 0 (the largest shard under oss) next to the ZeRO paper's bytes per parameter for fp32 AdamW training:
params 4 + grads 4 + Adam moments 8 = 16, divided by N where the strategy shards that part.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (label, dist section). The formula: bytes per parameter on one rank for fp32 AdamW with N ranks.
STRATEGIES = [
    ("ddp", {"strategy": "ddp"}, lambda n: 4 + 4 + 8),
    ("oss (fairscale, ZeRO-1)", {"strategy": "oss"}, lambda n: 4 + 4 + 8 / n),
    ("oss torch ZeRO-1", {"strategy": "oss", "oss_impl": "torch"}, lambda n: 4 + 4 + 8 / n),
    ("oss + shard_grads (ZeRO-2)", {"strategy": "oss", "shard_grads": True}, lambda n: 4 + (4 + 8) / n),
    ("fsdp (FSDP2, ZeRO-3)", {"strategy": "fsdp"}, lambda n: (4 + 4 + 8) / n),
    ("fsdp fairscale (ZeRO-3; CPU shim)", {"strategy": "fsdp", "fsdp_impl": "fairscale"}, lambda n: (4 + 4 + 8) / n),
]


def build_model(name: str):
    from transformers import BertConfig, BertForMaskedLM
    config = BertConfig() if name == "bert-base" else BertConfig(hidden_size=64, num_hidden_layers=2,
                                                                 num_attention_heads=2, intermediate_size=128)
    return BertForMaskedLM(config)


def worker(rank: int, world: int, port: int, dist_section: dict, model_name: str, queue) -> None:
    import dataclasses
    from config import config_from_dict
    from distributed import DistContext
    from strategies import STRATEGIES as APPLY, state_bytes
    torch.set_num_threads(1)
    fairscale_fsdp = dist_section.get("fsdp_impl") == "fairscale"
    if fairscale_fsdp:  # CUDA only in the product; on CPU through the shim the tests use (tests/fairscale_cpu.py)
        from tests import fairscale_cpu
        fairscale_cpu.install()
        dist_section = {k: v for k, v in dist_section.items() if k != "fsdp_impl"}
    cfg = config_from_dict({"output_dir": "/tmp/bench_sharded", "train": {"weight_decay": 0.01},
                            "dist": {**dist_section, "procs_per_node": world, "device": "cpu"}}, "bench")
    if fairscale_fsdp:
        cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, fsdp_impl="fairscale"))
    backend = None
    if cfg.dist.strategy != "none":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        backend = "gloo"
    ctx = DistContext(rank, world, rank, torch.device("cpu"), backend)
    torch.manual_seed(0)
    model = build_model(model_name)
    n_params = sum(p.numel() for p in model.parameters())
    par = APPLY[cfg.dist.strategy](model, cfg, ctx)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
    par.model(input_ids=ids, labels=ids).loss.backward()
    par.optimizer.step()
    queue.put((rank, n_params, state_bytes(par)))  # before zero_grad: params, grads and state all present
    if backend:
        dist.barrier()
        dist.destroy_process_group()


def measure(world: int, dist_section: dict, model_name: str) -> tuple[int, list[dict]]:
    from tests.conftest import free_port
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, free_port(), dist_section, model_name, queue), nprocs=world, join=True)
    results = sorted(queue.get() for _ in range(world))
    return results[0][1], [r[2] for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model", default="bert-base", choices=["bert-base", "tiny"])
    args = ap.parse_args()
    mb = 2 ** 20
    rows = []
    n, per_rank = measure(1, {"strategy": "none"}, args.model)
    rows.append(("none", 1, per_rank, 16.0))
    for world in args.procs:
        for label, section, formula in STRATEGIES:
            n, per_rank = measure(world, section, args.model)
            rows.append((label, world, per_rank, formula(world)))
            print(f"done: {label} x{world}", file=sys.stderr, flush=True)
    print(f"{args.model}: {n / 1e6:.1f}M parameters, fp32 AdamW, one step on a 1x16 batch, "
          f"{datetime.date.today()}, torch {torch.__version__}\n")
    print("| strategy | procs | params MiB | grads MiB | optimizer MiB | total MiB (rank 0) | bytes/param "
          "measured (rank 0 / largest rank) | ZeRO formula bytes/param |")
    print("|---|---|---|---|---|---|---|---|")
    for label, world, per_rank, formula in rows:
        r0 = per_rank[0]
        totals = [sum(r.values()) for r in per_rank]
        print(f"| {label} | {world} | {r0['params'] / mb:.0f} | {r0['grads'] / mb:.0f} | "
              f"{r0['optimizer'] / mb:.0f} | {totals[0] / mb:.0f} | {totals[0] / n:.2f} / {max(totals) / n:.2f} | "
              f"{formula:.2f} |")


if __name__ == "__main__":
    main()
