"""Your own classification data in the common formats (issue 21, item 7): CSV, TSV, JSON lines, parquet and
`datasets` save_to_disk folders (one per split, or a DatasetDict's) give csv_text the same datasets for the same
rows, with the text and label columns named in config; every format's mistakes are one DataError line naming the
file and the row (tasks/table_files.py). The folders and parquet files are written by the real `datasets` and
pyarrow; the tests make their own small data.
"""
import csv
import json
import re

import pytest

from conftest import logged, make_config

import main
from core.errors import DataError
from wiring import build_task

ROWS = {  # split: (sentence, sentiment) rows; texts with commas, quotes, accents, an empty one
    "train": [("A fine, \"moving\" film", "pos"), ("awful", "neg"), ("", "neg"), ("café crème, superb", "pos"),
              ("dull plot", "neg"), ("great cast", "pos")],
    "dev": [("fine acting", "pos"), ("boring", "neg"), ("a dull unseen plot", "neg")],
    "test": [("superb", "pos"), ("awful plot", "neg")],
}
COLUMNS = {"text_column": "sentence", "label_column": "sentiment"}


def write(folder, fmt, split, rows, columns=("idx", "sentence", "sentiment")):
    """`rows` (sentence, sentiment) as data.data_dir's `split` in format `fmt`, with an extra `idx` column first."""
    folder.mkdir(parents=True, exist_ok=True)
    table = {c: list(values) for c, values in zip(columns, zip(*[(i, *r) for i, r in enumerate(rows)]))}
    if fmt == "csv":
        with open(folder / f"{split}.csv", "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([columns, *zip(*table.values())])
    elif fmt == "tsv":  # no quoting: fields as they are, tabs between them
        with open(folder / f"{split}.tsv", "w", encoding="utf-8") as f:
            f.writelines("\t".join(map(str, values)) + "\n" for values in [columns, *zip(*table.values())])
    elif fmt == "jsonl":
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(dict(zip(columns, values)), ensure_ascii=False) + "\n" for values in zip(*table.values()))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table(table), folder / f"{split}.parquet")
    elif fmt == "save_to_disk":
        from datasets import Dataset
        Dataset.from_dict(table).save_to_disk(str(folder / split))
    else:
        raise ValueError(fmt)


def write_dataset_dict(folder):
    """ROWS as one DatasetDict folder, its dev split named `validation` and its labels a ClassLabel (ids on disk)."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
    features = Features({"sentence": Value("string"), "sentiment": ClassLabel(names=["neg", "pos"])})
    DatasetDict({"validation" if split == "dev" else split: Dataset.from_dict(
        {"sentence": [t for t, _ in rows], "sentiment": [["neg", "pos"].index(y) for _, y in rows]},
        features=features) for split, rows in ROWS.items()}).save_to_disk(str(folder), num_shards={"train": 2})


def config(tmp_path, folder, **data):
    return make_config(tmp_path / "run", task="csv_text", data={"data_dir": str(folder), **COLUMNS, **data},
                       model={"hidden": 16})


def built(tmp_path, folder):
    task = build_task(config(tmp_path, folder))
    return task.build_datasets(), task.classes, task.vocab


FORMATS = ["csv", "tsv", "jsonl", "parquet", "save_to_disk"]


def test_every_format_gives_the_same_datasets(tmp_path):
    results = {}
    for fmt in FORMATS:
        for split, rows in ROWS.items():
            write(tmp_path / fmt, fmt, split, rows)
        results[fmt] = built(tmp_path, tmp_path / fmt)
    write_dataset_dict(tmp_path / "dataset_dict")
    results["dataset_dict"] = built(tmp_path, tmp_path / "dataset_dict")
    datasets, classes, vocab = results["csv"]
    assert classes == ["neg", "pos"] and len(datasets["train"]) == 6 and len(datasets["test"]) == 2
    assert datasets["dev"][2] == {"ids": [vocab["a"], vocab["dull"], 1, vocab["plot"]], "labels": 0}  # `unseen` is not in train
    assert datasets["train"][2]["ids"] == [1]  # the empty text: one unknown word
    for fmt, result in results.items():
        assert result == results["csv"], fmt


def test_the_texts_and_labels_read_are_the_rows_written(tmp_path):
    write(tmp_path, "parquet", "train", ROWS["train"])
    task = build_task(config(tmp_path, tmp_path))
    assert task.read("train") == tuple(map(list, zip(*ROWS["train"])))
    assert task.read("test") is None


def test_whole_number_labels_equal_the_same_digits_in_csv(tmp_path):
    numbered = {split: [(t, ["neg", "pos"].index(y)) for t, y in rows] for split, rows in ROWS.items()}
    for fmt in ("jsonl", "parquet", "csv"):
        for split, rows in numbered.items():
            write(tmp_path / fmt, fmt, split, rows)
    assert built(tmp_path, tmp_path / "jsonl") == built(tmp_path, tmp_path / "parquet") == \
        built(tmp_path, tmp_path / "csv")
    assert build_task(config(tmp_path, tmp_path / "jsonl")).read("dev")[1] == ["1", "0", "0"]


def test_default_columns_are_text_and_label(tmp_path):
    write(tmp_path, "jsonl", "train", ROWS["train"], columns=("idx", "text", "label"))
    task = build_task(make_config(tmp_path / "run", task="csv_text", data={"data_dir": str(tmp_path)}))
    assert task.read("train")[1] == [y for _, y in ROWS["train"]]


# ---------------------------------------------------------------------------------------------------------------
# Mistakes: one line, naming the file and the row (`:LINE` in text files, `[i]` in tables)
# ---------------------------------------------------------------------------------------------------------------
def bad_train(tmp_path, fmt, rows=None, columns=("idx", "sentence", "sentiment")):
    """A data_dir whose train split (format `fmt`) holds `rows`, beside a good dev.csv; returns train's path."""
    write(tmp_path, "csv", "dev", ROWS["dev"])
    write(tmp_path, fmt, "train", ROWS["train"] if rows is None else rows, columns)
    return str(tmp_path / ("train" if fmt == "save_to_disk" else f"train.{fmt}"))


def error(tmp_path) -> str:
    with pytest.raises(DataError) as caught:
        build_task(config(tmp_path, tmp_path)).build_datasets()
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def where(fmt, row) -> str:
    """How messages name the 0-based `row`: the line in text files (CSV and TSV have a header line), `[row]` else."""
    return {"csv": f":{row + 2}", "tsv": f":{row + 2}", "jsonl": f":{row + 1}"}.get(fmt, f"[{row}]")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_missing_column_names_the_columns_found(tmp_path, fmt):
    path = bad_train(tmp_path, fmt, columns=("idx", "sentence", "stars"))
    where = ":1" if fmt in ("csv", "tsv", "jsonl") else ""  # the header, the first object, the table
    assert error(tmp_path) == (f"{path}{where}: no column 'sentiment' (columns found: idx, sentence, stars); set "
                               "data.label_column to the one that holds the labels")


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_label_names_its_row(tmp_path, fmt):
    rows = [("good", "pos"), ("no label", "" if fmt in ("csv", "tsv") else None), ("bad", "neg")]
    path = bad_train(tmp_path, fmt, rows)
    assert error(tmp_path) == f"{path}{where(fmt, 1)}: empty sentiment; every row needs one"


def test_a_datasets_classlabel_without_label_is_empty(tmp_path):
    from datasets import ClassLabel, Dataset, Features, Value
    write(tmp_path, "csv", "dev", ROWS["dev"])
    Dataset.from_dict({"sentence": ["a", "b"], "sentiment": [1, -1]}, features=Features(
        {"sentence": Value("string"), "sentiment": ClassLabel(names=["neg", "pos"])})).save_to_disk(
        str(tmp_path / "train"))
    assert error(tmp_path) == f"{tmp_path / 'train'}[1]: empty sentiment; every row needs one"


def test_a_test_split_without_any_label_is_skipped_with_a_note(tmp_path, capsys):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
    features = Features({"sentence": Value("string"), "sentiment": ClassLabel(names=["neg", "pos"])})
    splits = {"train": [1, 0], "validation": [0, 1], "test": [-1, -1]}  # GLUE's test splits hide their labels
    DatasetDict({split: Dataset.from_dict({"sentence": ["a", "b"], "sentiment": labels}, features=features)
                 for split, labels in splits.items()}).save_to_disk(str(tmp_path))
    datasets = build_task(config(tmp_path, tmp_path)).build_datasets()
    assert datasets["test"] is None and len(datasets["dev"]) == 2
    assert f"{tmp_path / 'test'}: no labels (as in GLUE's test splits): skipped" in capsys.readouterr().out
    write(tmp_path / "some", "csv", "train", ROWS["train"])
    write(tmp_path / "some", "csv", "dev", ROWS["dev"])
    write(tmp_path / "some", "csv", "test", [("a", "pos"), ("b", "")])  # some labels: the empty one is a mistake
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'some' / 'test.csv'}:3: empty sentiment")):
        build_task(config(tmp_path, tmp_path / "some")).build_datasets()


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_a_bad_encoding_names_the_line(tmp_path, fmt):
    path = bad_train(tmp_path, fmt)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data.replace("café".encode(), b"caf\xe9"))
    column = {"csv": 7, "tsv": 6, "jsonl": 28}[fmt]  # the `é` of row 3's `café` (after `3,"`, `3<TAB>`, `{"idx"...`)
    assert error(tmp_path) == (f"{path}{where(fmt, 3)}: not valid UTF-8 (byte 0xe9 at column {column}); the file "
                               "must be saved as UTF-8")


def test_bad_utf8_bytes_in_a_parquet_column_name_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    write(tmp_path, "csv", "dev", ROWS["dev"])
    pq.write_table(pa.table({"sentence": [b"fine", b"caf\xe9"], "sentiment": ["pos", "neg"]}),
                   tmp_path / "train.parquet")
    assert error(tmp_path) == (f"{tmp_path / 'train.parquet'}[1]: sentence is not valid UTF-8 (byte 0xe9 at "
                               "character 4); the file must hold UTF-8 text")


@pytest.mark.parametrize("fmt", ["parquet", "save_to_disk"])
def test_an_unreadable_table_is_one_line(tmp_path, fmt):
    path = bad_train(tmp_path, fmt)
    target = path if fmt == "parquet" else f"{path}/data-00000-of-00001.arrow"
    with open(target, "rb") as f:
        data = f.read()
    with open(target, "wb") as f:
        f.write(data[:len(data) // 2])  # cut short, as by a full disk or an interrupted copy
    assert error(tmp_path).startswith(f"{path}: cannot read it (")


@pytest.mark.parametrize("content, says", [
    (b'{"sentence": "a", "sentiment": "pos"}\n{"sentence": "b", "sentiment": pos}\n', ":2: not valid JSON at column 32 "
                                                                                       "(Expecting value); JSON lines hold one value per line"),
    (b'{"sentence": "a", "sentiment": 0.5}\n', ":1: sentiment is 0.5; a label is a name or a whole number"),
    (b'{"sentence": "a", "sentiment": "pos"}\n\n{"sentence": null, "sentiment": "neg"}\n',
     ":3: sentence is null; every row needs a text (an empty one will do)"),
    (b'["a", "pos"]\n', ": a JSON array; write JSON lines, one object per line (pandas: to_json(path, "
                        "orient='records', lines=True); datasets: to_json(path))"),
    (b'"a"\n', ':1: \'a\' is not an object; JSON lines hold one object per line'),
    (b"", ": no rows"),
])
def test_json_lines_mistakes(tmp_path, content, says):
    write(tmp_path, "csv", "dev", ROWS["dev"])
    (tmp_path / "train.jsonl").write_bytes(content)
    assert error(tmp_path) == f"{tmp_path / 'train.jsonl'}{says}"


def test_two_files_for_one_split_are_refused(tmp_path):
    write(tmp_path, "csv", "train", ROWS["train"])
    write(tmp_path, "jsonl", "train", ROWS["train"])
    write(tmp_path, "csv", "dev", ROWS["dev"])
    write(tmp_path, "parquet", "validation", ROWS["dev"])
    assert error(tmp_path) == (f"{tmp_path}: the train split is in train.csv and train.jsonl; keep one of them (the "
                               "format is found from the name)")
    (tmp_path / "train.csv").unlink()
    assert error(tmp_path).startswith(f"{tmp_path}: the dev split is in dev.csv and validation.parquet; keep one")


def test_no_train_split_names_the_formats(tmp_path):
    write(tmp_path, "csv", "dev", ROWS["dev"])
    assert error(tmp_path) == (f"data.data_dir={str(tmp_path)!r} needs a train file, and a dev file or "
                               "data.dev_fraction > 0 (.csv, .tsv, .jsonl, .json, .parquet, or a datasets "
                               "save_to_disk folder; dev may be named validation)")


def test_one_column_for_texts_and_labels_is_a_config_error(tmp_path):
    from core.errors import ConfigError
    with pytest.raises(ConfigError, match="data.label_column"):
        config(tmp_path, tmp_path, text_column="x", label_column="x")


def test_a_dev_or_test_label_no_training_row_has_names_its_file_and_row(tmp_path):
    """`02` beside `2`, `Pos` beside `pos`: scored wrong every time, so refused naming the file and its first row
    (train's row when data.dev_fraction cut dev off it and all of that label's rows went to dev)."""
    numbered = [(t, ["neg", "pos"].index(y)) for t, y in ROWS["train"]]
    write(tmp_path / "dev", "jsonl", "train", numbered)
    write(tmp_path / "dev", "csv", "dev", [("fine", "1"), ("boring", "02"), ("dull", "02")])
    assert error_in(tmp_path, tmp_path / "dev") == (f"{tmp_path / 'dev' / 'dev.csv'}:3: label '02' is in no "
                                                    "training row; the training classes are 0, 1")
    write(tmp_path / "test", "csv", "train", ROWS["train"])
    write(tmp_path / "test", "csv", "dev", ROWS["dev"])
    write(tmp_path / "test", "parquet", "test", [("superb", "pos"), ("awful", "Neg")])
    assert error_in(tmp_path, tmp_path / "test") == (f"{tmp_path / 'test' / 'test.parquet'}[1]: label 'Neg' is in "
                                                      "no training row; the training classes are neg, pos")
    write(tmp_path / "cut", "csv", "train", ROWS["train"] + [("meh", "mixed")])  # its one row: dev's (seed 0)
    assert error_in(tmp_path, tmp_path / "cut", dev_fraction=0.5) == (
        f"{tmp_path / 'cut' / 'train.csv'}:8: label 'mixed' is in no training row (data.dev_fraction put all its "
        "rows into the dev split); the training classes are neg, pos")


def test_texts_whose_letters_words_drops_are_refused_or_noted(tmp_path, capsys):
    """words() keeps runs of a-z, 0-9 and ': Russian reviews became one unknown word each, trained to chance without a
    word; Czech ones lose a share of their letters (a note)."""
    russian = [("Отличный фильм", "pos"), ("Ужасно скучно", "neg"), ("Прекрасная игра", "pos"), ("Плохой сюжет", "neg")]
    write(tmp_path / "ru", "csv", "train", russian + [("great", "pos"), ("", "neg")])
    write(tmp_path / "ru", "csv", "dev", ROWS["dev"])
    assert error_in(tmp_path, tmp_path / "ru") == (
        f"{tmp_path / 'ru' / 'train.csv'}: 4 of its 5 texts with letters give no word to words() in tasks/csv_text.py "
        "(it keeps runs of a-z, 0-9 and ', e.g. none of 'Отличный фильм'): they would all be one unknown word; "
        "edit words() for your language")
    czech = [("Skvělý film, úžasně zahrané", "pos"), ("Příšerně nudný děj", "neg"), ("Krásná hudba", "pos"),
             ("Špatný konec", "neg")]
    write(tmp_path / "cs", "csv", "train", czech)
    write(tmp_path / "cs", "csv", "dev", ROWS["dev"])
    capsys.readouterr()
    build_task(config(tmp_path, tmp_path / "cs")).build_datasets()
    assert (f"{tmp_path / 'cs' / 'train.csv'}: words() in tasks/csv_text.py drops 16 of the texts' 61 letters "
            "(26%; it keeps a-z, 0-9 and ', e.g. not 'ě'); edit it for your language") in capsys.readouterr().out
    write(tmp_path / "en", "csv", "train", ROWS["train"])  # (café crème: 2 of 90, no note)
    write(tmp_path / "en", "csv", "dev", ROWS["dev"])
    build_task(config(tmp_path, tmp_path / "en")).build_datasets()
    assert "words()" not in capsys.readouterr().out


def error_in(tmp_path, folder, **data) -> str:
    with pytest.raises(DataError) as caught:
        build_task(config(tmp_path, folder, **data)).build_datasets()
    return str(caught.value)


def test_a_mistake_through_main_is_one_line_and_exit_2(tmp_path, capsys):
    path = bad_train(tmp_path, "parquet", [("good", "pos"), ("bad", None)])
    assert main.run(config(tmp_path, tmp_path)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"error: {path}[1]: empty sentiment; every row needs one"], err


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_runs_on_json_lines_and_parquet_train_alike(tmp_path):
    losses = {}
    for fmt in ("jsonl", "parquet"):
        for split, rows in ROWS.items():
            write(tmp_path / fmt, fmt, split, rows * 4)
        out = tmp_path / f"run-{fmt}"
        cfg = make_config(out, task="csv_text", data={"data_dir": str(tmp_path / fmt), **COLUMNS},
                          model={"hidden": 16}, train={"max_steps": 4, "epochs": 0, "batch_size": 8, "lr": 0.05,
                                                       "eval_every": 2, "save_every": 4, "log_every": 1})
        assert main.run(cfg) == 0
        losses[fmt] = logged(out, "loss")
        assert (out / "checkpoints" / "step-4").is_dir()
    assert len(losses["jsonl"]) == 4 and losses["jsonl"] == losses["parquet"]
    assert losses["jsonl"][-1] < losses["jsonl"][0]


def read_texts(path: str, text_column: str) -> list[str]:
    """mode predict's texts of a file, all of them (text_stream streams them)."""
    from tasks.table_files import text_stream
    return list(text_stream(path, text_column))


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_predict_reads_a_file_as_training_reads_it(tmp_path, fmt):
    """mode: predict's texts (text_stream) are the texts a split of the same file gives, byte-order mark and quotes
    included: a TSV is not quoted, and Excel's "CSV UTF-8" starts with a BOM."""
    from tasks.table_files import csv_rows
    rows = [("sentence", "sentiment"), ("A fine film", "pos"), ("", "neg"), ('"a great" film', "pos")]
    path = tmp_path / f"train.{fmt}"
    with open(path, "w", newline="", encoding="utf-8-sig") as f:  # CRLF line ends, as Excel writes them
        csv.writer(f, **({"delimiter": "\t", "quoting": csv.QUOTE_NONE, "escapechar": None, "quotechar": None}
                         if fmt == "tsv" else {})).writerows(rows)
    trained = [text for text, _, _ in csv_rows(str(path), ("sentence", "sentiment"), tsv=fmt == "tsv")]
    assert trained == [text for text, _ in rows[1:]]
    assert read_texts(str(path), "sentence") == trained
    (tmp_path / "texts.txt").write_bytes(b"\xef\xbb\xbffirst\r\n\r\nsecond\r\n")
    assert read_texts(str(tmp_path / "texts.txt"), "text") == ["first", "second"]
    # an unquoted comma (a tab in a TSV) in a text: refused as training refuses it, not predicted on its first piece
    sep = "\t" if fmt == "tsv" else ","
    (tmp_path / f"new.{fmt}").write_text(f"text\nfine\ngreat{sep} really great film\n")
    with pytest.raises(DataError, match=re.escape(f"new.{fmt}:3: 2 fields but the header has 1 (text); ")):
        read_texts(str(tmp_path / f"new.{fmt}"), "text")


def test_predict_says_when_a_one_column_file_s_first_line_is_taken_as_its_header(tmp_path, capsys):
    """A one-column CSV of texts without a header lost its first text in silence: the line is still the header (as a
    split's is), and one line quotes it, so a user who meant it as a text sees it."""
    (tmp_path / "new.csv").write_text("a fine film\nawful\n")
    assert read_texts(str(tmp_path / "new.csv"), "text") == ["awful"]
    said = capsys.readouterr().out
    assert "new.csv" in said and "'a fine film'" in said and "header" in said and ".txt" in said
    (tmp_path / "named.csv").write_text("text\na fine film\n")  # its header is data.text_column: nothing to say
    assert read_texts(str(tmp_path / "named.csv"), "text") == ["a fine film"]
    assert capsys.readouterr().out == ""
    (tmp_path / "excel.csv").write_text("id;text\n1;a fine film\n")  # Excel's `;`: read as '1;a fine film', silently
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'excel.csv'}:1: the header 'id;text' is one field: "
                                                  "the file is separated by ';', not commas")):
        read_texts(str(tmp_path / "excel.csv"), "text")


@pytest.mark.parametrize("fmt", FORMATS)
def test_predict_reads_every_format_a_split_is_read_in(tmp_path, fmt):
    """predict.input in any training format (it took .csv, .tsv and .txt only): the texts of its data.text_column, as
    the split reader gives them; a file without that column is one line naming the columns it has."""
    write(tmp_path / "data", fmt, "new", ROWS["train"])
    path = str(tmp_path / "data" / ("new" if fmt == "save_to_disk" else f"new.{fmt}"))
    assert read_texts(path, "sentence") == [text for text, _ in ROWS["train"]]
    with pytest.raises(DataError, match="no column 'text' .*sentence"):
        read_texts(path, "text")
    with pytest.raises(DataError, match=re.escape(f"predict.input: {tmp_path} is not a file of texts (.csv, .tsv")):
        read_texts(str(tmp_path), "text")


def test_a_json_escape_of_half_a_surrogate_pair_is_one_line_naming_its_line(tmp_path):
    """JSON's "\\ud800" (half of an emoji's UTF-16 pair, a text cut inside one) is no character: sst2's predict
    crashed in the tokenizer (a TypeError traceback), csv_text read it silently; now a DataError naming the line,
    for predict.input and a split alike. A whole pair ("\\ud83d\\ude00") is its emoji."""
    from tasks.table_files import jsonl_rows
    path = tmp_path / "new.jsonl"
    path.write_text('{"text": "fine \\ud83d\\ude00", "label": "pos"}\n\n{"text": "cut \\ud83d", "label": "neg"}\n')
    for read in (lambda: read_texts(str(path), "text"), lambda: list(jsonl_rows(str(path), ("text", "label")))):
        with pytest.raises(DataError, match=re.escape(f"{path}:3: ") + r".*\\ud83d.*half of a UTF-16 pair"):
            read()
    path.write_text('{"text": "fine \\ud83d\\ude00", "label": "pos"}\n')
    assert read_texts(str(path), "text") == ["fine \N{GRINNING FACE}"]
