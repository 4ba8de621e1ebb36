"""Two CPU ranks on one host, with and without OMP_WAIT_POLICY=PASSIVE: what main.py's launcher now sets.

    python benchmarks/bench_omp_wait.py [--rounds 3 --steps 20 --params configs/sst2_minilm.yml --batch 8]

Each round runs main.py twice, alternating the order (before, after / after, before) so that drift of a shared
machine hits both alike: `before` is the launcher as it was (the ranks start with OpenMP's default waiting:
threads spin for a while before they sleep), `after` is main.py as it is (PASSIVE: idle threads sleep at once).
Both use 2 ddp ranks (gloo), cores // 2 threads per rank, the same seed and data. Throughput is the median of the
samples/s that rank 0 logs (the first window, with start-up costs, left out); the whole run's wall time too.
OMP_WAIT_POLICY and OMP_NUM_THREADS from the calling shell are dropped; --threads N sets OMP_NUM_THREADS=N in both.
"""
import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode: str, args, out: str) -> dict:
    """One training run by main.py in a subprocess; `before` turns off launcher.rank_environment (our launcher
    then passes the environment on unchanged, as it did before)."""
    patch = "launcher.rank_environment = lambda cfg, nprocs: {}; " if mode == "before" else ""
    code = f"import sys, main; from resilience import launcher; {patch}sys.exit(main.main(sys.argv[1:]))"
    with socket.socket() as s:  # a free port for each run
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", code, "--params", args.params, "--set", f"output_dir={out}",
           "--set", f"dist.master_port={port}",
           "--set", "dist.strategy=ddp", "--set", "dist.procs_per_node=2", "--set", f"train.max_steps={args.steps}",
           "--set", f"train.log_every={args.log_every}", "--set", "train.eval_every=0", "--set", "train.save_every=0",
           "--set", f"train.batch_size={args.batch}", "--set", "log.tensorboard=false",
           "--set", "log.progress_bar=false", *[a for kv in args.set for a in ("--set", kv)]]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if args.threads:  # more threads than a rank's share of the cores, as on a machine other jobs also use
        env["OMP_NUM_THREADS"] = str(args.threads)
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(f"{mode} run failed:\n{r.stderr[-3000:]}")
    with open(os.path.join(out, "logs", "rank0.log")) as f:
        log = f.read()
    sps = [float(v) for v in re.findall(r"step \d+/\d+ .*?samples_per_s=(\S+)", log)]
    plan = re.search(r"CPU threads per rank .*", log)
    return {"sps": statistics.median(sps[1:] or sps), "wall": wall, "plan": plan.group(0) if plan else "?"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="configs/sst2_minilm.yml")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for both (0: unset, cores // 2)")
    p.add_argument("--set", action="append", default=[], help="more overrides, e.g. data.data_dir=...")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.params, args.rounds, args.steps, args.log_every, args.batch = "parameters.yml", 1, 4, 2, 8
    results = {"before": [], "after": []}
    tmp = tempfile.mkdtemp(prefix="bench-omp-")
    try:
        for r in range(args.rounds):
            for mode in (("before", "after") if r % 2 == 0 else ("after", "before")):
                out = os.path.join(tmp, f"{mode}{r}")
                res = run(mode, args, out)
                results[mode].append(res)
                print(f"round {r} {mode:6s}: {res['sps']:7.2f} samples/s, run {res['wall']:6.1f} s   "
                      f"[{res['plan']}]", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: statistics.median(x["sps"] for x in v) for m, v in results.items()}
    wall = {m: statistics.median(x["wall"] for x in v) for m, v in results.items()}
    print(f"median samples/s: before {med['before']:.2f}, after {med['after']:.2f} "
          f"(x{med['after'] / med['before']:.2f}); median run: before {wall['before']:.0f} s, "
          f"after {wall['after']:.0f} s")


if __name__ == "__main__":
    main()
