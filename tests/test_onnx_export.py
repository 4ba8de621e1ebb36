"""export.format: onnx (issue 41): a classifier's graph for onnxruntime, with its label names beside it, gives the
checkpoint's logits (1e-4) on real inputs of any batch size and, for text, any length; the README's snippet runs."""
import json
import os
import re
import struct

import numpy as np
import onnxruntime
import pytest
import torch

import main
from test_export import checkpoint_model, cnn_run, data, export, python_blocks  # noqa: F401 (fixtures)
from test_text_tasks import task_config, train

pytestmark = pytest.mark.usefixtures("hf_offline")  # (conftest.py)


def onnx_logits(folder, feed: dict) -> np.ndarray:
    session = onnxruntime.InferenceSession(os.path.join(folder, "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(["logits"], feed)[0]


def readme_snippet(folder, **scope) -> dict:
    scope["FOLDER"] = str(folder)
    exec(python_blocks(open(os.path.join(folder, "README.md")).read())[0], scope)
    return scope


def test_the_cnn_as_onnx_gives_the_checkpoints_logits(cnn_run, tmp_path):
    folder = tmp_path / "onnx"
    assert export(cnn_run, format="onnx", dir=str(folder)) == 0
    assert sorted(os.listdir(folder)) == ["README.md", "labels.json", "model.onnx"]
    task, model = checkpoint_model(cnn_run)
    images = task.build_datasets()["dev"].images[:7]  # real digits, as the task feeds them
    with torch.no_grad():
        expected = model(images).numpy()
    for n in (7, 1):  # any batch size
        np.testing.assert_allclose(onnx_logits(folder, {"images": images[:n].numpy()}), expected[:n], atol=1e-4)
    scope = readme_snippet(folder, images=images.numpy())
    np.testing.assert_allclose(scope["logits"], expected, atol=1e-4)
    assert scope["names"] == {str(i): f"LABEL_{i}" for i in range(10)}  # the digits' data names no labels


def test_a_text_classifier_as_onnx_gives_the_checkpoints_logits_with_its_label_names(data, tmp_path):
    from transformers import AutoTokenizer
    from tasks.sst2 import read_tsv
    cfg = task_config("sst2", data, tmp_path, max_steps=4)  # a tiny random BART classifier
    train(cfg, 1)
    folder = tmp_path / "onnx"
    assert export(cfg, format="onnx", dir=str(folder)) == 0
    task, model = checkpoint_model(cfg)
    sentences = read_tsv(os.path.join(data["sst2"], "dev.tsv"))[0][:9]
    for texts in (sentences, sentences[:1]):  # a padded batch of different lengths, and one text
        enc = AutoTokenizer.from_pretrained(folder)(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            ours = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.numpy()
        theirs = onnx_logits(folder, {"input_ids": enc["input_ids"].numpy(),
                                      "attention_mask": enc["attention_mask"].numpy()})
        np.testing.assert_allclose(theirs, ours, atol=1e-4)
    scope = readme_snippet(folder, texts=sentences)
    assert scope["logits"].shape == (len(sentences), 2)
    assert list(scope["names"].values()) == task.label_names() and len(scope["names"]) == 2


@pytest.mark.slow
def test_an_image_folder_resnet_as_onnx_gives_the_checkpoints_logits_and_its_average_with_test_weights_ema(tmp_path):
    """image_folder's transformers ResNet, with its image processor beside it; test.weights: ema exports ema.pt."""
    import dataclasses
    from PIL import Image
    from sklearn.datasets import load_sample_images
    from transformers import AutoImageProcessor
    from transformers.image_utils import load_image
    from image_folders import digit_folder
    from test_image_folder import tiny
    images = digit_folder(tmp_path / "images", train=8, val=4)
    cfg = tiny(tmp_path / "run", images, train={"max_steps": 3, "eval_every": 0, "save_every": 0, "ema_decay": 0.5})
    assert main.run(cfg) == 0
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(os.path.join(images, "val")) for f in fs)[:6]
    # and a phone's portrait photo (EXIF Orientation 6): the README's snippet read it sideways (Image.open), so its
    # answer was not predict's nor pipeline()'s
    ifd = struct.pack("<H", 1) + struct.pack("<HHI4s", 0x0112, 3, 1, b"\x06\0\0\0") + struct.pack("<I", 0)
    Image.fromarray(load_sample_images().images[1]).resize((60, 40)).transpose(Image.ROTATE_90).save(
        tmp_path / "phone.jpg", exif=b"Exif\0\0II*\0" + struct.pack("<I", 8) + ifd)
    files.append(str(tmp_path / "phone.jpg"))
    pictures = [load_image(f) for f in files]  # grayscale PNGs and RGB JPEGs of several sizes, the photo upright
    answers = {}
    for weights in ("trained", "ema"):
        folder = tmp_path / weights
        cfg = dataclasses.replace(cfg, test=dataclasses.replace(cfg.test, weights=weights))
        assert export(cfg, format="onnx", dir=str(folder)) == 0
        pixels = AutoImageProcessor.from_pretrained(folder)(pictures, return_tensors="pt")["pixel_values"]
        task, model = checkpoint_model(cfg)
        with torch.no_grad():
            expected = model(pixel_values=pixels).logits.numpy()
        for n in (7, 1):  # any batch size
            np.testing.assert_allclose(onnx_logits(folder, {"pixel_values": pixels[:n].numpy()}), expected[:n],
                                       atol=1e-4)
        scope = readme_snippet(folder, paths=files)
        np.testing.assert_allclose(scope["logits"], expected, atol=1e-4)
        assert list(scope["names"].values()) == ["one", "two", "zero"]
        readme = open(folder / "README.md").read()
        assert ("moving average of the trained weights (ema.pt" in readme) == (weights == "ema"), readme
        answers[weights] = expected
    assert not np.allclose(answers["trained"], answers["ema"], atol=1e-4)  # the average is another model


def test_onnx_without_its_packages_is_one_line_naming_the_pip_command(cnn_run, tmp_path, monkeypatch, capsys):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else
                        find_spec(name, *a))
    assert export(cnn_run, format="onnx", dir=str(tmp_path / "onnx")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "python -m pip install onnxscript" in err and "export.format" in err
    assert not (tmp_path / "onnx").exists()


def test_csv_texts_bag_of_words_as_onnx_gives_the_models_logits(tmp_path):
    """csv_text's model goes to ONNX through its Hugging Face form (tasks/bag_of_words_hf.py): unknown words,
    case and padding give the model's own logits."""
    from torch import nn
    from transformers import AutoTokenizer
    from extras import export as export_module
    from tasks.bag_of_words_hf import BagOfWordsExport
    from tasks.csv_text import words
    torch.manual_seed(0)
    vocab = {w: i for i, w in enumerate(["a", "don't", "good", "ok", "the", "x1"], 2)}
    model = nn.Sequential(nn.EmbeddingBag(len(vocab) + 2, 8, mode="mean", padding_idx=0), nn.Dropout(0.5),
                          nn.Linear(8, 3)).eval()

    class Task(BagOfWordsExport):
        classes, cfg = ["neg", "neutral", "pos"], type("cfg", (), {"data": type("data", (), {"max_length": 6})})

        def label_names(self):
            return self.classes
    Task.vocab = vocab
    export_module.write_onnx(str(tmp_path), Task(), model)
    texts = ["GOOD good, good!", "Don't -- x1?", "unseen words only", "the a ok good the a ok good x1"]
    enc = AutoTokenizer.from_pretrained(tmp_path)(texts, padding=True, truncation=True, return_tensors="np")
    theirs = onnx_logits(tmp_path, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    with torch.no_grad():
        ours = torch.cat([model(torch.tensor([[vocab.get(w, 1) for w in words(t)][:6]])) for t in texts]).numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    assert json.load(open(tmp_path / "labels.json"))["id2label"] == {"0": "neg", "1": "neutral", "2": "pos"}
