"""csv_text's classes (tasks/table_files.check_classes): the plan lists them with their counts, and a training class
seen fewer than data.min_class_count times among common ones (a stray `7` among 0s and 1s) is refused in one line
naming the class, its count and the file, unless data.min_class_count: 1 asks for it."""
import pytest

import main
from core.errors import DataError
from conftest import make_config
from tasks.table_files import check_classes

TRAIN = {"max_steps": 1, "epochs": 0, "eval_every": 0, "save_every": 0, "batch_size": 4}


def write_data(folder, labels):
    folder.mkdir()
    (folder / "train.csv").write_text("text,label\n" + "".join(f"text number {i},{y}\n" for i, y in enumerate(labels)))
    (folder / "dev.csv").write_text("text,label\na text,0\nanother,1\n")
    return folder


def test_a_stray_label_is_refused_in_one_line(tmp_path, capsys):
    data = write_data(tmp_path / "data", ["0", "1"] * 20 + ["7"])
    assert main.run(make_config(tmp_path / "run", task="csv_text", data={"data_dir": str(data)}, train=TRAIN)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"error: {data / 'train.csv'}: class '7' appears 1 time among 41 rows") and \
        "data.min_class_count=2" in err and "data.min_class_count: 1" in err, err


def test_the_plan_lists_the_classes_and_min_count_1_trains_a_rare_one(tmp_path, capsys):
    data = write_data(tmp_path / "data", ["0", "1"] * 20 + ["7"])
    assert main.run(make_config(tmp_path / "run", task="csv_text", data={"data_dir": str(data), "min_class_count": 1},
                                train=TRAIN)) == 0
    out = capsys.readouterr().out
    assert f"task csv_text ({data})" in out and "\n  3 classes: 0 20, 1 20, 7 1\n" in out


def test_check_classes_rules():
    class Data:
        data_dir, min_class_count = "nowhere", 3
    assert check_classes(Data, ["a"] * 30 + ["b"] * 3) == "2 classes: a 30, b 3"
    with pytest.raises(DataError, match="class 'b' appears 2 times among 32 rows"):
        check_classes(Data, ["a"] * 30 + ["b"] * 2)
    assert check_classes(Data, ["a", "b", "c"]) == "3 classes: a 1, b 1, c 1"  # a tiny file: every class is rare
    with pytest.raises(DataError, match=r"one class \('a'\) in every row; a classifier needs two or more"):
        check_classes(Data, ["a"] * 30)  # (its loss would be 0 from the first step)
    # `pos` and ` pos` (a space after the comma in some rows) were two classes without a word
    with pytest.raises(DataError, match=r"classes 'pos' and ' pos' differ only in the spaces around them"):
        check_classes(Data, ["pos", "neg"] * 15 + [" pos"] * 15)
    assert check_classes(Data, [" pos", " neg"] * 15) == "2 classes:  pos 15,  neg 15"  # one way throughout: as written
    many = check_classes(Data, [f"class-{i}" for i in range(40) for _ in range(10)])
    assert many.startswith("40 classes: class-0 10, ") and many.endswith(", ...") and len(many) < 100


def test_the_plans_classes_line_of_any_classifier_is_cut_between_names_as_csv_texts_is():
    from tasks.base import Task

    class Classifier(Task):
        classes = [f"class-{i}" for i in range(40)]
    note = Classifier(cfg=None).classes_note()
    assert note.startswith("40 classes: class-0, class-1, ") and note.endswith(", ...") and len(note) < 100
    assert all(name.startswith("class-") and name[6:].isdigit() for name in note[12:-5].split(", ")), note
    assert Classifier.__base__(cfg=None).classes_note() is None  # no classes: no line
