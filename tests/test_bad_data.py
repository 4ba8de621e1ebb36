"""Bad values in data are caught at load (issue 9, item 7): when the task builds its datasets, before training
starts, as one DataError line naming the file and the line (or `dataset[row][column]` of an HDF5 shard) and
saying what is allowed. Each test writes a small bad file next to a good one; the good data must still load.
Nothing here trains: the whole file runs in well under 30 s on 2 cores.
"""
import gzip
import json
import os
import re
import struct
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT, make_config, spawn

from core.errors import DataError
from wiring import build_task


def datasets_of(cfg):
    return build_task(cfg).build_datasets()


# ---------------------------------------------------------------------------------------------------------------
# MNIST IDX files
# ---------------------------------------------------------------------------------------------------------------
IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int32): 0x0C,
             np.dtype(np.float32): 0x0D}


def write_idx(path, array):
    header = bytes([0, 0, IDX_CODES[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    body = array.astype(array.dtype.newbyteorder(">")).tobytes()
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(header + body)


def write_mnist(folder, train_labels=None, train_images=None, n=40):
    """Good train and t10k IDX files in `folder`; `train_labels` / `train_images` replace the training ones."""
    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    for split in ("train", "t10k"):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        if split == "train":
            images = images if train_images is None else train_images
            labels = labels if train_labels is None else train_labels
        write_idx(os.path.join(folder, f"{split}-images-idx3-ubyte"), images)
        write_idx(os.path.join(folder, f"{split}-labels-idx1-ubyte"), labels)
    return os.path.join(folder, "train-labels-idx1-ubyte")


def mnist_config(tmp_path, folder):
    return make_config(tmp_path / "run", data={"dataset": "mnist", "data_dir": str(folder), "download": False})


def test_good_mnist_loads(tmp_path):
    write_mnist(tmp_path / "mnist")
    datasets = datasets_of(mnist_config(tmp_path, tmp_path / "mnist"))
    assert len(datasets["train"]) + len(datasets["dev"]) == 40 and len(datasets["test"]) == 40


def mnist_labels(values, dtype=np.uint8):
    labels = np.zeros(40, dtype)
    for index, value in values.items():
        labels[index] = value
    return labels


@pytest.mark.parametrize("labels, message", [
    (mnist_labels({13: 12}), "label 12 at index 13 is outside the 10 classes (0-9)"),
    (mnist_labels({5: 10, 7: 255}), "label 10 at index 5 is outside the 10 classes (0-9) (2 bad labels in all)"),
    (mnist_labels({2: -1}, np.int8), "label -1 at index 2 is outside the 10 classes (0-9)"),
    (mnist_labels({4: 3.5}, np.float32), "label 3.5 at index 4 is not a whole number"),
])
def test_mnist_label_outside_the_classes(tmp_path, labels, message):
    path = write_mnist(tmp_path / "mnist", train_labels=labels)
    with pytest.raises(DataError, match=re.escape(f"{path}: {message}")):
        datasets_of(mnist_config(tmp_path, tmp_path / "mnist"))


@pytest.mark.parametrize("images, message", [
    (np.zeros((40, 28, 20), np.uint8), "images are 28x20; the CNN needs square images of at least 6x6"),
    (np.zeros((40, 4, 4), np.uint8), "images are 4x4; the CNN needs square images of at least 6x6"),
    (np.where(np.arange(40)[:, None, None] == 9, np.nan, np.zeros((40, 28, 28))).astype(np.float32),
     "image at index 9 holds non-finite pixels (NaN or infinity)"),
])
def test_mnist_images_the_cnn_cannot_take(tmp_path, images, message):
    write_mnist(tmp_path / "mnist", train_images=images)
    path = tmp_path / "mnist" / "train-images-idx3-ubyte"
    with pytest.raises(DataError, match=re.escape(f"{path}: {message}")):
        datasets_of(mnist_config(tmp_path, tmp_path / "mnist"))


def test_mnist_without_images(tmp_path):
    write_mnist(tmp_path / "mnist", train_images=np.zeros((0, 28, 28), np.uint8), train_labels=np.zeros(0, np.uint8))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'mnist' / 'train-images-idx3-ubyte'}: no images")):
        datasets_of(mnist_config(tmp_path, tmp_path / "mnist"))


def test_mnist_splits_of_different_sizes(tmp_path):
    write_mnist(tmp_path / "mnist", train_images=np.zeros((40, 20, 20), np.uint8))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'mnist'}: t10k images are 28x28 but train images "
                                                  "20x20; both splits need one size")):
        datasets_of(mnist_config(tmp_path, tmp_path / "mnist"))


def test_bad_label_through_main_is_one_line_and_exit_2(tmp_path):
    """The whole path a user takes: `python main.py`, the error before training, one line, no traceback."""
    path = write_mnist(tmp_path / "mnist", train_labels=mnist_labels({21: 11}))
    r = subprocess.run([sys.executable, "main.py", "--params", "parameters.yml", "--set", "task=image",
                        "--set", "data.dataset=mnist", "--set", f"data.data_dir={tmp_path / 'mnist'}",
                        "--set", "data.download=false", "--set", f"output_dir={tmp_path / 'run'}",
                        "--set", "log.tensorboard=false", "--set", "log.progress_bar=false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert errors == [f"error: {path}: label 11 at index 21 is outside the 10 classes (0-9)"], r.stderr
    assert not os.path.isdir(tmp_path / "run" / "checkpoints") or not os.listdir(tmp_path / "run" / "checkpoints")


# ---------------------------------------------------------------------------------------------------------------
# BERT pre-training shards (NVIDIA's HDF5 layout)
# ---------------------------------------------------------------------------------------------------------------
def bert_arrays(n=24, seq=32, max_pred=5, seed=0):
    """A good shard's arrays: int32, real tokens first, masked positions inside the real tokens, 0-padded."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(12, seq + 1, n)
    columns = np.arange(seq)
    mask = (columns[None] < lengths[:, None]).astype(np.int32)
    positions = np.zeros((n, max_pred), np.int32)
    for i, length in enumerate(lengths):
        positions[i] = np.sort(rng.choice(np.arange(1, length), max_pred, replace=False))
    return {"input_ids": (rng.integers(1000, 2000, (n, seq)) * mask).astype(np.int32), "input_mask": mask,
            "segment_ids": ((columns[None] >= lengths[:, None] // 2) * mask).astype(np.int32),
            "masked_lm_positions": positions,
            "masked_lm_ids": rng.integers(1000, 2000, (n, max_pred)).astype(np.int32),
            "next_sentence_labels": rng.integers(0, 2, n).astype(np.int32)}


def write_shard(path, arrays):
    import h5py
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value)
    return str(path)


def bert_data(tmp_path, change=None):
    """data_dir with a good dev shard and two training shards, the second changed by `change(arrays)`."""
    root = tmp_path / "bert"
    write_shard(root / "test" / "shard_00000.hdf5", bert_arrays(seed=1))
    write_shard(root / "training" / "shard_00000.hdf5", bert_arrays(seed=2))
    arrays = bert_arrays(seed=3)
    if change:
        change(arrays)
    bad = write_shard(root / "training" / "shard_00001.hdf5", arrays)
    return root, bad


def bert_config(tmp_path, root, **model):
    return make_config(tmp_path / "run", task="bert_pretrain", data={"data_dir": str(root)},
                       model={"name": "tiny", **model}, train={"best_metric": "loss"})


def setter(key, index, value):
    def change(arrays):
        arrays[key][index] = value
    return change


def test_good_bert_shards_load(tmp_path):
    root, _ = bert_data(tmp_path)
    datasets = datasets_of(bert_config(tmp_path, root))
    assert len(datasets["train"]) == 48 and len(datasets["dev"]) == 24
    item = datasets["train"][30]
    assert (item["mlm_labels"] != -100).sum() == 5


@pytest.mark.parametrize("change, message", [
    (setter("masked_lm_positions", (17, 3), 140),
     "masked_lm_positions[17][3] = 140 is outside the sequence (length 32: positions 0-31)"),
    (setter("masked_lm_positions", (17, 3), -2), "masked_lm_positions[17][3] = -2 is outside the sequence"),
    (lambda a: a["input_mask"].__setitem__(4, np.arange(32) < 20) or a["masked_lm_positions"].__setitem__(
        4, [1, 2, 3, 4, 25]), "masked_lm_positions[4][4] = 25 points at padding, past the sequence's real tokens"),
    (setter("input_ids", (6, 2), 30522), "input_ids[6][2] = 30522 is outside the vocabulary "
                                         "(vocab_size 30522: ids 0-30521)"),
    (setter("input_ids", (6, 2), -5), "input_ids[6][2] = -5 is outside the vocabulary"),
    (setter("masked_lm_ids", (8, 0), 99999), "masked_lm_ids[8][0] = 99999 is outside the vocabulary"),
    (setter("next_sentence_labels", 9, 2), "next_sentence_labels[9] = 2 is not 0 or 1"),
    (setter("next_sentence_labels", 9, -1), "next_sentence_labels[9] = -1 is not 0 or 1"),
    (setter("segment_ids", (3, 1), 2), "segment_ids[3][1] = 2 is not a segment id (0-1"),
    (setter("input_mask", (3, 1), 7), "input_mask[3][1] = 7 is not 0 or 1"),
    (setter("input_mask", (3, slice(0, 5)), 0), "input_mask[3][5] = 1 follows a 0: real tokens must come first"),
    (setter("input_mask", (3, slice(None)), 0), "input_mask[3] is all 0: an empty sequence"),
    (lambda a: a.update(input_ids=a["input_ids"].astype(np.float32)), "input_ids holds float32 values"),
    (lambda a: a.update(next_sentence_labels=np.int32(1)),
     "next_sentence_labels must be arrays with one row per sequence"),
    (lambda a: a.update(masked_lm_ids=a["masked_lm_ids"][:, :3]),
     "masked_lm_positions is 24x5 and masked_lm_ids 24x3"),
    (lambda a: a.update(segment_ids=a["segment_ids"][:, :30]), "segment_ids is 24x30 but input_ids 24x32"),
    (lambda a: a.update({k: v[:, :16] for k, v in a.items() if k.startswith("input") or k == "segment_ids"}),
     "sequences of 16 tokens, but"),
])
def test_bert_shard_value_the_model_cannot_take(tmp_path, change, message):
    root, bad = bert_data(tmp_path, change)
    with pytest.raises(DataError, match=re.escape(f"{bad}: {message}")):
        datasets_of(bert_config(tmp_path, root))


def test_bert_counts_every_bad_value_of_a_kind(tmp_path):
    def change(a):
        a["next_sentence_labels"][[4, 11, 20]] = 3
    root, bad = bert_data(tmp_path, change)
    with pytest.raises(DataError, match=re.escape(f"{bad}: next_sentence_labels[4] = 3 is not 0 or 1 (0: sentence B "
                                                  "follows A, 1: B is a random sentence) (and 2 more in rows 0-23)")):
        datasets_of(bert_config(tmp_path, root))


def test_bert_checks_blocks_of_rows(tmp_path, monkeypatch):
    """Big shards are checked a block of rows at a time: the row number is still the row in the shard."""
    import tasks.bert_pretrain as bert
    monkeypatch.setattr(bert, "CHECK_ELEMENTS", 32 * 5)  # 5 rows of 32 per block
    root, bad = bert_data(tmp_path, setter("masked_lm_positions", (17, 3), 40))
    with pytest.raises(DataError, match=re.escape(f"{bad}: masked_lm_positions[17][3] = 40 is outside")):
        datasets_of(bert_config(tmp_path, root))


def test_bert_vocabulary_comes_from_pretrained_config(tmp_path):
    """With model.pretrained_dir, ids are checked against its config.json's vocab_size, before the model is
    built (the ids here are 1000-1999, inside BERT's 30522 but outside this model's 1500)."""
    pretrained = tmp_path / "small-bert"
    pretrained.mkdir()
    (pretrained / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 1500,
                                                        "type_vocab_size": 2, "max_position_embeddings": 64}))
    root, _ = bert_data(tmp_path)
    with pytest.raises(DataError, match=r"shard_00000.hdf5: input_ids\[\d+\]\[\d+\] = 1\d\d\d is outside the "
                                        r"vocabulary \(vocab_size 1500: ids 0-1499\)"):
        datasets_of(bert_config(tmp_path, root, pretrained_dir=str(pretrained)))


def test_bert_sequences_longer_than_the_pretrained_positions(tmp_path):
    pretrained = tmp_path / "short-bert"
    pretrained.mkdir()
    (pretrained / "config.json").write_text(json.dumps({"model_type": "bert", "max_position_embeddings": 16}))
    root, _ = bert_data(tmp_path)
    with pytest.raises(DataError, match=r"shard_00000.hdf5: input_mask\[\d+\] has \d+ real tokens, more than the "
                                        r"model's 16 positions \(max_position_embeddings\)"):
        datasets_of(bert_config(tmp_path, root, pretrained_dir=str(pretrained)))


def _check_on_rank(rank, files, port, out):
    import torch.distributed as dist
    from tasks.bert_pretrain import HDF5Shards
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        HDF5Shards(files)
        message = "no error"
    except DataError as e:
        message = str(e)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_bert_ranks_share_the_check_and_all_report_the_error(tmp_path):
    """Under DDP each rank checks half the shards; a bad value found by rank 1 is raised on rank 0 as well."""
    from conftest import free_port
    root, bad = bert_data(tmp_path, setter("next_sentence_labels", 9, 5))  # shard 1 of 2: rank 1 checks it
    files = sorted(str(p) for p in (root / "training").iterdir())
    spawn(_check_on_rank, args=(files, free_port(), str(tmp_path)), nprocs=2)
    expected = f"{bad}: next_sentence_labels[9] = 5 is not 0 or 1 (0: sentence B follows A, 1: B is a random sentence)"
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [expected, expected]


# ---------------------------------------------------------------------------------------------------------------
# SST-2 TSV files
# ---------------------------------------------------------------------------------------------------------------
def sst2_data(tmp_path, train=b"sentence\tlabel\n" + b"a fine film \t1\nawful \t0\n" * 4, test=None):
    folder = tmp_path / "sst2"
    folder.mkdir(exist_ok=True)
    (folder / "train.tsv").write_bytes(train)
    (folder / "dev.tsv").write_bytes(b"a good film \t1\na bad film \t0\n")
    if test is not None:
        (folder / "test.tsv").write_bytes(test)
    return folder


def sst2_config(tmp_path, folder):
    return make_config(tmp_path / "run", task="sst2", data={"data_dir": str(folder), "max_length": 32},
                       model={"name": "tiny"})


def test_good_sst2_loads_with_byte_order_mark_and_crlf(tmp_path):
    folder = sst2_data(tmp_path, train="\ufeffsentence\tlabel\r\nun film génial \t1\r\nawful \t0\r\n".encode())
    datasets = datasets_of(sst2_config(tmp_path, folder))
    assert datasets["train"].labels == [1, 0] and datasets["test"] is None


@pytest.mark.parametrize("split, content, line, column, shown", [
    ("train", b"sentence\tlabel\ngood \t1\nbad \t0\nit was \xff great \t1\n", 4, 8, "byte 0xff"),
    ("train", b"good \t1\r\nbad \t0\r\ncaf\xc3\xa9 cr\xe8me \t1\r\n", 3, 8, "byte 0xe8"),  # Latin-1 after UTF-8
    ("train", b"good \t1\ncut short \xe2\x82", 2, 11, "bytes 0xe2 0x82"),  # the file ends inside a character
    ("test", b"sent\xe9nce\tlabel\ngood \t1\n", 1, 5, "byte 0xe9"),  # the header read to find labels
])
def test_sst2_invalid_utf8_names_line_and_column(tmp_path, split, content, line, column, shown):
    folder = sst2_data(tmp_path, **{split: content})
    with pytest.raises(DataError, match=re.escape(f"{folder / (split + '.tsv')}:{line}: not valid UTF-8 ({shown} "
                                                  f"at column {column})")):
        datasets_of(sst2_config(tmp_path, folder))


@pytest.mark.parametrize("bad_line", ["a film\t2", "a film\t-1", "a film\tpositive", "a film\t0.5",
                                      "a film with no label", "a film\t", "a film\t ", "\t1"])
def test_sst2_label_not_0_or_1(tmp_path, bad_line):
    """A wrong, missing or empty label (or an empty sentence) is an error naming the line, never a class of its own."""
    folder = sst2_data(tmp_path, train=f"sentence\tlabel\ngood \t1\n{bad_line}\nbad \t0\n".encode())
    with pytest.raises(DataError, match=re.escape(f"{folder / 'train.tsv'}:3: expected `sentence<TAB>label` with "
                                                  "label 0 or 1, got")):
        datasets_of(sst2_config(tmp_path, folder))


def test_sst2_sentences_must_fit_the_pretrained_model(tmp_path):
    """A pretrained tokenizer with more tokens than its model, or sentences longer than its position table: found
    when the model's config is known (build_model), before training, naming file and line."""
    task = build_task(sst2_config(tmp_path, sst2_data(tmp_path)))
    datasets = task.build_datasets()
    top = max(max(ids) for ids in datasets["train"].ids)
    path = tmp_path / "sst2" / "train.tsv"
    with pytest.raises(DataError, match=re.escape(f"{path}:") + r"\d+: token id " + str(top) +
                       re.escape(f" is outside the model's vocabulary (vocab_size {top}: ids 0-{top - 1})")):
        task.check_fits(SimpleNamespace(vocab_size=top, max_position_embeddings=512))
    longest = max(len(ids) for ids in datasets["train"].ids)
    with pytest.raises(DataError, match=re.escape(f"{path}:2: {longest} tokens, more than the model's 3 positions")):
        task.check_fits(SimpleNamespace(vocab_size=10 ** 6, max_position_embeddings=3))
    everywhere = [ids for ds in datasets.values() if ds is not None for ids in ds.ids]
    task.check_fits(SimpleNamespace(vocab_size=max(map(max, everywhere)) + 1,
                                    max_position_embeddings=max(map(len, everywhere))))  # fits exactly


# ---------------------------------------------------------------------------------------------------------------
# GPT-2 JSON files
# ---------------------------------------------------------------------------------------------------------------
def gpt2_data(tmp_path, dev=None):
    folder = tmp_path / "gpt2"
    folder.mkdir(exist_ok=True)
    (folder / "train.json").write_text(json.dumps([f"the cat number {i} sees a dog in the park ." for i in range(30)]))
    if dev is not None:
        (folder / "dev.json").write_bytes(dev)
    return folder


def gpt2_config(tmp_path, folder, **data):
    return make_config(tmp_path / "run", task="gpt2_lm", data={"data_dir": str(folder), "max_length": 8, **data},
                       model={"name": "tiny"}, train={"best_metric": "loss"})


def test_good_gpt2_loads(tmp_path):
    folder = gpt2_data(tmp_path, dev='\ufeff["a caf\\u00e9 text ok", "an emoji \\ud83d\\ude00 pair"]'.encode())
    datasets = datasets_of(gpt2_config(tmp_path, folder))
    assert len(datasets["train"]) > 10 and len(datasets["dev"]) >= 1


@pytest.mark.parametrize("content, message", [
    (b'[\n"one text",\n"caf\xe9 au lait"\n]', ":3: not valid UTF-8 (byte 0xe9 at column 5)"),
    (b'{"title": "an object"}', ":1: expected an object with a string 'text' (data.text_column) or a string, "
                                "got no 'text' field"),  # not an array: JSON lines, as prepare_text.py reads it
    (b'["text", 42, "more"]', ": expected a JSON array of strings; item 1 is a number"),
    (b'["text", null]', ": expected a JSON array of strings; item 1 is null"),
    (b'["text", ["nested"]]', ": expected a JSON array of strings; item 1 is an array"),
    (b'42', ":1: expected an object with a string 'text' (data.text_column) or a string, got a number"),
    (b'["fine", "a lone \\ud800 surrogate"]', ": item 1 holds a lone surrogate \\ud800 at character 7"),
    (b'["fine",\n "unterminated]', ":2: not valid JSON at column 2 (Unterminated string starting at)"),
    (b"[]", ": no texts"),
])
def test_gpt2_bad_json(tmp_path, content, message):
    folder = gpt2_data(tmp_path, dev=content)
    with pytest.raises(DataError, match=re.escape(f"{folder / 'dev.json'}{message}")):
        datasets_of(gpt2_config(tmp_path, folder))


def test_gpt2_blocks_must_fit_the_pretrained_model(tmp_path):
    task = build_task(gpt2_config(tmp_path, gpt2_data(tmp_path), dev_split="texts"))
    datasets = task.build_datasets()
    top = int(datasets["train"].blocks.max())
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'gpt2' / 'train.json'}: block ") + r"\d+" +
                       re.escape(f" has token id {top}, outside the model's vocabulary (vocab_size {top}")):
        task.check_fits(SimpleNamespace(vocab_size=top, n_positions=1024))
    with pytest.raises(DataError, match=re.escape("data.max_length=8 is longer than the 4 positions")):
        task.check_fits(SimpleNamespace(vocab_size=10 ** 6, n_positions=4))
    task.check_fits(SimpleNamespace(vocab_size=top + 1, n_positions=8))  # fits exactly


# ---------------------------------------------------------------------------------------------------------------
# CSV text files (task csv_text)
# ---------------------------------------------------------------------------------------------------------------
def csv_data(tmp_path, train=b"text,label\na fine film,pos\nawful,neg\n", dev=b"text,label\ngood,pos\nbad,neg\n"):
    folder = tmp_path / "csv"
    folder.mkdir(exist_ok=True)
    (folder / "train.csv").write_bytes(train)
    (folder / "dev.csv").write_bytes(dev)
    return folder


def csv_config(tmp_path, folder):
    return make_config(tmp_path / "run", task="csv_text", data={"data_dir": str(folder)})


def test_good_csv_loads_with_quotes_blank_lines_and_byte_order_mark(tmp_path):
    folder = csv_data(tmp_path, train='\ufefftext,label\r\n"fine, and ""moving""",pos\r\n\r\n"two\r\nlines",neg\r\n'
                                      "plain,pos\n".encode())
    task = build_task(csv_config(tmp_path, folder))
    assert task.read("train") == (['fine, and "moving"', "two\nlines", "plain"], ["pos", "neg", "pos"])
    datasets = task.build_datasets()
    assert task.classes == ["neg", "pos"] and [s["labels"] for s in datasets["train"]] == [1, 0, 1]


FIELD_LIMIT = 131072  # csv.field_size_limit(), unless a program raised it
BAD_CSV = {  # name: (train.csv, its line, what the message says after `train.csv:LINE: `)
    "missing label": (b"text,label\na,pos\nno label here\nb,neg\n", 3, "1 field but the header has 2 (text,label); "
                                                                       "quote a text that holds a comma"),
    "empty label": (b"text,label\na,pos\nb,neg\nc,\n", 4, "empty label; every row needs one"),
    "blank label": (b"text,label\na,pos\nb,  \n", 3, "empty label"),
    "an unquoted comma": (b"text,label\na,pos\nslow, but fine,pos\n", 3, "3 fields but the header has 2"),
    "a quote never closed": (b'text,label\na,pos\n"never closed,neg\nb,pos\nc,neg\n', 3,
                             "a quote opened in this row is never closed; close it"),
    "text after a closing quote": (b'text,label\n"quoted" then not,pos\n', 2,
                                   "not valid CSV (',' expected after '\"'); quote a text that holds a comma"),
    "not UTF-8": (b"text,label\na,pos\ncaf\xe9 cr\xe8me,neg\n", 3, "not valid UTF-8 (byte 0xe9 at column 4); "
                                                                     "the file must be saved as UTF-8"),
    "a field over the limit": (f"text,label\na,pos\n{'x' * (FIELD_LIMIT + 1)},neg\n".encode(), 3,
                               f"a field longer than {FIELD_LIMIT} characters: a quote never closed, or a "
                               "text to cut"),
    "separated by semicolons (Excel in many languages)": (b"text;label\na fine film;pos\n", 1,
                                                           "the header 'text;label' is one field: the file is "
                                                           "separated by ';', not commas"),
    "separated by tabs": (b"text\tlabel\na fine film\tpos\n", 1, "the header 'text\\tlabel' is one field: the file "
                                                                 "is separated by '\\t', not commas; name it .tsv"),
    "an unclosed quote before many rows": (b'text,label\n"a,pos\n' + b"more text,neg\n" * 20000, 2,
                                           "a field longer than"),
}


@pytest.mark.parametrize("name", list(BAD_CSV))
def test_csv_bad_row_names_file_and_line(tmp_path, name):
    content, line, says = BAD_CSV[name]
    folder = csv_data(tmp_path, train=content)
    with pytest.raises(DataError) as caught:
        datasets_of(csv_config(tmp_path, folder))
    message = str(caught.value)
    assert message.startswith(f"{folder / 'train.csv'}:{line}: {says}"), message
    assert "\n" not in message and len(message) < 400, message


def test_csv_bad_row_in_dev_names_dev(tmp_path):
    folder = csv_data(tmp_path, dev=b"text,label\ngood,pos\nbad\n")
    with pytest.raises(DataError, match=re.escape(f"{folder / 'dev.csv'}:3: 1 field but the header has 2")):
        datasets_of(csv_config(tmp_path, folder))


def test_a_dev_fraction_that_rounds_to_no_dev_sample_is_one_line_before_training(tmp_path):
    # the dev split was empty: the run trained to its end, then its last evaluation was a KeyError traceback
    folder = tmp_path / "csv"
    folder.mkdir()
    (folder / "train.csv").write_text("text,label\n" + "".join(f"text {i},{i % 2}\n" for i in range(20)))
    cfg = make_config(tmp_path / "run", task="csv_text", data={"data_dir": str(folder), "dev_fraction": 0.01})
    with pytest.raises(DataError) as caught:
        datasets_of(cfg)
    assert str(caught.value) == (f"{folder / 'train.csv'}: no dev split: data.dev_fraction 0.01 of its 20 rows is "
                                 "none; raise data.dev_fraction, or add a dev file")
    with pytest.raises(DataError) as caught:  # the digits: 0 of the pool, or a fraction that rounds to none
        datasets_of(make_config(tmp_path / "digits", data={"dev_fraction": 0.0}))
    assert str(caught.value) == ("data.dev_fraction 0 of the 1497 digits training images is none: no dev split; "
                                 "raise data.dev_fraction")


def test_csv_bad_row_through_main_is_one_line_and_exit_2(tmp_path, capsys):
    import main
    folder = csv_data(tmp_path, train=b"text,label\na,pos\nb,\n")
    assert main.run(csv_config(tmp_path, folder)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"error: {folder / 'train.csv'}:3: empty label; every row needs one"], err


# ---------------------------------------------------------------------------------------------------------------
# A file named with a control character
# ---------------------------------------------------------------------------------------------------------------
def test_each_reader_shows_a_file_named_with_a_newline_on_one_line(tmp_path):
    """A text file, an IDX file, a shard folder or a model folder named with a newline (or a terminal's escape
    sequence) broke its reader's one-line error in two. Each names it as Python writes the control characters."""
    from tasks import lm_data, mnist, token_shards, untrusted_folders
    folder = tmp_path / "a\nb\x1b[0m"
    folder.mkdir()
    shown = f"{tmp_path}/a\\nb\\x1b[0m"
    (folder / "train.json").write_text("[1, 2")
    (folder / "train-images-idx3-ubyte").write_bytes(b"\0\0\x08")
    (folder / "config.json").write_text("{")
    cases = [(lambda: lm_data.read_file(str(folder / "train.json")), f"{shown}/train.json:1: not valid JSON"),
             (lambda: mnist.read_idx(str(folder / "train-images-idx3-ubyte")), f"{shown}/train-images-idx3-ubyte: "),
             (lambda: token_shards.read_manifest(str(folder), "gpt2_lm"), f"{shown}: the preparation of these shards"),
             (lambda: untrusted_folders.check_json_files(str(folder)),
              f"model.pretrained_dir: {shown}/config.json:1: not valid JSON")]
    for read, expected in cases:
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value).startswith(expected) and len(str(e.value).splitlines()) == 1, str(e.value)
