"""Trainer overhead: the Trainer's step vs a minimal hand-written PyTorch loop, same model, data and batch.

    python benchmarks/bench_trainer_overhead.py [--rounds 10 --steps 20 --batch 64 --device cuda]

Both sides start from the same weights and read the same batches through a DataLoader. They run in alternating
blocks (trainer, loop, trainer, loop, ...) so that drift of this shared machine hits both alike; the ratio of the
median block times is printed. What the Trainer side runs per step is its loop body: the next micro-batch from its
resumable stream, train_step (loss normalisation over the global batch, AdamW step, LR schedule) and the loss
window; evaluation and checkpoints are not part of a step. Data: the real MNIST t10k images from ../shared/data
when present (28x28), else scikit-learn digits upsampled to 28x28.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from core import process_group  # noqa: E402
from wiring import checked_config_from_dict  # noqa: E402
from data_loader import make_loader  # noqa: E402
from core.run_log import LossWindow  # noqa: E402
from wiring import build_task, build_trainer  # noqa: E402
from tasks.image import TensorImages  # noqa: E402
from tasks.mnist import load_mnist  # noqa: E402


def images(small: bool):
    if small:  # 8x8 digits: a tiny step, where any per-step overhead of the Trainer shows most
        from sklearn.datasets import load_digits
        d = load_digits()
        return TensorImages(d.images / 16.0, d.target, 0.3, 0.4), "digits 8x8 (tiny steps)"
    mnist = os.path.join(os.path.dirname(ROOT), "shared", "data", "mnist")
    if os.path.isdir(mnist):
        images, labels = load_mnist(mnist, "t10k", download=False)
        return TensorImages(images / 255.0, labels, 0.1307, 0.3081), "MNIST t10k (real)"
    from sklearn.datasets import load_digits
    d = load_digits()
    up = torch.nn.functional.interpolate(torch.tensor(d.images, dtype=torch.float32)[:, None], size=28)[:, 0]
    return TensorImages(up.numpy() / 16.0, d.target, 0.3, 0.4), "digits upsampled (MNIST absent)"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: least disturbed by other load)")
    p.add_argument("--small", action="store_true", help="8x8 digits instead of 28x28 images")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when available")
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.rounds, args.steps, args.batch, args.small = 1, 2, 8, True
    torch.set_num_threads(args.threads)

    cfg = checked_config_from_dict({"output_dir": "/tmp/bench_overhead", "train": {
        "batch_size": args.batch, "max_steps": 10**6, "lr": 1e-3, "schedule": "cosine", "warmup": 0.0},
        "dist": {"device": args.device}, "log": {"progress_bar": False, "tensorboard": False}})
    task = build_task(cfg)
    dataset, data_name = images(args.small)
    task.build_datasets = lambda: {"train": dataset, "dev": None, "test": None}  # same data for both sides
    task.image_size = dataset.images.shape[-1]
    trainer = build_trainer(cfg, process_group.init(cfg, 0, 1, 0), task)
    stream, window = trainer.micro_batches(), LossWindow(trainer.ctx)
    device = trainer.ctx.device
    cuda = device.type == "cuda"

    # The hand-written loop: plain model, AdamW, DataLoader over the same batches, nothing else.
    model = copy.deepcopy(trainer.strategy.raw_model)
    # The same AdamW kernel as the Trainer's (train.optimizer_impl auto: fused on CPU and CUDA), so the ratio
    # measures the Trainer's own overhead, not a faster optimizer.
    from core.optimizers import optimizer_kernel
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0,
                            **optimizer_kernel(cfg.train.optimizer_impl, list(model.parameters())))
    order = [list(b) for b in np.array_split(np.random.default_rng(0).permutation(len(dataset)),
                                              len(dataset) // args.batch)]
    order = [b[:args.batch] for b in order if len(b) >= args.batch]

    def loop_batches():
        while True:
            yield from make_loader(dataset, order, task.collate, 0, cuda, 0)  # pinned on GPU, as the Trainer's
    hand_stream = loop_batches()

    def trainer_block():
        for _ in range(args.steps):
            batch = next(stream)
            loss_sum, count, _, _, _ = trainer.train_step([batch])
            window.add(loss_sum, count, len(batch["labels"]))
        window.flush()

    def hand_block():
        for _ in range(args.steps):
            batch = {k: v.to(device, non_blocking=cuda) for k, v in next(hand_stream).items()}
            loss = F.cross_entropy(model(batch["images"]), batch["labels"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:  # the Trainer's block waits for the device in window.flush(); so does this one
            torch.cuda.synchronize()

    trainer_block(), hand_block()  # warm-up
    times = {"trainer": [], "hand": []}
    for _ in range(args.rounds):
        for name, block in (("trainer", trainer_block), ("hand", hand_block)):
            start = time.perf_counter()
            block()
            times[name].append((time.perf_counter() - start) / args.steps)
    t, h = statistics.median(times["trainer"]), statistics.median(times["hand"])
    print(f"data: {data_name}, batch {args.batch}, {args.rounds} rounds x {args.steps} steps, "
          f"{torch.get_num_threads()} threads, device {torch.cuda.get_device_name() if cuda else 'cpu'}")
    print(f"median step: trainer {t * 1e3:.2f} ms, hand-written loop {h * 1e3:.2f} ms")
    print(f"ratio trainer/hand: {t / h:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
