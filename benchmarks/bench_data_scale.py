"""Start-up time and peak memory of a gpt2_lm run as the corpus grows (issue 12): prepared token shards keep both
flat, the JSON-array path does not.

    python benchmarks/bench_data_scale.py                       # 10 MB and 100 MB of synthetic text
    python benchmarks/bench_data_scale.py --sizes 10,100,1000   # and 1 GB (tokenizing it takes a while)

For each size: write a synthetic JSON-lines corpus (made-up words with a Zipf distribution, in /tmp by default),
tokenize it once with scripts/prepare_text.py (its time is reported separately: preparation, not start-up), then
start a fresh `main.py`-equivalent process on the shards (tiny GPT-2, 128-token blocks, batch 16) that trains
--steps steps and ends (a fixed 0.1 MB dev split is evaluated and the checkpoint saved, as every run does). The
child reports the seconds from its start (before importing torch) to the end of its first optimizer step, and its
peak RSS (ru_maxrss: everything it touched, memory-mapped shard pages included). --baseline-sizes also runs the
in-memory path (the same texts as a JSON array train.json) for comparison. Big files are deleted after use.
"""
from __future__ import annotations

import time

START = time.time()  # the child's clock starts before the heavy imports

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# ----------------------------------------------------------------------------------------------------------------
# Synthetic text
# ----------------------------------------------------------------------------------------------------------------
def sentence_pool(seed: int, n: int = 50_000) -> list[str]:
    """Sentences of 4-18 made-up words drawn from a Zipf-like distribution over 20,000 words."""
    rng = np.random.default_rng(seed)
    syllables = np.array(["ka", "to", "ri", "mu", "sa", "ne", "lo", "pi", "da", "ve", "qu", "zo", "in", "er", "an"])
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(20_000)]
    p = 1 / np.arange(1, len(words) + 1)
    p /= p.sum()
    lengths = rng.integers(4, 19, size=n)
    picks = rng.choice(len(words), size=int(lengths.sum()), p=p)  # one draw for all: fast
    ends = np.cumsum(lengths)
    return [" ".join(words[i] for i in picks[e - k:e]).capitalize() + "." for k, e in zip(lengths, ends)]


def write_corpus(path: str, megabytes: float, seed: int, as_array: bool = False) -> int:
    """JSON lines {"text": document} (or one JSON array) of about `megabytes` MB; documents of 3-40 sentences."""
    pool = sentence_pool(seed)
    rng = np.random.default_rng(seed + 1)
    target, written = int(megabytes * (1 << 20)), 0
    with open(path, "w", encoding="utf-8") as f:
        f.write("[" if as_array else "")
        first = True
        while written < target:
            counts = rng.integers(3, 41, size=100)
            picks = rng.integers(0, len(pool), size=int(counts.sum()))
            docs, at = [], 0
            for c in counts:
                docs.append(" ".join(pool[i] for i in picks[at:at + c]))
                at += c
            if as_array:
                chunk = ("" if first else ",") + ",".join(json.dumps(d) for d in docs)
            else:
                chunk = "".join(json.dumps({"text": d}) + "\n" for d in docs)
            f.write(chunk)
            written += len(chunk)
            first = False
        f.write("]" if as_array else "")
    return os.path.getsize(path)


# ----------------------------------------------------------------------------------------------------------------
# The measured run (a child process)
# ----------------------------------------------------------------------------------------------------------------
def child(data_dir: str, out: str, steps: int) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    import main
    import trainer as trainer_module
    from wiring import checked_config_from_dict
    torch.set_num_threads(1)
    marks = {}
    original = trainer_module.Trainer.train_step

    def timed(self, batches):
        result = original(self, batches)
        marks.setdefault("first_step", time.time() - START)
        marks["rss_first_step_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return result
    trainer_module.Trainer.train_step = timed
    cfg = checked_config_from_dict({
        "task": "gpt2_lm", "output_dir": out, "data": {"data_dir": data_dir, "max_length": 128},
        "model": {"name": "tiny", "dropout": 0.0},
        "train": {"batch_size": 16, "max_steps": steps, "epochs": 0, "eval_every": 0, "save_every": 0,
                  "log_every": steps, "best_metric": "loss", "eval_batch_size": 64},
        "log": {"progress_bar": False, "tensorboard": False}}, "bench")
    assert main.run(cfg) == 0
    marks["total"] = time.time() - START
    marks["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(marks), flush=True)


def measure(data_dir: str, out: str, steps: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", data_dir, "--out", out,
                           "--steps", str(steps)], capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"run on {data_dir} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(line[len("RESULT "):])


def token_only_shards(folder: str, tokens: int, tokenizer_dir: str, seed: int = 0) -> None:
    """Shards in prepare_text.py's format holding `tokens` random ids (documents of ~280 tokens), made without
    tokenizing: what the reader's start-up and memory see at a corpus size whose tokenization would take hours here."""
    from transformers import AutoTokenizer

    from tasks import token_shards as ts
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    os.makedirs(folder)
    shutil.copytree(tokenizer_dir, os.path.join(folder, "tokenizer"))
    rng = np.random.default_rng(seed)
    splits = {}
    for split, total in (("train", tokens), ("dev", 30_000)):
        shards, left, k = [], total, 0
        while left > 0:
            n = min(left, 8 << 20)  # ~32 MB of text per shard, as prepare_text.py's default chunks
            name = f"{split}-{k:05d}"
            np.save(os.path.join(folder, f"{name}.tokens.npy"), rng.integers(0, len(tokenizer), n, dtype=np.uint16))
            np.save(os.path.join(folder, f"{name}.index.npy"), np.append(np.arange(0, n, 280), n).astype(np.int64))
            shards.append({"name": name, "documents": -(-n // 280), "tokens": n, "max_token_id": len(tokenizer) - 1})
            left, k = left - n, k + 1
        splits[split] = {"documents": sum(x["documents"] for x in shards), "tokens": total,
                         "max_token_id": len(tokenizer) - 1, "max_length": 280, "shards": shards}
    manifest = {"format": ts.FORMAT, "version": ts.VERSION, "task": "lm", "tokenizer": "tokenizer",
                "tokenizer_source": tokenizer_dir, "fingerprint": ts.fingerprint(tokenizer),
                "vocab_size": len(tokenizer), "dtype": "uint16", "eos_token_id": tokenizer.eos_token_id,
                "splits": splits, "inputs": []}
    with open(os.path.join(folder, ts.MANIFEST), "w") as f:
        json.dump(manifest, f)


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------
def main_cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10,100", help="corpus sizes in MB, comma-separated")
    p.add_argument("--baseline-sizes", default="10", help="sizes (MB) also run through the JSON-array path ('' none)")
    p.add_argument("--workers", type=int, default=2, help="prepare_text.py processes")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dir", default="/tmp/bench_data_scale", help="scratch folder (emptied at the end)")
    p.add_argument("--token-only", default="",
                   help="sizes (MB of text) measured on shards of random ids, without tokenizing, at the tokens per "
                        "MB this synthetic text gives (233,000), interleaved, twice each ('' none)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args(argv)
    if args.tiny:  # seconds, not a measurement
        args.sizes, args.baseline_sizes, args.token_only, args.steps, args.workers = "0.05", "", "", 1, 1
    if args.child:
        child(args.child, args.out, args.steps)
        return 0
    os.makedirs(args.dir, exist_ok=True)
    scratch = args.dir
    from tasks.text_common import train_tokenizer
    dev = os.path.join(scratch, "dev.jsonl")
    write_corpus(dev, 0.1, seed=99)
    t = time.time()
    tok_sample = os.path.join(scratch, "tok.jsonl")
    write_corpus(tok_sample, 5, seed=7)
    tokenizer = train_tokenizer((json.loads(x)["text"] for x in open(tok_sample)), "gpt2")
    tokenizer.save_pretrained(os.path.join(scratch, "tokenizer"))
    os.remove(tok_sample)
    print(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens, trained on 5 MB in {time.time() - t:.1f} s",
          flush=True)
    rows = []
    token_only = [float(s) for s in args.token_only.split(",") if s]
    for size in token_only:
        token_only_shards(os.path.join(scratch, f"ids-{size:g}MB"), int(size * 233_000),
                          os.path.join(scratch, "tokenizer"))
    for size in token_only * 2:  # interleaved: the machine's load drifts
        run = measure(os.path.join(scratch, f"ids-{size:g}MB"), os.path.join(scratch, "run"), args.steps)
        rows.append({"path": "shards (random ids)", "mb": size, "tokens": int(size * 233_000), **run})
        print(json.dumps(rows[-1]), flush=True)
    for size in [float(s) for s in args.sizes.split(",") if s]:
        corpus = os.path.join(scratch, f"corpus-{size:g}MB.jsonl")
        t = time.time()
        nbytes = write_corpus(corpus, size, seed=1)
        made = time.time() - t
        shards = os.path.join(scratch, f"shards-{size:g}MB")
        shutil.rmtree(shards, ignore_errors=True)
        t = time.time()
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_text.py"), "--task", "lm",
                        "--train", corpus, "--dev", dev, "--output", shards, "--tokenizer",
                        os.path.join(scratch, "tokenizer"), "--workers", str(args.workers), "--no-progress"],
                       check=True, cwd=ROOT)
        prep = time.time() - t
        os.remove(corpus)
        manifest = json.load(open(os.path.join(shards, "manifest.json")))
        tokens = manifest["splits"]["train"]["tokens"]
        run = measure(shards, os.path.join(scratch, "run"), args.steps)
        shutil.rmtree(shards)
        rows.append({"path": "shards", "mb": nbytes / 2**20, "tokens": tokens, "made_s": made, "prepare_s": prep,
                     **run})
        print(json.dumps(rows[-1]), flush=True)
    for size in [float(s) for s in args.baseline_sizes.split(",") if s]:
        folder = os.path.join(scratch, f"json-{size:g}MB")
        os.makedirs(folder, exist_ok=True)
        nbytes = write_corpus(os.path.join(folder, "train.json"), size, seed=1, as_array=True)
        dev_texts = [json.loads(x)["text"] for x in open(dev)]
        json.dump(dev_texts, open(os.path.join(folder, "dev.json"), "w"))
        out = os.path.join(scratch, "run")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        # the same tokenizer, not one trained at start-up
        shutil.copytree(os.path.join(scratch, "tokenizer"), os.path.join(out, "tokenizer"))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", folder, "--out", out,
                               "--steps", str(args.steps)], capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        shutil.rmtree(folder)
        shutil.rmtree(out, ignore_errors=True)
        if line is None:
            print(f"JSON path at {size:g} MB failed: {proc.stderr[-1500:]}", flush=True)
            continue
        rows.append({"path": "json array", "mb": nbytes / 2**20, **json.loads(line[len("RESULT "):])})
        print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    print("\n| path | corpus | train tokens | preparation (once) | start-up to first step | run total | "
          "peak RSS |\n|---|---|---|---|---|---|---|")
    for r in rows:
        prep = f"{r['prepare_s']:.1f} s ({r['mb'] / r['prepare_s']:.2f} MB/s)" if "prepare_s" in r else "-"
        print(f"| {r['path']} | {r['mb']:.0f} MB | {r.get('tokens', 0):,} | {prep} | {r['first_step']:.1f} s | "
              f"{r['total']:.1f} s | {r['peak_rss_mb']:.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
