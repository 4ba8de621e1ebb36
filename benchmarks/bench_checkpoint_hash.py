"""What the sha256 record of a checkpoint's files costs (checkpoint_hashes.py): a save with and without it, and
the check before a load against the load itself, measured side by side in one run.

    python benchmarks/bench_checkpoint_hash.py [--rounds 3] [--dir /tmp/bench_checkpoint_hash]

BERT-base (transformers' BertConfig() defaults, 110M parameters, random weights) with AdamW state, one process,
saved as a run saves it (ReplicatedStrategy.save, a state.pt, checkpoint.start_write(...).finish(): fsyncs and
rename included). Saves alternate without and with the record for --rounds rounds ("without": the record replaced
by an empty one, in this process only). Then the check (checkpoint_io.verify: every file's size and sha256) and the
load it precedes (torch.load of model.pt, optimizer.pt and state.pt, as resume reads them), each with the files in
the page cache ("warm": a save just wrote them) and out of it ("cold": evicted with posix_fadvise, so they come
from the disk), alternating.
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
from core import checkpoint_io  # noqa: E402
from core import checkpoint_hashes  # noqa: E402
from core.distributed import DistContext  # noqa: E402
from strategies.replicated import ReplicatedStrategy  # noqa: E402


def evict(folder: str) -> None:
    """Drop `folder`'s files from the page cache (their pages are clean: the save fsynced them)."""
    for parent, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load(folder: str) -> None:
    for name in ("model.pt", "optimizer.pt", "state.pt"):
        torch.load(os.path.join(folder, name), map_location="cpu", weights_only=True)


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def median(values: list[float]) -> str:
    return f"{', '.join(f'{v:.2f}' for v in values)} s (median {statistics.median(values):.2f} s)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bench_checkpoint_hash")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args(argv)
    if args.tiny:  # seconds, not a measurement
        args.rounds = 1
    from transformers import BertConfig, BertModel  # only this benchmark needs it
    torch.manual_seed(0)
    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=512)
    model = BertModel(BertConfig(**tiny) if args.tiny else BertConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()  # AdamW state exists: what a real checkpoint holds
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    strategy = ReplicatedStrategy(model, model, optimizer, ctx)

    def write_files(folder: str):
        strategy.save(folder)
        torch.save({"scheduler": {}, "scaler": None, "rng": [torch.get_rng_state()]}, os.path.join(folder, "state.pt"))
        return lambda: None

    record, no_record = checkpoint_hashes.record, lambda folder: {}
    shutil.rmtree(args.dir, ignore_errors=True)
    save = {"without": [], "with": []}
    step = 0
    for _ in range(args.rounds):
        for mode in save:
            step += 1
            checkpoint_hashes.record = record if mode == "with" else no_record  # what _publish calls
            save[mode].append(timed(lambda: checkpoint.start_write(args.dir, step, ctx, write_files,
                                                                   {"step": step, "state": {}}).finish()))
            checkpoint.prune(args.dir, 1, keep=set())
    checkpoint_hashes.record = record
    path = checkpoint.latest(args.dir)  # saved with the record
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    check = {"warm": [], "cold": []}
    read = {"warm": [], "cold": []}
    for _ in range(args.rounds):
        for cache in check:
            for what, work in ((check, lambda: checkpoint_io.verify(path)), (read, lambda: load(path))):
                if cache == "cold":
                    evict(path)
                else:
                    load(path)  # every page in the cache
                what[cache].append(timed(work))
    shutil.rmtree(args.dir, ignore_errors=True)
    n = sum(t.numel() for t in model.parameters()) / 1e6
    print(f"BERT-base, {n:.0f}M parameters + AdamW state, {size / 2**30:.2f} GiB per checkpoint, {args.rounds} rounds, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    for mode, values in save.items():
        print(f"save {mode:<7} the record: {median(values)}")
    plain, hashed = statistics.median(save["without"]), statistics.median(save["with"])
    print(f"save with / without the record: {hashed / plain:.2f}x (+{hashed - plain:.2f} s)")
    for cache in check:
        v, r = statistics.median(check[cache]), statistics.median(read[cache])
        print(f"{cache}: verify {median(check[cache])}, {size / v / 1e9:.2f} GB/s; load {median(read[cache])}; "
              f"verify / load {v / r:.2f}x")


if __name__ == "__main__":
    main()
