"""Every task in fp32 and in bf16 autocast on this CPU (issue 22, item 2): ms per optimizer step and the dev
metrics after the same number of steps, the two precisions run alternately (fp32, bf16, fp32, bf16, ...) so that a
shared machine's drift hits both alike.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_bf16_tasks.py [--rounds 2] [--only cnn,gpt2]

Each job is `main.py` itself (a subprocess, as a user runs it) with `--set train.precision=...`; ms/step is the
median of the logged `ms_per_step` values after the first window (warm-up), the metrics are the last dev line
(the whole dev split: the large-shape jobs read the small synthetic data of scripts/make_sample_text_data.py).
Jobs needing ../shared/data (SST-2) or the MiniLM package are skipped with a line when those are absent. Sizes are
small enough for a 2-core CPU without bf16 units (where bf16 is emulated and 5-10x slower); on a CPU with
amx_bf16/avx512_bf16, raise --steps to see the steady state.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SST2 = os.path.join(os.path.dirname(ROOT), "shared", "data", "sst2")
COMMON = ["train.epochs=0", "train.eval_every=0", "train.save_every=0", "log.progress_bar=false",
          "log.tensorboard=false", "train.warmup=0"]


def jobs(sample: str) -> dict:
    """name -> (params file, overrides, what it needs). Sizes: a few steps each, a small dev split."""
    return {
        "cnn digits, batch 32": ("parameters.yml", ["train.max_steps=60", "train.log_every=20"], None),
        "sst2 MiniLM-L6 pretrained, batch 32 x <=64 tokens": (
            "configs/sst2_minilm.yml", ["train.max_steps=40", "train.log_every=10", "train.eval_batches=4",
                                        "train.eval_batch_size=128"], SST2),
        "sst2 BART-base shapes (random, BPE on the synthetic sentences), batch 8": (
            "configs/sst2_bart.yml", [f"data.data_dir={sample}/sst2", "model.pretrained_dir=null",
                                      "train.batch_size=8", "train.max_steps=4", "train.log_every=2",
                                      "train.eval_batch_size=64", "train.grad_accum_steps=1"], None),
        "bert_pretrain bert-base shapes, seq 128, batch 4": (
            "configs/bert_pretrain_128.yml", [f"data.data_dir={sample}/bert128", "train.batch_size=4",
                                              "train.max_steps=4", "train.log_every=2", "data.num_workers=0",
                                              "train.eval_batch_size=16", "train.eval_batches=2"], None),
        "gpt2_lm gpt2 (124M shapes), batch 4 x 128 tokens, 4 accumulated": (
            "configs/gpt2_lm.yml", [f"data.data_dir={sample}/gpt2", "model.pretrained_dir=null",
                                    "model.name=gpt2", "data.max_length=128", "train.batch_size=4",
                                    "train.max_steps=4", "train.log_every=2", "train.eval_batch_size=8"], None),
    }


def make_sample(folder: str) -> None:
    """The synthetic texts of scripts/make_sample_text_data.py, and seq-128 BERT shards made from them."""
    py = sys.executable
    subprocess.run([py, "scripts/make_sample_text_data.py", folder], cwd=ROOT, check=True, capture_output=True)
    subprocess.run([py, "scripts/make_bert_shards.py", "--input", f"{folder}/bert_text.txt", "--output-dir",
                    f"{folder}/bert128", "--seq-length", "128", "--max-predictions", "20", "--shards", "2"],
                   cwd=ROOT, check=True, capture_output=True)


def run(params: str, overrides: list, precision: str, out: str) -> tuple:
    """One training run; (median ms/step after the first window, the last dev line's metrics)."""
    cmd = [sys.executable, "main.py", "--params", params, "--set", f"output_dir={out}",
           "--set", f"train.precision={precision}"]
    for o in COMMON + overrides:
        cmd += ["--set", o]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\nexit {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    ms = [float(v) for v in re.findall(r"ms_per_step=(\S+)", done.stdout)]
    dev = re.findall(r"step \d+ dev: (.*)", done.stdout)
    return statistics.median(ms[1:] or ms), dev[-1] if dev else "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="fp32/bf16 pairs per job")
    p.add_argument("--only", default="", help="comma-separated words: run the jobs whose name holds one")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.rounds, args.only = 1, "cnn"
    with tempfile.TemporaryDirectory() as tmp:
        sample = os.path.join(tmp, "sample")
        if not args.tiny:  # the text jobs' data; tiny runs the CNN only
            make_sample(sample)
        print("| job | fp32 ms/step | bf16 ms/step | bf16 gain | dev after the same steps: fp32 / bf16 |")
        print("|---|---|---|---|---|")
        for j, (name, (params, overrides, needs)) in enumerate(jobs(sample).items()):
            if args.only and not any(w in name for w in args.only.split(",")):
                continue
            if needs and not os.path.isdir(needs):
                print(f"| {name} | skipped: {needs} absent | | | |", flush=True)
                continue
            overrides = overrides + ["train.max_steps=4", "train.log_every=2"] if args.tiny else overrides
            ms, dev = {"fp32": [], "bf16": []}, {}
            for r in range(args.rounds):
                for precision in ("fp32", "bf16"):
                    t, dev[precision] = run(params, overrides, precision, os.path.join(tmp, f"job{j}-{precision}-{r}"))
                    ms[precision].append(t)
            a, b = statistics.median(ms["fp32"]), statistics.median(ms["bf16"])
            print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f}x | {dev['fp32']} / {dev['bf16']} |", flush=True)


if __name__ == "__main__":
    main()
