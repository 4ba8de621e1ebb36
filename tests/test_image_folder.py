"""task: image_folder on real images: MNIST digits written out as PNG and JPEG folders (tests/image_folders.py) and
scikit-learn's sample photos; the hostile folders; the seeded crops; runs under none and ddp, resume, test mode."""
import hashlib
import json
import os
import re
import shutil
import struct
import types
import unicodedata
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import load_model_state, make_config, slow
from image_folders import digit_folder
import main
from core import checkpoint_meta
from core.errors import ConfigError, DataError
from core.file_names import shown_name
from tasks import base, image_folder
from tasks.bag_of_words_hf import word_ids
from tasks.image_folder import ImageFolderTask
from tasks.text_common import read_words

TINY = {"task": "image_folder", "model": {"arch": "resnet18", "width": 4, "dropout": 0.0},
        "data": {"image_size": 16, "resize_size": 20, "crop_scale": [0.35, 1.0]}}
TRAIN = {"max_steps": 8, "epochs": 0, "batch_size": 12, "eval_every": 4, "save_every": 4, "keep_last": 5,
         "lr": 3e-3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return digit_folder(tmp_path_factory.mktemp("digits"), train=16, val=4, test=4)


def tiny(out, data_dir, train=None, data=None, **sections):
    return make_config(out, **{**TINY, "data": {**TINY["data"], "data_dir": str(data_dir), **(data or {})},
                               "train": {**TRAIN, **(train or {})}, **sections})


def task_for(out, data_dir, **data) -> ImageFolderTask:
    return ImageFolderTask(tiny(out, data_dir, data=data))


# ---- the folder ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["train_val", "TRAIN_EVAL", "whole"])
def test_each_layout_gives_the_sorted_class_folders(tmp_path, layout):
    root = digit_folder(tmp_path / "d", classes=("zero", "one", "two"), train=10, val=5, layout=layout)
    task = task_for(tmp_path, root, dev_fraction=0.2)
    sets = task.build_datasets()
    assert task.label_names() == ["one", "two", "zero"]  # sorted names, whatever the digits
    assert len(sets["train"]) + len(sets["dev"]) == 45 and sets["test"] is None
    assert len(sets["dev"]) == (9 if layout == "whole" else 15)  # whole: a dev_fraction of the 45 files
    assert task.classes_note().startswith("3 classes: one (")
    paths = {p for p, _ in sets["train"].files} & {p for p, _ in sets["dev"].files}
    assert not paths  # no file in both splits
    labels = {os.path.basename(os.path.dirname(p)): c for p, c in sets["train"].files}
    assert labels == {"one": 0, "two": 1, "zero": 2}


def test_hidden_and_other_files_are_ignored_and_counted(tmp_path):
    root = digit_folder(tmp_path / "d", train=6, val=2)
    for name in (".DS_Store", "notes.txt", "._00001.png", "Thumbs.db"):
        open(os.path.join(root, "train", "one", name), "w").write("x")
    os.makedirs(os.path.join(root, "train", "one", ".cache"))
    open(os.path.join(root, "train", "one", ".cache", "a.png"), "w").write("x")  # a hidden folder: not read
    shutil.copytree(os.path.join(root, "val", "one"), tmp_path / "elsewhere")  # 2 more, through a symlinked folder
    os.symlink(tmp_path / "elsewhere", os.path.join(root, "train", "one", "linked"))
    os.symlink(os.path.join(root, "train", "one"), os.path.join(root, "train", "one", "again"))  # a loop: once
    task = task_for(tmp_path, root)
    sets = task.build_datasets()
    assert len(sets["train"]) == 20
    assert os.path.join(root, "train", "one", "linked", sorted(os.listdir(tmp_path / "elsewhere"))[0]) in {
        p for p, _ in sets["train"].files}
    assert task.classes_note().endswith("; 5 hidden or non-image files or system folders ignored")  # .cache/: 1
    # images beside the class folders, not in one: no class to give them; said as images, not as 'non-image files'
    for split in ("train", "val"):
        shutil.copy(sets["train"].files[0][0], os.path.join(root, split, "stray.png"))
    task = task_for(tmp_path, root)
    task.build_datasets()
    assert task.classes_note().endswith(f"; 5 hidden or non-image files or system folders ignored; 2 images outside "
                                        f"the class folders ignored ({root}/train/stray.png, ...)")


@pytest.mark.parametrize("case", ["empty class", "no classes", "val class not in train", "val without classes",
                                  "no dev split", "no training split", "val without train", "one class",
                                  "class all in dev", "two dev folders", "train and TRAIN"])
def test_a_broken_folder_is_one_line_naming_it(tmp_path, case):
    root = digit_folder(tmp_path / "d", train=4, val=2)
    dev_fraction = 0.15
    if case == "empty class":
        os.makedirs(os.path.join(root, "train", "three"))
        open(os.path.join(root, "train", "three", "readme.txt"), "w").write("x")
        expected = f"{root}/train/three: an empty class folder"
    elif case == "no classes":
        shutil.rmtree(os.path.join(root, "train"))
        os.makedirs(os.path.join(root, "train"))
        expected = f"{root}/train: no class folders"
    elif case == "val class not in train":
        shutil.copytree(os.path.join(root, "val", "one"), os.path.join(root, "val", "seven"))
        expected = f"{root}/val/seven: class 'seven' is not in {root}/train (its classes: one, two, zero)"
    elif case == "val without classes":  # its images not in class folders: no dev split (the run failed at its end)
        for c in ("one", "two", "zero"):
            for f in os.listdir(os.path.join(root, "val", c)):
                os.rename(os.path.join(root, "val", c, f), os.path.join(root, "val", f"{c}-{f}"))
            os.rmdir(os.path.join(root, "val", c))
        expected = f"{root}/val: no class folders (expected val/<class>/*.jpg, its classes those of {root}/train)"
    elif case == "val without train":  # the class folders beside val/: val/ was ignored, silently
        for c in ("one", "two", "zero"):
            os.rename(os.path.join(root, "train", c), os.path.join(root, c))
        os.rmdir(os.path.join(root, "train"))
        expected = f"{root}/val: a dev folder without train/ beside it; put the training class folders in {root}/train/"
    elif case == "two dev folders":  # valid/ beside val/: one of them was read, the other ignored unsaid
        shutil.copytree(os.path.join(root, "val"), os.path.join(root, "valid"))
        expected = f"{root}: two dev folders, val/ and valid/; merge them into one"
    elif case == "train and TRAIN":
        shutil.copytree(os.path.join(root, "train"), os.path.join(root, "TRAIN"))
        expected = f"{root}: two train folders, TRAIN/ and train/; merge them into one"
    elif case == "one class":  # its loss is 0 from the first step
        for c in ("one", "two"):
            shutil.rmtree(os.path.join(root, "train", c))
            shutil.rmtree(os.path.join(root, "val", c))
        expected = f"{root}/train: one class folder ('zero'); a classifier needs two or more"
    elif case == "class all in dev":  # the class folders alone; the split's first dev image is two's only one
        root = os.path.join(root, "train")
        for f in sorted(os.listdir(os.path.join(root, "two")))[1:]:
            os.remove(os.path.join(root, "two", f))
        expected = (f"{root}/two: its 1 image(s) all went to the dev split (data.dev_fraction 0.15), so nothing "
                    "trains the class")
    elif case == "no training split":  # the class folders alone, a dev_fraction of 12 images that rounds to all
        root, dev_fraction = os.path.join(root, "train"), 0.97  # (a TypeError traceback from the sampler)
        expected = f"{root}: no training split: data.dev_fraction 0.97 of its 12 images is all of them; lower"
    else:  # the class folders alone, a data.dev_fraction of 12 images that rounds to none
        root, dev_fraction = os.path.join(root, "train"), 0.02
        expected = f"{root}: no dev split: data.dev_fraction 0.02 of its 12 images is none; raise data.dev_fraction"
    with pytest.raises(DataError) as e:
        task_for(tmp_path, root, dev_fraction=dev_fraction).build_datasets()
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_a_class_folder_named_in_another_unicode_form_is_the_same_class(tmp_path):
    """macOS (HFS+) wrote `café` decomposed (e + U+0301); a val/ made elsewhere has it composed: the same class, not
    'class 'café' is not in train (its classes: café, ...)'. A name that is not UTF-8 is refused."""
    root = digit_folder(tmp_path / "d", classes=("café", "one", "two"), train=4, val=2)
    os.rename(os.path.join(root, "val", "café"), os.path.join(root, "val", unicodedata.normalize("NFD", "café")))
    task = task_for(tmp_path, root)
    sets = task.build_datasets()
    assert task.classes == ["café", "one", "two"]
    assert sorted(c for _, c in sets["dev"].files) == [0, 0, 1, 1, 2, 2]
    # a name that is not UTF-8 at all (a zip of Latin-1 names): no label to record, export or write; one line
    os.rename(os.path.join(root, "train", "café"), os.path.join(os.fsencode(root), b"train", b"caf\xe9"))
    with pytest.raises(DataError) as e:
        task_for(tmp_path, root).build_datasets()
    assert str(e.value) == (f"{root}/train/caf\\xe9: a class folder whose name is not UTF-8 (Latin-1?); its name is "
                            "the class's label (checkpoints, exports, predictions.csv): rename it in UTF-8")


def test_a_folder_that_cannot_be_read_is_one_line_not_images_left_out(tmp_path, monkeypatch):
    """A subfolder another user keeps to themselves (mode 700): os.walk skipped it without a word, its images never
    trained on; predict's folder likewise. (The tests run as root, whom modes do not stop: scandir refuses it here.)"""
    root = digit_folder(tmp_path / "d", train=4, val=2)
    shutil.copytree(os.path.join(root, "val", "one"), os.path.join(root, "train", "one", "private"))
    scandir, listdir = os.scandir, os.listdir

    def refused(path, read):
        if isinstance(path, str) and os.path.basename(path) in ("private", "val"):
            raise PermissionError(13, "Permission denied", path)
        return read(path)
    monkeypatch.setattr(os, "scandir", lambda path=".": refused(path, scandir))
    with pytest.raises(DataError) as e:
        task_for(tmp_path, root).build_datasets()
    assert str(e.value) == f"{root}/train/one/private: cannot be read (Permission denied); its images would be left out"
    with pytest.raises(DataError, match=re.escape(f"{root}/train/one/private: cannot be read (Permission denied)")):
        image_folder.image_files(os.path.join(root, "train"))
    shutil.rmtree(os.path.join(root, "train", "one", "private"))
    monkeypatch.setattr(os, "listdir", lambda path=".": refused(path, listdir))  # val/ itself
    with pytest.raises(DataError, match=re.escape(f"{root}/val: cannot be read (Permission denied)")):
        task_for(tmp_path, root).build_datasets()


def test_an_output_dir_among_the_class_folders_is_one_line_not_a_class_to_remove(tmp_path):
    """data_dir/<class>/ alone, and output_dir data_dir/runs (or data_dir itself): the run's folders were taken for
    classes and refused as 'an empty class folder ...; put images in it or remove it', the run's checkpoints."""
    root = os.path.join(digit_folder(tmp_path / "d", train=8, val=0), "train")
    for out, name in ((os.path.join(root, "runs", "first"), "runs"), (root, "checkpoints")):
        os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)  # (as a run makes it before reading the data)
        with pytest.raises(DataError) as e:
            ImageFolderTask(tiny(out, root)).build_datasets()
        assert str(e.value) == (f"output_dir: {out} is inside {root}, whose subfolders are read as classes (so is "
                                f"{name!r}); put output_dir outside it")
    shutil.rmtree(os.path.join(root, "checkpoints"))
    shutil.rmtree(os.path.join(root, "runs"))
    assert len(ImageFolderTask(tiny(tmp_path / "run", root)).build_datasets()["train"]) == 20  # beside it: read


def test_keys_of_other_tasks_are_refused_for_images(tmp_path):
    with pytest.raises(ConfigError, match="`model.heads` is for the transformer tasks, not image_folder"):
        tiny(tmp_path, tmp_path, model={**TINY["model"], "heads": 2})
    with pytest.raises(ConfigError, match="`model.arch` is resnet18, a ResNet of task image_folder; remove it for image"):
        make_config(tmp_path, model={"arch": "resnet18"})  # the digits CNN
    with pytest.raises(ConfigError, match="`data.resize_size` must be in"):
        tiny(tmp_path, tmp_path, data={"resize_size": 8})
    with pytest.raises(ConfigError, match="`model.channels_last` is not for dist.strategy: fsdp .fsdp takes cont"):
        tiny(tmp_path, tmp_path, model={**TINY["model"], "channels_last": True}, dist={"strategy": "fsdp"})
    with pytest.raises(ConfigError, match="`model.sync_batchnorm` needs GPUs"):
        tiny(tmp_path, tmp_path, model={**TINY["model"], "sync_batchnorm": True}, dist={"strategy": "ddp"})
    with pytest.raises(ConfigError, match="`data.skip_bad_images` is for task image_folder, not image"):
        make_config(tmp_path, data={"skip_bad_images": True})
    with pytest.raises(ConfigError, match="`data.skip_bad_images` is not for dist.strategy: pipe in training .a skip"):
        tiny(tmp_path, tmp_path, data={"skip_bad_images": True}, dist={"strategy": "pipe", "procs_per_node": 2})
    with pytest.raises(ConfigError, match="`model.channels_last` is for task image_folder's convolutions, not im"):
        make_config(tmp_path, model={"channels_last": True})
    with pytest.raises(ConfigError, match="`train.compile` under dist.strategy fsdp is refused for image_folder on a CPU"):
        tiny(tmp_path, tmp_path, train={"compile": True}, dist={"strategy": "fsdp", "procs_per_node": 2})
    tiny(tmp_path, tmp_path, train={"compile": True}, dist={"strategy": "ddp", "procs_per_node": 2})  # (works)
    # pipe's micro-batches of one 16 px image: the ResNet's BatchNorm on a 1x1 map (a traceback at step 1)
    with pytest.raises(ConfigError, match=r"`train.batch_size` 4 per pipeline in dist.pp_microbatches=4 is micro-batc"):
        tiny(tmp_path, tmp_path, train={"batch_size": 4}, dist={"strategy": "pipe", "procs_per_node": 2})
    tiny(tmp_path, tmp_path, train={"batch_size": 8}, dist={"strategy": "pipe", "procs_per_node": 2})  # (2 each)
    with pytest.raises(ConfigError, match=r"`train.batch_size` 1 is batches of one image, which the ResNet's Bat"):
        tiny(tmp_path, tmp_path, train={"batch_size": 1})  # (the same traceback at step 1)


def test_a_sync_batchnorm_run_is_tested_predicted_and_exported_on_a_cpu(tmp_path):
    """A ddp run trained with model.sync_batchnorm on GPUs, its folder copied to a laptop: test, predict and export
    read no training batch (BatchNorm in eval mode uses its running statistics), yet its config.yml was refused there
    ('needs GPUs ...; remove it on a CPU'). Training on a CPU still is."""
    model = {**TINY["model"], "sync_batchnorm": True}
    dist = {"strategy": "ddp", "procs_per_node": 2}
    with pytest.raises(ConfigError, match="`model.sync_batchnorm` needs GPUs"):
        tiny(tmp_path, tmp_path, model=model, dist=dist)
    os.makedirs(tmp_path / "checkpoints")  # (test mode asks for them as it reads its config)
    for mode in ("test", "predict", "export"):
        task = ImageFolderTask(tiny(tmp_path, tmp_path, model=model, dist=dist, mode=mode,
                                    predict={"input": str(tmp_path)}))
        task.prepare_inference(["a", "b"])
        assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in task.build_model().modules())


# ---- decoding and preprocessing --------------------------------------------------------------------------------------
def test_every_image_mode_becomes_the_same_rgb_tensor(tmp_path):
    """Grayscale (8 and 16 bits), palette, RGBA, CMYK, netpbm, EXIF-rotated and scikit-learn's JPEG photos decode to
    [3, S, S] normalised tensors."""
    from sklearn.datasets import load_sample_images
    root = tmp_path / "d"
    os.makedirs(root / "train" / "a")
    photo = Image.fromarray(load_sample_images().images[0])  # 640x427 JPEG, decoded by scikit-learn
    photo.save(root / "train" / "a" / "rgb.JPEG", quality=90)
    photo.convert("L").save(root / "train" / "a" / "gray.png")
    photo.convert("P").save(root / "train" / "a" / "palette.gif")
    photo.convert("RGBA").save(root / "train" / "a" / "rgba.webp")
    photo.convert("CMYK").save(root / "train" / "a" / "cmyk.tif")
    photo.save(root / "train" / "a" / "bitmap.BMP")
    photo.save(root / "train" / "a" / "netpbm.ppm")  # (torchvision's ImageFolder reads .ppm and .pgm: GTSRB's files)
    photo.convert("L").save(root / "train" / "a" / "netpbm.pgm")
    Image.fromarray(np.asarray(photo.convert("L")).astype(np.uint16) * 257).save(root / "train" / "a" / "gray16.png")
    Image.fromarray(np.asarray(photo.convert("L")).astype(np.uint16) * 257).save(root / "train" / "a" / "gray16.pgm")
    # EXIF Orientation 6 (shown turned 90 degrees clockwise: a phone's portrait photo), and a tag Pillow cannot write
    # back (ResolutionUnit as text, which ImageOps.exif_transpose fails on): read upright all the same
    ifd = (struct.pack("<H", 2) + struct.pack("<HHI4s", 0x0112, 3, 1, b"\x06\0\0\0")
           + struct.pack("<HHI4s", 0x0128, 2, 4, b"abc\0") + struct.pack("<I", 0))
    photo.transpose(Image.ROTATE_90).save(root / "train" / "a" / "phone.jpg", quality=90,
                                          exif=b"Exif\0\0II*\0" + struct.pack("<I", 8) + ifd)
    os.makedirs(root / "train" / "b")  # (a classifier needs two classes)
    photo.save(root / "train" / "b" / "other.png")
    os.makedirs(root / "val" / "a")
    photo.save(root / "val" / "a" / "dev.png")
    task = task_for(tmp_path, root, image_size=24, resize_size=32)
    sets = task.build_datasets()
    assert len(sets["train"]) == 12
    sets["train"].train = False  # evaluation's resize + center crop: comparable across modes
    items = {os.path.basename(p): sets["train"][i]["pixel_values"] for i, (p, _) in enumerate(sets["train"].files)}
    assert all(t.shape == (3, 24, 24) and t.dtype == torch.float32 for t in items.values())
    assert torch.allclose(items["rgb.JPEG"], items["bitmap.BMP"], atol=0.15)  # JPEG's loss, re-encoded
    assert torch.allclose(items["cmyk.tif"], items["bitmap.BMP"], atol=0.1)
    assert torch.equal(items["netpbm.ppm"], items["bitmap.BMP"]) and torch.equal(items["netpbm.pgm"], items["gray.png"])
    gray = items["gray.png"]
    assert torch.allclose(gray[0] * 0.229 + 0.485, gray[1] * 0.224 + 0.456, atol=1e-5)  # R = G: one gray level
    assert torch.equal(items["gray16.png"], gray)  # 16 bits: the same levels, not clipped to white
    assert torch.equal(items["gray16.pgm"], gray)  # (Pillow opens it as 32-bit mode I)
    assert torch.allclose(items["phone.jpg"], items["bitmap.BMP"], atol=0.15)  # upright, as pipeline() reads it
    # The center crop of a 256-style resize, as computed by hand from the photo.
    small = photo.resize((int(32 * 640 / 427), 32), Image.BILINEAR)
    left = (small.width - 24) // 2
    expect = torch.tensor(np.asarray(small.crop((left, 4, left + 24, 28))), dtype=torch.float32).permute(2, 0, 1)
    mean, std = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    assert torch.allclose(items["bitmap.BMP"], (expect / 255 - mean) / std, atol=1e-5)


def test_a_float_image_is_a_bad_image_not_a_black_one(tmp_path):
    """A 32-bit float TIFF (mode F: a microscope's or a simulation's output, 0..1 here) became black squares unsaid
    (Pillow's convert clips at 255 after truncating the floats); its scale is not knowable, so it is a bad image."""
    Image.fromarray(np.linspace(0, 1, 200, dtype=np.float32).reshape(10, 20), "F").save(tmp_path / "float.tif")
    with pytest.raises(ValueError, match="float pixels"):
        image_folder.open_rgb(str(tmp_path / "float.tif"))
    line = image_folder.bad_image_line(str(tmp_path / "float.tif"))
    assert line.startswith(f"{tmp_path / 'float.tif'}: not a readable image (float pixels") and "8 or 16 bits" in line


def test_pillows_warnings_on_a_readable_image_are_not_printed(tmp_path, monkeypatch):
    """A photo's corrupt EXIF block, or one over Pillow's 89-megapixel warning line: two lines of Pillow's source
    path and `warnings.warn(` each, naming no image, from every loader worker; the image decodes all the same."""
    ifd = struct.pack("<H", 5) + b"\x12\x01"  # says 5 tags, holds 2 bytes
    exif = b"Exif\0\0II*\0" + struct.pack("<I", 8) + ifd
    Image.new("RGB", (20, 10), (10, 200, 30)).save(tmp_path / "exif.jpg", exif=exif)
    Image.new("RGB", (20, 10), (10, 200, 30)).save(tmp_path / "large.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 150)  # 200 pixels: over the warning line, under the error's (300)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert image_folder.open_rgb(str(tmp_path / "exif.jpg")).size == (20, 10)
        assert image_folder.open_rgb(str(tmp_path / "large.png")).size == (20, 10)
    assert [str(w.message) for w in caught] == []
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 90)  # over twice the line: still refused, as a bad image
    with pytest.raises(Image.DecompressionBombError):
        image_folder.open_rgb(str(tmp_path / "large.png"))


def test_crops_are_drawn_per_seed_epoch_and_sample_off_the_global_stream(tmp_path, folder):
    task = task_for(tmp_path, folder)
    train = task.build_datasets()["train"]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = train[3]["pixel_values"]
    assert torch.equal(torch.get_rng_state(), before)  # dropout's stream untouched
    assert torch.equal(first, train[3]["pixel_values"])  # the same sample, the same crop
    train.set_epoch(1)
    assert not torch.equal(first, train[3]["pixel_values"])  # another epoch, another crop
    train.set_epoch(0)
    train.seed += 1
    assert not torch.equal(first, train[3]["pixel_values"])


def test_crop_box_follows_torchvisions_bounds():
    rng = np.random.default_rng(0)
    for width, height in ((640, 427), (28, 28), (10, 300)):
        for _ in range(50):
            left, top, right, bottom = image_folder.random_resized_crop(width, height, rng, (0.08, 1.0))
            assert 0 <= left < right <= width and 0 <= top < bottom <= height
    assert image_folder.random_resized_crop(10, 300, rng, (0.9, 1.0)) == (0, 143, 10, 156)  # 3/4 at most


# ---- runs --------------------------------------------------------------------------------------------------------
def truncate_one(root, split="train") -> str:
    folder = os.path.join(root, split, "two")
    path = os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".png"))[0])
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    return path


@pytest.mark.slow  # 7 s: two runs
def test_a_file_named_with_a_newline_or_an_escape_sequence_is_shown_on_one_line(tmp_path, capsys):
    """An image named `a<newline>b.png` that Pillow cannot decode printed its one-line error on two lines (and the
    log's `skipped` line too); a class folder named with a terminal's escape sequence recoloured the console. Each
    name now shows its control characters as Python writes them; any other name is shown as it is."""
    assert shown_name("a\nb\r\t\x1b[31m\x85\u2028.png") == "a\\nb\\r\\t\\x1b[31m\\x85\\u2028.png"
    assert shown_name("photos/été 2024/ü x.png") == "photos/été 2024/ü x.png"
    assert shown_name(os.fsdecode(b"b\xe9.png")) == shown_name(b"b\xe9.png") == "b\\xe9.png"  # not UTF-8
    root = digit_folder(tmp_path / "d", train=6, val=2)
    folder = os.path.join(root, "train", "two")
    open(os.path.join(folder, "a\nb.png"), "wb").write(b"not an image")
    shown = os.path.join(folder, "a\\nb.png")
    for split in ("train", "val"):  # a class named with a newline, and an image in no class folder: the plan's line
        shutil.copytree(os.path.join(root, split, "one"), os.path.join(root, split, "new\nline"))
    shutil.copy(os.path.join(folder, sorted(os.listdir(folder))[0]), os.path.join(root, "train", "loose\n.png"))
    train = {"max_steps": 1, "eval_every": 0, "save_every": 0, "batch_size": 18}
    assert main.run(tiny(tmp_path / "a", root, train=train, data={"num_workers": 0})) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {shown}: not a readable image ("), err
    assert main.run(tiny(tmp_path / "b", root, train=train, data={"num_workers": 0, "skip_bad_images": True})) == 0
    skipped = [line for line in open(tmp_path / "b" / "logs" / "rank0.log").read().splitlines() if "skipped" in line]
    assert len(skipped) == 1 and f"skipped {shown}: not a readable image (data.skip_bad_images" in skipped[0], skipped
    [plan] = [line for line in open(tmp_path / "b" / "logs" / "rank0.log").read().splitlines() if " classes: " in line]
    assert "4 classes: new\\nline (" in plan and f"ignored ({root}/train/loose\\n.png, ...)" in plan, plan
    os.makedirs(os.path.join(root, "train", "\x1b[31mred"))
    with pytest.raises(DataError) as e:
        task_for(tmp_path, root).build_datasets()
    assert str(e.value).startswith(f"{root}/train/\\x1b[31mred: an empty class folder"), str(e.value)


@pytest.mark.parametrize("workers", [1, slow(0)])
def test_a_truncated_image_is_one_line_or_skipped_and_counted(tmp_path, capsys, workers):
    root = digit_folder(tmp_path / "d", train=6, val=2)
    bad, bad_dev = truncate_one(root), truncate_one(root, "val")
    train = {"max_steps": 2, "eval_every": 0, "save_every": 0, "batch_size": 18}
    assert main.run(tiny(tmp_path / "a", root, train=train, data={"num_workers": workers})) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"{bad}: not a readable image (" in err[0] and "data.skip_bad_images" in err[0]
    assert main.run(tiny(tmp_path / "b", root, train=train, data={"num_workers": workers,
                                                                 "skip_bad_images": True})) == 0
    log = open(tmp_path / "b" / "logs" / "rank0.log").read()
    assert f"skipped {bad}: not a readable image (data.skip_bad_images; 1 skipped so far" in log
    # evaluation names what it skips too
    assert f"skipped {bad_dev}: not a readable image (data.skip_bad_images; 2 skipped so far" in log
    assert "dev: loss=" in log and "samples=5" in log  # the 6 dev images but the one skipped
    # every dev image skipped (and the training one: 7): "dev: loss=0 accuracy=0 ... samples=0", a best picked by it
    for c in ("one", "two", "zero"):
        for f in os.listdir(os.path.join(root, "val", c)):
            open(os.path.join(root, "val", c, f), "wb").close()
    capsys.readouterr()
    assert main.run(tiny(tmp_path / "c", root, train={**train, "max_steps": 1, "eval_every": 1},
                         data={"num_workers": workers, "skip_bad_images": True})) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [f"error: data.skip_bad_images skipped every image of an evaluation (7 skipped so far on this "
                   f"rank, each named in its log): its metrics would be of no image; replace the unreadable files "
                   f"in {root}"], err


def test_a_step_whose_every_image_was_skipped_moves_no_weight_and_a_run_of_them_ends_in_one_line(tmp_path, capsys):
    """data.skip_bad_images with every training image unreadable: each step counted no sample, yet AdamW stepped
    (weight decay, momentum) and the run ended "done" with loss=nan. Such a step applies no update now, said in the
    log; train.max_bad_steps of them in a row end the run in one line (exit 4), as non-finite norms do."""
    from core import process_group
    from test_sharded import params
    import wiring
    root = digit_folder(tmp_path / "d", train=6, val=2)
    for c in os.listdir(os.path.join(root, "train")):
        for f in os.listdir(os.path.join(root, "train", c)):
            open(os.path.join(root, "train", c, f), "wb").close()
    data, train = {"num_workers": 0, "skip_bad_images": True}, {"eval_every": 0, "save_every": 1, "batch_size": 18,
                                                                 "weight_decay": 0.1}
    cfg = tiny(tmp_path / "a", root, train={**train, "max_steps": 2}, data=data)
    before = {k: v.clone() for k, v in wiring.build_trainer(cfg, process_group.init(cfg, 0, 1, 0))
              .strategy.raw_model.state_dict().items()}
    assert main.run(cfg) == 0
    after = params(tmp_path / "a", 2)
    # not a weight moved (nor BatchNorm's statistics: only its count of batches, which an empty one adds to)
    assert all(torch.equal(after[k], before[k]) for k in after if after[k].is_floating_point())
    log = open(tmp_path / "a" / "logs" / "rank0.log").read()
    assert "step 2: its batch counts no sample (every image skipped by data.skip_bad_images" in log
    assert "update skipped (2 in a row" in log
    capsys.readouterr()
    assert main.run(tiny(tmp_path / "b", root, train={**train, "max_steps": 4, "max_bad_steps": 3}, data=data)) == 4
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("training ")]
    assert len(err) == 1 and err[0].startswith("training stopped: 3 steps in a row up to step 3 had no sample"), err
    assert "data.skip_bad_images names each file it skipped in the log" in err[0] and "diverged" not in err[0]


def test_a_training_batch_of_one_small_image_is_one_line_not_a_batchnorm_traceback(tmp_path, capsys):
    """9 photos in batches of 8: the epoch's last batch is one image, whose 1x1 last feature map (data.image_size 32
    or less, the tiny preset's) gives BatchNorm one value per channel: a ValueError traceback at the epoch's end."""
    root = digit_folder(tmp_path / "d", train=3, val=1)
    train = {"max_steps": 2, "eval_every": 0, "save_every": 0, "batch_size": 8}
    assert main.run(tiny(tmp_path / "a", root, train=train, data={"num_workers": 0})) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: a training batch of one image cannot go through the model's BatchNorm at "
                               "data.image_size 16") and "(9 training images)" in lines[0], lines[0]


@pytest.mark.slow
def test_a_truncated_dev_image_under_pipe_is_one_line(tmp_path, capsys):
    """pipe evaluates through the task's pipeline_inputs, not eval_batch: the batch that met the file is refused
    there too (it was a KeyError traceback)."""
    root = digit_folder(tmp_path / "d", train=6, val=2)
    bad = truncate_one(root, "val")
    train = {"max_steps": 2, "eval_every": 2, "save_every": 0, "batch_size": 8}
    assert main.run(tiny(tmp_path / "a", root, train=train, dist={"strategy": "pipe", "procs_per_node": 2})) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"{bad}: not a readable image (" in err[0], err


def test_resume_is_bit_exact_crops_included(tmp_path, folder):
    """Two epochs of random crops in two loader workers; resumed at step 4 (mid-epoch), it ends where the
    uninterrupted run ends, bit for bit."""
    data = {"num_workers": 2}
    assert main.run(tiny(tmp_path / "full", folder, data=data)) == 0
    os.makedirs(tmp_path / "resumed" / "checkpoints")
    shutil.copytree(tmp_path / "full/checkpoints/step-4", tmp_path / "resumed/checkpoints/step-4")
    assert main.run(tiny(tmp_path / "resumed", folder, data=data)) == 0
    assert "resumed from" in open(tmp_path / "resumed" / "logs" / "rank0.log").read()
    a, b = load_model_state(tmp_path / "full", 8), load_model_state(tmp_path / "resumed", 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["classifier.1.weight"], load_model_state(tmp_path / "full", 4)["classifier.1.weight"])


def test_persistent_workers_decode_the_batches_one_process_decodes_epoch_after_epoch(tmp_path, folder):
    """Two loader workers kept through three epochs (the same processes throughout) give the batches of no workers,
    bit for bit: each worker starts every epoch on its own copy of the dataset, so the crops follow the epoch."""
    import multiprocessing
    from core import process_group
    import wiring
    streams, per_epoch = {}, 4  # 48 training images in batches of 12
    for workers in (0, 2):
        cfg = tiny(tmp_path / f"w{workers}", folder, data={"num_workers": workers})
        stream = wiring.build_trainer(cfg, process_group.init(cfg, 0, 1, 0)).micro_batches()
        streams[workers], pids, before = [], [], {p.pid for p in multiprocessing.active_children()}
        for _ in range(3 * per_epoch):
            streams[workers].append(next(stream))
            pids.append({p.pid for p in multiprocessing.active_children()} - before)  # this stream's workers
        stream.close()  # the stream's end ends its workers
        if workers:
            assert len(pids[0]) == 2 and all(p == pids[0] for p in pids)  # no worker started again per epoch
            assert not pids[0] & {p.pid for p in multiprocessing.active_children()}
    for a, b in zip(streams[0], streams[2]):
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(streams[0][0]["pixel_values"], streams[0][per_epoch]["pixel_values"])


@pytest.mark.slow
def test_fsdp_resume_ends_where_the_run_ends_batchnorm_statistics_included(tmp_path, folder):
    """fsdp never syncs buffers: each rank's BatchNorm statistics follow its own batches. A save gives every rank rank
    0's (the checkpoint's), so a run resumed from step 4 ends at step 8 where the uninterrupted one does."""
    from test_sharded import params
    train = {"eval_every": 0, "save_every": 4}
    dist = {"strategy": "fsdp", "procs_per_node": 2}
    assert main.run(tiny(tmp_path / "full", folder, train=train, dist=dist)) == 0
    os.makedirs(tmp_path / "resumed" / "checkpoints")
    shutil.copytree(tmp_path / "full/checkpoints/step-4", tmp_path / "resumed/checkpoints/step-4")
    assert main.run(tiny(tmp_path / "resumed", folder, train=train, dist=dist)) == 0
    a, b = params(tmp_path / "full", 8), params(tmp_path / "resumed", 8)
    assert any("running_mean" in k for k in a)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=0, atol=1e-6), k


@pytest.mark.parametrize("strategy", ["ddp", slow("oss"), slow("fsdp"), slow("pipe"), slow("pipe x2"), slow("dp"),
                                      slow("ddp [8, 4]")])
def test_strategies_train_and_test_mode_scores_the_best(tmp_path, folder, strategy):
    # pipe x2: two pipelines of two stages (4 ranks), whose replicas of a stage share the first one's statistics
    dist = {"strategy": strategy.split()[0], "procs_per_node": {"dp": 1, "pipe x2": 4}.get(strategy, 2)}
    train = {"max_steps": 12, "eval_every": 6, "save_every": 6, **({"batch_size": [8, 4]} if "[" in strategy else {})}
    assert main.run(tiny(tmp_path, folder, train=train, dist=dist)) == 0
    best = checkpoint_meta.best_recorded(str(tmp_path))
    dev = checkpoint_meta.read(best)["metrics"]
    assert main.run(tiny(tmp_path, folder, train=train, dist=dist, mode="test")) == 0
    import json
    results = json.load(open(tmp_path / "dev_results.json"))
    assert results["checkpoint"] == os.path.abspath(best) and results["metrics"]["samples"] == 12
    # one process scores what ddp did: every rank evaluated with the BatchNorm statistics rank 0 saved
    assert results["metrics"]["accuracy"] == pytest.approx(dev["accuracy"])
    assert results["metrics"]["loss"] == pytest.approx(dev["loss"], rel=1e-5)
    assert json.load(open(tmp_path / "test_results.json"))["metrics"]["samples"] == 12
    # predict from this strategy's checkpoint (ddp: on both ranks, else in one process): each test image once, in
    # order, as one process predicts them
    test_dir = os.path.join(folder, "test")
    assert main.run(tiny(tmp_path, folder, train=train, dist=dist, mode="predict", predict={"input": test_dir})) == 0
    rows = read_csv(tmp_path / "predictions.csv")[1:]
    assert [r[0] for r in rows] == sorted(os.path.join(c, f) for c in os.listdir(test_dir)
                                          for f in os.listdir(os.path.join(test_dir, c)))
    if strategy == "ddp":
        assert f"predicting the inputs of {test_dir}" in open(tmp_path / "logs" / "rank1.log").read()
        assert main.run(tiny(tmp_path, folder, train=train, mode="predict", predict={"input": test_dir})) == 0
        alone = read_csv(tmp_path / "predictions.csv")[1:]
        assert [r[:2] for r in alone] == [r[:2] for r in rows]
        assert [float(r[2]) for r in alone] == pytest.approx([float(r[2]) for r in rows], abs=1e-5)


@pytest.mark.parametrize("split", ["even", slow("auto")])
def test_pipe_batchnorm_statistics_are_those_of_its_micro_batches(tmp_path, folder, split):
    """Under pipe, each stage's BatchNorm running statistics after one step are those of one process fed the step's
    four micro-batches in order: torch's schedule runs every stage once before its first step to learn the shapes
    passed between stages (past the first stage on uninitialised memory), and pp_split auto times every layer; neither
    may leave a trace in them (the garbage made dev losses NaN or different run to run)."""
    from core import process_group
    from test_sharded import params
    import wiring
    train = {"max_steps": 1, "eval_every": 0, "save_every": 1}
    assert main.run(tiny(tmp_path / "pipe", folder, train=train,
                         dist={"strategy": "pipe", "procs_per_node": 2, "pp_split": split})) == 0
    piped = params(tmp_path / "pipe", 1)
    cfg = tiny(tmp_path / "one", folder, train=train)
    trainer = wiring.build_trainer(cfg, process_group.init(cfg, 0, 1, 0))
    batch = next(trainer.micro_batches())  # the same 12 images as the pipeline's first batch
    model, task = trainer.strategy.raw_model, trainer.task
    with torch.no_grad():
        for chunk in batch["pixel_values"].tensor_split(4):  # how the schedule cuts a batch (pp_microbatches 4)
            carry = (chunk,)
            for layer in task.pipeline_layers(model):
                out = layer(*carry)
                carry = out if isinstance(out, tuple) else (out,)
    stats = {k: v for k, v in model.state_dict().items() if "running_" in k or "num_batches" in k}
    assert len(stats) > 20 and stats.keys() <= piped.keys()
    for k, v in stats.items():
        assert torch.allclose(piped[k].float(), v.float(), rtol=1e-4, atol=1e-5), \
            f"{k}: {piped[k].flatten()[:4]} vs {v.flatten()[:4]}"


@pytest.mark.slow
def test_the_resnet50_preset_trains_a_few_steps(tmp_path, folder):
    from wiring import checked_config
    preset = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "resnet50_imagefolder.yml")
    cfg = checked_config(preset, [f"data.data_dir={folder}", f"output_dir={tmp_path}", "data.image_size=64",
                                  "data.resize_size=72", "train.batch_size=4", "train.max_steps=2", "train.epochs=0",
                                  "train.eval_every=0", "train.eval_batches=1", "train.precision=fp32",
                                  "log.progress_bar=false", "log.report_to=[]"])
    assert cfg.model.arch == "resnet50" and cfg.train.optimizer == "SGD"
    assert main.run(cfg) == 0
    state = load_model_state(tmp_path, 2)
    assert state["classifier.1.weight"].shape == (3, 2048)


def test_channels_last_trains_as_contiguous_and_its_checkpoint_and_export_load_anywhere(tmp_path, folder):
    """model.channels_last: true keeps the weights in NHWC memory; 4 steps end where contiguous ones end (to float
    rounding, 1e-5), its checkpoint loads into a contiguous model, and its export loads as a transformers folder."""
    from transformers import ResNetForImageClassification
    train = {"max_steps": 4, "eval_every": 0, "save_every": 0}
    states = {}
    for layout in (True, False):
        cfg = tiny(tmp_path / str(layout), folder, train=train, model={**TINY["model"], "channels_last": layout})
        assert main.run(cfg) == 0
        states[layout] = load_model_state(tmp_path / str(layout), 4)
    nhwc = [k for k, v in states[True].items() if v.dim() == 4 and not v.is_contiguous()]
    assert nhwc and all(states[True][k].is_contiguous(memory_format=torch.channels_last) for k in nhwc)
    assert all(torch.allclose(states[True][k].float(), states[False][k].float(), atol=1e-5) for k in states[True])
    plain = task_for(tmp_path, folder)  # auto: off on a CPU for 16 px images (on from 224 px)
    assert not plain.channels_last and task_for(tmp_path, folder, image_size=224, resize_size=256).channels_last
    model = plain.build_model()
    model.load_state_dict(states[True])
    assert all(v.is_contiguous() for v in model.state_dict().values())
    assert main.run(tiny(tmp_path / "True", folder, mode="export", model={**TINY["model"], "channels_last": True})) == 0
    exported = ResNetForImageClassification.from_pretrained(tmp_path / "True" / "export").state_dict()
    assert all(torch.equal(exported[k], states[True][k]) for k in states[True])


# ---- export and predict ----------------------------------------------------------------------------------------------
def read_csv(path):
    import csv
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_export_answers_through_pipeline_as_predict_does(tmp_path, folder, capsys):
    """One trained run: predict writes each image once, in order, with top_k names; the export's
    pipeline("image-classification") names the same classes with the same probabilities."""
    from transformers import pipeline
    assert main.run(tiny(tmp_path, folder, train={"max_steps": 6, "eval_every": 0, "save_every": 0})) == 0
    new = tmp_path / "new"
    shutil.copytree(os.path.join(folder, "test"), new)
    open(new / ".DS_Store", "w").write("x")
    assert main.run(tiny(tmp_path, folder, mode="predict", predict={"input": str(new), "top_k": 2})) == 0
    table = read_csv(tmp_path / "predictions.csv")
    files = sorted(os.path.relpath(os.path.join(r, f), new) for r, _, fs in os.walk(new) for f in fs if f[0] != ".")
    assert table[0] == ["input", "label", "probability", "label_2", "probability_2"]
    assert [row[0] for row in table[1:]] == files and len(files) == 12
    assert all(row[1] in ("one", "two", "zero") and float(row[2]) >= float(row[4]) for row in table[1:])
    assert main.run(tiny(tmp_path, folder, mode="export")) == 0
    pipe = pipeline("image-classification", model=str(tmp_path / "export"))
    for row in table[1:]:
        answer = pipe(str(new / row[0]), top_k=2)
        assert [a["label"] for a in answer] == [row[1], row[3]]
        assert answer[0]["score"] == pytest.approx(float(row[2]), abs=1e-4)
    assert main.run(tiny(tmp_path, folder, mode="predict", predict={"input": str(tmp_path / "nothing.png")})) == 2
    assert f"error: predict.input: {tmp_path / 'nothing.png'} does not exist" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not an image")
    assert main.run(tiny(tmp_path, folder, mode="predict", predict={"input": str(tmp_path / "notes.txt")})) == 2
    assert f"error: predict.input: {tmp_path / 'notes.txt'} is neither a folder of images nor an image file" in \
        capsys.readouterr().err
    broken = new / "zero" / "broken.png"
    broken.write_bytes(open(new / row[0], "rb").read()[:100])  # a cut-off file among the inputs
    assert main.run(tiny(tmp_path, folder, mode="predict", predict={"input": str(new)})) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and err[0].startswith(f"error: {broken}: not a readable image ("), err
    # data.skip_bad_images: the unreadable inputs (one of zero bytes, first) have no row; every other row is as before
    (new / "0.png").write_bytes(b"")
    skip = {"skip_bad_images": True}
    assert main.run(tiny(tmp_path, folder, mode="predict", data=skip, predict={"input": str(new), "top_k": 2})) == 0
    assert read_csv(tmp_path / "predictions.csv") == table
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert f"skipped {new / '0.png'}: not a readable image" in log and f"skipped {broken}: not a readable" in log
    os.makedirs(tmp_path / "bad")
    shutil.move(new / "0.png", tmp_path / "bad" / "0.png")
    assert main.run(tiny(tmp_path, folder, mode="predict", data=skip, predict={"input": str(tmp_path / "bad")})) == 2
    assert f"error: predict.input: none of the 1 inputs of {tmp_path / 'bad'} could be read" in capsys.readouterr().err


def test_predict_and_export_read_the_classes_from_the_checkpoint_not_the_training_folder(tmp_path, capsys):
    """A run copied to another machine without its images: meta.json's class names size the model and name the
    answers, so predict answers as it did beside the folder, and the export names the same classes. A checkpoint
    written before the names were recorded still takes them from the folder."""
    import json
    data = digit_folder(tmp_path / "d", train=8, val=4)
    run = {"train": {"max_steps": 4, "eval_every": 0, "save_every": 0}}
    assert main.run(tiny(tmp_path / "run", data, **run)) == 0
    new = tmp_path / "new"
    shutil.copytree(os.path.join(data, "val"), new)
    predict = {"input": str(new), "top_k": 2}
    assert main.run(tiny(tmp_path / "run", data, **run, mode="predict", predict=predict)) == 0
    beside = read_csv(tmp_path / "run" / "predictions.csv")
    assert len(beside) == 13 and {row[1] for row in beside[1:]} <= {"one", "two", "zero"}
    shutil.move(data, tmp_path / "elsewhere")
    os.remove(tmp_path / "run" / "predictions.csv")
    assert main.run(tiny(tmp_path / "run", data, **run, mode="predict", predict=predict)) == 0
    assert read_csv(tmp_path / "run" / "predictions.csv") == beside
    assert main.run(tiny(tmp_path / "run", data, **run, mode="export")) == 0
    labels = json.load(open(tmp_path / "run" / "export" / "config.json"))["id2label"]
    assert labels == {"0": "one", "1": "two", "2": "zero"}
    meta_path = checkpoint_meta.best_recorded(str(tmp_path / "run")) + "/meta.json"
    meta = json.load(open(meta_path))
    del meta["label_names"]  # as an older version wrote it
    json.dump(meta, open(meta_path, "w"))
    capsys.readouterr()
    assert main.run(tiny(tmp_path / "run", data, **run, mode="predict", predict=predict)) == 2
    assert f"error: data.data_dir: {data} is not a folder" in capsys.readouterr().err
    shutil.move(tmp_path / "elsewhere", data)
    assert main.run(tiny(tmp_path / "run", data, **run, mode="predict", predict=predict)) == 0
    assert read_csv(tmp_path / "run" / "predictions.csv") == beside


def test_csv_text_predicts_a_file_of_texts_after_training_on_one_csv(tmp_path, capsys):
    """csv_text on a single CSV (its dev split a data.dev_fraction of it), then predict on a text file."""
    rows = [(f"great fine lovely day {i}", "pos") for i in range(30)] + [(f"awful bad sad day {i}", "neg")
                                                                          for i in range(30)]
    (tmp_path / "all.csv").write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
    run = dict(task="csv_text", data={"data_dir": str(tmp_path / "all.csv"), "dev_fraction": 0.2},
               model={"hidden": 16, "dropout": 0.0},
               train={"max_steps": 30, "epochs": 0, "eval_every": 0, "save_every": 0, "batch_size": 8, "lr": 0.05})
    assert main.run(make_config(tmp_path / "run", **run)) == 0
    assert "dev: loss" in open(tmp_path / "run" / "logs" / "rank0.log").read()
    (tmp_path / "new.txt").write_text("a lovely great day\n\nsuch a sad awful day\nfine\n")
    assert main.run(make_config(tmp_path / "run", **run, mode="predict",
                                predict={"input": str(tmp_path / "new.txt")})) == 0
    table = read_csv(tmp_path / "run" / "predictions.csv")
    assert [r[:2] for r in table[1:]] == [["a lovely great day", "pos"], ["such a sad awful day", "neg"],
                                          ["fine", "pos"]]
    (tmp_path / "bad.csv").write_text("id,sentence\n1,hello\n")
    assert main.run(make_config(tmp_path / "run", **run, mode="predict",
                                predict={"input": str(tmp_path / "bad.csv")})) == 2
    assert f"error: predict.input: {tmp_path / 'bad.csv'} has no column 'text' (data.text_column) among id, " \
           "sentence" in capsys.readouterr().err
    # Relabelled data (pos -> good, which sorts first) would answer under swapped names: test mode and a resume,
    # which read it, refuse it in one line; predict and export read the checkpoint's names and do not read it.
    (tmp_path / "all.csv").write_text("text,label\n" + "".join(f"{t},{'good' if y == 'pos' else y}\n" for t, y in rows))
    assert main.run(make_config(tmp_path / "run", **run, mode="predict",
                                predict={"input": str(tmp_path / "new.txt")})) == 0
    assert read_csv(tmp_path / "run" / "predictions.csv") == table
    capsys.readouterr()
    for mode in ("test", "train"):
        assert main.run(make_config(tmp_path / "run", **{**run, "train": {**run["train"], "max_steps": 40}},
                                    mode=mode, predict={"input": str(tmp_path / "new.txt")})) == 2, mode
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "step-30: trained on 2 classes, the data now names " \
            "2: output 0 was 'neg', the data names 'good'; give the data the classes it was trained on (neg, pos)" \
            in err[0], (mode, err)


def test_csv_text_answers_with_its_own_vocabulary_after_the_training_file_changes(tmp_path):
    """A word renamed in train.csv after training shifts the ids of the words after it (the vocabulary is sorted):
    predict and test mode read the run's saved vocabulary, so the checkpoint answers as it did, not scrambled (nor
    does mode lr_find, a fresh start on the edited file, replace the saved one)."""
    import json
    rows = [(f"great fine day {i}", "pos") for i in range(20)] + [(f"awful bad day {i}", "neg") for i in range(20)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dev.csv").write_text("text,label\na great day,pos\nan awful day,neg\n")
    (tmp_path / "new.txt").write_text("a fine great day\nsuch a bad awful day\n")
    run = dict(task="csv_text", data={"data_dir": str(tmp_path / "data")}, model={"hidden": 8, "dropout": 0.0},
               train={"max_steps": 10, "epochs": 0, "eval_every": 0, "save_every": 0, "batch_size": 8, "lr": 0.05},
               predict={"input": str(tmp_path / "new.txt"), "top_k": 2})
    answers = []
    for word in ("awful", "zzawful"):  # trained with the first, then the file edited
        (tmp_path / "data" / "train.csv").write_text("text,label\n" + "".join(f"{t.replace('awful', word)},{y}\n"
                                                                             for t, y in rows))
        if not answers:
            assert main.run(make_config(tmp_path / "run", **run)) == 0
        else:  # an lr_find sweep on the edited file starts fresh: it leaves the run's vocabulary as it is
            assert main.run(make_config(tmp_path / "run", **run, mode="lr_find", lr_find={"steps": 5})) == 0
        for mode in ("predict", "test"):
            assert main.run(make_config(tmp_path / "run", **run, mode=mode)) == 0
        answers.append((read_csv(tmp_path / "run" / "predictions.csv"),
                        json.load(open(tmp_path / "run" / "dev_results.json"))["metrics"]))
    assert answers[1] == answers[0] and answers[0][0][1][1] == "pos" and answers[0][0][2][1] == "neg", answers


def test_the_vocabulary_is_hashed_once_a_run_though_every_checkpoint_records_it(tmp_path, monkeypatch):
    """meta.json's vocabulary_sha256 hashed the whole vocabulary at every save: a tokenizer does not change during
    a run, so it is hashed once per task, the recorded value unchanged (and a tokenizer put in its place is hashed)."""
    hashed = []
    monkeypatch.setattr(base, "hashlib", types.SimpleNamespace(sha256=lambda data: hashed.append(data) or
                                                               hashlib.sha256(data)))
    rows = [(f"great fine day {i}", "pos") for i in range(8)] + [(f"awful bad day {i}", "neg") for i in range(8)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
    (tmp_path / "data" / "dev.csv").write_text("text,label\na great day,pos\nan awful day,neg\n")
    assert main.run(make_config(tmp_path / "run", task="csv_text", data={"data_dir": str(tmp_path / "data")},
                                model={"hidden": 8}, train={"max_steps": 3, "epochs": 0, "eval_every": 0,
                                                            "save_every": 1, "batch_size": 8})) == 0
    vocabulary = word_ids(read_words(tmp_path / "run" / "vocabulary.json"))
    uncached = hashlib.sha256(json.dumps(sorted(vocabulary.items())).encode()).hexdigest()
    recorded = [json.load(open(tmp_path / "run" / "checkpoints" / f"step-{s}" / "meta.json"))["vocabulary_sha256"]
                for s in (2, 3)]  # (the last 2 kept: step 1 was saved too)
    assert recorded == [uncached] * 2 and len(hashed) == 1, (recorded, uncached, len(hashed))
    task = base.Task(None)
    task.tokenizer = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    first = task.vocabulary_sha256()
    task.tokenizer = types.SimpleNamespace(get_vocab=lambda: {"a": 1, "b": 0})
    assert task.vocabulary_sha256() != first and task.vocabulary_sha256() == task.vocabulary_sha256()
    assert len(hashed) == 3  # one per tokenizer

def test_csv_text_predicts_and_exports_without_its_training_file_and_refuses_another_run_s_vocabulary(tmp_path,
                                                                                                         capsys):
    """predict and export take the classes from meta.json and the words from the run's vocabulary.json, so a run
    copied without its data still labels texts; a checkpoint read beside another run's vocabulary (test.checkpoint,
    predict.checkpoint) would read every word as another id: refused in one line, not answered at random."""
    rows = [(f"great fine day {i}", "pos") for i in range(20)] + [(f"awful bad day {i}", "neg") for i in range(20)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
    (tmp_path / "data" / "dev.csv").write_text("text,label\na great day,pos\nan awful day,neg\n")
    (tmp_path / "new.txt").write_text("a fine great day\nsuch a bad awful day\n")
    run = dict(task="csv_text", data={"data_dir": str(tmp_path / "data")}, model={"hidden": 8, "dropout": 0.0},
               train={"max_steps": 10, "epochs": 0, "eval_every": 0, "save_every": 0, "batch_size": 8, "lr": 0.05},
               predict={"input": str(tmp_path / "new.txt")})
    assert main.run(make_config(tmp_path / "run", **run)) == 0
    assert main.run(make_config(tmp_path / "run", **run, mode="predict")) == 0
    answers = read_csv(tmp_path / "run" / "predictions.csv")
    shutil.move(tmp_path / "data", tmp_path / "elsewhere")
    assert main.run(make_config(tmp_path / "run", **run, mode="predict")) == 0
    assert read_csv(tmp_path / "run" / "predictions.csv") == answers and answers[1][1] == "pos"
    assert main.run(make_config(tmp_path / "run", **run, mode="export")) == 0
    assert json.load(open(tmp_path / "run" / "export" / "config.json"))["id2label"] == {"0": "neg", "1": "pos"}
    shutil.move(tmp_path / "elsewhere", tmp_path / "data")
    # another run, on other words: its vocabulary gives "great" another id
    (tmp_path / "data" / "train.csv").write_text("text,label\n" + "".join(f"{t.replace('fine', 'aaa')},{y}\n"
                                                                         for t, y in rows))
    assert main.run(make_config(tmp_path / "other", **run)) == 0
    capsys.readouterr()
    first = str(tmp_path / "run" / "checkpoints" / "step-10")
    for mode, section in (("test", "test"), ("predict", "predict")):
        assert main.run(make_config(tmp_path / "other", **{**run, section: {**run.get(section, {}),
                                                                            "checkpoint": first}}, mode=mode)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and first in err[0] and "another vocabulary" in err[0] and "output_dir" in err[0], err


def test_the_digits_cnn_predicts_a_folder_of_images(tmp_path, capsys):
    from tasks.image import load_digits_split
    assert main.run(make_config(tmp_path, train={"max_steps": 60, "epochs": 0, "eval_every": 0, "lr": 1e-2})) == 0
    _, _, images, labels = load_digits_split()
    os.makedirs(tmp_path / "new")
    for i in range(20):  # the digits' 0..16 pixels as 8x8 PNGs, some upscaled
        image = Image.fromarray((images[i] * 255 / 16).astype(np.uint8), "L")
        (image.resize((32, 32), Image.NEAREST) if i % 2 else image).save(tmp_path / "new" / f"{i:02d}-{labels[i]}.png")
    for other in ("IMG_0001.HEIC", "notes.txt", ".DS_Store"):  # an iPhone's photo is not read: said, not dropped unsaid
        (tmp_path / "new" / other).write_bytes(b"x")
    capsys.readouterr()
    assert main.run(make_config(tmp_path, mode="predict", predict={"input": str(tmp_path / "new")})) == 0
    assert (f"predict.input: 3 hidden or non-image files or system folders under {tmp_path / 'new'} ignored (images: "
            "jpg, jpeg, png, bmp, gif, webp, tif, tiff, ppm, pgm)") in capsys.readouterr().out
    rows = read_csv(tmp_path / "predictions.csv")[1:]
    assert [r[0] for r in rows] == sorted(f for f in os.listdir(tmp_path / "new") if f.endswith(".png"))
    right = sum(r[1] == r[0].split("-")[1][:-4] for r in rows)
    assert right >= 14, rows  # a CNN trained 60 steps reads most of them
    # one image file as predict.input (as transformers' pipeline takes one): refused before as "not a folder"
    one = tmp_path / "new" / rows[3][0]
    assert main.run(make_config(tmp_path, mode="predict", predict={"input": str(one)})) == 0
    assert read_csv(tmp_path / "predictions.csv")[1:] == [rows[3]]
    # names that are not UTF-8 (a zip of Latin-1 names, unpacked as bytes): predictions.csv's write failed, the rows
    # lost, and the log's line naming the folder was a 'Logging error' traceback; both show the bytes as \xe9
    latin = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    os.makedirs(latin)
    shutil.copy(tmp_path / "new" / rows[0][0], os.path.join(latin, b"\xe9t\xe9.png"))
    assert main.run(make_config(tmp_path, mode="predict", predict={"input": os.fsdecode(latin)})) == 0
    assert [r[0] for r in read_csv(tmp_path / "predictions.csv")[1:]] == ["\\xe9t\\xe9.png"]
    out = capsys.readouterr()
    assert f"predicting the inputs of {tmp_path}/caf\\xe9 with" in out.out and "Logging error" not in out.err


def test_the_digits_cnn_reads_a_photo_upright_and_16_bits_as_image_folder_does():
    """A phone's photo turned by its EXIF tag, and a 16-bit scan, give the CNN the pixels of the plain 8-bit file
    (read before as sideways, and as a white square)."""
    from tasks.image import gray_square
    import tempfile
    pixels = np.zeros((12, 8), np.uint8)
    pixels[2:5, 1:7] = 200  # a bar near the top: upright or not tells
    with tempfile.TemporaryDirectory() as d:
        Image.fromarray(pixels, "L").save(os.path.join(d, "plain.png"))
        turned = Image.fromarray(pixels, "L").transpose(Image.Transpose.ROTATE_90)  # stored turned, tagged "turn back"
        exif = Image.Exif()
        exif[0x0112] = 6
        turned.save(os.path.join(d, "phone.jpg"), exif=exif, quality=100)
        Image.fromarray(pixels.astype(np.uint16) * 257).save(os.path.join(d, "scan16.png"))
        plain, phone, scan = (gray_square(os.path.join(d, f), 16) for f in ("plain.png", "phone.jpg", "scan16.png"))
    assert np.array_equal(scan, plain) and plain.max() > 0.7
    assert np.abs(phone - plain).max() < 0.1  # (JPEG's rounding)


@pytest.mark.parametrize("kind", ["resnet", slow("vit")])
def test_a_pretrained_folder_gets_a_head_for_the_classes(tmp_path, folder, kind):
    """Any AutoModelForImageClassification folder: its 5-class head replaced by one for the folder's 3, said once."""
    from transformers import ResNetConfig, ResNetForImageClassification, ViTConfig, ViTForImageClassification
    if kind == "resnet":
        model = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 8],
                                                          depths=[1, 1, 1, 1], layer_type="basic", num_labels=5))
    else:
        model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32, num_labels=5))
    model.save_pretrained(tmp_path / "pretrained")
    cfg = tiny(tmp_path / "run", folder, train={"max_steps": 2, "eval_every": 0, "save_every": 0},
               model={"pretrained_dir": str(tmp_path / "pretrained"), "dropout": 0.0})
    assert main.run(cfg) == 0
    log = open(tmp_path / "run" / "logs" / "rank0.log").read()
    assert log.count("head had 5 classes; a new head of 3 (random) replaces it") == 1
    state = load_model_state(tmp_path / "run", 2)
    head = "classifier.1.weight" if kind == "resnet" else "classifier.weight"
    assert state[head].shape[0] == 3


def test_a_pretrained_folder_made_for_another_image_size_is_one_line(tmp_path, folder):
    """A ViT takes the image size its position embeddings were made for: another data.image_size is refused as the
    model is built (it was a ValueError traceback at the first step)."""
    from transformers import ViTConfig, ViTForImageClassification
    ViTForImageClassification(ViTConfig(image_size=32, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=32)).save_pretrained(tmp_path / "vit")
    model = {"pretrained_dir": str(tmp_path / "vit"), "dropout": 0.0}
    with pytest.raises(DataError) as e:
        ImageFolderTask(tiny(tmp_path, folder, model=model)).build_model()
    assert str(e.value) == (f"model.pretrained_dir: {tmp_path / 'vit'} does not take 16x16 images (data.image_size): "
                            "Input image size (16*16) doesn't match model (32*32); it was made for 32x32: set "
                            "data.image_size to that")
    task = ImageFolderTask(tiny(tmp_path, folder, model=model, data={"image_size": 32, "resize_size": 36}))
    assert task.build_model().classifier.out_features == 3


@pytest.mark.slow
def test_ddp_equals_one_process_for_a_model_without_batchnorm(tmp_path, folder):
    """The crops are drawn per sample, not per rank: a ViT (LayerNorm, no BatchNorm) trained by 2 ddp ranks of 6
    ends where one process with batch 12 ends (a ResNet would not: each rank's BatchNorm sees its own 6 images)."""
    from transformers import ViTConfig, ViTForImageClassification
    # No qkv bias: the key bias's true gradient is 0 (softmax ignores a shift all keys share), so AdamW turned
    # rounding noise into lr-sized steps there (up to 1e-5 apart, one seed in six failed); the rest agree to 1e-7.
    vit = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32, num_labels=3,
                                              qkv_bias=False))
    vit.save_pretrained(tmp_path / "vit")
    model = {"pretrained_dir": str(tmp_path / "vit"), "dropout": 0.0}
    train = {"max_steps": 4, "eval_every": 0, "save_every": 0}
    assert main.run(tiny(tmp_path / "one", folder, train={**train, "batch_size": 12}, model=model)) == 0
    assert main.run(tiny(tmp_path / "ddp", folder, train={**train, "batch_size": 6}, model=model,
                         dist={"strategy": "ddp", "procs_per_node": 2})) == 0
    a, b = load_model_state(tmp_path / "one", 4), load_model_state(tmp_path / "ddp", 4)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert not torch.equal(a["classifier.weight"], vit.classifier.weight)
