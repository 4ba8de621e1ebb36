"""image_folder's speed, side by side: ResNet training images/s of this Trainer against a hand-written loop over the
same model, batches and optimizer (the limit) and against Hugging Face's Trainer on the same model and folder; and
the loader's decode + augment images/s (per worker) at 0, 1, 2 and auto workers: does it keep up with the model?
Last, whether model.channels_last pays for this model and size (interleaved pairs of one training step).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_images.py                      # ResNet-50, 224, batch 32
    python benchmarks/bench_images.py --tiny                                       # proves it runs (seconds)
    python benchmarks/bench_images.py --data_dir path/to/folder --device cuda      # your folder, a GPU

The folder (without --data_dir): --images JPEGs cut at random from scikit-learn's two sample photos (640x427) into
4 classes, in a temporary folder. All three use the preset configs/resnet50_imagefolder.yml (SGD momentum 0.9, fp32),
the same model built by tasks/image_folder.py from the same seed, the same decoding and crops (its ImageFiles
dataset) and the same number of loader workers. The hand-written loop and HF's Trainer read the very batches ours
reads (the full ones of our epoch order; HF's sampler set to sequential over a dataset in that order), with plain
SGD at a constant lr (ours: the preset's SGD, its lr schedule and weight decay on matrices only). HF's Trainer takes the transformers model as it
is (ResNetForImageClassification returns the loss when given labels). Each side's first 2 steps are a warm-up, not
timed. Take the figures on a quiet machine: on a shared one, the other jobs' load is in them (benchmarks/RESULTS.md
says where they were taken).
"""
import argparse
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import main  # noqa: E402
from data_loader import GlobalBatchSampler, auto_workers, make_loader  # noqa: E402
from tasks.image_folder import ImageFolderTask  # noqa: E402
from wiring import checked_config  # noqa: E402

PRESET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "resnet50_imagefolder.yml")


def make_folder(root: str, images: int, classes: int = 4) -> str:
    from PIL import Image
    from sklearn.datasets import load_sample_images
    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    for i in range(images):
        photo = photos[i % len(photos)]
        h, w = rng.integers(200, 427), rng.integers(200, 640)
        top, left = rng.integers(0, 427 - h + 1), rng.integers(0, 640 - w + 1)
        folder = os.path.join(root, "train", f"class{i % classes}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(photo[top:top + h, left:left + w]).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)
    return root


def config(args, output_dir: str, extra=()):
    sets = [f"data.data_dir={args.data_dir}", f"output_dir={output_dir}", f"train.batch_size={args.batch}",
            f"train.max_steps={args.steps + 2}", "train.epochs=0", "train.eval_every=0", "train.save_every=0",
            "train.precision=fp32", "train.log_every=2", "log.progress_bar=false", "log.report_to=[]",
            f"data.num_workers={args.workers}", f"dist.device={args.device}", "data.dev_fraction=0.05"]
    if args.tiny:
        sets += ["model.arch=resnet18", "model.width=8", "data.image_size=32", "data.resize_size=36"]
    return checked_config(PRESET, sets + list(extra))


def ours(args, out: str) -> float:
    """Images/s of main.run after its first 2 steps: the mean of its training lines' samples_per_s (one line per 2
    steps, equal windows) but the first."""
    cfg = config(args, out)
    t0 = time.perf_counter()
    assert main.run(cfg) == 0
    wall = time.perf_counter() - t0
    text = open(os.path.join(out, "logs", "rank0.log")).read()
    rates = [float(v) for v in re.findall(r"samples_per_s=(\S+)", text)]
    rate = float(np.mean(rates[1:] or rates))
    print(f"ours: {rate:.1f} images/s (whole run incl. start-up: {wall:.1f} s)")
    return rate


def same_batches(args, cfg, train) -> list[list[int]]:
    """The first steps + 2 full batches of our epoch order (epoch after epoch), for the loop and HF's Trainer."""
    sampler, batches, epoch = GlobalBatchSampler(len(train), [args.batch], 0, cfg.seed), [], 0
    while len(batches) < args.steps + 2:
        batches += [b for b in sampler.epoch_batches(epoch) if len(b) == args.batch]
        epoch += 1
    return batches[:args.steps + 2]


def sgd(model, cfg):
    return torch.optim.SGD(model.parameters(), lr=cfg.train.lr, momentum=0.9, weight_decay=1e-4)


def hand_written(args, out: str) -> float:
    """The same model, batches and optimizer, in a plain loop: forward, cross_entropy, backward, step."""
    cfg = config(args, out)
    torch.manual_seed(cfg.seed)
    task = ImageFolderTask(cfg)
    train = task.build_datasets()["train"]
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    model = task.build_model().to(device).train()
    optimizer = sgd(model, cfg)
    loader = make_loader(train, same_batches(args, cfg, train), task.collate, cfg.data.num_workers,
                         device.type == "cuda", cfg.seed)
    seen, start = 0, None
    for i, batch in enumerate(loader):
        if i == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, seen = time.perf_counter(), 0
        images, labels = batch["pixel_values"].to(device), batch["labels"].to(device)
        loss = torch.nn.functional.cross_entropy(task.logits(model, {"pixel_values": images}), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += len(labels)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = seen / (time.perf_counter() - start)
    print(f"hand-written loop: {rate:.1f} images/s")
    return rate


class InOrder(torch.utils.data.Dataset):
    """`dataset`'s samples at `order`'s positions: read sequentially, they make our batches."""

    def __init__(self, dataset, order: list[int]):
        self.dataset, self.order = dataset, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, k: int) -> dict:
        return self.dataset[self.order[k]]


def hf_trainer(args, out: str) -> float:
    """Hugging Face's Trainer on the same model (transformers' ResNet, the same seed), the same decoded batches
    (our dataset in our order, read sequentially), the same SGD and loader workers; images/s after 2 steps."""
    import transformers
    cfg = config(args, out)
    torch.manual_seed(cfg.seed)
    task = ImageFolderTask(cfg)
    train = task.build_datasets()["train"]
    model = task.build_model()
    workers = auto_workers() if cfg.data.num_workers == "auto" else cfg.data.num_workers
    cuda = args.device == "cuda"
    marks = {}

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step in (2, args.steps + 2):
                if cuda:
                    torch.cuda.synchronize()
                marks[state.global_step] = time.perf_counter()

    hf_args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "hf"), per_device_train_batch_size=args.batch, max_steps=args.steps + 2,
        train_sampling_strategy="sequential", dataloader_num_workers=workers,
        dataloader_persistent_workers=workers > 0, dataloader_pin_memory=cuda, use_cpu=not cuda,
        report_to="none", save_strategy="no", eval_strategy="no", logging_steps=10**6, disable_tqdm=True,
        seed=cfg.seed)
    order = [i for b in same_batches(args, cfg, train) for i in b]
    optimizer = sgd(model, cfg)
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    transformers.Trainer(model=model, args=hf_args, train_dataset=InOrder(train, order),
                         optimizers=(optimizer, constant), callbacks=[Clock()]).train()
    rate = args.steps * args.batch / (marks[args.steps + 2] - marks[2])
    print(f"Hugging Face's Trainer: {rate:.1f} images/s")
    return rate


def decode_rate(args, out: str, workers) -> float:
    """The loader alone: training batches decoded and augmented, no model."""
    args_w = argparse.Namespace(**{**vars(args), "workers": workers})
    cfg = config(args_w, out)
    task = ImageFolderTask(cfg)
    train = task.build_datasets()["train"]
    batches = list(GlobalBatchSampler(len(train), [args.batch], 0, cfg.seed).epoch_batches(0))[:max(3, args.steps)]
    loader = iter(make_loader(train, batches, task.collate, workers, False, cfg.seed))
    next(loader)  # workers started, first batch out
    start, seen = time.perf_counter(), 0
    for batch in loader:
        seen += len(batch["labels"])
    return seen / (time.perf_counter() - start)


def channels_last_speedup(args, out: str) -> float:
    """model.channels_last: one forward + backward of the preset's model on a random batch, in interleaved pairs
    (contiguous then channels_last, the order swapped every other pair, after one warm-up of each); the median of
    contiguous time / channels_last time."""
    cfg = config(args, out)
    torch.manual_seed(cfg.seed)
    task = ImageFolderTask(cfg)
    task.build_datasets()
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    model = task.build_model().to(device).train()
    size = cfg.data.image_size
    images = torch.randn(args.batch, 3, size, size, device=device)
    labels = torch.randint(0, len(task.classes), (args.batch,), device=device)

    def step_time(nhwc: bool) -> float:
        layout = torch.channels_last if nhwc else torch.contiguous_format
        model.to(memory_format=layout)
        x = images.contiguous(memory_format=layout)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(pixel_values=x).logits, labels).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step_time(False), step_time(True)
    ratios = []
    for pair in range(args.layout_pairs):
        if pair % 2:
            nhwc = step_time(True)
            ratios.append(step_time(False) / nhwc)
        else:
            ratios.append(step_time(False) / step_time(True))
    median = float(np.median(ratios))
    print(f"channels_last speed-up (contiguous / channels_last step time, {args.batch} x {size} px, "
          f"{len(ratios)} interleaved pairs): median {median:.3f}, pairs {', '.join(f'{r:.2f}' for r in ratios)}")
    return median


def main_() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir")
    p.add_argument("--images", type=int, help="images in the folder made (default 512; --tiny: 64)")
    p.add_argument("--steps", type=int, help="timed steps per side (default 10; --tiny: 4)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", default="auto")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layout_pairs", type=int, help="channels_last vs contiguous pairs (default 6; --tiny: 2)")
    p.add_argument("--tiny", action="store_true", help="resnet18 of width 8 on 32x32 crops: proves the script runs")
    args = p.parse_args()
    args.images = args.images or (64 if args.tiny else 512)
    args.steps = args.steps or (4 if args.tiny else 10)
    args.layout_pairs = args.layout_pairs if args.layout_pairs is not None else (2 if args.tiny else 6)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.data_dir:
            args.data_dir = make_folder(os.path.join(tmp, "images"), args.images)
        a = ours(args, os.path.join(tmp, "ours"))
        b = hand_written(args, os.path.join(tmp, "hand"))
        c = hf_trainer(args, os.path.join(tmp, "hf"))
        print(f"ours / hand-written: {a / b:.3f}; HF's Trainer / hand-written: {c / b:.3f}; ours / HF's: {a / c:.3f}")
        for workers in (0, 1, 2, "auto"):
            rate = decode_rate(args, os.path.join(tmp, f"decode{workers}"), workers)
            n = auto_workers() if workers == "auto" else workers
            each = f"{rate / n:.1f} per worker" if n else "in the training process"
            print(f"loader, num_workers={workers} ({n}): {rate:.1f} images/s ({each}); "
                  f"{'keeps up with' if rate >= b else 'slower than'} the hand-written loop's {b:.1f} images/s")
        if args.layout_pairs:
            channels_last_speedup(args, os.path.join(tmp, "layout"))


if __name__ == "__main__":
    main_()
