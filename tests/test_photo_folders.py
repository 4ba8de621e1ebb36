"""image_folder on folders as NAS and Mac users hand them over: a Synology's @eaDir thumbnails and the other
system folders beside the photos, class names macOS wrote decomposed (NFD)."""
import json
import os
import shutil
import unicodedata

import pytest
from PIL import Image

from conftest import make_config
from image_folders import digit_folder
import main
from core import checkpoint_meta
from core.errors import DataError
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
    """What a NAS keeps beside each photo of `folder`: `system`/<photo>/SYNOFILE_THUMB_*.jpg, the photo at other sizes."""
    for name in sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n))):
        with Image.open(os.path.join(folder, name)) as image:
            for size in (12, 20, 30):
                os.makedirs(os.path.join(folder, system, name), exist_ok=True)
                image.convert("RGB").resize((size, size)).save(os.path.join(folder, system, name,
                                                                            f"SYNOFILE_THUMB_{size}.jpg"))


def test_nas_and_system_folders_are_neither_classes_nor_images(tmp_path, caplog):
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
    with caplog.at_level("INFO"):
        files, names = image_folder.image_files(os.path.join(root, "train"))  # predict.input: the same rule
    assert len(files) == 12 and all("THUMB" not in n for n in names)
    assert f"predict.input: 14 hidden or non-image files or system folders under {root}/train ignored" in caplog.text

