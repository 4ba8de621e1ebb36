"""configs/shakespeare_char.yml against nanoGPT's train.py on the same text, run the same way, interleaved.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_nanogpt.py [--steps 2000 --runs 2]
    python benchmarks/bench_nanogpt.py --text input.txt --nanogpt ~/src/nanoGPT     # your text, your nanoGPT copy

The text: --text FILE, or by default the SST-2 training sentences of ../shared/data/sst2/train.tsv, one per line
in file order, cut to 1,115,394 characters (the size of nanoGPT's tiny Shakespeare; no download here). nanoGPT
comes from --nanogpt FOLDER or the read-only git mirror of karpathy/nanoGPT (its HEAD), copied into a temporary
folder at run time; its data/shakespeare_char/prepare.py encodes the text (it downloads only when input.txt is
missing, and it is not). Each run is a fresh process; the two alternate (ours, nanoGPT, ours, nanoGPT, ...) so
that drift of this shared machine hits both alike. Both take the same settings: 4 layers,
4 heads, 128 wide, context 64, batch 12, no bias, dropout 0, AdamW lr 1e-3 betas (0.9, 0.99) weight decay 0.1,
warm-up 100, cosine to 1e-4 at the last step, clip 1.0, evaluation every 250 steps.

Printed per run: the median over blocks of 10 steps of their mean ms/step (ours: the training lines' ms_per_step;
nanoGPT: the means of its per-iteration times, steps 1-10, 11-20, ...; blocks that evaluate left out; also its
median single step), wall time of the process, and the final dev loss: nanoGPT's
estimate at the last step (20 random batches of 12 windows, --eval_iters=20), ours over the whole dev split (the
last evaluation always covers it; 240-window subsets before).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SST2 = os.path.join(os.path.dirname(ROOT), "shared", "data", "sst2", "train.tsv")
MIRROR = "/work/.mirror/karpathy+nanoGPT/repo"
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")
SHAKESPEARE_CHARS = 1115394


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps of each run (nanoGPT's max_iters)")
    p.add_argument("--runs", type=int, default=2, help="runs of each side, interleaved")
    p.add_argument("--text", help="a plain-text file (default: SST-2 sentences, 1.1 MB)")
    p.add_argument("--nanogpt", help="a nanoGPT checkout (default: the git mirror)")
    p.add_argument("--models", type=int, default=0, metavar="STEPS",
                   help="instead: time STEPS training steps of each model alone (HF GPT-2 as the preset builds it, "
                        "the same with model.arch llama, nanoGPT's model.py) in one process, alternating blocks of "
                        "10, on random windows")
    p.add_argument("--profile", action="store_true", help="with --models: also print torch.profiler's top ops of "
                   "20 steps of each model")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    return p.parse_args()


def make_text(path: str, given: str) -> str:
    """The training text, written to `path`; returns what it is, for the printout."""
    if given:
        text, what = open(given, encoding="utf-8").read(), given
    else:
        if not os.path.isfile(SST2):
            sys.exit(f"{SST2} is absent: pass --text FILE")
        lines = [line.split("\t")[0].strip() for line in open(SST2, encoding="utf-8").read().splitlines()[1:]]
        text = "\n".join(lines)[:SHAKESPEARE_CHARS]
        what = f"SST-2 train.tsv sentences, one per line, first {SHAKESPEARE_CHARS:,} characters"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return f"{what} ({len(text):,} characters, {len(set(text))} distinct)"


def copy_nanogpt(folder: str, source: str) -> None:
    """nanoGPT's files into `folder`, from a checkout or the git mirror."""
    for name in NANOGPT_FILES:
        os.makedirs(os.path.dirname(os.path.join(folder, name)) or folder, exist_ok=True)
        if source:
            content = open(os.path.join(source, name), "rb").read()
        else:
            content = subprocess.run(["git", f"--git-dir={MIRROR}", "show", f"HEAD:{name}"], check=True,
                                     capture_output=True).stdout
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content)


def run(cmd: list, cwd: str) -> tuple[str, float]:
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr, wall


def nanogpt_run(folder: str, steps: int, k: int) -> dict:
    interval = 250 if steps % 250 == 0 else steps  # it estimates at multiples of it: the last step is one
    flags = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
             "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", f"--max_iters={steps}",
             f"--lr_decay_iters={steps}", "--dropout=0.0", f"--out_dir=out-{k}",
             f"--eval_interval={interval}"]
    log, wall = run([sys.executable, "train.py", "config/train_shakespeare_char.py", *flags], folder)
    times = {int(i): float(t) for i, t in re.findall(r"iter (\d+): loss \S+, time ([\d.]+)ms", log) if int(i) > 0}
    # Ours logs the mean of each 10 steps: the same here (steps 1-10, 11-20, ...), leaving out the blocks with an
    # evaluation. A median of single steps would drop the load's spikes that a mean of 10 keeps.
    blocks = [[times[i] for i in range(b, b + 10) if i in times] for b in range(1, steps + 1, 10)
              if not any(i % interval == 0 for i in range(b, b + 10))]
    val = re.findall(rf"step {steps}: train loss \S+, val loss ([\d.]+)", log)
    return {"ms_per_step": statistics.median(statistics.mean(b) for b in blocks if b), "wall_s": wall,
            "val_loss": float(val[-1]), "median_single_step": statistics.median(times.values())}


def ours_run(data_dir: str, out_dir: str, steps: int) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--params", os.path.join(ROOT, "configs",
           "shakespeare_char.yml"), "--set", f"data.data_dir={data_dir}", "--set", f"output_dir={out_dir}",
           "--set", f"train.max_steps={steps}", "--set", "log.progress_bar=false",
           "--set", f"train.eval_every={min(250, steps)}"]
    log, wall = run(cmd, ROOT)
    times = [float(t) for t in re.findall(r"ms_per_step=([\d.]+)", log)]
    val = re.findall(rf"step {steps} dev: loss=([\d.]+)", log)
    return {"ms_per_step": statistics.median(times), "wall_s": wall, "val_loss": float(val[-1])}


def compare_models(nano: str, steps: int, profile: bool) -> None:
    """Where a gap comes from: forward, backward and a fused AdamW step of each model on the same batches."""
    import torch
    sys.path[:0] = [ROOT, nano]
    from model import GPT, GPTConfig  # nanoGPT's
    from wiring import checked_config
    from tasks import lm_models
    torch.manual_seed(0)
    cfg = checked_config(os.path.join(ROOT, "configs", "shakespeare_char.yml"))
    models = {"ours (HF GPT2LMHeadModel)": lm_models.build_causal_lm(cfg, 66, 65)}
    cfg.model.arch = "llama"
    models["ours, model.arch llama (HF LlamaForCausalLM)"] = lm_models.build_causal_lm(cfg, 66, 65)
    models["nanoGPT model.py"] = GPT(GPTConfig(block_size=64, vocab_size=66, n_layer=4, n_head=4, n_embd=128,
                                               dropout=0.0, bias=False))
    optims = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, fused=True)
              for k, m in models.items()}
    x = torch.randint(0, 66, (12, 65))
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    times = {k: [] for k in models}

    def step(name, model):
        if name.startswith("ours"):
            loss = torch.nn.functional.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten())
        else:
            loss = model(inputs, targets)[1]
        loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)
    for block in range(steps // 10 + 1):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(10):
                step(name, model)
            if block:  # the first block warms up
                times[name].append((time.perf_counter() - start) * 100)
    if profile:  # which ops the time goes to: 20 steps of each, by self CPU time
        from torch.profiler import profile as profiler
        for name, model in models.items():
            with profiler() as prof:
                for _ in range(20):
                    step(name, model)
            print(f"{name}:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    for name, t in times.items():
        print(f"{name}: {statistics.median(t):.1f} ms/step (median of {len(t)} blocks of 10)")


def main():
    args = parse_args()
    if args.tiny:  # seconds, not a measurement
        args.steps, args.runs = 20, 1
    if not args.nanogpt and not os.path.isdir(MIRROR):
        print(f"skipped: no nanoGPT (--nanogpt FOLDER, or a git mirror at {MIRROR})")
        return
    work = tempfile.mkdtemp(prefix="bench-nanogpt-")
    nano = os.path.join(work, "nanoGPT")
    copy_nanogpt(nano, args.nanogpt)
    if args.models:
        return compare_models(nano, args.models, args.profile)
    data_dir = os.path.join(work, "text")
    os.makedirs(data_dir)
    what = make_text(os.path.join(data_dir, "input.txt"), args.text)
    os.link(os.path.join(data_dir, "input.txt"), os.path.join(nano, "data", "shakespeare_char", "input.txt"))
    prepared, _ = run([sys.executable, "data/shakespeare_char/prepare.py"], nano)
    print(f"text: {what}\nnanoGPT prepare.py: " + "; ".join(
        line for line in prepared.splitlines() if line.startswith(("vocab size", "train has", "val has"))))
    results = {"ours": [], "nanoGPT": []}
    for k in range(args.runs):
        results["ours"].append(ours_run(data_dir, os.path.join(work, f"ours-{k}"), args.steps))
        print(f"ours    run {k}: {results['ours'][-1]}", flush=True)
        results["nanoGPT"].append(nanogpt_run(nano, args.steps, k))
        print(f"nanoGPT run {k}: {results['nanoGPT'][-1]}", flush=True)
    print(f"\n{args.steps} steps, {args.runs} runs each, interleaved (work folder {work})")
    print("| | ms/step (median), per run | wall s, per run | final dev loss, per run |\n|---|---|---|---|")
    for side, rows in results.items():
        cells = [", ".join(f"{r[key]:.{d}f}" for r in rows) for key, d in
                 (("ms_per_step", 1), ("wall_s", 1), ("val_loss", 3))]
        print(f"| {side} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
