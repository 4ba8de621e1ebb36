"""image_folder on folders as NAS and Mac users hand them over: a Synology's @eaDir thumbnails and the other
system folders beside the photos, class names macOS wrote decomposed (NFD)."""
import json
import os
import re
import shutil
import types
import unicodedata

import numpy as np
import pytest
from PIL import Image

from conftest import make_config
from image_folders import digit_folder
import main
from core import checkpoint_io, checkpoint_meta
from core.errors import CheckpointError, DataError
from tasks import image_folder
from tasks.image_folder import ImageFolderTask

TINY = {"task": "image_folder", "model": {"arch": "resnet18", "width": 4, "dropout": 0.0},
        "data": {"image_size": 16, "resize_size": 20, "crop_scale": [0.35, 1.0]}}
TRAIN = {"max_steps": 2, "epochs": 0, "batch_size": 12, "eval_every": 2, "save_every": 2, "lr": 3e-3}
NAS_FOLDERS = ("@eaDir", ".@__thumb", ".thumbnails", "#recycle", "@Recycle", ".Trash-1000", "$RECYCLE.BIN",
               "System Volume Information", "__MACOSX", "lost+found")


def tiny(out, data_dir, **sections):
    return make_config(out, **{**TINY, "data": {**TINY["data"], "data_dir": str(data_dir)},
                               "train": TRAIN, **sections})


def thumbnails(folder: str, system: str) -> None:
    """What a NAS keeps beside each photo of `folder`: `system`/<photo>/SYNOFILE_THUMB_*.jpg, the photo at other
    sizes."""
    for name in sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n))):
        with Image.open(os.path.join(folder, name)) as image:
            for size in (12, 20, 30):
                os.makedirs(os.path.join(folder, system, name), exist_ok=True)
                image.convert("RGB").resize((size, size)).save(os.path.join(folder, system, name,
                                                                            f"SYNOFILE_THUMB_{size}.jpg"))


def test_nas_and_system_folders_are_neither_classes_nor_images(tmp_path, monkeypatch):
    """A Synology's @eaDir in each class folder held each photo again as thumbnails: trained on, and the val photos'
    thumbnails evaluated, the dev metrics inflated unsaid. Such folders (a NAS's, Windows', macOS's) beside the class
    folders were classes. Each is ignored, counted in the plan (and in predict's log) as hidden files are."""
    root = digit_folder(tmp_path / "d", train=4, val=2)
    for split in ("train", "val"):
        for c in ("one", "two", "zero"):
            thumbnails(os.path.join(root, split, c), "@eaDir")
    thumbnails(os.path.join(root, "train", "one"), ".@__thumb")
    for name in NAS_FOLDERS:  # beside the class folders: each would have been a class (or an 'empty class' line)
        thumbnails(os.path.join(root, "train", "zero"), os.path.join("..", name))
    task = ImageFolderTask(tiny(tmp_path, root))
    sets = task.build_datasets()
    assert task.classes == ["one", "two", "zero"]
    assert (len(sets["train"]), len(sets["dev"])) == (12, 6)
    assert all("THUMB" not in p for s in ("train", "dev") for p, _ in sets[s].files)
    # train/: 3 @eaDir, one .@__thumb, the 10 beside the classes; val/: 3 @eaDir
    assert task.classes_note().endswith("; 17 hidden or non-image files or system folders ignored")
    # the class folders alone (data_dir/<class>/): the same
    task = ImageFolderTask(tiny(tmp_path, os.path.join(root, "train"), data={**TINY["data"], "dev_fraction": 0.25,
                                                                             "data_dir": os.path.join(root, "train")}))
    assert task.build_datasets() and task.classes == ["one", "two", "zero"]
    said = []
    monkeypatch.setattr(image_folder, "rank_log", lambda: types.SimpleNamespace(info=said.append))
    files, names = image_folder.image_files(os.path.join(root, "train"))  # predict.input: the same rule
    assert len(files) == 12 and all("THUMB" not in n for n in names)
    assert said[0].startswith(f"predict.input: 14 hidden or non-image files or system folders under {root}/train "
                              "ignored (images: jpg,")


def test_class_names_are_compared_and_sorted_in_one_unicode_form(tmp_path, capsys):
    """macOS wrote `café` decomposed (e + U+0301): the label was exported as such and sorted as such (before `caff`;
    composed, it sorts after), so the same folder copied with composed names was refused at test mode ("output 0 was
    'café', the data names 'café'"). Names are NFC: labels, sort, the checkpoint's record. Two folders of one split
    named alike but for the form are one line that shows the difference. A checkpoint written before, its decomposed
    names recorded, still tests with its own folder."""
    nfd = unicodedata.normalize("NFD", "café")
    data = digit_folder(tmp_path / "d", classes=(nfd, "caff", "one"), train=4, val=2)
    task = ImageFolderTask(tiny(tmp_path, data))
    sets = task.build_datasets()
    assert task.label_names() == ["caff", "café", "one"]  # sorted as composed: é (U+00E9) after f
    assert all(unicodedata.is_normalized("NFC", n) for n in task.label_names())
    assert {os.path.basename(os.path.dirname(p)): c for p, c in sets["train"].files} == {"caff": 0, nfd: 1, "one": 2}
    run, data = tmp_path / "run", digit_folder(tmp_path / "d2", classes=(nfd, "one", "two"), train=4, val=2)
    assert main.run(tiny(run, data)) == 0
    meta_path = os.path.join(checkpoint_meta.best_recorded(str(run)), "meta.json")
    assert json.load(open(meta_path))["label_names"] == ["café", "one", "two"]
    copied = tmp_path / "copied"  # the same folder, copied by a tool that wrote the names composed
    shutil.copytree(data, copied)
    for split in ("train", "val"):
        os.rename(copied / split / nfd, copied / split / "café")
    assert main.run(tiny(run, copied, mode="test")) == 0
    # an older checkpoint: its names recorded as the folder spelled them; with its own folder it still tests
    meta = json.load(open(meta_path))
    meta["label_names"] = [nfd, "one", "two"]
    json.dump(meta, open(meta_path, "w"))
    assert main.run(tiny(run, data, mode="test")) == 0
    # both forms side by side in train/ (Linux keeps both): one line showing the code points that differ
    shutil.copytree(copied / "train" / "café", copied / "train" / nfd)
    with pytest.raises(DataError) as e:
        ImageFolderTask(tiny(tmp_path, copied)).build_datasets()
    assert str(e.value) == (f"{copied}/train: two class folders name one class, 'cafe\\u0301' and 'caf\\xe9' (the same "
                            "letters in two Unicode forms); merge them into one")
    # a checkpoint's classes that differ: the first that differs is named, not one that differs only in form
    with pytest.raises(CheckpointError, match=r"output 1 was 'one', the data names 'six'; give"):
        checkpoint_io.check_label_names("run/step-2", ["café", "six"], {"label_names": [nfd, "one"]})


def test_a_12_bit_image_in_16_bits_is_noted_once_a_run(tmp_path):
    """A microscope's 12-bit image saved as a 16-bit PNG (values 0..4095) becomes near-black (at most 15 of 255)
    after the 16-bit range onto 8 bits, unsaid. The scaling stays; the run's log names the first such file once,
    whichever of the loader's worker processes (training's and evaluation's) decodes it."""
    root = digit_folder(tmp_path / "d", train=4, val=2)
    for split, c in (("train", "one"), ("val", "two"), ("train", "zero")):
        folder = os.path.join(root, split, c)
        for name in sorted(os.listdir(folder)):
            with Image.open(os.path.join(folder, name)) as image:
                pixels = np.asarray(image.convert("L"), dtype=np.uint16) * 16  # 0..4080: 12 bits
            os.remove(os.path.join(folder, name))
            Image.fromarray(pixels).save(os.path.join(folder, name.rsplit(".", 1)[0] + ".png"))
    assert main.run(tiny(tmp_path / "run", root, data={**TINY["data"], "data_dir": root, "num_workers": 2})) == 0
    log = open(tmp_path / "run" / "logs" / "rank0.log").read()
    assert log.count("values are all below 4096") == 1, log
    assert re.search(rf"{re.escape(root)}/(train/(one|zero)|val/two)/\d+\.png: a 16-bit image whose values are all "
                     r"below 4096 \(12 bits\?\) is near-black on 8 bits \(its values / 257: 15 at most\)", log)


def test_a_link_to_a_share_not_mounted_is_one_line_not_a_class_left_out(tmp_path):
    """train/three -> /mnt/nas/three with the NAS not mounted: the class was left out, counted among 'hidden or
    non-image files ignored' (its dev images then 'not in train', or no word at all); a linked subfolder of a class
    likewise. One line naming the link and where it points. (A dangling link named .jpg stays an unreadable image.)"""
    root = digit_folder(tmp_path / "d", train=4, val=0)
    gone = str(tmp_path / "nas" / "three")
    for link in (os.path.join(root, "train", "three"), os.path.join(root, "train", "one", "more")):
        os.symlink(gone, link)
        with pytest.raises(DataError) as e:
            ImageFolderTask(tiny(tmp_path, root)).build_datasets()
        assert str(e.value) == (f"{link}: a link to {gone}, which is not there (a disk or share not mounted?); its "
                                "images would be left out: mount it, or remove the link")
        os.remove(link)
    for name in ("gone.jpg", ".#notes.txt"):  # an image to be decoded (and refused, or skipped); an editor's lock
        os.symlink(gone, os.path.join(root, "train", "one", name))
    sets = ImageFolderTask(tiny(tmp_path, root)).build_datasets()
    assert os.path.join(root, "train", "one", "gone.jpg") in {p for s in ("train", "dev") for p, _ in sets[s].files}
