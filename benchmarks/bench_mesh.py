"""Steps per second of each mesh layout (pp x dp x tp) on CPU, measured side by side in one run.

    python benchmarks/bench_mesh.py [--task bert_pretrain|gpt2_lm] [--model tiny|bert-base] [--steps 20]
                                    [--rounds 2] [--batch 16]

bert_pretrain: BERT pretraining (random init, NVIDIA-format shards written here from generated text, sequence length
64) under one process and the dp x tp layouts. gpt2_lm: a random GPT-2 (model.arch gpt2, context 64, generated
stories) under one process, ddp 2 x tp 2 and pipe 2 stages x tp 2. Each trained through main.py with each layout in
turn, for --rounds rounds interleaved (one, ddp 2, tp 2, ..., then again), so that the machine's load falls on all
of them alike. The figure is the median ms per optimizer step over each run's logged steps after the first log line
(start-up and the first steps excluded), also given as steps/s and as a ratio to one process. The global batch is
the same in every layout. On a machine with fewer cores than ranks the 4-rank layouts share cores: read the
ratios, not the absolute speed.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

LAYOUTS = {  # per task: name, dist settings, replicas (the global batch is --batch in each)
    "bert_pretrain": [
        ("one process", ["dist.strategy=none"], 1),
        ("ddp 2", ["dist.strategy=ddp", "dist.procs_per_node=2"], 2),
        ("tp 2", ["dist.strategy=ddp", "dist.procs_per_node=2", "dist.tp=2"], 1),
        ("fsdp 2", ["dist.strategy=fsdp", "dist.procs_per_node=2"], 2),
        ("ddp 2 x tp 2", ["dist.strategy=ddp", "dist.procs_per_node=4", "dist.tp=2"], 2),
        ("fsdp 2 x tp 2", ["dist.strategy=fsdp", "dist.procs_per_node=4", "dist.tp=2"], 2)],
    "gpt2_lm": [
        ("one process", ["dist.strategy=none"], 1),
        ("ddp 2 x tp 2", ["dist.strategy=ddp", "dist.procs_per_node=4", "dist.tp=2"], 2),
        ("pipe 2 x tp 2", ["dist.strategy=pipe", "dist.procs_per_node=4", "dist.tp=2", "dist.pp_stages=2"], 1)],
}


def make_data(folder: str, task: str) -> str:
    import make_bert_shards
    import make_sample_text_data as sample
    if task == "gpt2_lm":
        return sample.write_gpt2(os.path.join(folder, "gpt2"), random.Random(0), sizes=(2000, 40))
    text = sample.write_bert_text(os.path.join(folder, "bert.txt"), random.Random(0), documents=300)
    assert make_bert_shards.main(["--input", text, "--output-dir", os.path.join(folder, "bert"), "--seq-length",
                                  "64", "--max-predictions", "10", "--shards", "2"]) == 0
    return os.path.join(folder, "bert")


def run(data: str, out: str, settings: list[str], replicas: int, args) -> float:
    """One training run; the median ms per step of its logged windows (each logged line covers log_every steps)."""
    # A task's own settings (GPT-2: blocks of 64 tokens, padded to that length: pipe needs constant shapes)
    own = ["model.arch=gpt2", "data.max_length=64"] if args.task == "gpt2_lm" else []
    sets = [f"task={args.task}", f"data.data_dir={data}", f"model.name={args.model}", "model.dropout=0", *own,
            f"train.max_steps={args.steps}", "train.epochs=0", f"train.batch_size={args.batch // replicas}",
            "train.eval_every=0", "train.save_every=0", "train.log_every=2", f"output_dir={out}",
            "log.progress_bar=false", "log.tensorboard=false", "train.start_over=true", *settings]
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--params", os.path.join(ROOT, "parameters.yml")]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if done.returncode:
        sys.exit(f"{settings} failed:\n{done.stderr[-2000:]}")
    rates = [float(x) for x in re.findall(r"samples_per_s=(\S+)", open(os.path.join(out, "logs", "rank0.log")).read())]
    return 1000 * args.batch / statistics.median(rates[1:] or rates)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="bert_pretrain", choices=sorted(LAYOUTS))
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args(argv)
    if args.tiny:  # seconds, not a measurement
        args.steps, args.rounds, args.batch = 4, 1, 4
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(tmp, args.task)
        layouts = [lay for lay in LAYOUTS[args.task] if not args.tiny or lay[0] in ("one process", "tp 2")]
        times: dict[str, list[float]] = {name: [] for name, _, _ in layouts}
        for r in range(args.rounds):
            for name, settings, replicas in layouts:
                times[name].append(run(data, os.path.join(tmp, f"run-{r}-{len(times[name])}-{name.replace(' ', '')}"),
                                       settings, replicas, args))
    base = statistics.median(times["one process"])
    print(f"{args.task} {args.model}, seq 64, global batch {args.batch}, {args.steps} steps, {args.rounds} rounds, "
          f"{os.cpu_count()} cores")
    print(f"{'layout':<16} {'ms/step (each round)':<28} {'median':>8} {'steps/s':>8} {'vs one process':>15}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<16} {', '.join(f'{v:.0f}' for v in values):<28} {med:>8.0f} {1000 / med:>8.2f} "
              f"{base / med:>14.2f}x")


if __name__ == "__main__":
    main()
