"""MNIST for the image task (data.dataset: mnist): the standard IDX files, gzipped or raw, from data.data_dir
(downloaded with data.download), checked before training: one size, finite pixels, labels among the classes."""
from __future__ import annotations

import gzip
import hashlib
import os
import struct
import urllib.request

import numpy as np

from core.errors import DataError
from core.file_names import shown_name

CLASSES = 10  # the digits 0-9: Net's output size, and the labels the data may hold
MIN_IMAGE_SIZE = 6  # two 3x3 convolutions and a 2x2 max-pool leave at least one pixel

MNIST_FILES = {  # name -> MD5 as published with the dataset
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
MNIST_MIRRORS = ["https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "https://storage.googleapis.com/cvdf-datasets/mnist/"]
IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic (0, 0, dtype, ndim), ndim big-endian sizes, then the data."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{shown_name(path)}: cannot read ({e})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_TYPES:
        raise DataError(f"{shown_name(path)}: not an IDX file (bad magic number {data[:4].hex()})")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise DataError(f"{shown_name(path)}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dtype = np.dtype(IDX_TYPES[data[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    body = data[4 + 4 * ndim:]
    if len(body) != expected:
        raise DataError(f"{shown_name(path)}: IDX header promises {shape} ({expected} bytes) but holds {len(body)} "
                        "bytes")
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
            raise DataError(f"{shown_name(os.path.join(data_dir, name))}[.gz]: missing. Put the MNIST IDX files "
                            f"({', '.join(MNIST_FILES)}, .gz or raw) in data.data_dir={data_dir!r}, "
                            "or run once with network access and data.download: true")
        paths.append(path)
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(f"{shown_name(paths[0])}: {images.shape} images do not match {labels.shape} labels in "
                        f"{shown_name(paths[1])}")
    check_images(paths[0], images)
    return images, check_labels(paths[1], labels)


def load_mnist_splits(data_dir: str, download: bool):
    """(train images, train labels, t10k images, t10k labels): one model is sized for both, so both have one size."""
    images, labels = load_mnist(data_dir, "train", download)
    test_images, test_labels = load_mnist(data_dir, "t10k", download)
    if test_images.shape[1:] != images.shape[1:]:  # said now, not when test mode reads t10k
        raise DataError(f"{shown_name(data_dir)}: t10k images are {'x'.join(map(str, test_images.shape[1:]))} but "
                        f"train images {'x'.join(map(str, images.shape[1:]))}; both splits need one size")
    return images, labels, test_images, test_labels


def check_images(path: str, images: np.ndarray) -> None:
    """Images the CNN can take: square (it is sized from one side), large enough for its two convolutions and the
    pooling, and finite (a float IDX file may hold NaN, which would only show up as a NaN loss mid-run)."""
    n, height, width = images.shape
    if n == 0:
        raise DataError(f"{shown_name(path)}: no images")
    if height != width or width < MIN_IMAGE_SIZE:
        raise DataError(f"{shown_name(path)}: images are {height}x{width}; the CNN needs square images of at least "
                        f"{MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE}")
    if images.dtype.kind == "f":
        bad = ~np.isfinite(images.reshape(n, -1)).all(axis=1)
        if bad.any():
            first = int(np.argmax(bad))
            raise DataError(f"{shown_name(path)}: image at index {first} holds non-finite pixels (NaN or infinity)"
                            f"{others(int(bad.sum()), 'images')}; pixels must be finite numbers")


def check_labels(path: str, labels: np.ndarray) -> np.ndarray:
    """int64 labels, all classes of the network (0..CLASSES-1). Checked here, in one vectorised pass, because an
    out-of-range label otherwise passes silently until cross_entropy raises a traceback mid-run (on a GPU, a
    device-side assert that names nothing)."""
    if labels.dtype.kind == "f":  # a float IDX file: 3.0 is a class, 3.5 is not (astype would truncate it)
        bad = ~np.isfinite(labels) | (labels != np.round(labels))
        if bad.any():
            first = int(np.argmax(bad))
            raise DataError(f"{shown_name(path)}: label {labels[first]} at index {first} is not a whole number"
                            f"{others(int(bad.sum()), 'labels')}; labels are classes 0-{CLASSES - 1}")
    bad = (labels < 0) | (labels >= CLASSES)
    if bad.any():
        first = int(np.argmax(bad))
        value = labels[first].item()
        value = int(value) if float(value).is_integer() else value  # 12.0 in a float file reads as 12
        raise DataError(f"{shown_name(path)}: label {value} at index {first} is outside the {CLASSES} classes "
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
