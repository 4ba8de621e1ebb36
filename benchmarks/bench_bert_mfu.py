"""BERT pre-training throughput and MFU: our Trainer vs Hugging Face's `transformers.Trainer`.

    python benchmarks/bench_bert_mfu.py                                  # GPU: bert-base, bf16, batch 64
    python benchmarks/bench_bert_mfu.py --model tiny --steps 10 --peak-tflops 0.1   # CPU smoke check (fp32)

Three sides, same `BertForPreTraining` initialisation (our Trainer builds it after seeding; the others get exact
copies), same per-device batch, same precision (autocast; bf16 default on CUDA, fp32 on CPU), same AdamW
(lr 1e-4 constant, weight decay 0.01, clip 1.0), same data: rows of HDF5 shards made by
scripts/make_bert_shards.py from synthetic text (or --shards DIR with training/*.hdf5), seq 128, batched by the
task's collate (cut to the batch's longest sequence) and read by --workers DataLoader workers on every side.
- ours-masked: our Trainer, task bert_pretrain as shipped: the vocabulary projection runs on MASKED positions
  only (~15% of tokens), which is cheaper.
- ours-allpos: our Trainer with the projection run on ALL positions, then the masked ones picked (the loss is
  the task's); the same projection work as HF's.
- hf: `transformers.Trainer.train()` on BertForPreTraining's own loss: projection and cross-entropy over all
  positions (labels -100 where nothing is masked), mean over the batch's masked tokens + NSP.

Interleaving: HF's loop runs once for all blocks; a callback stops it every --steps optimizer steps, and the
Trainer sides then run a block of --steps steps each, so drift of the machine hits all three. Block clocks are
read after torch.cuda.synchronize(); the first --warmup-blocks blocks of each side are dropped; throughput =
steps x batch / median block time. Every block includes data loading, forward, backward, clipping, the AdamW
step and the LR schedule.

MFU = achieved model FLOP/s / --peak-tflops, with model FLOPs per sequence (the same for all three sides):
    6 * N * L  +  12 * layers * hidden * L^2
N = non-embedding parameters (all but the word, position and token-type embeddings; the MLM decoder is tied to
the word embeddings, so the vocabulary projection is NOT counted), L = the shards' sequence length (128).
The default peak, 989 TFLOP/s, is H100 SXM dense bf16 (H200: the same); pass the right one for other devices
(e.g. ~1979 for fp8, or a nominal 0.1 for a CPU check, where MFU means nothing).
"""
import argparse
import copy
import itertools
import os
import random
import statistics
import sys
import tempfile
import time

# One device: with several visible GPUs transformers.Trainer would wrap the model in DataParallel over all of them.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from core import process_group  # noqa: E402
from wiring import checked_config_from_dict  # noqa: E402
from core.run_log import LossWindow  # noqa: E402
from wiring import build_task, build_trainer  # noqa: E402
from tasks.bert_pretrain import BERT_PRESETS, HDF5Shards, PretrainingModel  # noqa: E402

SEQ_PER_DOC = 6.5  # sequences make_bert_shards.py makes per 60-sentence document (measured: 7754 from 1136)


class InMemoryShards(HDF5Shards):
    """The same rows as HDF5Shards, converted by the same __getitem__, but read from arrays loaded once: gzip
    HDF5 rows cost ~1 ms each on a slow CPU, which would measure h5py rather than training."""

    def __init__(self, files):
        super().__init__(files)
        import h5py
        self.arrays = []
        for path in files:
            with h5py.File(path, "r") as f:
                self.arrays.append({k: f[k][:] for k in f})

    def shard(self, s):
        return self.arrays[s]


class AllPositionsModel(PretrainingModel):
    """Projects every position onto the vocabulary (as BertForPreTraining's own loss does), then keeps the
    masked ones, so the task's loss is unchanged but the head costs what HF's costs."""

    def forward(self, input_ids, attention_mask, token_type_ids, mlm_labels):
        out = self.bert.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        mlm_logits = self.bert.cls.predictions(out.last_hidden_state)[mlm_labels != -100]
        return mlm_logits, self.bert.cls.seq_relationship(out.pooler_output)


def make_shards(root: str, sequences: int) -> str:
    """Synthetic documents long enough (~60 sentences, ~600 tokens) that nearly every sequence fills all 128
    positions, as Wikipedia's do: the FLOP count below assumes L = 128."""
    import make_bert_shards
    from make_sample_text_data import sentence
    rng, path = random.Random(0), os.path.join(root, "bert.txt")
    with open(path, "w") as f:
        for _ in range(int(sequences / SEQ_PER_DOC) + 20):
            f.write("\n".join(sentence(rng) for _ in range(60)) + "\n\n")
    make_bert_shards.main(["--input", path, "--output-dir", os.path.join(root, "bert128"), "--seq-length", "128",
                           "--max-predictions", "20", "--shards", "4", "--dev-shards", "0"])
    return os.path.join(root, "bert128")


def model_flops_per_sequence(bert, seq_len: int) -> tuple[float, int]:
    c, emb = bert.config, bert.bert.embeddings
    embedding = sum(m.weight.numel() for m in (emb.word_embeddings, emb.position_embeddings,
                                                emb.token_type_embeddings))
    n = sum(p.numel() for p in bert.parameters()) - embedding  # parameters() lists the tied decoder once
    return 6 * n * seq_len + 12 * c.num_hidden_layers * c.hidden_size * seq_len ** 2, n


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert-base", choices=list(BERT_PRESETS))
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="autocast precision (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--batch", type=int, default=64, help="sequences per step (per device)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per block")
    p.add_argument("--rounds", type=int, default=6, help="timed blocks per side")
    p.add_argument("--warmup-blocks", type=int, default=1, help="blocks per side dropped before timing")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers on every side")
    p.add_argument("--data", choices=["memory", "hdf5"], default="memory",
                   help="memory: shard rows loaded once (default); hdf5: read row by row as training does")
    p.add_argument("--shards", help="a folder with training/*.hdf5 (seq 128) instead of synthetic shards")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak FLOP/s of the device in TFLOP/s (default 989: H100/H200 SXM dense bf16)")
    p.add_argument("--hf-optim", default="adamw_torch",
                   help="HF optimizer name (default adamw_torch = torch.optim.AdamW like ours; HF's own default "
                        "on torch>=2.8 is adamw_torch_fused)")
    p.add_argument("--sides", nargs="+", default=["ours-masked", "ours-allpos", "hf"],
                   choices=["ours-masked", "ours-allpos", "hf"])
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.model, args.steps, args.rounds, args.warmup_blocks = "tiny", 1, 1, 0
        args.batch, args.workers, args.peak_tflops = 4, 0, 0.1
    cuda = torch.cuda.is_available()
    precision = args.precision or ("bf16" if cuda else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = args.rounds + args.warmup_blocks

    tmp = tempfile.TemporaryDirectory()
    data_dir = args.shards or make_shards(tmp.name, blocks * args.steps * args.batch)
    cfg = checked_config_from_dict({
        "task": "bert_pretrain", "output_dir": os.path.join(tmp.name, "run"), "seed": 42,
        "data": {"data_dir": data_dir, "dev_files": os.path.join(data_dir, "training", "*.hdf5"),
                 "num_workers": args.workers},
        "model": {"name": args.model, "dropout": 0.1},
        "train": {"batch_size": args.batch, "max_steps": 10**6, "epochs": 0, "lr": 1e-4, "warmup": 0,
                  "schedule": "constant", "weight_decay": 0.01, "clip_grad_norm": 1.0, "precision": precision},
        "dist": {"strategy": "none"},
        "log": {"progress_bar": False, "tensorboard": False}}, "bench")
    task = build_task(cfg)
    datasets = task.build_datasets()
    train_set = datasets["train"]
    if args.data == "memory":  # only the first shards that cover the run: real corpora do not fit in memory
        needed, files = blocks * args.steps * args.batch, train_set.files  # rows each side reads
        k = next((i + 1 for i, n in enumerate(itertools.accumulate(train_set.shard_sizes)) if n >= needed), len(files))
        train_set = InMemoryShards(files[:k])
    task.build_datasets = lambda: {"train": train_set, "dev": None, "test": None}  # one dataset for all sides
    ctx = process_group.init(cfg, 0, 1, 0)

    def sync_clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    trainers, losses, widths = {}, {}, {}
    masked = build_trainer(cfg, ctx, task)  # seeds, then builds the model: the reference initialisation
    init = masked.strategy.raw_model.bert
    if "ours-masked" in args.sides:
        trainers["ours-masked"] = masked
    if "ours-allpos" in args.sides:
        build = task.build_model
        task.build_model = lambda: AllPositionsModel(build().bert)  # Trainer seeds first: same init
        trainers["ours-allpos"] = build_trainer(cfg, ctx, task)
        task.build_model = build
        assert all(torch.equal(a, b) for a, b in zip(init.state_dict().values(),
                                                     trainers["ours-allpos"].strategy.raw_model.bert.state_dict().values()))

    def trainer_block(name):
        trainer, stream, window = trainers[name], streams[name], windows[name]
        for _ in range(args.steps):
            batch = next(stream)
            widths.setdefault(name, []).append(batch["input_ids"].shape[1])
            loss_sum, count, _, _, _ = trainer.train_step([batch])
            window.add(loss_sum, count, len(batch["input_ids"]))
        losses[name] = window.flush()["loss"]  # .item(): waits for the device, inside the block

    streams = {n: t.micro_batches() for n, t in trainers.items()}
    windows = {n: LossWindow(ctx) for n in trainers}
    times = {name: [] for name in args.sides}

    def run_trainer_blocks():
        for name in trainers:
            start = sync_clock()
            trainer_block(name)
            times[name].append(sync_clock() - start)

    if "hf" in args.sides:
        run_hf(args, cfg, precision, cuda, copy.deepcopy(init), train_set, task, blocks, sync_clock,
               run_trainer_blocks, times, losses)
    else:
        for _ in range(blocks):
            run_trainer_blocks()

    seq_len = datasets["train"].seq_length
    flops, n_params = model_flops_per_sequence(init, seq_len)
    device = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{args.model}: {n_params / 1e6:.1f}M non-embedding parameters, {precision}, batch {args.batch}, "
          f"seq {seq_len}, data {args.data} ({len(train_set)} sequences, {args.workers} workers), {args.rounds} "
          f"timed blocks x {args.steps} steps per side (+{args.warmup_blocks} warm-up), device {device}")
    print(f"model FLOPs/sequence = 6*N*L + 12*layers*hidden*L^2 = {flops / 1e9:.2f} GFLOP (N non-embedding "
          f"params, L {seq_len}; vocab projection not counted); peak {args.peak_tflops:g} TFLOP/s")
    print(f"{'side':<13}{'seq/s':>10}{'ms/step':>10}{'TFLOP/s':>10}{'MFU':>8}{'last loss':>11}")
    for name in args.sides:
        block = statistics.median(times[name][args.warmup_blocks:])
        rate = args.steps * args.batch / block
        print(f"{name:<13}{rate:>10,.1f}{block / args.steps * 1e3:>10.2f}{rate * flops / 1e12:>10.3g}"
              f"{rate * flops / 1e12 / args.peak_tflops:>8.1%}{losses.get(name, float('nan')):>11.3f}")
    if widths:
        print("mean batch width (tokens per row):", {n: round(statistics.mean(w), 1) for n, w in widths.items()})
    print("ours-masked: vocabulary projection on masked positions only; ours-allpos and hf: on all positions "
          "(hf also takes the cross-entropy over all positions). Loss: ours = per-sequence mean MLM + NSP, "
          "hf = mean over the batch's masked tokens + NSP.")
    tmp.cleanup()


def run_hf(args, cfg, precision, cuda, model, train_set, task, blocks, sync_clock, run_trainer_blocks, times,
           losses):
    """transformers.Trainer.train() for all blocks; a callback closes each HF block and runs ours in between."""
    from transformers import PrinterCallback, Trainer as HFTrainer, TrainerCallback, TrainingArguments

    def collate(samples):  # the task's batches, under BertForPreTraining's argument names
        b = task.collate(samples)
        return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                "token_type_ids": b["token_type_ids"], "labels": b["mlm_labels"],
                "next_sentence_label": b["nsp_labels"]}

    class Interleave(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.start = sync_clock()

        def on_step_end(self, hf_args, state, control, **k):
            if state.global_step % args.steps == 0:
                times["hf"].append(sync_clock() - self.start)
                run_trainer_blocks()
                self.start = sync_clock()

        def on_log(self, hf_args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses["hf"] = logs["loss"]

    hf_args = TrainingArguments(
        output_dir=os.path.join(cfg.output_dir, "hf"), per_device_train_batch_size=args.batch,
        max_steps=blocks * args.steps, learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0,
        lr_scheduler_type="constant", warmup_steps=0, optim=args.hf_optim, seed=cfg.seed,
        bf16=precision == "bf16", fp16=precision == "fp16", use_cpu=not cuda,
        dataloader_num_workers=args.workers, dataloader_drop_last=True, remove_unused_columns=False,
        logging_steps=args.steps, save_strategy="no", report_to="none", disable_tqdm=True)
    hf = HFTrainer(model=model, args=hf_args, train_dataset=train_set, data_collator=collate,
                   callbacks=[Interleave()])
    hf.remove_callback(PrinterCallback)  # its summary would count our blocks as HF's time; losses go to the table
    hf.train()


if __name__ == "__main__":
    main()
