"""Real image folders for the image_folder tests: MNIST's t10k digits from ../shared/data written out as PNG and
JPEG files (some grayscale, some RGB, several sizes), in the layouts the task reads."""
import os

import numpy as np
import pytest

from conftest import SHARED

MNIST = os.path.join(SHARED, "mnist")


def digits(n: int):
    """The first `n` t10k digits (uint8 [n, 28, 28]) and labels; the test skips without ../shared/data."""
    if not os.path.isfile(os.path.join(MNIST, "t10k-images-idx3-ubyte.gz")):
        pytest.skip("../shared/data/mnist is absent")
    from tasks.mnist import load_mnist
    images, labels = load_mnist(MNIST, "t10k", download=False)
    return images[:n], labels[:n]


def write_image(path: str, pixels: np.ndarray, k: int) -> str:
    """One digit as a file: even k a grayscale PNG, odd k an RGB JPEG (tinted), every third one larger."""
    from PIL import Image
    image = Image.fromarray(pixels, "L")
    if k % 3 == 0:
        image = image.resize((36, 40), Image.BILINEAR)
    if k % 2:
        rgb = np.stack([pixels, pixels // 2, 255 - pixels], -1).astype(np.uint8)
        image = Image.fromarray(rgb, "RGB").resize(image.size)
        path += ".JPG" if k % 4 == 1 else ".jpeg"  # any case of the extension
        image.save(path, quality=95)
    else:
        path += ".png"
        image.save(path)
    return path


def digit_folder(root, classes=("zero", "one", "two"), train=40, val=10, test=0, layout="train_val") -> str:
    """An image folder of MNIST digits 0, 1, 2 named `classes`: layout `train_val` (train/ and val/), `TRAIN_EVAL`
    (SD-Pipe's names), or `whole` (the class folders alone). Returns the folder."""
    root = str(root)
    need = {c: train + val + test for c in range(len(classes))}
    images, labels = digits(2000)
    by_class = {c: [i for i in range(len(labels)) if labels[i] == c][:need[c]] for c in need}
    names = {"train_val": ("train", "val", "test"), "TRAIN_EVAL": ("TRAIN", "EVAL", "TEST"),
             "whole": ("", "", None)}[layout]
    k = 0
    for c, name in enumerate(classes):
        picks = by_class[c]
        parts = [(names[0], picks[:train]), (names[1], picks[train:train + val]),
                 (names[2], picks[train + val:])]
        for split, indices in parts:
            if split is None or not indices:
                continue
            folder = os.path.join(root, split, name)
            os.makedirs(folder, exist_ok=True)
            for i in indices:
                write_image(os.path.join(folder, f"{i:05d}"), images[i], k)
                k += 1
    return root
