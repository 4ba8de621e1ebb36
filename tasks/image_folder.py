"""task: image_folder: your own photos in PyTorch's image-folder layout, trained by a ResNet (or any Hugging Face
image classifier folder).

    data_dir/train/<class>/*.jpg   data_dir/val/<class>/...   [data_dir/test/<class>/...]
    (also TRAIN/ and EVAL/; or data_dir/<class>/... alone, its dev split a fixed data.dev_fraction of it)

Class names are the subfolder names (NFC), sorted. Images are decoded with Pillow in the DataLoader's workers and
preprocessed as the ImageNet recipes do (torch and Pillow only): training RandomResizedCrop + horizontal flip,
evaluation resize + center crop, then mean/std. Each random crop comes from a generator seeded by (seed, epoch,
sample), so a resumed run sees the same crops and augmentation never draws from the stream dropout uses.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import os
import unicodedata
import warnings
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile
from torch import nn
from torch.utils.data import Dataset

from core.config import is_set
from core.errors import ConfigError, DataError
from core.file_names import shown_name
from core.errors import printable
from tasks.base import PipelineLayer, Task
from tasks.metrics import classification_batch, classification_metrics
from tasks.text_common import WEIGHTS_DTYPE, load_report, plain_transformers_output, pretrained_dropout
from tasks.untrusted_folders import check_folder

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")  # any case
SPLITS = ("train", "dev", "test", "predict")
SPLIT_FOLDERS = {"train": ("train",), "dev": ("val", "valid", "validation", "eval", "dev"), "test": ("test",)}
CROP_RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's aspect ratios, as torchvision's
# model.arch -> (block type, blocks per stage, channels of the last stage per unit of width: 8 basic, 32 bottleneck)
RESNETS = {"resnet18": ("basic", [2, 2, 2, 2]), "resnet34": ("basic", [3, 4, 6, 3]),
           "resnet50": ("bottleneck", [3, 4, 6, 3]), "resnet101": ("bottleneck", [3, 4, 23, 3])}

# Folders an OS or a NAS keeps beside the photos, never a class nor read: hidden ones (.thumbnails, .@__thumb,
# .Trash-1000), a Synology's or QNAP's (@eaDir: each photo again as thumbnails; #recycle, @Recycle), Windows'
# ($RECYCLE.BIN, System Volume Information), a macOS zip's __MACOSX, a disk's lost+found
SYSTEM_FOLDER_STARTS = (".", "@", "#", "$")
SYSTEM_FOLDERS = ("system volume information", "__macosx", "lost+found")
TWELVE_BITS = 4096  # a 16-bit image whose values stay below: 12 bits (microscopes, X-rays), near-black once / 257
ONE_PIXEL_MAP = 32  # a ResNet's last feature map is 1x1 at this image size or less (it strides by 32)
ImageFile.LOAD_TRUNCATED_IMAGES = False  # a cut-off file is an error, never an image padded with grey


def check_config(cfg, fail) -> None:
    """model.arch / model.width / model.sync_batchnorm for image_folder (wiring.READER_CHECKS asks; lm_models checks
    them for the other tasks)."""
    m = cfg.model
    if m.arch is not None and m.arch not in RESNETS:
        fail("model.arch", f"is {m.arch}; image_folder builds {' | '.join(RESNETS)}")
    if m.width is not None and m.width < 1:
        fail("model.width", f"must be >= 1 (the ResNet's first channels; null: 64), got {m.width}")
    for key in ("layers", "heads", "bias", "tie_embeddings"):
        if getattr(m, key) is not None:
            fail(f"model.{key}", "is for the transformer tasks, not image_folder (model.arch and model.width shape "
                                 "its ResNet); remove it")
    training = cfg.mode in ("train", "lr_find")  # (test, predict, export: BatchNorm in eval mode, nothing to sync)
    if m.sync_batchnorm and training and cfg.dist.strategy != "ddp":
        fail("model.sync_batchnorm", f"is for dist.strategy: ddp, not {cfg.dist.strategy}")
    if m.channels_last is True and cfg.dist.strategy in ("fsdp", "pipe"):  # (auto: off there)
        fail("model.channels_last", f"is not for dist.strategy: {cfg.dist.strategy} (fsdp takes contiguous parameters "
                                    "only, pipe sends contiguous activations only); remove it")
    if m.sync_batchnorm and training and not cfg.dist.on_gpu():
        fail("model.sync_batchnorm", "needs GPUs (torch's SyncBatchNorm computes on CUDA only); remove it on a CPU")


def check_compile(cfg, fail) -> None:
    """train.compile for image_folder (wiring.READER_CHECKS asks when it is set)."""
    if cfg.task == "image_folder" and cfg.dist.strategy == "fsdp" and not cfg.dist.on_gpu():
        # fsdp compiles each block on its own: the ResNet's blocks share one forward with different strides, and
        # torch 2.13's inductor fails at the recompile this forces on a CPU (InductorError at step 1)
        fail("train.compile", "under dist.strategy fsdp is refused for image_folder on a CPU: torch 2.13's inductor "
                              "fails on the ResNet's blocks compiled one by one; compile under ddp or none, or "
                              "train fsdp in eager")


def check_activation_checkpointing(cfg, fail) -> None:
    """model.activation_checkpointing for image_folder (wiring.READER_CHECKS asks when it is set)."""
    if cfg.task == "image_folder":
        # the recomputation in backward runs each BatchNorm's forward again, which updates its running statistics
        fail("model.activation_checkpointing", "is refused for image_folder: the ResNet's BatchNorm layers would "
                                               "update their running statistics twice a step (again as backward "
                                               "recomputes each stage), and evaluation would use those; set it to "
                                               "false")


def check_data_config(cfg, fail) -> None:
    """The preprocessing keys of data.* (wiring.READER_CHECKS asks when one is set)."""
    d = cfg.data
    if cfg.task != "image_folder":
        key = next(k for k in ("image_size", "resize_size", "crop_scale", "image_mean", "image_std", "skip_bad_images")
                   if is_set(cfg, f"data.{k}"))
        fail(f"data.{key}", f"is for task image_folder, not {cfg.task}; remove it")
    if not 8 <= d.image_size <= 4096:
        fail("data.image_size", f"must be in [8, 4096], got {d.image_size}")
    if not d.image_size <= d.resize_size <= 8192:
        fail("data.resize_size", f"must be in [data.image_size ({d.image_size}), 8192], got {d.resize_size}")
    s = d.crop_scale
    if len(s) != 2 or not all(isinstance(v, (int, float)) for v in s) or not 0 < s[0] <= s[1] <= 1:
        fail("data.crop_scale", f"must be [min, max] with 0 < min <= max <= 1, got {s}")
    for key in ("image_mean", "image_std"):
        v = getattr(d, key)
        if len(v) != 3 or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in v):
            fail(f"data.{key}", f"must list 3 numbers (R, G, B), got {v}")
    if not all(x > 0 for x in d.image_std):
        fail("data.image_std", f"must be > 0 per channel, got {d.image_std}")
    sizes = cfg.train.batch_size if isinstance(cfg.train.batch_size, list) else [cfg.train.batch_size]
    pipe = cfg.dist.strategy == "pipe"
    one = cfg.dist.pp_microbatches if pipe else 1  # the batch size that gives each forward one image
    if cfg.mode in ("train", "lr_find") and d.image_size <= ONE_PIXEL_MAP and one in sizes and \
            (pipe or not cfg.model.pretrained_dir):  # (a traceback at step 1; pipe: a ResNet, pretrained or not)
        per = f" per pipeline in dist.pp_microbatches={one}" if pipe else ""
        fail("train.batch_size", f"{cfg.train.batch_size}{per} is {'micro-' if pipe else ''}batches of one image, "
                                 f"which the ResNet's BatchNorm cannot train on at data.image_size {d.image_size} "
                                 "(its last feature map is 1x1: one value per channel); give each "
                                 f"{'micro-' if pipe else ''}batch 2 or more images")
    if d.skip_bad_images and cfg.dist.strategy == "pipe" and cfg.mode in ("train", "lr_find"):
        fail("data.skip_bad_images", "is not for dist.strategy: pipe in training (a skipped image shrinks its batch; "
                                     "pipeline stages take one shape every step); remove or replace the unreadable files")


# ---- the folder: splits, classes, files ---------------------------------------------------------------------------
def split_folder(data_dir: str, split: str) -> Optional[str]:
    """data_dir's folder for `split` (train/TRAIN, val/EVAL/dev..., test), any case; None if it has none, and one
    line if it has two."""
    try:
        names = sorted(os.listdir(data_dir))
    except OSError as e:
        raise DataError(f"data.data_dir: {shown_name(data_dir)} cannot be read ({e.strerror})") from None
    found = [n for n in names if n.lower() in SPLIT_FOLDERS[split] and os.path.isdir(os.path.join(data_dir, n))]
    if len(found) > 1:  # (the first was read, the others' images neither trained on nor evaluated)
        raise DataError(f"{shown_name(data_dir)}: two {split} folders, {shown_name(found[0])}/ and "
                        f"{shown_name(found[1])}/; merge them into one")
    return os.path.join(data_dir, found[0]) if found else None


def hidden_or_system_folder(name: str) -> bool:
    """A hidden or system folder (SYSTEM_FOLDER_STARTS, SYSTEM_FOLDERS): left out of the scan, counted."""
    return name.startswith(SYSTEM_FOLDER_STARTS) or name.lower() in SYSTEM_FOLDERS


def walk_images(folder: str) -> tuple[list[str], int]:
    """The image files under `folder`, any depth, sorted (hidden files and hidden or system folders left out;
    symlinked folders followed, as torchvision's ImageFolder does, each real folder once), and how many other files
    and system folders there were."""
    files, others, seen = [], 0, {os.path.realpath(folder)}
    for root, dirs, names in os.walk(folder, onerror=refuse_unreadable, followlinks=True):
        kept = []
        for d in sorted(dirs):
            real = os.path.realpath(os.path.join(root, d))
            left_out = hidden_or_system_folder(d)
            others += left_out
            if not left_out and real not in seen:  # each real folder once: a link back up is not followed
                seen.add(real)
                kept.append(d)
        dirs[:] = kept
        for f in sorted(names):
            if f.startswith(".") or not f.lower().endswith(IMAGE_EXTENSIONS):
                if not f.startswith("."):  # (hidden: an editor's lock file is a link to nothing)
                    refuse_dangling_link(os.path.join(root, f))
                others += 1
            else:
                files.append(os.path.join(root, f))
    return files, others


def refuse_dangling_link(path: str) -> None:
    """A link to nothing, not named as an image (a folder on a share not mounted, os.walk lists it as a file): one
    line, not its images left out as 'a non-image file'. (One named .jpg is an unreadable image, as it is.)"""
    if os.path.islink(path) and not os.path.exists(path):
        raise DataError(f"{shown_name(path)}: a link to {shown_name(os.readlink(path))}, which is not there (a disk or "
                        "share not mounted?); its images would be left out: mount it, or remove the link")


def refuse_unreadable(error: OSError) -> None:
    """os.walk's onerror: a folder it cannot list (another user's, mode 700) is one line, not skipped unsaid."""
    raise DataError(f"{shown_name(error.filename)}: cannot be read ({error.strerror}); its images would be left out")


def scan_classes(folder: str, skip: tuple = ()) -> tuple[dict[str, list[str]], int, list[str]]:
    """{class name: its image files, sorted} of `folder`'s subfolders (searched to any depth, hidden and system
    folders left out), how many other files and system folders were ignored (hidden ones, other extensions), and the
    images beside the class folders (in none: no class to give them)."""
    classes, ignored, loose = {}, 0, []
    try:
        listed = sorted(os.listdir(folder))
    except OSError as e:
        refuse_unreadable(e)
    for name in listed:
        path = os.path.join(folder, name)
        if hidden_or_system_folder(name) or not os.path.isdir(path) or name.lower() in skip:
            if not os.path.isdir(path) and not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS):
                loose.append(path)
            else:
                if not hidden_or_system_folder(name) and name.lower() not in skip:
                    refuse_dangling_link(path)
                ignored += not os.path.isdir(path) or hidden_or_system_folder(name)
            continue
        if name != printable(name):  # bytes Python read as lone surrogates: no label JSON, a console or a CSV takes
            raise DataError(f"{shown_name(path)}: a class folder whose name is not UTF-8 (Latin-1?); its name is the "
                            "class's label (checkpoints, exports, predictions.csv): rename it in UTF-8")
        files, others = walk_images(path)
        ignored += others
        if not files:
            raise DataError(f"{shown_name(path)}: an empty class folder (no "
                            f"{'/'.join(e[1:] for e in IMAGE_EXTENSIONS)} images); put images in it or remove it")
        # the class is its name composed (NFC): the `é` macOS wrote decomposed (e + U+0301) is `é` wherever copied
        label = unicodedata.normalize("NFC", name)
        if label in classes:  # (ascii: the two forms print alike)
            other = os.path.relpath(classes[label][0], folder).split(os.sep)[0]
            raise DataError(f"{shown_name(folder)}: two class folders name one class, {ascii(other)} and "
                            f"{ascii(name)} (the same letters in two Unicode forms); merge them into one")
        classes[label] = files
    return classes, ignored, loose


def read_layout(data_dir: str, dev_fraction: float,
                output_dir: Optional[str] = None) -> tuple[list[str], dict, dict, list[str]]:
    """(class names, {split: [(path, class index)]}, {split: files ignored}, images beside the class folders) of
    the folder."""
    if not os.path.isdir(data_dir):
        raise DataError(f"data.data_dir: {shown_name(data_dir)} is not a folder (give one with train/<class>/ images, "
                        "or <class>/ folders alone)")
    folders = {split: split_folder(data_dir, split) for split in SPLIT_FOLDERS}
    whole = folders["train"] is None
    if whole and folders["dev"]:  # (its images would be neither trained on nor evaluated)
        raise DataError(f"{shown_name(folders['dev'])}: a dev folder without train/ beside it; put the training class "
                        f"folders in {shown_name(os.path.join(data_dir, 'train'))}/, or remove it (the class folders "
                        "alone: a data.dev_fraction of them is the dev split)")
    train_dir = data_dir if whole else folders["train"]
    every_split_name = tuple(n for names in SPLIT_FOLDERS.values() for n in names)
    for folder in (train_dir, folders["dev"], folders["test"]):
        refuse_output_among_classes(output_dir, folder, every_split_name if folder == data_dir else ())
    found, ignored, loose = {}, {}, []
    found["train"], ignored["train"], loose = scan_classes(train_dir, every_split_name if whole else ())
    names = sorted(found["train"])
    if not names:
        raise DataError(f"{shown_name(train_dir)}: no class folders (expected train/<class>/*.jpg, or <class>/*.jpg)")
    if len(names) == 1:  # (its loss is 0 from the first step: nothing to learn, every answer the same)
        raise DataError(f"{shown_name(train_dir)}: one class folder ({names[0]!r}); a classifier needs two or more")
    index = {n: i for i, n in enumerate(names)}  # (names composed: scan_classes)
    splits = {}
    if whole or folders["dev"] is None:  # a fixed slice of the training files, whatever the seed
        splits["train"], splits["dev"] = dev_from_training(train_dir, names, found["train"], dev_fraction)
    else:
        splits["train"] = [(p, index[c]) for c in names for p in found["train"][c]]
    for split in ("dev", "test"):
        if folders[split] is None or (split == "dev" and whole):
            splits.setdefault(split, None)
            continue
        found[split], ignored[split], beside = scan_classes(folders[split])
        loose += beside
        if not found[split]:
            raise DataError(f"{shown_name(folders[split])}: no class folders (expected "
                            f"{shown_name(os.path.basename(folders[split]))}/<class>/*.jpg, its classes those of "
                            f"{shown_name(train_dir)})")
        for c, files in found[split].items():
            if c not in index:
                folder = os.path.relpath(files[0], folders[split]).split(os.sep)[0]  # (as it is spelled on disk)
                raise DataError(f"{shown_name(os.path.join(folders[split], folder))}: class {c!r} is not in "
                                f"{shown_name(train_dir)} (its classes: {', '.join(names)[:80]})")
        splits[split] = [(p, index[c]) for c in sorted(found[split]) for p in found[split][c]]
    return names, splits, ignored, loose


def refuse_output_among_classes(output_dir: Optional[str], folder: Optional[str], skip: tuple) -> None:
    """output_dir at or under `folder`, in a subfolder that would be a class: its checkpoints/ or logs/ were refused as
    empty class folders 'to remove'; one line saying so instead."""
    if not output_dir or not folder:
        return
    inside = os.path.relpath(os.path.realpath(output_dir), os.path.realpath(folder))
    top = inside.split(os.sep)[0]
    if top == os.pardir or (inside != "." and (hidden_or_system_folder(top) or top.lower() in skip)):
        return  # beside it, hidden, or another split's folder
    raise DataError(f"output_dir: {shown_name(output_dir)} is inside {shown_name(folder)}, whose subfolders are read "
                    f"as classes (so is {'checkpoints' if inside == '.' else top!r}); put output_dir outside it")


def dev_from_training(train_dir: str, names: list[str], found: dict, dev_fraction: float) -> tuple[list, list]:
    """(train, dev): the class folders' (path, class index) pairs, a data.dev_fraction of them for dev, the same
    slice whatever the seed; a split that leaves dev, training or a class's training images empty is one line."""
    pool = [(p, i) for i, c in enumerate(names) for p in found[c]]
    order = np.random.default_rng(0).permutation(len(pool))
    n_dev = int(round(len(pool) * dev_fraction))
    if n_dev == 0:  # (the last step always evaluates dev: the run could not end)
        raise DataError(f"{shown_name(train_dir)}: no dev split: data.dev_fraction {dev_fraction} of its {len(pool)} "
                        "images is none; raise data.dev_fraction, or put the dev images in val/<class>/ beside train/")
    if n_dev == len(pool):  # (the sampler got no training set: a TypeError traceback)
        raise DataError(f"{shown_name(train_dir)}: no training split: data.dev_fraction {dev_fraction} of its "
                        f"{len(pool)} images is all of them; lower data.dev_fraction, or put the dev images in "
                        "val/<class>/ beside train/")
    train = [pool[i] for i in sorted(order[n_dev:])]
    untrained = sorted(set(range(len(names))) - {c for _, c in train})
    if untrained:  # as an empty class folder: an output nothing trains (torchvision's ImageFolder refuses one)
        c = names[untrained[0]]
        raise DataError(f"{shown_name(os.path.join(train_dir, c))}: its {len(found[c])} image(s) all went to the dev "
                        f"split (data.dev_fraction {dev_fraction}), so nothing trains the class; add images to it, or "
                        "put the dev images in val/<class>/ beside train/")
    return train, [pool[i] for i in sorted(order[:n_dev])]


def image_files(path: str) -> tuple[list[str], list[str]]:
    """mode: predict's images and their names in predictions.csv: the image files under folder `path`, sorted, named
    by their path under it (hidden files and folders left out; the others, an iPhone's .heic say, get no row: their
    count is logged, as training's plan counts them); or the one image file `path`, named by its file name."""
    extensions = ", ".join(e[1:] for e in IMAGE_EXTENSIONS)
    if os.path.isfile(path) and path.lower().endswith(IMAGE_EXTENSIONS):
        return [path], [os.path.basename(path)]
    if not os.path.lexists(path):
        raise DataError(f"predict.input: {shown_name(path)} does not exist")
    if not os.path.isdir(path):
        raise DataError(f"predict.input: {shown_name(path)} is neither a folder of images nor an image file "
                        f"({extensions})")
    files, others = walk_images(path)
    if others:
        rank_log().info(f"predict.input: {others} hidden or non-image files or system folders under "
                        f"{shown_name(path)} ignored (images: {extensions})")
    return files, [os.path.relpath(f, path) for f in files]


# ---- preprocessing: torch and Pillow only -------------------------------------------------------------------------
def random_resized_crop(width: int, height: int, rng: np.random.Generator, scale) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (left, top, right, bottom): an area share in `scale` and an aspect ratio
    in CROP_RATIO (log-uniform), 10 tries, else the whole image cut to the nearest allowed ratio."""
    area = width * height
    log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        ratio = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    ratio = width / height
    if ratio < CROP_RATIO[0]:  # taller than 3:4: the full width, as tall as 3:4 allows
        w, h = width, int(round(width / CROP_RATIO[0]))
    elif ratio > CROP_RATIO[1]:
        w, h = int(round(height * CROP_RATIO[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def resize_center_crop(image: Image.Image, resize: int, size: int) -> Image.Image:
    """Evaluation: the shorter side to `resize` (aspect kept), then the center `size` x `size` (as Hugging Face's
    image processors compute it, so an export's pipeline() sees the pixels test mode saw)."""
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(resize * long / short)
    new = (resize, new_long) if width <= height else (new_long, resize)
    image = image.resize(new, Image.BILINEAR)
    left, top = (new[0] - size) // 2, (new[1] - size) // 2
    return image.crop((left, top, left + size, top + size))


def to_tensor(image: Image.Image, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """RGB image -> float [3, H, W]: pixels / 255, then (x - mean) / std per channel."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3)
    return (pixels.permute(2, 0, 1).float() / 255 - mean[:, None, None]) / std[:, None, None]


# EXIF Orientation 2..8 -> the turn that shows the image upright, as ImageOps.exif_transpose turns it (which also
# rewrites the EXIF, and fails on a corrupt tag there)
EXIF_ORIENTATION = 0x0112
EXIF_TURNS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}


def open_rgb(path: str) -> Image.Image:
    """The image at `path`, fully decoded, upright (its EXIF orientation applied), as RGB (grayscale, 16-bit
    grayscale, palette, RGBA, CMYK converted); OSError and the like when it is truncated, not an image, or float."""
    with warnings.catch_warnings():  # Pillow's (corrupt EXIF, over 89 megapixels) name no file and change no
        warnings.simplefilter("ignore")  # pixel; what it cannot decode still raises
        with Image.open(path) as image:
            image.load()
            orientation = image.getexif().get(EXIF_ORIENTATION)  # a phone's photo as shown (and as pipeline() reads it)
            if isinstance(orientation, int) and orientation in EXIF_TURNS:
                image = image.transpose(EXIF_TURNS[orientation])
            if image.mode.startswith("I;16") or image.mode == "I":  # 16 bits (microscopy, X-rays; a 16-bit PGM opens
                # as 32-bit I): the range onto 8 bits, where convert clips at 255
                pixels = np.clip(np.asarray(image), 0, 65535)
                rgb = Image.fromarray((pixels / 257).round().astype(np.uint8), "L").convert("RGB")
                rgb.info["max_16_bits"] = int(pixels.max(initial=0))  # (ImageFiles notes a 12-bit one)
                return rgb
            if image.mode == "F":  # (convert clips floats at 255: a 0..1 image became black, unsaid)
                raise ValueError("float pixels (mode F), which have no agreed range: save it with 8 or 16 bits")
            if image.mode == "RGB":
                return image.copy()
            if image.mode in ("P", "PA", "LA", "RGBA") or "transparency" in image.info:  # transparent: onto white
                rgba = image.convert("RGBA")
                background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                return Image.alpha_composite(background, rgba).convert("RGB")
            return image.convert("RGB")


BAD_IMAGE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)  # what Pillow raises on a broken file


class ImageFiles(Dataset):
    """(path, class) pairs decoded on demand: training crops seeded by (seed, epoch, index); evaluation resize +
    center crop. A file that fails to decode comes back as {"bad": index}, for `collate` (see there)."""

    def __init__(self, files: list, split: str, cfg, twelve_bits_noted=None):
        d = cfg.data
        self.files, self.split, self.train, self.seed, self.epoch = files, split, split == "train", cfg.seed, 0
        self.twelve_bits_noted = twelve_bits_noted  # the run's flag, shared with the loader's worker processes
        self.size, self.resize, self.scale = d.image_size, d.resize_size, tuple(d.crop_scale)
        self.mean, self.std = torch.tensor(d.image_mean), torch.tensor(d.image_std)

    def __len__(self) -> int:
        return len(self.files)

    def set_epoch(self, epoch: int) -> None:  # Task.start_epoch: the Trainer's copy, and each worker's
        self.epoch = epoch

    def __getitem__(self, i: int) -> dict:
        path, label = self.files[i]
        try:
            image = open_rgb(path)
        except BAD_IMAGE:
            return {"bad": (SPLITS.index(self.split), i)}
        if 0 < image.info.get("max_16_bits", TWELVE_BITS) < TWELVE_BITS and self.twelve_bits_noted is not None:
            note_twelve_bits(path, self.twelve_bits_noted)
        if self.train:
            rng = np.random.default_rng([self.seed, self.epoch, i])  # never the global stream (dropout's)
            box = random_resized_crop(image.width, image.height, rng, self.scale)
            image = image.resize((self.size, self.size), Image.BILINEAR, box=box)
            if rng.random() < 0.5:
                image = image.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            image = resize_center_crop(image, self.resize, self.size)
        return {"pixel_values": to_tensor(image, self.mean, self.std), "labels": torch.tensor(label)}


def note_twelve_bits(path: str, noted) -> None:
    """The run's first 16-bit image whose values all stay below TWELVE_BITS, named once in this rank's log (`noted`:
    a multiprocessing.Value every loader worker of the run shares). The scaling stays: 16 bits are 16 bits."""
    with noted.get_lock():
        if noted.value:
            return
        noted.value = 1
    rank_log().warning(f"{shown_name(path)}: a 16-bit image whose values are all below {TWELVE_BITS} (12 bits?) is "
                       "near-black on 8 bits (its values / 257: 15 at most); if the images are 12-bit, save them "
                       "scaled by 16 (said once a run, for the first such file)")


def bad_image_line(path: str) -> str:
    """Why Pillow cannot read `path`, in one line naming it."""
    try:
        open_rgb(path)
        why = "it could not be decoded in a loader worker"
    except BAD_IMAGE as e:
        why = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
    return (f"{shown_name(path)}: not a readable image ({why}); remove or replace it, or set data.skip_bad_images: "
            "true to skip such files")


def one_image_batch_line(cfg, n_train: int) -> str:
    """A training batch of one image (an epoch's last, or what data.skip_bad_images left of one) whose last feature
    map is 1x1: BatchNorm has one value per channel to normalise, and nothing to learn from."""
    return (f"a training batch of one image cannot go through the model's BatchNorm at data.image_size "
            f"{cfg.data.image_size} (its last feature map is 1x1: one value per channel); an epoch's last batch "
            f"must leave every rank 2 or more images ({n_train} training images): change train.batch_size or the "
            f"number of images, or set data.image_size above {ONE_PIXEL_MAP}")


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def rank_log() -> logging.Logger:
    """This rank's log (core/run_log.py's): its file, and rank 0's console."""
    return logging.getLogger(f"trainer.rank{rank()}")


# ---- the models -----------------------------------------------------------------------------------------------------
def resnet(arch: str, width: Optional[int], classes: list[str]) -> nn.Module:
    """transformers' ResNet of `arch`, random init; `width`: the first stage's channels (64 in the paper)."""
    from transformers import ResNetConfig, ResNetForImageClassification
    layer_type, depths = RESNETS[arch]
    w = width or 64
    hidden = [w, 2 * w, 4 * w, 8 * w] if layer_type == "basic" else [4 * w, 8 * w, 16 * w, 32 * w]
    config = ResNetConfig(num_channels=3, embedding_size=w, hidden_sizes=hidden, depths=depths,
                          layer_type=layer_type, num_labels=len(classes),
                          id2label=dict(enumerate(classes)), label2id={c: i for i, c in enumerate(classes)})
    return ResNetForImageClassification(config)


def pretrained(cfg, classes: list[str], log) -> nn.Module:
    """Any AutoModelForImageClassification folder (no code of its own), its head resized to `classes`."""
    from transformers import AutoConfig, AutoModelForImageClassification
    folder = cfg.model.pretrained_dir
    check_folder(folder)
    plain_transformers_output()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    had, dropout = config.num_labels, pretrained_dropout(cfg, config)
    with load_report(cfg):  # (silent when a checkpoint's weights come next)
        model = AutoModelForImageClassification.from_pretrained(
            folder, id2label=dict(enumerate(classes)),  # (num_labels follows id2label)
            label2id={c: i for i, c in enumerate(classes)}, ignore_mismatched_sizes=True, trust_remote_code=False,
            dtype=WEIGHTS_DTYPE, **dropout)
    if had != len(classes):
        log(f"model.pretrained_dir: {shown_name(folder)}'s head had {had} classes; a new head of {len(classes)} "
            "(random) replaces it")
    check_image_size(model, folder, cfg.data.image_size)
    return model


def check_image_size(model: nn.Module, folder: str, size: int) -> None:
    """One blank image of data.image_size through the model (in eval mode: BatchNorm's statistics untouched; no
    gradients): a model made for one size (ViT's position embeddings) refuses another here, not at the first step."""
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(pixel_values=torch.zeros(1, 3, size, size))
    except (ValueError, RuntimeError) as e:
        why = str(e).splitlines()[0][:100].rstrip(".")
        made_for = getattr(model.config, "image_size", None)
        hint = f"; it was made for {made_for}x{made_for}: set data.image_size to that" if made_for else ""
        raise DataError(f"model.pretrained_dir: {shown_name(folder)} does not take {size}x{size} images "
                        f"(data.image_size): {why}{hint}") from None
    finally:
        model.train(was_training)


CHANNELS_LAST_CPU_SIZE = 224  # on a CPU, NHWC was measured to pay at 224 px (ResNet-18, -50), not at 32 px


def uses_channels_last(cfg) -> bool:
    """model.channels_last: auto is on for GPUs (cuDNN's NHWC convolutions), and on a CPU for images of 224 px or
    more, where a ResNet's training step was measured faster in it (docs/image_folder.md); off under fsdp and pipe."""
    if cfg.model.channels_last != "auto":
        return cfg.model.channels_last
    if cfg.dist.strategy in ("fsdp", "pipe"):  # they refuse NHWC tensors (check_config)
        return False
    return cfg.dist.on_gpu() or cfg.data.image_size >= CHANNELS_LAST_CPU_SIZE


# ---- the task ------------------------------------------------------------------------------------------------------
class ImageFolderTask(Task):
    has_pipeline_chain = reads_new_inputs = True
    hf_pipeline = "image-classification"
    export_formats = ("hf", "onnx")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.classes, self.files, self.counts, self.ignored, self.loose, self.skipped = None, {}, {}, {}, [], set()
        self.channels_last = uses_channels_last(cfg)
        self.twelve_bits_noted = multiprocessing.Value("b", 0)  # (note_twelve_bits; pickled to spawned workers too)

    def data_name(self) -> str:
        return self.cfg.data.data_dir

    def build_datasets(self) -> dict:
        d = self.cfg.data
        self.classes, files, self.ignored, self.loose = read_layout(d.data_dir, d.dev_fraction, self.cfg.output_dir)
        self.counts = {split: np.bincount([c for _, c in f], minlength=len(self.classes)).tolist()
                       for split, f in files.items() if f}
        self.files = files
        return {split: ImageFiles(f, split, self.cfg, self.twelve_bits_noted) if f else None
                for split, f in files.items()}

    def classes_note(self) -> Optional[str]:
        """The plan's line: each class with its training count (and what was ignored)."""
        if not self.classes:
            return None
        counts = self.counts.get("train", [])
        shown = ", ".join(f"{shown_name(c)} ({n})" for c, n in zip(self.classes, counts))
        shown = shown if len(shown) <= 100 else shown[:97].rsplit(",", 1)[0] + ", ..."
        line = f"{len(self.classes)} classes: {shown}"
        ignored = sum(self.ignored.values())
        line += f"; {ignored} hidden or non-image files or system folders ignored" if ignored else ""
        if self.loose:  # (images, yet in no class folder: said apart from the other files)
            line += f"; {len(self.loose)} images outside the class folders ignored ({shown_name(self.loose[0])}, ...)"
        return line

    def build_model(self) -> nn.Module:
        m = self.cfg.model
        if m.dropout and not m.pretrained_dir and self.cfg.mode in ("train", "lr_find"):  # the ResNet has none
            raise ConfigError(f"model.dropout is {m.dropout} but image_folder's ResNet has no dropout; set it to null "
                              "(or 0)")
        if self.classes is None:
            self.build_datasets()
        # -----> swap in your own image model here (it takes pixel_values [N, 3, H, W], returns .logits).
        if m.pretrained_dir:
            model = pretrained(self.cfg, self.classes, rank_log().info if rank() == 0 else lambda line: None)
        else:
            model = resnet(m.arch or "resnet50", m.width, self.classes)
        if m.sync_batchnorm and self.cfg.mode in ("train", "lr_find"):  # checked: ddp on GPUs; one set of batch
            # statistics over all ranks (a run's folder tests, predicts and exports on a CPU too: plain BatchNorm)
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if self.channels_last:  # the same values in NHWC order: a checkpoint's state_dict loads either way
            model = model.to(memory_format=torch.channels_last)
        return model

    def collate(self, samples: list) -> dict:
        """Decoded samples into a batch. A file that failed to decode: the batch carries `bad_image` (its index),
        which count()/eval_batch turn into one line naming it in the main process (a worker's exception would
        arrive there wrapped in a traceback); with data.skip_bad_images it is left out, and `skipped` says which
        indices of split `skipped_split`."""
        bad = [s["bad"] for s in samples if "bad" in s]
        good = [s for s in samples if "bad" not in s]
        if bad and not self.cfg.data.skip_bad_images:
            return {"bad_image": torch.tensor(bad[0])}
        batch = {"pixel_values": torch.stack([s["pixel_values"] for s in good]) if good else
                 torch.zeros(0, 3, self.cfg.data.image_size, self.cfg.data.image_size),
                 "labels": torch.stack([s["labels"] for s in good]) if good else torch.zeros(0, dtype=torch.long)}
        if bad:
            batch["skipped"] = torch.tensor([i for _, i in bad])
            batch["skipped_split"] = torch.tensor(bad[0][0])  # (a batch holds one split)
        return batch

    def refuse_bad_image(self, batch: dict) -> None:
        """A batch that met a file Pillow cannot decode: one line naming it."""
        if "bad_image" in batch:
            split, index = batch["bad_image"].tolist()
            raise DataError(bad_image_line(self.files[SPLITS[split]][index][0]))

    def note_skipped(self, batch: dict) -> None:
        """data.skip_bad_images: each file a batch left out said once, with the count so far (any split)."""
        if "skipped" not in batch:
            return
        split = SPLITS[int(batch["skipped_split"])]
        for i in batch["skipped"].tolist():
            if (split, i) not in self.skipped:
                self.skipped.add((split, i))
                rank_log().warning(f"skipped {shown_name(self.files[split][i][0])}: not a readable image "
                                   f"(data.skip_bad_images; {len(self.skipped)} skipped so far on this rank)")

    def count(self, batch: dict) -> int:
        self.refuse_bad_image(batch)
        self.note_skipped(batch)
        return len(batch["labels"])

    def tokens(self, batch: dict) -> Optional[int]:
        return None

    def logits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        pixels = batch["pixel_values"]
        if self.channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return model(pixel_values=pixels).logits

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        try:
            return self.loss_from_output(self.logits(model, batch), batch["labels"])
        except ValueError as e:  # torch's BatchNorm on one value per channel: a traceback at an epoch's end
            if len(batch["labels"]) != 1 or "value per channel" not in str(e):
                raise
            raise DataError(one_image_batch_line(self.cfg, len(self.files["train"]))) from None

    def loss_from_output(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, reduction="sum")

    def eval_batch(self, model: nn.Module, batch: dict) -> dict:
        self.refuse_bad_image(batch)
        return self.eval_from_output(self.logits(model, batch), batch)

    def eval_from_output(self, logits: torch.Tensor, batch: dict) -> dict:
        self.note_skipped(batch)  # (every strategy's evaluation comes here, pipe's last stage too)
        return classification_batch(logits, batch["labels"], self.loss_from_output(logits, batch["labels"]))

    def metrics(self, totals: dict) -> dict:
        if not totals["count"]:  # (a split has images: data.skip_bad_images skipped them all) not accuracy=0, loss=0
            raise DataError(f"data.skip_bad_images skipped every image of an evaluation ({len(self.skipped)} skipped "
                            "so far on this rank, each named in its log): its metrics would be of no image; replace "
                            f"the unreadable files in {self.cfg.data.data_dir}")
        return classification_metrics(totals["preds"], totals["labels"], totals["loss_sum"], totals["count"])

    # pipe: the ResNet's stem, each stage, then pooling and the head (transformers' ResNetForImageClassification).
    def pipeline_layers(self, model: nn.Module) -> list[nn.Module]:
        if not hasattr(model, "resnet"):
            raise DataError(f"dist.strategy: pipe splits a ResNet into its stages; {type(model).__name__} is not one")
        r = model.resnet
        head = lambda x: model.classifier(r.pooler(x))  # noqa: E731
        return [PipelineLayer(r.embedder, r.embedder), *[PipelineLayer(stage, stage) for stage in r.encoder.stages],
                PipelineLayer(head, r.pooler, model.classifier)]

    def pipeline_inputs(self, batch: dict) -> tuple:
        self.refuse_bad_image(batch)  # (pipe evaluates through here, not eval_batch)
        return (batch["pixel_values"],)

    def predict_inputs(self, path: str) -> tuple[list[str], Dataset]:
        """mode: predict: the images of a folder (any depth, sorted; hidden and other files left out), or one image."""
        files, names = image_files(path)
        self.files["predict"] = [(f, 0) for f in files]
        return names, ImageFiles(self.files["predict"], "predict", self.cfg, self.twelve_bits_noted)

    def predict_logits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        self.refuse_bad_image(batch)
        self.note_skipped(batch)
        return self.logits(model, batch)

    # mode: export: the transformers model, its classes as the checkpoint records them, and an image processor of the
    # same evaluation preprocessing (Pillow only).
    def prepare_inference(self, label_names: Optional[list[str]]) -> None:
        if label_names is None:  # a checkpoint written before meta.json recorded them: the folders' classes
            self.build_datasets()
        else:  # the training folders need not be there (an older run's names composed, as a run's are now)
            self.classes = [unicodedata.normalize("NFC", n) for n in label_names]

    def label_names(self) -> Optional[list[str]]:
        return self.classes

    def hf_model(self, model: nn.Module):
        return model

    def hf_tokenizer(self):
        return None

    def example_inputs(self) -> tuple:
        return (torch.zeros(2, 3, self.cfg.data.image_size, self.cfg.data.image_size),)

    def hf_image_processor(self):
        from transformers import BitImageProcessorPil
        d = self.cfg.data
        return BitImageProcessorPil(do_resize=True, size={"shortest_edge": d.resize_size}, resample=Image.BILINEAR,
                                    do_center_crop=True, crop_size={"height": d.image_size, "width": d.image_size},
                                    do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                                    image_mean=list(d.image_mean), image_std=list(d.image_std), do_convert_rgb=True)
