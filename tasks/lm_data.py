"""Language-model data (gpt2_lm): text files -> one token stream per split -> windows of data.max_length tokens.

Files. data.train_files (a glob; default `train.*` in data_dir, or else every text file in data_dir that is not
dev.* or test.*), data.dev_files (default `dev.*`) and `test.*`, each one of:
    .txt (any other suffix too)  plain text: the whole file is one text (nanoGPT's input.txt)
    .json                        a JSON array of strings (a .json file that does not start with `[` is JSON lines)
    .jsonl / .ndjson             JSON lines: one object per line with the text in field data.text_column, or a string
A file that is not what its suffix says is a one-line DataError naming it and the line (or item).

Stream. Each text is tokenized and followed by the end-of-text token; a split's stream is its texts in file order.

Dev split (data.dev_split): `files` the dev files; `tail` the last data.dev_fraction of the training stream
(nanoGPT's split: the tokenizer is trained on the whole training text, tail included, as nanoGPT's char
vocabulary is); `texts` a fixed (seed 0) data.dev_fraction of the training texts, whole; `auto` files when
there are some, else tail.

Windows (data.windows), each T + 1 tokens (T = data.max_length; inputs its first T, targets its last T):
`blocks` the stream cut into non-overlapping blocks (block k starts at kT, so every token is a target once);
`random` windows starting at random offsets, nanoGPT's get_batch, drawn from (seed, epoch, sample index) so that a
resumed run draws the same windows. Dev and test are always blocks (the same tokens at every evaluation).
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from core.config import DataConfig
from core.errors import DataError
from core.file_names import shown_name
from tasks.text_common import json_lines, read_utf8

TEXT_SUFFIXES = (".txt", ".json", ".jsonl", ".ndjson")  # what a data_dir is searched for
SPLIT_NAMES = ("train", "dev", "test")


def check_config(cfg, fail) -> None:
    """data.tokenizer, windows or dev_split, set (config.validate asks): they are gpt2_lm's, refused elsewhere, not
    ignored; a trained tokenizer cannot stand in for a pretrained model's own."""
    d = cfg.data
    for key in ("tokenizer", "windows", "dev_split"):
        if getattr(d, key) != getattr(DataConfig, key) and cfg.task != "gpt2_lm":
            fail(f"data.{key}", f"is gpt2_lm's, not {cfg.task}'s; remove it")
    if d.tokenizer in ("bpe", "char", "byte") and cfg.model.pretrained_dir:
        fail("data.tokenizer", f"is {d.tokenizer}, but model.pretrained_dir's model was trained with its own "
                               "tokenizer; use auto (or that folder)")


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------
def find_files(data, split: str) -> list[str]:
    """The files of `split` (train, dev, test) by data.train_files / data.dev_files or their defaults; [] if none."""
    pattern = {"train": data.train_files, "dev": data.dev_files}.get(split)
    if pattern:
        return sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    named = [os.path.join(data.data_dir, split + suffix) for suffix in TEXT_SUFFIXES]
    named = [p for p in named if os.path.isfile(p)]
    if named or split != "train":
        return named
    # no train.*: the folder's text files (nanoGPT's layout: one input.txt), leaving out dev.* and test.*
    return sorted(p for p in glob.glob(os.path.join(glob.escape(data.data_dir), "*")) if os.path.isfile(p)
                  and p.endswith(TEXT_SUFFIXES) and os.path.basename(p).split(".")[0] not in SPLIT_NAMES)


def read_file(path: str, text_column: str = "text") -> list[str]:
    """The texts of one file, by its suffix (see the module docstring)."""
    check_size(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix in (".jsonl", ".ndjson"):
        return read_json_lines(path, text_column)
    if suffix == ".json":
        text = read_utf8(path)
        return read_texts(path, text) if text.lstrip().startswith("[") else read_json_lines(path, text_column, text)
    text = read_utf8(path)
    if not text:
        raise DataError(f"{shown_name(path)}: empty file, no text")
    return [text]


# A file larger than this is refused: read in memory, its bpe token stream needs about 150 bytes per byte of text
# (measured: 2.8 GiB for 19 MiB), and a 2 GB text aborted tokenizers' Rust code; token shards stream any size.
MAX_FILE_BYTES = 1 << 30


def check_size(path: str) -> None:
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise DataError(f"{shown_name(path)}: {size / 2**30:.1f} GiB, more than the {MAX_FILE_BYTES >> 30} GiB a "
                        "text file read in memory may hold; make token shards of it with scripts/prepare_text.py "
                        "--task lm (streamed, any size) and set data.data_dir to their folder")


def read_texts(path: str, text: str | None = None) -> list[str]:
    """The JSON array of strings in `path`. Everything the tokenizer would choke on later (invalid UTF-8, JSON
    that is not an array of strings, a lone surrogate) is a DataError naming the file, and the line or item."""
    try:
        texts = json.loads(read_utf8(path) if text is None else text)
    except json.JSONDecodeError as e:
        raise DataError(f"{shown_name(path)}:{e.lineno}: not valid JSON at column {e.colno} ({e.msg})") from None
    if not isinstance(texts, list):
        raise DataError(f"{shown_name(path)}: expected a JSON array of strings, got {json_kind(texts)}")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"{shown_name(path)}: expected a JSON array of strings; item {bad} is {json_kind(texts[bad])}")
    if not texts:
        raise DataError(f"{shown_name(path)}: no texts")
    check_surrogates(path, texts)
    return texts


def read_json_lines(path: str, field: str, text: str | None = None) -> list[str]:
    """JSON lines: each non-blank line an object holding a string in `field`, or a bare JSON string."""
    texts = []
    for number, value in json_lines(path, text):
        doc = value.get(field) if isinstance(value, dict) else value
        if not isinstance(doc, str):
            what = f"its {field!r} is {json_kind(doc)}" if isinstance(value, dict) and field in value else \
                f"no {field!r} field" if isinstance(value, dict) else json_kind(value)
            raise DataError(f"{shown_name(path)}:{number}: expected an object with a string {field!r} "
                            f"(data.text_column) or a string, got {what}")
        try:
            doc.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{shown_name(path)}:{number}: holds a lone surrogate escape (\\ud800-\\udfff), which "
                            "is not text") from None
        texts.append(doc)
    if not texts:
        raise DataError(f"{shown_name(path)}: no texts")
    return texts


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words (a dict is an object, a float a number)."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "true/false", int: "a number",
             float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def check_surrogates(path: str, texts: list[str]) -> None:
    """JSON may spell a lone UTF-16 surrogate (`"\\ud800"`): valid JSON, but not text. The tokenizer refuses it
    with a bare TypeError naming nothing, so find it here: one encode of all texts, item by item only on error."""
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{shown_name(path)}: item {i} holds a lone surrogate \\u{ord(text[e.start]):04x} at "
                                f"character {e.start}, which is not text; escapes \\ud800-\\udfff must come in valid "
                                "pairs")


# ----------------------------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------------------------
def read_splits(data) -> tuple[dict, dict]:
    """({split: texts}, {split: where, for messages}) of the text files; dev only when it comes from files or
    whole texts (the tail split cuts the token stream later: split_tail)."""
    files = {split: find_files(data, split) for split in SPLIT_NAMES}
    if not files["train"]:
        raise DataError(f"{shown_name(data.train_files or data.data_dir)}: no training text. gpt2_lm reads train.txt, "
                        "train.json or train.jsonl (or any .txt/.json/.jsonl file) from data.data_dir, or the "
                        "files of data.train_files")
    how = dev_source(data, bool(files["dev"]))
    if how == "files" and not files["dev"]:
        raise DataError(f"{shown_name(data.dev_files or os.path.join(data.data_dir, 'dev.*'))}: no dev file, "
                        "which data.dev_split: files needs; add one, or use dev_split tail or texts")
    wanted = [s for s in SPLIT_NAMES if files[s] and (s != "dev" or how == "files")]
    texts = {s: [t for path in files[s] for t in read_file(path, data.text_column)] for s in wanted}
    where = {s: shown_name(files[s][0]) + (f" (+{len(files[s]) - 1} files)" if len(files[s]) > 1 else "")
             for s in wanted}
    if how == "texts":
        texts["train"], texts["dev"] = hold_out_texts(texts["train"], data.dev_fraction, where["train"])
        where["dev"] = f"{where['train']} (held-out texts)"
    return texts, where


def dev_source(data, have_dev_files: bool) -> str:
    """data.dev_split with auto resolved: dev files when there are some, else the tail of the training stream."""
    if data.dev_split != "auto":
        return data.dev_split
    return "files" if have_dev_files else "tail"


def hold_out_texts(texts: list[str], fraction: float, where: str) -> tuple[list[str], list[str]]:
    """(train, dev): a fixed holdout of whole texts, independent of the training seed."""
    order = np.random.default_rng(0).permutation(len(texts))
    n_dev = max(1, int(round(len(order) * fraction)))
    if n_dev >= len(order):
        raise DataError(f"{where}: {len(order)} texts, too few to hold out a dev split of whole texts (add a dev "
                        "file, or set data.dev_split: tail)")
    return [texts[i] for i in sorted(order[n_dev:])], [texts[i] for i in sorted(order[:n_dev])]


def token_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """The texts' token ids, each text followed by the end-of-text token (it separates documents), as one tensor."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, verbose=False)["input_ids"]  # verbose=False: no warning about texts over 1024 tokens
    return torch.tensor([i for text_ids in ids for i in (*text_ids, eos)], dtype=torch.long)


def split_tail(stream: torch.Tensor, fraction: float, block: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, dev): the last `fraction` of the stream is dev (nanoGPT: data[int(n * 0.9):] with 0.1)."""
    cut = int(len(stream) * (1 - fraction))
    if fraction <= 0 or len(stream) - cut < block + 1:
        raise DataError(f"{where}: data.dev_fraction={fraction:g} of its {len(stream)} tokens is fewer than one "
                        f"block of data.max_length={block} + 1 for dev; raise dev_fraction or add a dev file")
    return stream[:cut], stream[cut:]


# ----------------------------------------------------------------------------------------------------------------
# Windows
# ----------------------------------------------------------------------------------------------------------------
class Blocks(Dataset):
    """A token stream cut into non-overlapping blocks: sample k is stream[kT : kT + T + 1] (inputs = [:-1],
    targets = [1:]), so every token but the first is a target exactly once."""

    def __init__(self, stream: torch.Tensor, block: int, path: str):
        n = (len(stream) - 1) // block
        if n == 0:
            raise DataError(f"{path}: {len(stream)} tokens, fewer than one block of data.max_length={block} + 1")
        self.stream, self.block, self.path = stream, block, path
        self.n_tokens = len(stream)
        self.blocks = stream[: n * block + 1].unfold(0, block + 1, block)  # overlapping by one token: [n, T + 1]

    def __len__(self) -> int:
        return len(self.blocks)

    def tokens(self, a: int, b: int) -> torch.Tensor:
        return self.stream[a:b]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i, :-1], "labels": self.blocks[i, 1:]}


class RandomWindows(Dataset):
    """nanoGPT's sampling: a window of T + 1 tokens at a random offset of the stream of `base` (Blocks, or the
    shards' TokenBlocks). An epoch is as many windows as `base` has blocks. The offset of sample i comes from
    (seed, epoch, i) alone, never from the global RNG: the Trainer calls set_epoch before each epoch, and a
    resumed run, which restarts from (epoch, sample), draws the same windows."""

    def __init__(self, base: Dataset, seed: int):
        self.base, self.seed, self.epoch = base, seed, 0
        self.block, self.path = base.block, base.path
        self.last_start = base.n_tokens - base.block - 1  # a window needs T + 1 tokens
        for name in ("blocks", "shards"):  # what check_fits / check_vocabulary read from the base
            if hasattr(base, name):
                setattr(self, name, getattr(base, name))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.base)

    def offset(self, i: int) -> int:
        # -----> where sample i of this epoch starts: uniform over the stream (nanoGPT's torch.randint).
        return int(np.random.default_rng([self.seed, self.epoch, int(i), 21]).integers(0, self.last_start + 1))

    def __getitem__(self, i: int) -> dict:
        start = self.offset(i)
        ids = self.base.tokens(start, start + self.block + 1)
        ids = torch.from_numpy(ids.astype(np.int64)) if isinstance(ids, np.ndarray) else ids  # shards: numpy
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def windows(cfg, base: Dataset, split: str) -> Dataset:
    """The training split as data.windows says; dev and test stay blocks."""
    return RandomWindows(base, cfg.seed) if split == "train" and cfg.data.windows == "random" else base
