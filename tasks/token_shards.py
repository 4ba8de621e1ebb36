"""Prepared token shards: corpora larger than memory, tokenized once by `scripts/prepare_text.py`, read lazily.

A prepared folder holds, per split and per input chunk (`train-00003` ...):
    NAME.tokens.npy   the chunk's token ids, one flat array (uint16 when the vocabulary fits, else uint32)
    NAME.index.npy    int64 document offsets into tokens (documents + 1 entries: document d is [index[d], index[d+1]))
    NAME.labels.npy   classification only: one int64 label per document
plus `tokenizer/` (the tokenizer used, a Hugging Face folder) and `manifest.json` (tokenizer fingerprint, vocab
size, dtype, counts per split and shard), written last: a folder without it is an unfinished preparation.

Language modelling (`task: lm`): every document is stored followed by the end-of-text token, so a split is one
token stream, the concatenation of its shards, exactly the stream gpt2_lm's in-memory path builds from a JSON
array. TokenBlocks cuts it into the same blocks (block k = stream[kT, kT + T]).
Classification (`task: classification`): one example per document, truncated at preparation (`max_length` of the
manifest); TokenExamples gives token ids and label, as sst2's in-memory path does.

Memory: a dataset holds a few numbers per shard. Arrays are opened with np.load(mmap_mode="r") when a sample
needs them (at most OPEN_SHARDS per process, so a 10,000-shard corpus does not hold 10,000 file handles), and the
datasets pickle without them (DataLoader workers open their own). Both expose `shard_sizes`, so the Trainer's
sampler shuffles the order of the shards and the samples inside each shard, and a rank reads one shard at a time;
its sample order is made as it is consumed (data_order.ShardOrder), so the epoch's order is never held whole.
Resume: a position is (epoch, batch), as for every dataset; nothing here needs saving.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from core.errors import DataError
from core.file_names import shown_name
from tasks.text_common import check_pretrained_dir, main_first, open_tokenizer, tokenizer_dir

MANIFEST = "manifest.json"
PLAN = os.path.join("progress", "plan.json")  # written first by prepare_text.py: a preparation was started here
FORMAT = "token-shards"
VERSION = 1
OPEN_SHARDS = 4  # memory-mapped shards kept open per process and split


def is_prepared(folder: str) -> bool:
    """Whether `folder` holds prepared shards (or a preparation that has not finished: read_manifest says so)."""
    return bool(folder) and (os.path.isfile(os.path.join(folder, MANIFEST)) or
                             os.path.isfile(os.path.join(folder, PLAN)))


def read_manifest(folder: str, task: str) -> dict:
    """The manifest of a finished preparation for `task` (lm or classification), with a dev split (training
    evaluates on it); anything else is a DataError."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise DataError(f"{shown_name(folder)}: the preparation of these shards has not finished (no {MANIFEST}); run "
                        "the same scripts/prepare_text.py command again to complete it")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{shown_name(path)}: unreadable ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataError(f"{shown_name(path)}: not a {FORMAT} manifest of version {VERSION}")
    if manifest.get("task") != task:
        raise DataError(f"{shown_name(path)}: shards prepared for --task {manifest.get('task')}, but this task reads "
                        f"--task {task} shards")
    if "dev" not in manifest.get("splits", {}):
        raise DataError(f"{shown_name(folder)}: no dev split in these shards; prepare them with --dev or "
                        "--dev-fraction")
    return manifest


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def fingerprint(tokenizer) -> str:
    """What ties shards to a tokenizer: a hash of its vocabulary (token -> id) and its special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())
    return hashlib.sha256(json.dumps([vocab, specials], ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def run_tokenizer(cfg, folder: str, manifest: dict):
    """The tokenizer of a run on prepared shards: model.pretrained_dir's (which must be the one the shards were
    made with), else the shards' own, copied to <output_dir>/tokenizer (where resume, `mode: test` and
    generate.py look for it). A different tokenizer already in output_dir is an error, not a silent mix of ids."""
    if cfg.model.pretrained_dir:
        tokenizer = open_tokenizer(check_pretrained_dir(cfg.model.pretrained_dir))
        where = f"model.pretrained_dir {shown_name(cfg.model.pretrained_dir)}"
    else:
        saved = tokenizer_dir(cfg)

        def copy():
            if not os.path.isdir(saved):
                shutil.copytree(os.path.join(folder, "tokenizer"), saved + ".part", dirs_exist_ok=True)
                os.replace(saved + ".part", saved)
        main_first(copy)
        tokenizer = open_tokenizer(saved, "the saved tokenizer")
        where = saved
    if fingerprint(tokenizer) != manifest["fingerprint"]:
        raise DataError(f"{shown_name(folder)}: the shards were tokenized with another tokenizer than {where}'s "
                        f"({manifest.get('tokenizer_source')}); prepare them again with --tokenizer pointing at "
                        "the one the model uses, or use a new output_dir")
    return tokenizer


class ShardSet:
    """The shards of one split: sizes from the manifest, arrays memory-mapped on first use (OPEN_SHARDS at most)."""

    def __init__(self, folder: str, manifest: dict, split: str):
        if split not in manifest["splits"]:
            raise DataError(f"{shown_name(folder)}: no {split} split in these shards (prepared splits: "
                            f"{', '.join(manifest['splits'])})")
        info = manifest["splits"][split]
        self.folder, self.split = folder, split
        self.names = [s["name"] for s in info["shards"]]
        self.documents = [s["documents"] for s in info["shards"]]
        self.tokens = [s["tokens"] for s in info["shards"]]
        self.max_token_id = info["max_token_id"]
        self.open: OrderedDict = OrderedDict()

    def __getstate__(self):  # DataLoader workers (and pickling) get the sizes only; they map the files themselves
        state = dict(self.__dict__)
        state["open"] = OrderedDict()
        return state

    def array(self, s: int, kind: str) -> np.ndarray:
        key = (s, kind)
        if key not in self.open:
            path = os.path.join(self.folder, f"{self.names[s]}.{kind}.npy")
            try:
                self.open[key] = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise DataError(f"{shown_name(path)}: cannot read ({e})") from None
            held = len(self.open[key])
            expected = {"tokens": self.tokens[s], "index": self.documents[s] + 1, "labels": self.documents[s]}[kind]
            if held != expected:  # cut short (or grown) since its preparation: its samples would come out short
                del self.open[key]
                raise DataError(f"{shown_name(path)}: holds {held} values, its manifest says {expected}; prepare the "
                                "shards again")
            if len(self.open) > OPEN_SHARDS * 3:
                self.open.popitem(last=False)
        self.open.move_to_end(key)
        return self.open[key]


class TokenBlocks(Dataset):
    """Language-model blocks over a split's token stream: sample k is stream[kT : kT + T + 1] (T = block),
    inputs its first T tokens, labels its last T; the same samples as gpt2_lm's in-memory Blocks."""

    def __init__(self, folder: str, manifest: dict, split: str, block: int):
        self.shards = ShardSet(folder, manifest, split)
        self.block, self.path = block, f"{shown_name(folder)} ({split})"
        self.starts = np.concatenate([[0], np.cumsum(self.shards.tokens, dtype=np.int64)]).tolist()
        total = self.n_tokens = self.starts[-1]
        self.n = max(0, (total - 1) // block)
        if self.n == 0:
            raise DataError(f"{self.path}: {total} tokens, fewer than one block of data.max_length={block} + 1")
        # Blocks starting in each shard: the sampler shuffles shards and blocks within them (a block that runs
        # past its shard's end reads the next one too).
        first = [min(self.n, -(-start // block)) for start in self.starts]
        self.shard_sizes = [b - a for a, b in zip(first, first[1:])]

    def __len__(self) -> int:
        return self.n

    def tokens(self, a: int, b: int) -> np.ndarray:
        """stream[a:b], read from the shards that hold it."""
        parts, s = [], bisect.bisect_right(self.starts, a) - 1
        while a < b:
            while self.starts[s + 1] <= a:  # skip empty shards
                s += 1
            end = min(b, self.starts[s + 1])
            parts.append(self.shards.array(s, "tokens")[a - self.starts[s]:end - self.starts[s]])
            a = end
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def __getitem__(self, k: int) -> dict:
        ids = torch.from_numpy(self.tokens(k * self.block, (k + 1) * self.block + 1).astype(np.int64))
        return {"input_ids": ids[:-1], "labels": ids[1:]}


class TokenExamples(Dataset):
    """Classification examples: token ids (cut to max_length, keeping the tokenizer's closing special tokens, as
    truncation at tokenization does) and the label; the same items as sst2's in-memory TokenizedSentences."""

    def __init__(self, folder: str, manifest: dict, split: str, max_length: int):
        self.shards = ShardSet(folder, manifest, split)
        self.path = f"{shown_name(folder)} ({split})"
        self.starts = np.concatenate([[0], np.cumsum(self.shards.documents, dtype=np.int64)]).tolist()
        self.shard_sizes = list(self.shards.documents)
        self.max_length, self.suffix = max_length, manifest["special_suffix"]
        self.max_stored = manifest["splits"][split]["max_length"]

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, i: int) -> tuple[int, int]:
        s = bisect.bisect_right(self.starts, i) - 1
        return s, i - self.starts[s]

    def __getitem__(self, i: int) -> dict:
        s, j = self.locate(i)
        a, b = self.shards.array(s, "index")[j:j + 2]
        ids = self.shards.array(s, "tokens")[a:b].tolist()
        if len(ids) > self.max_length:
            keep = self.max_length - self.suffix
            ids = ids[:keep] + ids[len(ids) - self.suffix:]
        return {"input_ids": ids, "labels": int(self.shards.array(s, "labels")[j])}


class ShardLengths:
    """Per-example lengths of a TokenExamples (for data.group_by_length), read from the index when asked for:
    `lengths[indices]` for an array of indices, without holding one number per example."""

    def __init__(self, dataset: TokenExamples):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty(len(indices), dtype=np.int64)
        shard = np.searchsorted(self.dataset.starts, indices, side="right") - 1
        for s in np.unique(shard):
            mine = shard == s
            index = self.dataset.shards.array(int(s), "index")
            j = indices[mine] - self.dataset.starts[s]
            out[mine] = index[j + 1] - index[j]
        return np.minimum(out, self.dataset.max_length)


def check_vocabulary(datasets: dict, vocab_size: int) -> Optional[str]:
    """The first split whose largest token id (from the manifest) is outside a model's vocabulary, as a message."""
    for split, ds in datasets.items():
        if ds is None or not hasattr(ds, "shards"):
            continue
        top = ds.shards.max_token_id
        if top >= vocab_size:
            return (f"{ds.path}: token id {top} is outside the model's vocabulary (vocab_size {vocab_size}: ids "
                    f"0-{vocab_size - 1}); the shards' tokenizer and the model disagree")
    return None
