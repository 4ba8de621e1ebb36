"""An A/B that can tell a 3% change from noise: two trees of this project (any two commits), or this Trainer and
Hugging Face's, run alternately in N pairs; each side's median samples/s, the median of the per-pair ratios B/A
and its spread (min-max, and a bootstrap 95% interval of the median ratio).

    python benchmarks/ab.py ec598c5 HEAD [--pairs 10] [--steps 300] [--params parameters.yml] [--set KEY=VALUE ...]
    python benchmarks/ab.py ec598c5 .                      # `.`: this working tree as it is, uncommitted edits too
    python benchmarks/ab.py --vs-hf [--pairs 10] [--hf-args "--steps 50 --rounds 2"]   # A = HF's Trainer, B = ours

Two commits: each is exported (`git archive`, nothing of this checkout changes) into a temporary folder, with
`../shared` linked beside it as in a clone; each side is `python main.py` in its tree, a fresh process, on the same
params, seed and overrides (no evaluation, no checkpoints). A side's samples/s is the median of the samples_per_s
its log lines report, the first window (start-up) left out. --vs-hf: each pair is one run of bench_vs_hf.py, which
already alternates blocks of the two sides on the same batches in one process.

The order within a pair alternates (A B, B A, A B, ...) so that a machine drifting over the run hits both sides
alike. Read the interval, not one ratio: when it holds 1.0, the two cannot be told apart with this many pairs; its
half-width is the smallest change this run could show. Take the figures on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
QUIET = ["train.eval_every=0", "train.save_every=0", "log.progress_bar=false", "log.tensorboard=false"]


def export_tree(commit: str, folder: str) -> str:
    """The tree of `commit` in folder/tree (`.`: this checkout itself), ../shared linked beside it."""
    if commit == ".":
        return ROOT
    tree = os.path.join(folder, "tree")
    os.makedirs(tree)
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True)
    if archive.returncode:
        sys.exit(f"error: git archive {commit}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    if os.path.isdir(SHARED):
        os.symlink(SHARED, os.path.join(folder, "shared"))
    return tree


def logged_rates(log: str) -> list[float]:
    """The samples_per_s of each training line, as the log writes them (4 significant digits: 1.502e+04 too)."""
    return [float(v) for v in re.findall(r"samples_per_s=([\d.]+(?:e[+-]?\d+)?)", log)]


def main_py_rate(tree: str, out: str, args) -> float:
    """One run of main.py in `tree`: the median logged samples/s, the first window left out."""
    sets = [f"output_dir={out}", f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", *QUIET,
            *args.set]
    cmd = [sys.executable, "main.py", "--params", args.params, *[a for s in sets for a in ("--set", s)]]
    r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: {' '.join(cmd)} in {tree} exited {r.returncode}:\n{r.stderr[-2000:]}")
    with open(os.path.join(out, "logs", "rank0.log")) as f:
        rates = logged_rates(f.read())
    if not rates:
        sys.exit(f"error: {out}/logs/rank0.log has no samples_per_s: raise --steps above --log-every")
    return statistics.median(rates[1:] or rates)


def vs_hf_rates(args) -> tuple[float, float]:
    """One run of bench_vs_hf.py: (HF's samples/s, ours)."""
    cmd = [sys.executable, os.path.join("benchmarks", "bench_vs_hf.py"), *shlex.split(args.hf_args)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    skipped = re.search(r"^skipped: .*", r.stdout, re.M)
    if r.returncode or skipped:
        sys.exit(skipped.group(0) if skipped else f"error: {' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    rate = {name: float(re.search(rf"{name}: +([\d.]+) samples/s", r.stdout).group(1))
            for name in ("HF Trainer", "this Trainer")}
    return rate["HF Trainer"], rate["this Trainer"]


def bootstrap_median(values: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% bootstrap interval of the median: pairs drawn with replacement, `rounds` times."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def summary(labels: dict[str, str], rates: dict[str, list[float]]) -> list[str]:
    """Each side's median and its runs, then the ratio B/A: median, min-max, bootstrap interval, verdict."""
    a, b = "A", "B"
    ratios = [y / x for x, y in zip(rates[a], rates[b])]
    low, high = bootstrap_median(ratios)
    med = statistics.median(ratios)
    verdict = ("too few pairs to judge (take 5 or more)" if len(ratios) < 5 else
               "cannot be told apart from noise with these pairs" if low <= 1.0 <= high else
               f"B is {'faster' if med > 1 else 'slower'} than A beyond this run's noise")
    return [f"{side} {labels[side]}: median {statistics.median(rates[side]):.1f} samples/s (pairs: "
            + ", ".join(f"{v:.1f}" for v in rates[side]) + ")" for side in (a, b)] + [
            f"ratio B/A: median {med:.3f}, min-max {min(ratios):.3f}-{max(ratios):.3f}, bootstrap 95% interval "
            f"{low:.3f}-{high:.3f} (+-{100 * (high - low) / 2 / med:.1f}%), {len(ratios)} pairs: {verdict}"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("commits", nargs="*", help="A and B: two commits (`.` = this working tree)")
    p.add_argument("--vs-hf", action="store_true", help="A = Hugging Face's Trainer, B = ours (bench_vs_hf.py)")
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of each main.py run")
    p.add_argument("--log-every", type=int, default=20, help="steps per logged samples/s window")
    p.add_argument("--params", default="parameters.yml", help="the params file, inside each tree")
    p.add_argument("--set", action="append", default=[], help="an override for both sides (repeatable)")
    p.add_argument("--hf-args", default="--steps 50 --rounds 2", help="--vs-hf: bench_vs_hf.py's arguments")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args(argv)
    if args.vs_hf != (not args.commits) or (args.commits and len(args.commits) != 2):
        p.error("give two commits, or --vs-hf")
    if args.tiny:
        args.pairs, args.steps, args.log_every, args.hf_args = 2, 8, 4, "--tiny"
    labels = dict(zip("AB", ("HF's Trainer", "this Trainer") if args.vs_hf else args.commits))
    rates = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        if not args.vs_hf:
            trees = {side: export_tree(labels[side], os.path.join(tmp, side)) for side in "AB"}
        for pair in range(args.pairs):
            if args.vs_hf:
                for side, rate in zip("AB", vs_hf_rates(args)):
                    rates[side].append(rate)
            else:
                for side in ("AB" if pair % 2 == 0 else "BA"):
                    rates[side].append(main_py_rate(trees[side], os.path.join(tmp, f"run-{pair}-{side}"), args))
            print(f"pair {pair + 1}/{args.pairs}: A {rates['A'][-1]:.1f}, B {rates['B'][-1]:.1f} samples/s", flush=True)
    what = "bench_vs_hf.py " + args.hf_args if args.vs_hf else f"main.py --params {args.params}, {args.steps} steps"
    order = "the sides' blocks alternating within each run" if args.vs_hf else "alternating order"
    print(f"\n{what}, {args.pairs} pairs, {order}; samples/s")
    print("\n".join(summary(labels, rates)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
