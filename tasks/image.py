"""Image classification: a CNN in the style of pytorch/examples' MNIST, on `digits` or `mnist`.

`digits` is scikit-learn's bundled set of 1,797 real 8x8 handwritten digits: no download, trains in a minute on a
laptop CPU. `mnist` reads the standard IDX files (gzipped or raw) from data.dir, any split that is present.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import struct
import urllib.request

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from config import DataError
from tasks.base import Layer, Task, classification_batch, classification_metrics

MNIST_FILES = {  # name -> MD5 as published with the dataset
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
MNIST_MIRRORS = ["https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "https://storage.googleapis.com/cvdf-datasets/mnist/"]


CLASSES = 10  # the digits 0-9: Net's output size, and the labels the data may hold
MIN_IMAGE_SIZE = 6  # two 3x3 convolutions and a 2x2 max-pool leave at least one pixel


class Net(nn.Module):
    """pytorch/examples' MNIST network, sized from the image: two 3x3 convolutions, max-pool, two linear layers."""

    def __init__(self, image_size: int, channels: int = 32, hidden: int = 128, dropout: float = 0.25,
                 classes: int = CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, 1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, 1)
        side = (image_size - 4) // 2
        self.fc1 = nn.Linear(2 * channels * side * side, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(2 * dropout)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.features2(self.features1(images))))

    # The forward in four pieces: pipe cuts the network between them (ImageTask.pipeline_layers).
    def features1(self, images: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv1(images))

    def features2(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.conv2(x)), 2)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout2(x))


class TensorImages(Dataset):
    """Normalised float images [N, 1, H, W] and int64 labels, held in memory."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, mean: float, std: float):
        self.images = ((torch.as_tensor(images, dtype=torch.float32) - mean) / std).unsqueeze(1)
        self.labels = torch.as_tensor(labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"images": self.images[i], "labels": self.labels[i]}


class ImageTask(Task):
    def build_model(self) -> nn.Module:
        m = self.cfg.model
        if m.name != "cnn":
            raise DataError(f"model.name: the image task has one architecture, `cnn`, not {m.name!r}")
        # -----> swap in your own image model here.
        return Net(self.image_size, m.channels, m.hidden, m.dropout)

    def data_name(self) -> str:
        return self.cfg.data.dataset  # digits or mnist

    def build_datasets(self) -> dict:
        d = self.cfg.data
        if d.dataset == "digits":
            images, labels, test_images, test_labels = load_digits_split()
            scale, mean, std = 16.0, 0.3, 0.4  # pixel range 0..16; mean/std of the training images
        elif d.dataset == "mnist":
            images, labels = load_mnist(d.data_dir, "train", d.download)
            test_images, test_labels = load_mnist(d.data_dir, "t10k", d.download)
            if test_images.shape[1:] != images.shape[1:]:  # one model is sized for both: say so now, not in test
                raise DataError(f"{d.data_dir}: t10k images are {'x'.join(map(str, test_images.shape[1:]))} but "
                                f"train images {'x'.join(map(str, images.shape[1:]))}; both splits need one size")
            scale, mean, std = 255.0, 0.1307, 0.3081
        else:
            raise DataError(f"data.dataset: the image task reads `digits` or `mnist`, not {d.dataset!r}")
        self.image_size, self.pixels = images.shape[-1], (scale, mean, std)  # pixels: for export_config
        # The dev split is a fixed slice of the training pool (independent of the training seed).
        order = np.random.default_rng(0).permutation(len(labels))
        n_dev = int(round(len(labels) * d.dev_fraction))
        dev, train = order[:n_dev], order[n_dev:]
        make = lambda x, y: TensorImages(x / scale, y, mean, std)  # noqa: E731
        return {"train": make(images[train], labels[train]), "dev": make(images[dev], labels[dev]),
                "test": make(test_images, test_labels)}

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.loss_from_output(model(batch["images"]), batch["labels"])

    def loss_from_output(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # -----> the loss of a task: summed over the batch (the Trainer divides by the global count).
        return F.cross_entropy(logits.float(), labels, reduction="sum")

    def eval_batch(self, model: nn.Module, batch: dict) -> dict:
        return self.eval_from_output(model(batch["images"]), batch)

    def eval_from_output(self, logits: torch.Tensor, batch: dict) -> dict:
        return classification_batch(logits, batch["labels"], self.loss_from_output(logits, batch["labels"]))

    def pipeline_layers(self, model: Net) -> list[nn.Module]:
        return [Layer(model.features1, model.conv1), Layer(model.features2, model.conv2),
                Layer(model.hidden, model.fc1), Layer(model.head, model.fc2)]

    def pipeline_inputs(self, batch: dict) -> tuple:
        return (batch["images"],)

    # mode: export (export.py): the weights, how to rebuild Net around them, and a torch.export program.
    export_formats = ("state_dict", "torch_export")

    def export_config(self, model: Net) -> dict:
        scale, mean, std = self.pixels
        m = self.cfg.model
        return {"class": "tasks.image:Net", "init": {"image_size": self.image_size, "channels": m.channels,
                                                     "hidden": m.hidden, "dropout": m.dropout, "classes": CLASSES},
                "input": f"float images [N, 1, {self.image_size}, {self.image_size}]: pixels / {scale:g}, then "
                         f"(x - {mean:g}) / {std:g}",
                "output": f"logits [N, {CLASSES}] (the digits 0-9)"}

    def example_inputs(self) -> tuple:
        return (torch.zeros(2, 1, self.image_size, self.image_size),)

    def metrics(self, totals: dict) -> dict:
        # -----> metrics of a task, from everything eval_batch returned over the whole split.
        return classification_metrics(totals["preds"], totals["labels"], totals["loss_sum"], totals["count"])


# ----------------------------------------------------------------------------------------------------------------
# digits: 1,797 8x8 images shipped with scikit-learn
# ----------------------------------------------------------------------------------------------------------------
def load_digits_split(test_size: int = 300):
    """(train images, train labels, test images, test labels); the test split is a fixed random 300."""
    images, target = read_digits()
    order = np.random.default_rng(1234).permutation(len(target))
    test, train = order[:test_size], order[test_size:]
    return images[train], target[train], images[test], target[test]


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (images [1797, 8, 8] float64, targets int), what `load_digits()` returns.
    Read straight from the CSV that scikit-learn ships: importing sklearn.datasets costs 2-3 s of CPU in every
    rank, which on a 2-core laptop is longer than training the CNN."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") if spec else ""
    if not os.path.isfile(path):  # a scikit-learn that keeps it elsewhere: ask it
        from sklearn.datasets import load_digits
        digits = load_digits()
        return digits.images, digits.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


# ----------------------------------------------------------------------------------------------------------------
# MNIST: IDX files
# ----------------------------------------------------------------------------------------------------------------
IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic (0, 0, dtype, ndim), ndim big-endian sizes, then the data."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_TYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number {data[:4].hex()})")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dtype = np.dtype(IDX_TYPES[data[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    body = data[4 + 4 * ndim:]
    if len(body) != expected:
        raise DataError(f"{path}: IDX header promises {shape} ({expected} bytes) but holds {len(body)} bytes")
    return np.frombuffer(body, dtype=dtype).reshape(shape)


def find_idx(data_dir: str, name: str):
    """`name` (e.g. t10k-images-idx3-ubyte) in data_dir, gzipped or raw, also with the common '.' variant."""
    for candidate in (name, name + ".gz", name.replace("-idx", ".idx"), name.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(data_dir, candidate)
        if os.path.exists(path):
            return path
    return None


def load_mnist(data_dir: str, split: str, download: bool = True):
    """(images uint8 [N, 28, 28], labels int64 [N]) of split `train` or `t10k`."""
    paths = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        name = f"{split}-{kind}"
        path = find_idx(data_dir, name)
        if path is None and download:
            path = download_mnist_file(data_dir, name)
        if path is None:
            raise DataError(f"{os.path.join(data_dir, name)}[.gz]: missing. Put the MNIST IDX files "
                            f"({', '.join(MNIST_FILES)}, .gz or raw) in data.data_dir={data_dir!r}, "
                            "or run once with network access and data.download: true")
        paths.append(path)
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(f"{paths[0]}: {images.shape} images do not match {labels.shape} labels in {paths[1]}")
    check_images(paths[0], images)
    return images, check_labels(paths[1], labels)


def check_images(path: str, images: np.ndarray) -> None:
    """Images the CNN can take: square (it is sized from one side), large enough for its two convolutions and the
    pooling, and finite (a float IDX file may hold NaN, which would only show up as a NaN loss mid-run)."""
    n, height, width = images.shape
    if n == 0:
        raise DataError(f"{path}: no images")
    if height != width or width < MIN_IMAGE_SIZE:
        raise DataError(f"{path}: images are {height}x{width}; the CNN needs square images of at least "
                        f"{MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE}")
    if images.dtype.kind == "f":
        bad = ~np.isfinite(images.reshape(n, -1)).all(axis=1)
        if bad.any():
            first = int(np.argmax(bad))
            raise DataError(f"{path}: image at index {first} holds non-finite pixels (NaN or infinity)"
                            f"{others(int(bad.sum()), 'images')}; pixels must be finite numbers")


def check_labels(path: str, labels: np.ndarray) -> np.ndarray:
    """int64 labels, all classes of the network (0..CLASSES-1). Checked here, in one vectorised pass, because an
    out-of-range label otherwise passes silently until cross_entropy raises a traceback mid-run (on a GPU, a
    device-side assert that names nothing)."""
    if labels.dtype.kind == "f":  # a float IDX file: 3.0 is a class, 3.5 is not (astype would truncate it)
        bad = ~np.isfinite(labels) | (labels != np.round(labels))
        if bad.any():
            first = int(np.argmax(bad))
            raise DataError(f"{path}: label {labels[first]} at index {first} is not a whole number"
                            f"{others(int(bad.sum()), 'labels')}; labels are classes 0-{CLASSES - 1}")
    bad = (labels < 0) | (labels >= CLASSES)
    if bad.any():
        first = int(np.argmax(bad))
        value = labels[first].item()
        value = int(value) if float(value).is_integer() else value  # 12.0 in a float file reads as 12
        raise DataError(f"{path}: label {value} at index {first} is outside the {CLASSES} classes "
                        f"(0-{CLASSES - 1}){others(int(bad.sum()), 'labels')}")
    return labels.astype(np.int64)


def others(count: int, what: str) -> str:
    """` (42 bad labels in all)` after the first bad value, so one message says how widespread the damage is."""
    return f" ({count} bad {what} in all)" if count > 1 else ""


def download_mnist_file(data_dir: str, name: str):
    """Fetch `name`.gz into data_dir and check its MD5. Returns the path, or None when offline."""
    os.makedirs(data_dir, exist_ok=True)
    target = os.path.join(data_dir, name + ".gz")
    for mirror in MNIST_MIRRORS:
        try:
            with urllib.request.urlopen(mirror + name + ".gz", timeout=10) as r:
                payload = r.read()
        except OSError:
            continue
        if hashlib.md5(payload).hexdigest() != MNIST_FILES[name]:
            continue  # a broken mirror must not leave a corrupt file behind
        with open(target + ".part", "wb") as f:
            f.write(payload)
        os.replace(target + ".part", target)
        return target
    return None
