"""LoRA vs full fine-tuning of MiniLM on real SST-2: the same steps, batch and data order, then the memory each keeps
and the dev accuracy each reaches.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_lora.py [--steps 300] [--data ../shared/data/sst2]
                                                            [--dir /tmp/bench_lora] [--lora-lr 5e-4]

configs/sst2_minilm.yml (full fine-tuning, lr 5e-5) and configs/sst2_minilm_lora.yml (rank 8 on query and value,
the classifier whole, lr --lora-lr), each for --steps optimizer steps in this one process, through the Trainer a run
uses. Reported per run: parameters that train, the optimizer state's bytes after training (tests/rank_memory.state_bytes), the checkpoint's model.pt + optimizer.pt bytes, ms per step (the mean of the logged
windows; the runs are sequential, so on a shared machine compare them loosely) and the dev accuracy at the last
step (the whole dev split). Skips (exit 0) without the data folder.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(preset: str, out: str, steps: int, data: str, lr: float) -> dict:
    import torch
    from core import process_group
    from tests.rank_memory import state_bytes
    from wiring import checked_config
    from wiring import build_task
    from wiring import build_trainer
    sets = [f"output_dir={out}", f"data.data_dir={data}", f"train.max_steps={steps}", f"train.eval_every={steps}",
            f"train.save_every={steps}", f"train.lr={lr}", "train.log_every=25", "log.tensorboard=false",
            "train.precision=fp32"]
    cfg = checked_config(os.path.join(ROOT, "configs", preset), sets)
    ctx = process_group.init(cfg, 0, 1, 0)
    trainer = build_trainer(cfg, ctx)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    held = state_bytes(trainer.strategy)
    step_dir = os.path.join(out, "checkpoints", f"step-{steps}")
    saved = sum(os.path.getsize(os.path.join(step_dir, f)) for f in ("model.pt", "optimizer.pt"))
    log = open(os.path.join(out, "logs", "rank0.log")).read()
    ms = [float(x) for x in re.findall(r"ms_per_step=(\S+)", log)]
    accuracy = float(re.findall(r"dev .*?accuracy=(\S+)", log)[-1])
    model = trainer.strategy.raw_model
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del trainer
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"trained": trained, "optimizer": held["optimizer"], "saved": saved,
            "ms": sum(ms) / len(ms), "accuracy": accuracy, "wall": wall}


def head_of_splits(data: str, folder: str, rows: dict) -> str:
    os.makedirs(folder)
    for name, n in rows.items():
        with open(os.path.join(data, name)) as f:
            lines = [line for _, line in zip(range(n + 1), f)]  # the header and n rows
        with open(os.path.join(folder, name), "w") as f:
            f.writelines(lines)
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--data", default=os.path.join(os.path.dirname(ROOT), "shared", "data", "sst2"))
    p.add_argument("--dir", default="/tmp/bench_lora")
    p.add_argument("--full-lr", type=float, default=5e-5)
    p.add_argument("--lora-lr", type=float, default=5e-4)
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args(argv)
    if args.tiny:  # seconds, not a measurement
        args.steps = 2
    if not os.path.isfile(os.path.join(args.data, "train.tsv")):
        print(f"skipped: {args.data}/train.tsv not found (real SST-2)")
        return 0
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.tiny:  # the first rows of each split: the whole dev split is evaluated at the end
        args.data = head_of_splits(args.data, os.path.join(args.dir, "data"), {"train.tsv": 200, "dev.tsv": 32})
    rows = {}
    for name, preset, lr in (("full fine-tuning", "sst2_minilm.yml", args.full_lr),
                             ("LoRA r=8 (query, value) + head", "sst2_minilm_lora.yml", args.lora_lr)):
        rows[name] = run(preset, os.path.join(args.dir, preset.split(".")[0]), args.steps, args.data, lr)
        print(name, rows[name], flush=True)
    mib = 1 << 20
    print(f"\n{args.steps} steps, batch 32, max_length 64, fp32, one process\n")
    print("| run | lr | parameters that train | optimizer state | checkpoint (model.pt + optimizer.pt) | ms/step "
          "| dev accuracy |")
    print("|---|---|---|---|---|---|---|")
    for (name, r), lr in zip(rows.items(), (args.full_lr, args.lora_lr)):
        print(f"| {name} | {lr:g} | {r['trained']:,} | {r['optimizer'] / mib:.2f} MiB | "
              f"{r['saved'] / mib:.2f} MiB | {r['ms']:.0f} | {r['accuracy']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
