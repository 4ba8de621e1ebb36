"""Your own classification data in the common formats: the (text, label) rows of a split, every row checked.

A split is a file in data.data_dir named after it (`train`; `dev` or `validation`; `test`), its format found from
the name: `.csv` (a header row; RFC 4180 quotes, `""` inside quotes is one quote), `.tsv` (a header row; tabs
between fields, no quoting: one row per line, as GLUE's files), `.jsonl` or `.json` (JSON lines: one object per
line), `.parquet`, or a folder `datasets` wrote with `save_to_disk` (`Dataset.save_to_disk("data/x/train")`, or
`DatasetDict.save_to_disk("data/x")`, which makes one folder per split). Two of them for one split are refused.
The text and label columns are data.text_column and data.label_column; other columns are ignored.

Each format only yields (text, label, where) rows; `checked` is the one place that validates them, so every format
gives the same one-line DataError naming the file and the row: `file:LINE` in the text formats, `file[i]` (the
row's 0-based index, as `ds[i]` shows it) in parquet and save_to_disk folders. Labels are names or whole numbers
(a `datasets` ClassLabel column gives its names); texts may be empty, labels may not, except in a test split
without any label (GLUE's), which is skipped with a note.

parquet and save_to_disk folders need pyarrow, imported only when such a file is read. The save_to_disk folders are
read with pyarrow directly (the Arrow stream files state.json lists, in order): `datasets` itself would bring dill,
multiprocess, pandas and xxhash along for these few lines, so only the tests use it (to write real folders).
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import os
from collections import Counter
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from core.errors import ConfigError, DataError
from tasks.text_common import json_lines, note, read_utf8, utf8_lines

SPLIT_NAMES = {"train": ("train",), "dev": ("dev", "validation"), "test": ("test",)}
FORMATS = ".csv, .tsv, .jsonl, .json, .parquet, or a datasets save_to_disk folder; dev may be named validation"
Rows = Iterable[tuple[object, object, str]]  # (text, label, where: `:LINE` or `[i]`, printed after the file)


def train_dev_test(read, data) -> dict:
    """{split: (texts, labels) or None} read by `read(split)`. Without a dev file, a fixed data.dev_fraction of the
    training rows (whatever the seed) becomes dev."""
    raw = {split: read(split) for split in ("train", "dev", "test")}
    cut = raw["train"] is not None and raw["dev"] is None and data.dev_fraction > 0
    if cut:
        texts, labels = raw["train"]
        dev = set(np.random.default_rng(0).permutation(len(texts))[:int(round(len(texts) * data.dev_fraction))])
        raw["train"], raw["dev"] = [([t for i, t in enumerate(texts) if (i in dev) == keep],
                                     [y for i, y in enumerate(labels) if (i in dev) == keep]) for keep in (False, True)]
        if not dev:  # (the last step always evaluates dev: a KeyError traceback once training had ended)
            raise DataError(f"{find_split(data.data_dir, 'train') or data.data_dir}: no dev split: data.dev_fraction "
                            f"{data.dev_fraction:g} of its {len(texts)} rows is none; raise data.dev_fraction, or add "
                            "a dev file")
    if raw["train"] is None or raw["dev"] is None:
        raise DataError(f"data.data_dir={data.data_dir!r} needs a train file, and a dev file or data.dev_fraction > 0 "
                        f"({FORMATS})")
    check_known_labels(data, raw, cut)
    return raw


def check_known_labels(data, raw: dict, cut: bool) -> None:
    """A dev or test label that no training row has (`02` for `2`, `Pos` for `pos`) would be scored wrong every
    time: refused in one line naming its file and first row (train's, when data.dev_fraction cut dev off it)."""
    classes = set(raw["train"][1])
    for split in ("dev", "test"):
        unknown = set(raw[split][1]) - classes if raw[split] is not None else set()
        if not unknown:
            continue
        source = "train" if split == "dev" and cut else split
        at, label = first_row_with(data, source, unknown) or (f"{split} split", sorted(unknown)[0])
        why = " (data.dev_fraction put all its rows into the dev split)" if source != split else ""
        raise DataError(f"{at}: label {label[:40]!r} is in no training row{why}; the training classes are "
                        f"{', '.join(sorted(classes))[:80]}")


def first_row_with(data, split: str, labels: set) -> Optional[tuple[str, str]]:
    """(file and row, label) of the first row of `split` whose label is one of `labels`; None without its file (a
    task's own `read`)."""
    path = find_split(data.data_dir, split)
    columns = (data.text_column, data.label_column)
    for text, label, where in split_rows(path, columns) if path else ():
        label = checked(path, [(text, label, where)], columns)[1][0]  # as read_split read it
        if label in labels:
            return f"{path}{where}", label
    return None


def split_rows(path: str, columns: tuple[str, str]) -> Rows:
    """The (text, label, where) rows of a split's file or save_to_disk folder, unchecked."""
    return folder_rows(path, columns) if os.path.isdir(path) else READERS[os.path.splitext(path)[1]](path, columns)


def read_split(data_dir: str, split: str, text_column: str, label_column: str):
    """The (texts, labels) of `split` in data_dir, or None when data_dir holds no file for it."""
    path = find_split(data_dir, split)
    if path is None:
        return None
    columns = (text_column, label_column)
    rows = list(split_rows(path, columns))
    if split == "test" and rows and all(label is None or label == "" for _, label, _ in rows):
        note(f"{path}: no labels (as in GLUE's test splits): skipped, there is nothing to score")
        return None
    return checked(path, rows, columns)


def check_train_rows(data, texts: list[str], labels: list[str], words) -> str:
    """csv_text's training rows: its classes (check_classes, whose line for the plan it returns) and whether its
    tokenizer `words` reads their script (check_words)."""
    note = check_classes(data, labels)
    check_words(data, texts, words)
    return note


def check_classes(data, labels: list[str]) -> str:
    """The training classes with their counts for the plan (`2 classes: neg 40, pos 38`, most common first, cut to
    about 80 characters), once check_rare_classes has let them pass."""
    check_spaced_classes(data.data_dir, labels)
    check_rare_classes(data.data_dir, labels, data.min_class_count)
    counts = Counter(labels).most_common()
    shown = ", ".join(f"{name[:20]} {n}" for name, n in counts)
    return f"{len(counts)} classes: " + (shown if len(shown) <= 80 else shown[:77].rsplit(",", 1)[0] + ", ...")


def check_spaced_classes(data_dir: str, labels: list[str]) -> None:
    """`pos` and ` pos` (a space after the comma in some rows) would silently be two classes: refused in one line."""
    written = {}
    for name in dict.fromkeys(labels):
        other = written.setdefault(name.strip(), name)
        if other != name:
            raise DataError(f"{find_split(data_dir, 'train')}: classes {other[:40]!r} and {name[:40]!r} differ only "
                            "in the spaces around them (a space after a comma?); write each label one way")


def check_rare_classes(data_dir: str, labels: list[str], min_count: int) -> None:
    """A training class seen fewer than data.min_class_count times, among classes of 10 rows or more on average,
    is most likely a stray label (a `7` among 0s and 1s) that would silently add a class: refused in one line."""
    if min_count < 1:
        raise ConfigError(f"data.min_class_count: must be >= 1, got {min_count}")
    counts = Counter(labels)
    if len(counts) == 1:  # (its loss is 0 from the first step: nothing to learn, every answer the same)
        raise DataError(f"{find_split(data_dir, 'train')}: one class ({labels[0][:40]!r}) in every row; a classifier "
                        "needs two or more")
    if len(labels) < 10 * len(counts):  # a tiny file: every class is rare
        return
    name, n = min(counts.items(), key=lambda item: (item[1], item[0]))
    if n < min_count:
        raise DataError(f"{find_split(data_dir, 'train')}: class {name[:40]!r} appears {n} time{'s' * (n != 1)} "
                        f"among {len(labels)} rows (data.min_class_count={min_count}); fix its label{'s' * (n != 1)}, "
                        "or set data.min_class_count: 1 to train it as a class")


def check_words(data, texts: list[str], words) -> None:
    """A tokenizer blind to the texts' script (csv_text's words() keeps a-z, 0-9 and ') trains on unknown words
    without a word said. Where it drops over a tenth of the letters: refused when most texts with letters give it no
    word at all, else a note (accents: café is caf)."""
    joined = " ".join(texts)
    if joined.isascii():  # (the common case, at once: words() keeps every a-z)
        return
    letters = sum(map(str.isalpha, joined))  # any script's
    dropped = letters - sum(map(str.isalpha, "".join(words(joined))))
    if dropped * 10 <= letters:
        return
    path = find_split(data.data_dir, "train") or "the training texts"
    lettered = [t for t in texts if any(map(str.isalpha, t))]
    empty = [t for t in lettered if not words(t)]
    if len(empty) * 2 > len(lettered):
        raise DataError(f"{path}: {len(empty)} of its {len(lettered)} texts with letters give no word to words() in "
                        f"tasks/csv_text.py (it keeps runs of a-z, 0-9 and ', e.g. none of {empty[0][:40]!r}): they "
                        "would all be one unknown word; edit words() for your language")
    kept = set("".join(words(joined)))
    example = next(c for c in joined if c.isalpha() and c.lower() not in kept)
    note(f"{path}: words() in tasks/csv_text.py drops {dropped} of the texts' {letters} letters "
         f"({dropped / letters:.0%}; it keeps a-z, 0-9 and ', e.g. not {example!r}); edit it for your language")


def find_split(data_dir: str, split: str) -> Optional[str]:
    """The one file (or save_to_disk folder) of `split` in data_dir, or None. data_dir a file: the training rows."""
    if os.path.isfile(data_dir):  # (csv_text cuts its dev split off them: data.dev_fraction)
        return data_dir if split == "train" and os.path.splitext(data_dir)[1] in READERS else None
    names = SPLIT_NAMES[split]
    found = [name + ext for name in names for ext in READERS if os.path.isfile(os.path.join(data_dir, name + ext))]
    found += [name + "/" for name in names if os.path.isfile(os.path.join(data_dir, name, "state.json"))]
    if len(found) > 1:
        raise DataError(f"{data_dir}: the {split} split is in {' and '.join(found)}; keep one of them (the format "
                        "is found from the name)")
    return os.path.join(data_dir, found[0].rstrip("/")) if found else None


def checked(path: str, rows: Rows, columns: tuple[str, str]) -> tuple[list[str], list[str]]:
    """The one place rows are validated, whatever their format: a text is a string (bytes must be UTF-8), a label
    a non-blank name or a whole number (kept as its digits, so `1` in JSON equals `1` in CSV)."""
    texts, labels = [], []
    for text, label, where in rows:
        at = f"{path}{where}"
        text = utf8(text, at, columns[0]) if isinstance(text, bytes) else text  # a parquet binary column
        label = utf8(label, at, columns[1]) if isinstance(label, bytes) else label
        if not isinstance(text, str):
            raise DataError(f"{at}: {columns[0]} is {shown(text)}; every row needs a text (an empty one will do)")
        if isinstance(label, int) and not isinstance(label, bool):
            label = str(label)
        if label is None or (isinstance(label, str) and not label.strip()):
            raise DataError(f"{at}: empty {columns[1]}; every row needs one")
        if not isinstance(label, str):
            raise DataError(f"{at}: {columns[1]} is {shown(label)}; a label is a name or a whole number")
        texts.append(text)
        labels.append(label)
    if not texts:
        raise DataError(f"{path}: no rows")
    return texts, labels


class MissingColumn(DataError):
    """need_columns' DataError; `found`: the columns the file has (text_stream then tries the task's own name)."""

    def __init__(self, message: str, found: list):
        super().__init__(message)
        self.found = found


def need_columns(at: str, found: list, columns: tuple[str, str]) -> None:
    """A missing column is a DataError naming the columns the file has, and the key that names ours."""
    for key, what, column in zip(("data.text_column", "data.label_column"), ("texts", "labels"), columns):
        if column not in found:
            listed = ", ".join(map(str, found[:20])) + (", ..." if len(found) > 20 else "")
            raise MissingColumn(f"{at}: no column {column!r} (columns found: {listed or 'none'}); set {key} to the "
                                f"one that holds the {what}", list(found))


def shown(value) -> str:
    return "null" if value is None else repr(value)[:40]


def utf8(data: bytes, at: str, column: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{at}: {column} is not valid UTF-8 (byte 0x{data[e.start]:02x} at character "
                        f"{len(data[:e.start].decode())+1}); the file must hold UTF-8 text") from None


# ---------------------------------------------------------------------------------------------------------------
# The formats: each yields (text, label, where) and raises a DataError for what only it can get wrong.
# -----> another format: a function (path, columns) -> rows, under its file name ending in READERS below
# ---------------------------------------------------------------------------------------------------------------
def csv_rows(path: str, columns: tuple[str, str], tsv: bool = False) -> Rows:
    """A CSV (or TSV) file's rows, the first one its header; where: the row's first line."""
    text = read_utf8(path)  # the whole file decoded at once: a bad byte is a DataError naming its line
    quoting = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tsv else {}
    header = None
    for line, row in csv_records(path, csv.reader(io.StringIO(text, newline=""), strict=True, **quoting), tsv):
        if header is None:
            refuse_other_separator(f"{path}:{line}", row, columns, tsv)
            need_columns(f"{path}:{line}", row, columns)
            header, where = row, [row.index(c) for c in columns]
        elif len(row) != len(header):
            raise DataError(f"{path}:{line}: {len(row)} field{'s' * (len(row) != 1)} but the header has "
                            f"{len(header)} ({','.join(header)}); " +
                            ("a text may not hold a tab" if tsv else "quote a text that holds a comma"))
        else:
            yield row[where[0]], row[where[1]], f":{line}"


def refuse_other_separator(at: str, header: list[str], columns: tuple[str, str], tsv: bool) -> None:
    """A header read as one field that holds another separator (Excel's `;` in many languages, tabs in a .csv):
    said so, not 'set data.text_column' to the whole line."""
    others = (",", ";", "|") if tsv else (";", "\t", "|")
    separator = next((s for s in others if len(header) == 1 and s in header[0]), None)
    if separator is None or header[0] in columns:
        return
    fix = {",": "name it .csv", "\t": "name it .tsv"}.get(separator, "save it with commas (Excel: CSV UTF-8)")
    raise DataError(f"{at}: the header {header[0][:60]!r} is one field: the file is separated by {separator!r}, not "
                    f"{'tabs' if tsv else 'commas'}; {fix}")


def csv_records(path: str, reader, tsv: bool) -> Iterator[tuple[int, list[str]]]:
    """(first line, fields) of each non-blank row; a row the csv module cannot parse is a DataError naming it."""
    line = 1
    try:
        for row in reader:
            if row:  # blank lines carry nothing
                yield line, row
            line = reader.line_num + 1
    except csv.Error as e:
        if "unexpected end of data" in str(e):
            why = "a quote opened in this row is never closed; close it"
        elif "field larger than field limit" in str(e):
            why = f"a field longer than {csv.field_size_limit()} characters: " + (
                "a text to cut" if tsv else "a quote never closed, or a text to cut")
        else:
            why = f"not valid CSV ({e}); quote a text that holds a comma, quote or line break"
        raise DataError(f"{path}:{line}: {why}" + ("" if tsv else " (\"\" inside quotes is one quote)")) from None


def tsv_rows(path: str, columns: tuple[str, str]) -> Rows:
    return csv_rows(path, columns, tsv=True)


def jsonl_rows(path: str, columns: tuple[str, str]) -> Rows:
    """A JSON lines file's rows: one object per line (blank lines skipped); where: the line. Read a line at a time."""
    lines = utf8_lines(path)
    head = []  # the blank lines before the first value, and that value's line
    for line in lines:
        head.append(line)
        if line.strip():
            break
    if head and head[-1].lstrip().startswith("["):
        raise DataError(f"{path}: a JSON array; write JSON lines, one object per line (pandas: "
                        "to_json(path, orient='records', lines=True); datasets: to_json(path))")
    for line, record in json_lines(path, lines=itertools.chain(head, lines)):
        if not isinstance(record, dict):
            raise DataError(f"{path}:{line}: {shown(record)} is not an object; JSON lines hold one object per line")
        need_columns(f"{path}:{line}", list(record), columns)
        yield record[columns[0]], record[columns[1]], f":{line}"


def parquet_rows(path: str, columns: tuple[str, str]) -> Rows:
    import pyarrow.parquet as pq

    def batches():
        file = pq.ParquetFile(path)
        yield file.schema_arrow
        yield from file.iter_batches(batch_size=256,  # (its default, 65536 rows: many chunks of mode predict's)
                                     columns=[c for c in dict.fromkeys(columns) if c in file.schema_arrow.names])
    return table_rows(path, batches, columns)


def folder_rows(path: str, columns: tuple[str, str]) -> Rows:
    """A save_to_disk folder's rows: its state.json lists the Arrow stream files, in the dataset's order."""
    import pyarrow as pa
    state_path = os.path.join(path, "state.json")
    try:
        files = [os.path.join(path, f["filename"]) for f in json.loads(read_utf8(state_path))["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{state_path}: not the state.json of datasets' save_to_disk (no _data_files list)") \
            from None

    def batches():
        if not files:
            yield pa.schema([])
        for i, file in enumerate(files):
            with pa.OSFile(file) as source:  # read, not mapped: nothing stays mapped to the files
                reader = pa.ipc.open_stream(source)
                if i == 0:
                    yield reader.schema
                yield from reader
    return table_rows(path, batches, columns)


def table_rows(path: str, batches, columns: tuple[str, str]) -> Rows:
    """The rows of the Arrow record batches `batches()` yields after their schema (where: `[i]`), a batch at a
    time; ClassLabel ids become their names."""
    import pyarrow as pa
    i = 0
    try:
        stream = batches()
        schema = next(stream)
        need_columns(path, schema.names, columns)
        names = class_names(schema, columns[1])
        for batch in stream:
            texts = batch.column(columns[0]).to_pylist()
            labels = texts if columns[1] == columns[0] else batch.column(columns[1]).to_pylist()  # (predict's)
            if names is not None:  # -1 (no label, as in GLUE's test splits) becomes None: an empty label
                labels = [names[j] if isinstance(j, int) and 0 <= j < len(names) else None for j in labels]
            for text, label in zip(texts, labels):
                yield text, label, f"[{i}]"
                i += 1
    except (OSError, pa.ArrowException) as e:  # unreadable, truncated, not parquet/Arrow at all
        raise DataError(f"{path}: cannot read it ({' '.join(str(e).split())})") from None


def class_names(schema, column: str) -> Optional[list]:
    """The names of a `datasets` ClassLabel column, which it writes into the schema's metadata; else None."""
    try:
        feature = json.loads(schema.metadata[b"huggingface"])["info"]["features"][column]
    except (TypeError, ValueError, KeyError):
        return None
    return feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None


READERS = {".csv": csv_rows, ".tsv": tsv_rows, ".jsonl": jsonl_rows, ".json": jsonl_rows, ".parquet": parquet_rows}


# ---- mode: predict's texts (extras/predict.py): no labels --------------------------------------------------------
TEXT_FILES = (".csv", ".tsv", ".txt", ".jsonl", ".json", ".parquet")


def in_chunks(items: Iterable, size: Optional[int]) -> Iterator[list]:
    """`items` as lists of `size` (None: one list of all): predict_chunks' pieces; no items give one empty list."""
    items = iter(items)
    chunk = list(itertools.islice(items, size))
    yield chunk
    while size is not None and len(chunk) == size:
        chunk = list(itertools.islice(items, size))
        if chunk:
            yield chunk


class EncodedLazily:
    """A chunk's inputs as a Dataset whose items are encoded as a loader reads them: under ddp a rank encodes only
    the inputs it predicts (encoded whole, every rank did the whole chunk's work, and more ranks were no faster)."""

    def __init__(self, inputs: list, encode: Callable):
        self.inputs, self.encode = inputs, encode

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int):
        try:
            return self.encode(self.inputs[i])
        except DataError as e:  # (an unreadable image): one line, in a loader worker (data.num_workers) too
            raise UnreadableInput(str(e)) from None


class UnreadableInput(DataError):
    """An input's DataError raised in a loader worker, which torch raises again in the rank as this class of its own
    traceback around the message: the message alone is kept (its last line, after the class's name)."""

    def __init__(self, message: str):
        super().__init__(message.rstrip().rsplit(f"{__name__}.{type(self).__name__}: ", 1)[-1])


def text_stream(path: str, text_column: str, own_column: Optional[str] = None) -> Iterator[str]:
    """The texts of a file in a split's format (its `text_column`; a CSV/TSV's only column too; a `datasets`
    save_to_disk folder) or a text file (one per line; blank lines skipped), decoded and parsed as a split is read (a
    byte-order mark dropped; TSV unquoted), so that a text predicted is the text training would have read there.
    One at a time: the text formats are read a line at a time, parquet and Arrow a record batch at a time (mode
    predict's memory is its chunk's, whatever the file's size). own_column: the task's own name for its texts (sst2:
    `sentence`), read from a file without `text_column`."""
    folder = os.path.isfile(os.path.join(path, "state.json"))
    if not folder and not (os.path.isfile(path) and path.lower().endswith(TEXT_FILES)):
        raise DataError(f"predict.input: {path} is not a file of texts ({', '.join(TEXT_FILES)}) nor a datasets "
                        "save_to_disk folder")
    ext = os.path.splitext(path.lower())[1]
    if ext in (".csv", ".tsv"):
        yield from csv_texts(path, text_column, tsv=ext == ".tsv", own_column=own_column)
        return
    if ext == ".txt":
        yield from (line for line in utf8_lines(path) if line.strip())  # a bad byte: DataError, file:line
        return
    reader = folder_rows if folder else READERS[ext]  # JSON lines, parquet, a save_to_disk folder: the split's
    rows = reader(path, (text_column, text_column))  # reader, the text column read as both
    try:
        first = list(itertools.islice(rows, 1))
    except MissingColumn as e:  # (its first row: the file has no such column)
        if own_column not in e.found:
            raise
        rows, text_column, first = reader(path, (own_column, own_column)), own_column, []
    for text, _, where in itertools.chain(first, rows):
        text = utf8(text, f"{path}{where}", text_column) if isinstance(text, bytes) else text
        if not isinstance(text, str):
            raise DataError(f"predict.input: {path}{where}: {text_column} is {shown(text)}; every row needs a text")
        yield text


def csv_texts(path: str, text_column: str, tsv: bool, own_column: Optional[str] = None) -> Iterator[str]:
    lines = (line + "\n" for line in utf8_lines(path))  # a bad byte: a DataError naming the file and line
    quoting = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tsv else {}
    records = csv_records(path, csv.reader(lines, strict=True, **quoting), tsv)
    first = next(records, None)
    if first is None:
        raise DataError(f"predict.input: {path} is empty")
    header = first[1]
    if len(header) == 1 and any(text_column in header[0].split(s) for s in (",", ";", "\t", "|")):
        refuse_other_separator(f"{path}:{first[0]}", header, (text_column, text_column), tsv)  # (`id;text`)
    if text_column in header:
        column = header.index(text_column)
    elif own_column in header:
        column = header.index(own_column)
    elif len(header) == 1:  # its one column: the first line is its header, whatever it says, as for a split
        column = 0
        note(f"predict.input: {path}: its first line, {header[0][:60]!r}, is read as the header of its one column "
             f"(data.text_column is {text_column!r}), not as a text; texts without a header: a .txt file, one a line")
    else:
        also = f" nor {own_column!r}" if own_column else ""
        raise DataError(f"predict.input: {path} has no column {text_column!r} (data.text_column){also} among "
                        f"{', '.join(header)[:80]}")
    for line, row in records:  # a field more or less: an unquoted comma cut the text there, as csv_rows refuses
        if len(row) != len(header):
            raise DataError(f"predict.input: {path}:{line}: {len(row)} field{'s' * (len(row) != 1)} but the header "
                            f"has {len(header)} ({','.join(header)[:60]}); " +
                            ("a text may not hold a tab" if tsv else "quote a text that holds a comma"))
        yield row[column]
