"""Recovery time of an elastic torchrun run after a node is lost (issue 20, item 4).

Runs tests/test_elastic_launch.py's scenario (two network namespaces, one torchrun agent each, `--nnodes=1:2
--max-restarts=3`, c10d rendezvous with last_call_timeout=1 and keep_alive_interval=1; needs root) N times and
prints, for each stage of node 0's recovery, the seconds from node 1's kill: its worker failed on the lost peer,
the restarted worker's process started, the checkpoint was reloaded ("resumed from" in its log), its first
training step at world 1.

    python benchmarks/bench_elastic.py [--runs 3]
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("worker failed", "worker restarted", "checkpoint reloaded", "first step")


def one_run() -> dict:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                        "tests/test_elastic_launch.py", "-k", "lost"], cwd=ROOT, capture_output=True, text=True)
    found = re.search(r"recovery after node 1 was lost \(s from the kill\): (\{.*\})", r.stdout)
    if r.returncode != 0 or not found:
        sys.exit(f"the scenario failed (exit {r.returncode}):\n{r.stdout[-3000:]}")
    return ast.literal_eval(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    runs = [one_run() for _ in range(p.parse_args().runs)]
    for stage in STAGES:
        values = [r[stage] for r in runs]
        print(f"{stage:20s} median {statistics.median(values):5.1f} s  (runs: "
              + ", ".join(f"{v:.1f}" for v in values) + ")")


if __name__ == "__main__":
    main()
