"""Image classification: a CNN in the style of pytorch/examples' MNIST, on `digits` or `mnist`.

`digits` is scikit-learn's bundled set of 1,797 real 8x8 handwritten digits: no download, trains in a minute on a
laptop CPU. `mnist` reads the standard IDX files from data.data_dir (tasks/mnist.py).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

from core.errors import DataError
from core.file_names import shown_name
from tasks.base import PipelineLayer, Task
from tasks.image_folder import BAD_IMAGE, image_files, open_rgb
from tasks.metrics import classification_batch, classification_metrics
from tasks.mnist import CLASSES, load_mnist_splits
from tasks.table_files import EncodedLazily, in_chunks


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
    compiles_on_cpu = False  # torch 2.13's inductor computes zero gradients for its convolutions on CPU
    has_pipeline_chain = reads_new_inputs = True

    def build_model(self) -> nn.Module:
        m = self.cfg.model
        if m.name != "cnn":
            raise DataError(f"model.name: the image task has one architecture, `cnn`, not {m.name!r}")
        # -----> swap in your own image model here.
        return Net(self.image_size, m.channels, m.hidden, m.random_dropout())

    def data_name(self) -> str:
        return self.cfg.data.dataset  # digits or mnist

    def build_datasets(self) -> dict:
        d = self.cfg.data
        if d.dataset == "digits":
            images, labels, test_images, test_labels = load_digits_split()
            scale, mean, std = 16.0, 0.3, 0.4  # pixel range 0..16; mean/std of the training images
        elif d.dataset == "mnist":
            images, labels, test_images, test_labels = load_mnist_splits(d.data_dir, d.download)
            scale, mean, std = 255.0, 0.1307, 0.3081
        else:
            raise DataError(f"data.dataset: the image task reads `digits` or `mnist`, not {d.dataset!r}")
        self.image_size, self.pixels = images.shape[-1], (scale, mean, std)  # pixels: for export_config
        # The dev split is a fixed slice of the training pool (independent of the training seed). digits: 1,797
        # images, 300 held out as test (load_digits_split), dev round(1,497 x 0.15) = 225, train 1,272.
        order = np.random.default_rng(0).permutation(len(labels))
        n_dev = int(round(len(labels) * d.dev_fraction))
        if not n_dev:  # (the last step always evaluates dev: a KeyError traceback once training had ended)
            raise DataError(f"data.dev_fraction {d.dev_fraction:g} of the {len(labels)} {d.dataset} training images "
                            "is none: no dev split; raise data.dev_fraction")
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
        # each link holds the dropout it runs too: the stage's eval() must reach it
        return [PipelineLayer(model.features1, model.conv1), PipelineLayer(model.features2, model.conv2),
                PipelineLayer(model.hidden, model.dropout1, model.fc1),
                PipelineLayer(model.head, model.dropout2, model.fc2)]

    def pipeline_inputs(self, batch: dict) -> tuple:
        return (batch["images"],)

    # mode: export (export.py): the weights, how to rebuild Net around them, and a torch.export program.
    export_formats = ("state_dict", "torch_export", "onnx")

    def export_config(self, model: Net) -> dict:
        scale, mean, std = self.pixels
        m = self.cfg.model
        return {"class": "tasks.image:Net", "init": {"image_size": self.image_size, "channels": m.channels,
                                                     "hidden": m.hidden, "dropout": m.random_dropout(), "classes": CLASSES},
                "input": f"float images [N, 1, {self.image_size}, {self.image_size}]: pixels in 0..1 (the {self.cfg.data.dataset} data's / "
                         f"{scale:g}; an image file's: gray, resized to {self.image_size}x{self.image_size} bilinear, "
                         f"/ 255, as mode predict reads it), then (x - {mean:g}) / {std:g}",
                "output": f"logits [N, {CLASSES}] (the digits 0-9)"}

    def example_inputs(self) -> tuple:
        return (torch.zeros(2, 1, self.image_size, self.image_size),)

    def predict_chunks(self, path: str, size: Optional[int]) -> Iterator[tuple[list[str], Dataset]]:
        """mode: predict: a folder's images, or one image, as the CNN saw its training images (gray, image_size
        square), `size` at a time, each decoded by the rank that predicts it (under ddp: its share alone)."""
        files, names = image_files(path)
        for chunk in in_chunks(range(len(files)), size):
            yield [names[i] for i in chunk], EncodedLazily([files[i] for i in chunk], self.predict_item)

    def predict_item(self, path: str) -> dict:
        _, mean, std = self.pixels  # (one image normalised as TensorImages normalises a stack: the same floats)
        return TensorImages(gray_square(path, self.image_size)[None], np.zeros(1), mean, std)[0]

    def predict_logits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(batch["images"])

    def metrics(self, totals: dict) -> dict:
        # -----> metrics of a task, from everything eval_batch returned over the whole split.
        return classification_metrics(totals["preds"], totals["labels"], totals["loss_sum"], totals["count"])


def gray_square(path: str, size: int) -> np.ndarray:
    """An image file as the CNN's input: read as image_folder reads it (upright by its EXIF, 16 bits onto 8,
    transparency onto white), then grayscale, resized to size x size, pixels in 0..1."""
    try:
        gray = open_rgb(path).convert("L")
        return np.asarray(gray.resize((size, size), Image.BILINEAR), dtype=np.float32) / 255
    except BAD_IMAGE as e:
        raise DataError(f"predict.input: {shown_name(path)}: not a readable image "
                        f"({str(e).splitlines()[0][:80]})") from None


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
    """scikit-learn's digits as (images [1797, 8, 8] float64, targets int), what `load_digits()` returns, read
    from the CSV it ships: importing sklearn.datasets takes longer than training the CNN (benchmarks/RESULTS.md, "CI time with the fault tests")."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") if spec else ""
    if not os.path.isfile(path):  # a scikit-learn that keeps it elsewhere: ask it
        from sklearn.datasets import load_digits
        digits = load_digits()
        return digits.images, digits.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
