"""image_folder's speed, side by side: ResNet training images/s of this Trainer against a hand-written loop over the
same model, batches and optimizer (the limit), and the loader's decode + augment images/s at 0, 1, 2 and auto
workers (does it keep up with the model?).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_images.py                      # ResNet-50, 224, batch 32
    python benchmarks/bench_images.py --tiny --steps 4 --images 64                 # proves it runs (seconds)
    python benchmarks/bench_images.py --data_dir path/to/folder --device cuda      # your folder, a GPU

The folder (without --data_dir): --images JPEGs cut at random from scikit-learn's two sample photos (640x427) into
4 classes, in a temporary folder. Both loops use the preset configs/resnet50_imagefolder.yml (SGD momentum 0.9, the
same lr schedule's first steps, fp32), the same model built by tasks/image_folder.py from the same seed, and the
same DataLoader settings; each side's first 2 steps are a warm-up, not timed. Take the figures on a quiet machine:
on a shared one, the other jobs' load is in them (benchmarks/RESULTS.md says where they were taken).
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
from data_loader import GlobalBatchSampler, make_loader  # noqa: E402
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


def hand_written(args, out: str) -> float:
    """The same model, batches and optimizer, in a plain loop: forward, cross_entropy, backward, step."""
    cfg = config(args, out)
    torch.manual_seed(cfg.seed)
    task = ImageFolderTask(cfg)
    train = task.build_datasets()["train"]
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    model = task.build_model().to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr, momentum=0.9, weight_decay=1e-4)
    sampler = GlobalBatchSampler(len(train), [args.batch], 0, cfg.seed)
    batches, seen, start = [], 0, None
    epoch = 0
    while len(batches) < args.steps + 2:
        batches += list(sampler.epoch_batches(epoch))
        epoch += 1
    loader = make_loader(train, batches[:args.steps + 2], task.collate, cfg.data.num_workers, device.type == "cuda",
                         cfg.seed)
    for i, batch in enumerate(loader):
        if i == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, seen = time.perf_counter(), 0
        images, labels = batch["pixel_values"].to(device), batch["labels"].to(device)
        loss = torch.nn.functional.cross_entropy(model(pixel_values=images).logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += len(labels)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = seen / (time.perf_counter() - start)
    print(f"hand-written loop: {rate:.1f} images/s")
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
    rate = seen / (time.perf_counter() - start)
    print(f"loader, num_workers={workers}: {rate:.1f} images/s")
    return rate


def main_() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir")
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", default="auto")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tiny", action="store_true", help="resnet18 of width 8 on 32x32 crops: proves the script runs")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.data_dir:
            args.data_dir = make_folder(os.path.join(tmp, "images"), args.images)
        for workers in (0, 1, 2, "auto"):
            decode_rate(args, os.path.join(tmp, f"decode{workers}"), workers)
        a = ours(args, os.path.join(tmp, "ours"))
        b = hand_written(args, os.path.join(tmp, "hand"))
        print(f"ours / hand-written: {a / b:.3f}")


if __name__ == "__main__":
    main_()
