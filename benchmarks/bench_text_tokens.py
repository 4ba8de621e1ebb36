"""Text tasks: tokens/s through the Trainer vs a minimal hand-written PyTorch loop, same model, data and batches.

    python benchmarks/bench_text_tokens.py [--tasks sst2 gpt2_lm bert_pretrain --rounds 6 --steps 10]

For each task, both sides start from the same weights and take the same batches in the same order (the Trainer's
own sampler), collated by the task. They run in alternating blocks (trainer, loop, trainer, loop, ...) so drift of
a shared machine hits both alike; the ratio of median block times is printed. The Trainer side runs its loop
body: next micro-batch from the resumable stream, train_step (global loss normalisation, AdamW, LR schedule),
loss window. Two hand-written loops (each with its own copy of the weights and the same batches):
- hand: what one writes with transformers directly, `model(**batch, labels=...).loss`, backward, AdamW step.
  For bert_pretrain that is BertForPreTraining's own loss, which projects EVERY position onto the 30k vocabulary,
  while the task scores masked positions only: there the Trainer is faster by design.
- same: the task's own loss code (loss_sum / count) in a bare loop: the difference to the Trainer is the
  Trainer's per-step machinery alone.
Tokens = real (non-padding) input tokens. Data is synthetic (scripts/make_sample_text_data.py), SST-2 is the
real training set from ../shared/data/sst2 when present.
"""
import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from core import process_group  # noqa: E402
import make_bert_shards  # noqa: E402
import make_sample_text_data as sample  # noqa: E402
from wiring import checked_config_from_dict  # noqa: E402
from data_loader import make_loader  # noqa: E402
from core.run_log import LossWindow  # noqa: E402
from wiring import build_task, build_trainer  # noqa: E402

SST2 = os.path.join(os.path.dirname(ROOT), "shared", "data", "sst2")


def make_data(root: str) -> dict:
    rng = random.Random(0)
    sst2 = SST2 if os.path.isfile(os.path.join(SST2, "train.tsv")) else \
        sample.write_sst2(os.path.join(root, "sst2"), rng, sizes=(4000, 200, 0))
    gpt2 = sample.write_gpt2(os.path.join(root, "gpt2"), rng, sizes=(1500, 50))
    text = sample.write_bert_text(os.path.join(root, "bert.txt"), rng, documents=600)
    make_bert_shards.main(["--input", text, "--output-dir", os.path.join(root, "bert128"), "--seq-length", "128",
                           "--max-predictions", "20", "--shards", "2"])
    return {"sst2": sst2, "gpt2_lm": gpt2, "bert_pretrain": os.path.join(root, "bert128")}


def hand_loss(task_name: str, model, batch: dict) -> torch.Tensor:
    """The loss as one writes it with transformers' built-in heads (mean over the batch)."""
    if task_name == "sst2":
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).loss
    if task_name == "gpt2_lm":  # our blocks carry shifted labels already: cross-entropy on the logits
        logits = model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    return model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      token_type_ids=batch["token_type_ids"], labels=batch["mlm_labels"],
                      next_sentence_label=batch["nsp_labels"]).loss


def tokens(batch: dict) -> int:
    return int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()


def bench(task_name: str, data_dir: str, out: str, args) -> dict:
    cfg = checked_config_from_dict({
        "task": task_name, "output_dir": out,
        "data": {"data_dir": data_dir, "max_length": args.max_length},
        "model": {"name": "tiny", "dropout": 0.0},
        "train": {"batch_size": args.batch, "max_steps": 10**6, "epochs": 0, "lr": 1e-3, "warmup": 0,
                  "schedule": "constant", "best_metric": "accuracy" if task_name == "sst2" else "loss"},
        "log": {"progress_bar": False, "tensorboard": False}}, "bench")
    trainer = build_trainer(cfg, process_group.init(cfg, 0, 1, 0))
    task, dataset = trainer.task, trainer.datasets["train"]
    stream, window = trainer.micro_batches(), LossWindow(trainer.ctx)

    def hand_batches():
        epoch = 0
        while True:
            yield from make_loader(dataset, trainer.sampler.epoch_batches(epoch), task.collate, 0, False, 0)
            epoch += 1

    def hand_loop(loss_fn):
        """A bare loop: its own copy of the weights, AdamW, the same batches in the same order."""
        model = copy.deepcopy(trainer.strategy.raw_model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        batches = hand_batches()

        def block(name):
            for _ in range(args.steps):
                batch = next(batches)
                counted[name] += tokens(batch)
                loss_fn(model, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return block

    counted = {"trainer": 0, "hand": 0, "same_loss": 0}
    blocks = {"hand": hand_loop(lambda m, b: hand_loss(task_name, m, b)),  # transformers' own loss heads
              "same_loss": hand_loop(lambda m, b: task.loss_sum(m, b) / task.count(b))}  # the task's loss code

    def trainer_block(name="trainer"):
        for _ in range(args.steps):
            batch = next(stream)
            counted["trainer"] += tokens(batch)
            loss_sum, count, _, _, _ = trainer.train_step([batch])
            window.add(loss_sum, count, len(batch["input_ids"]))
        window.flush()

    blocks["trainer"] = trainer_block
    for name, block in blocks.items():  # warm-up
        block(name)
    rates = {name: [] for name in blocks}
    for _ in range(args.rounds):
        for name in ("trainer", "hand", "same_loss"):
            before, start = counted[name], time.perf_counter()
            blocks[name](name)
            rates[name].append((counted[name] - before) / (time.perf_counter() - start))
    r = {name: statistics.median(v) for name, v in rates.items()}
    return {"task": task_name, **r, "params": sum(p.numel() for p in trainer.strategy.raw_model.parameters())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", nargs="+", default=["sst2", "gpt2_lm", "bert_pretrain"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64, help="sst2 truncation / gpt2 block size")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: least disturbed by other load)")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.tasks, args.rounds, args.steps, args.batch, args.max_length = ["gpt2_lm"], 1, 1, 4, 16
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        data = make_data(root)
        results = [bench(t, data[t], os.path.join(root, f"run_{t}"), args) for t in args.tasks]
    print(f"\ntiny models, batch {args.batch}, max_length {args.max_length}, {args.rounds} rounds x {args.steps} "
          f"steps, {torch.get_num_threads()} thread(s); tokens/s (median of rounds)")
    print("hand = bare loop with transformers' loss heads; same = bare loop with the task's loss_sum/count")
    print(f"{'task':<15}{'params':>10}{'trainer':>10}{'hand':>10}{'same':>10}{'trainer/hand':>14}"
          f"{'trainer/same':>14}")
    for r in results:
        print(f"{r['task']:<15}{r['params']:>10,}{r['trainer']:>10,.0f}{r['hand']:>10,.0f}{r['same_loss']:>10,.0f}"
              f"{r['trainer'] / r['hand']:>14.3f}{r['trainer'] / r['same_loss']:>14.3f}")


if __name__ == "__main__":
    main()
