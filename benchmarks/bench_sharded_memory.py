"""Per-rank model-state memory of the strategies, measured from the tensors each rank holds.

    python benchmarks/bench_sharded_memory.py [--procs 2 4] [--model bert-base|tiny] [--json rows.json]

For each strategy and world size, every rank builds BERT-base (BertForMaskedLM from a default BertConfig,
random init, ~110M parameters), wraps it with the project's strategy (wiring.STRATEGIES), runs one fp32
training step on a tiny batch (this is about memory, not speed) and then counts, before zero_grad, the bytes of
parameters, gradients and optimizer state it holds (tests/rank_memory.state_bytes: local shards only). The table shows
rank 0 (the largest shard under oss) next to the ZeRO paper's bytes per parameter for fp32 AdamW training:
params 4 + grads 4 + Adam moments 8 = 16, divided by N where the strategy shards that part.
"""
from __future__ import annotations

import argparse
import datetime
import json
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


def worker(rank: int, world: int, port: int, sections: list, model_name: str, queue) -> None:
    """One rank: every strategy of `sections` in turn, in one process group (a process start costs more than the
    measurement). fairscale's FSDP comes last: its CPU shim, once installed, stays."""
    import dataclasses
    from wiring import checked_config_from_dict
    from core.distributed import DistContext
    from wiring import parallelize as apply
    from tests.rank_memory import state_bytes
    torch.set_num_threads(1)
    backend = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        backend = "gloo"
    ctx = DistContext(rank, world, rank, torch.device("cpu"), backend)
    for index, dist_section in enumerate(sections):
        fairscale_fsdp = dist_section.get("fsdp_impl") == "fairscale"
        if fairscale_fsdp:  # CUDA only in the product; on CPU through the shim the tests use (tests/fairscale_cpu.py)
            from tests import fairscale_cpu
            fairscale_cpu.install()
            dist_section = {k: v for k, v in dist_section.items() if k != "fsdp_impl"}
        cfg = checked_config_from_dict({"output_dir": "/tmp/bench_sharded", "train": {"weight_decay": 0.01},
                                        "dist": {**dist_section, "procs_per_node": world, "device": "cpu"}}, "bench")
        if fairscale_fsdp:
            cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, fsdp_impl="fairscale"))
        torch.manual_seed(0)
        model = build_model(model_name)
        n_params = sum(p.numel() for p in model.parameters())
        strategy = apply(model, cfg, ctx, None, None)
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
        strategy.model(input_ids=ids, labels=ids).loss.backward()
        strategy.optimizer.step()
        queue.put((index, rank, n_params, state_bytes(strategy)))  # before zero_grad: params, grads and state all present
        del strategy, model
        if backend:
            dist.barrier()
    if backend:
        dist.destroy_process_group()


def measure(world: int, sections: list, model_name: str) -> list[tuple[int, list[dict]]]:
    """[(parameters, [bytes held by each rank])] for each dist section, measured with `world` processes."""
    from tests.conftest import free_port
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, free_port(), sections, model_name, queue), nprocs=world, join=True)
    results = sorted(queue.get() for _ in range(world * len(sections)))
    return [(results[i * world][2], [r[3] for r in results[i * world:(i + 1) * world]]) for i in range(len(sections))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model", default="bert-base", choices=["bert-base", "tiny"])
    ap.add_argument("--json", help="also write the rows here (docs/tutorial/plots.py memory draws them)")
    ap.add_argument("--tiny", action="store_true",
                    help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = ap.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.procs, args.model = [2], "tiny"
    mb = 2 ** 20
    [(n, per_rank)] = measure(1, [{"strategy": "none"}], args.model)
    rows = [("none", 1, per_rank, 16.0)]
    for world in args.procs:
        measured = measure(world, [section for _, section, _ in STRATEGIES], args.model)
        for (label, _, formula), (n, per_rank) in zip(STRATEGIES, measured):
            rows.append((label, world, per_rank, formula(world)))
        print(f"done: {world} processes", file=sys.stderr, flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "parameters": n, "torch": torch.__version__, "rows": [
                {"label": label, "procs": world, "per_rank": per_rank, "formula": formula}
                for label, world, per_rank, formula in rows]}, f, indent=1)
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
