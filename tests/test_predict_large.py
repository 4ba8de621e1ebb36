"""mode: predict on large and repeated inputs (extras/predict.py): read, predicted and written a chunk at a time
(memory bounded whatever the input's size, the rows those of one chunk), into predictions.csv only at the end."""
import itertools
import os
import re
import sys
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from conftest import make_config, tmpfs
import main
from core import checkpoint_io, run_log
from core.distributed import DistContext
from core.errors import DataError, UserError
from extras import predict
from resilience.run_dir import move_run_aside
from resilience.run_dir_lock import hold_output_dir
from tasks import csv_text, image, table_files
from tasks.csv_text import words
from tasks.image import gray_square
from tasks.text_common import read_utf8, utf8_lines
from wiring import build_task

ROWS = [(f"great fine lovely day {i}", "pos") for i in range(30)] + [(f"awful bad sad day {i}", "neg")
                                                                      for i in range(30)]
WORDS = "great fine lovely day awful bad sad the a film not".split()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A csv_text run trained a few steps; its settings, for mode predict."""
    root = tmp_path_factory.mktemp("predict_large")
    (root / "all.csv").write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in ROWS))
    settings = dict(task="csv_text", data={"data_dir": str(root / "all.csv"), "dev_fraction": 0.2},
                    model={"hidden": 16, "dropout": 0.0},
                    train={"max_steps": 20, "epochs": 0, "eval_every": 0, "save_every": 0, "batch_size": 8,
                           "lr": 0.05, "eval_batch_size": 16})
    assert main.run(make_config(root / "run", **settings)) == 0
    return root, settings


def texts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(1 + i % 9)) for i in range(n)]


def predicted(root, settings, path, **predict_settings) -> int:
    return main.run(make_config(root / "run", **settings, mode="predict",
                                predict={"input": str(path), "top_k": 2, **predict_settings}))


def test_predict_streams_its_inputs_with_the_rows_of_one_chunk(run, monkeypatch):
    """Predict read every input before the first, and held every row: 300k lines took ~280 MB, 10M ran out of
    memory. Now a chunk at a time: the rows are those of one chunk (a CSV with a BOM and CRLF, JSON lines, a .txt),
    and the peak memory of a file 4 times longer is about the same (a .txt, a parquet file)."""
    root, settings = run
    lines = texts(300)
    (root / "new.csv").write_bytes(("\ufefftext,id\r\n" + "".join(f'"{t}",{i}\r\n' for i, t in enumerate(lines)))
                                   .encode())
    (root / "new.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in lines))
    (root / "new.txt").write_text("\n".join(lines))
    for name in ("new.csv", "new.jsonl", "new.txt"):
        written = []
        for chunk in (10 ** 9, 40):  # all in one (as before chunks), then chunks of 32 (2 batches of 16)
            monkeypatch.setattr(predict, "CHUNK", chunk)
            assert predicted(root, settings, root / name) == 0
            written.append((root / "run" / "predictions.csv").read_bytes())
        assert written[0] == written[1] and written[0].count(b"\n") == 301, name
        assert written[0].split(b"\n")[1].startswith(lines[0].encode() + b",")
    monkeypatch.setattr(predict, "CHUNK", 256)
    load = checkpoint_io.load_verified  # the peak measured from the model loaded on: the inputs' and rows' memory
    monkeypatch.setattr(checkpoint_io, "load_verified", lambda *a, **k: (load(*a, **k), tracemalloc.reset_peak())[0])
    for name in ("big.txt", "big.parquet"):  # (parquet: a record batch at a time, its row groups of 1000)
        peaks = []
        for n in (1000, 4000):
            if name.endswith(".txt"):
                (root / name).write_text("\n".join(texts(n)))
            else:
                pq.write_table(pa.table({"text": [t * 20 for t in texts(n)]}), root / name, row_group_size=1000)
            tracemalloc.start()
            try:
                assert predicted(root, settings, root / name) == 0
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
            assert (root / "run" / "predictions.csv").read_text().count("\n") == n + 1
        assert peaks[1] < peaks[0] * 1.3, (name, peaks)


def test_a_long_predict_shows_it_is_alive(run, monkeypatch, capsys):
    """A predict of millions of inputs printed nothing between its first line and its last: an hour's wait could
    not tell progress from a hang. Now rank 0 writes a line every run_log.EVAL_LOG_EVERY_S seconds (on the console too
    when there is no bar), its count of the inputs predicted rising to the last chunk's."""
    root, settings = run
    monkeypatch.setattr(predict, "CHUNK", 64)  # (4 batches of 16 a chunk)
    monkeypatch.setattr(run_log, "EVAL_LOG_EVERY_S", 0.0)  # every batch (30 s in real runs)
    (root / "some.txt").write_text("\n".join(texts(200)))
    assert predicted(root, settings, root / "some.txt") == 0
    out = capsys.readouterr().out
    line = rf"predicting {re.escape(str(root / 'some.txt'))}: (\d+) inputs, \d+ s\n"
    counts = [int(n) for n in re.findall(line, out)]
    assert counts == list(range(16, 200, 16)) + [200], out  # each batch's
    log = (root / "run" / "logs" / "rank0.log").read_text()
    assert log.count(" inputs, ") >= len(counts) and "(200 rows)" in out.splitlines()[-1]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: the bar, and the lines in the log alone
    assert main.run(make_config(root / "run", **settings, mode="predict", log={"progress_bar": True},
                                predict={"input": str(root / "some.txt")})) == 0
    out, err = capsys.readouterr()
    assert "predict: 200 inputs [" in err and " inputs, " not in out and "(200 rows)" in out, (out, err)
    (root / "bad.txt").write_bytes("\n".join(texts(99)).encode() + b"\nbad \xff byte\n")  # a failure under the bar
    assert main.run(make_config(root / "run", **settings, mode="predict", log={"progress_bar": True},
                                predict={"input": str(root / "bad.txt")})) == 2
    err = capsys.readouterr().err
    assert f"\nerror: {root / 'bad.txt'}:100: not valid UTF-8" in err, err  # its own line, not glued to the bar


def test_a_file_with_old_mac_line_ends_is_streamed_too(tmp_path):
    """Lines were split at \\n bytes, then at \\r: a file whose lines end in a lone \\r (Excel's `CSV
    (Macintosh)`) was one line, read whole (a 70 MB file took 450 MB more). Now its memory is a line's, as for \\n; the
    lines are read_utf8's whatever the ends (a \\r\\n across the reading buffer's edge, a BOM, no last end), and a
    bad byte still names its line and column."""
    lines = texts(20000)
    peaks = {}
    for name, end in (("lf.txt", "\n"), ("cr.txt", "\r")):
        (tmp_path / name).write_text(end.join(lines) + end, newline="")
        tracemalloc.start()
        try:
            read = table_files.text_stream(str(tmp_path / name), "text")  # (compared as read: none held)
            assert all(a == b for a, b in itertools.zip_longest(read, lines)), name
            peaks[name] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks["cr.txt"] < 2 * peaks["lf.txt"] + 100_000, peaks  # (before: 3 MB against 7 kB)
    for data in (b"", b"a", b"a\n", b"\xef\xbb\xbfa\r\nb\rc\n\nd", b"x" * 8191 + b"\r\ny\r", b"\r" * 9000):
        (tmp_path / "mixed.txt").write_bytes(data)
        assert list(utf8_lines(str(tmp_path / "mixed.txt"))) == read_utf8(str(tmp_path / "mixed.txt")).split("\n")
    (tmp_path / "bad.txt").write_bytes(b"a\rb\r\n\xc3\xa9t\xe9\rc")
    with pytest.raises(DataError) as error:
        list(utf8_lines(str(tmp_path / "bad.txt")))
    assert str(error.value) == f"{tmp_path / 'bad.txt'}:3: not valid UTF-8 (byte 0xe9 at column 3); the file must be " \
                               "saved as UTF-8"


def test_a_failed_predict_leaves_the_earlier_predictions_and_a_replaced_one_is_said(run, monkeypatch, capsys):
    """predictions.csv was replaced without a word; now the closing line says so. Written a chunk at a time, a
    predict that fails after chunks were written (a bad byte at line 100, a full disk) leaves the earlier
    predictions.csv whole, and no predictions.csv.tmp."""
    root, settings = run
    monkeypatch.setattr(predict, "CHUNK", 32)
    (root / "few.txt").write_text("a great day\nsuch a sad day\n")
    for _ in range(2):  # (the second replaces the first's)
        assert predicted(root, settings, root / "few.txt") == 0
    where = root / "run" / "predictions.csv"
    assert f"wrote {where} (2 rows), replacing the earlier predictions.csv" in capsys.readouterr().out
    earlier = where.read_bytes()
    (root / "bad.txt").write_bytes("\n".join(texts(99)).encode() + b"\nbad \xff byte\n" + b"more\n" * 50)
    assert predicted(root, settings, root / "bad.txt") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {root / 'bad.txt'}:100: not valid UTF-8 (byte 0xff at column 5); the file must be saved "
                   "as UTF-8"], err
    assert where.read_bytes() == earlier and not os.path.lexists(f"{where}.tmp")
    where.unlink()
    where.mkdir()  # a folder in its place: an IsADirectoryError traceback after every input was predicted
    assert predicted(root, settings, root / "few.txt") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {where}: a folder, where predict writes its rows; move it away, or set another "
                   "output_dir"], err
    where.rmdir()
    assert predicted(root, settings, root / "few.txt") == 0
    assert f"wrote {where} (2 rows)\n" in capsys.readouterr().out  # none before: nothing replaced


def test_a_second_predict_on_one_output_dir_is_refused_while_training_is_not(run, capsys):
    """Two predicts on one output_dir wrote one predictions.csv.tmp: the second deleted the first's, and the first
    renamed the second's half-written file onto predictions.csv, saying it wrote all its rows. The second is now
    refused in one line; a predict beside a training run (its own lock) is not."""
    root, settings = run
    (root / "few.txt").write_text("a great day\nsuch a sad day\n")
    out = str(root / "run")
    held = hold_output_dir(out, "predict")  # (this test is the other predict)
    try:
        assert predicted(root, settings, root / "few.txt") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: output_dir {out!r} is in use by another predict (pid "
                                                   f"{os.getpid()} on "), err
    finally:
        held.close()
    training = hold_output_dir(out)
    try:
        assert predicted(root, settings, root / "few.txt") == 0
    finally:
        training.close()


def test_a_predict_that_crashes_says_it_was_predicting(run, monkeypatch, capsys):
    """A crash or Ctrl-C in mode predict said `rank 0 on HOST failed before training (setup)`: there is no training."""
    root, settings = run
    (root / "few.txt").write_text("a great day\n")

    def broken(*args, **kwargs):
        raise RuntimeError("a loader that breaks")
    monkeypatch.setattr(predict, "make_loader", broken)
    assert predicted(root, settings, root / "few.txt") == 1
    err = capsys.readouterr().err
    assert " failed while predicting (mode predict): RuntimeError: a loader that breaks" in err, err


def test_predict_s_lock_on_a_full_disk_names_its_file(tmp_path):
    """A real full tmpfs (root only): predict's lock could not be written, and the line named the training run's
    .lock."""
    with tmpfs(tmp_path / "full", "size=64k") as folder:
        with open(folder / "filler", "wb") as f:
            with pytest.raises(OSError):
                f.write(b"x" * (1 << 20))
                f.flush()
        with pytest.raises(UserError, match=re.escape(f"output_dir {str(folder)!r}: No space left on device "
                                                      "(writing its .predict.lock): free some space")):
            hold_output_dir(str(folder), "predict")


def test_start_over_moves_the_earlier_run_s_predictions_aside(tmp_path):
    """train.start_over moved the earlier run's checkpoints, config and *_results.json aside but left its
    predictions.csv: the new run's folder held the old model's labels as if they were its own."""
    for name in ("config.yml", "predictions.csv", "dev_results.json"):
        (tmp_path / name).write_text("earlier\n")
    moved, aside = move_run_aside(str(tmp_path))
    assert sorted(moved) == ["config.yml", "dev_results.json", "predictions.csv"], moved
    assert sorted(os.listdir(aside)) == sorted(moved) and not (tmp_path / "predictions.csv").exists()


def test_a_folder_where_test_mode_writes_its_results_is_one_line(run, capsys):
    """A folder named dev_results.json: an IsADirectoryError traceback once dev was evaluated (predict's
    predictions.csv: test_a_failed_predict...)."""
    root, settings = run
    where = root / "run" / "dev_results.json"
    if where.exists():
        where.unlink()
    where.mkdir()
    try:
        assert main.run(make_config(root / "run", **settings, mode="test")) == 2
    finally:
        where.rmdir()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {where}: a folder, where test mode writes the dev results; move it away, or set another "
                   "output_dir"], err


def test_under_ddp_each_rank_encodes_only_the_inputs_it_predicts(run, monkeypatch, capsys):
    """Every rank parsed and encoded every input of each chunk, then predicted its share: N ranks did N times the
    encoding (csv_text's was half of predict's time), and predict got no faster with ranks. Now a rank encodes its
    share alone (texts of mixed lengths; chunks of 32 under 2 ranks, the last of 4), and its rows are one process's."""
    root, settings = run
    monkeypatch.setattr(predict, "CHUNK", 48)
    (root / "mixed.txt").write_text("\n".join(texts(100)))
    cfg = make_config(root / "run", **settings, mode="predict", predict={"input": str(root / "mixed.txt")})
    task = build_task(cfg)
    task.prepare_inference(None)  # (the training file's classes and words)
    model = task.build_model().eval()
    encoded = []
    monkeypatch.setattr(csv_text, "words", lambda text: (encoded.append(text), words(text))[1])
    rows = {}
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        encoded.clear()
        ctx = DistContext(rank, world, rank, torch.device("cpu"), None)  # (no process group: the rank's own rows)
        rows[rank, world] = list(predict.predicted(cfg, ctx, task, model))
        assert len(encoded) == len(rows[rank, world]), (rank, world, len(encoded))
    alone = rows[0, 1]
    assert [r[0] for r in alone] == texts(100)
    for rank in (0, 1):  # each chunk of 32: rank 0 its first 16 inputs, rank 1 the others; the last 4: 2 each
        share = [i for i in range(96) if i % 32 // 16 == rank] + [96 + 2 * rank, 97 + 2 * rank]
        assert [r[:2] for r in rows[rank, 2]] == [alone[i][:2] for i in share], rank
        assert [r[2] for r in rows[rank, 2]] == [pytest.approx(alone[i][2], abs=1e-6) for i in share], rank
    (root / "one.txt").write_text("a great day\n")  # (and the closing line's count of one input: `1 rows`)
    assert predicted(root, settings, root / "one.txt") == 0
    assert f"\nwrote {root / 'run' / 'predictions.csv'} (1 row)" in capsys.readouterr().out


def test_under_ddp_each_rank_decodes_only_the_images_it_predicts(tmp_path, monkeypatch):
    """The image task decoded every image of each chunk on every rank (as csv_text encoded every text): a rank now
    decodes the images it predicts alone (5 images of mixed sizes, 2 ranks), each as one process reads it."""
    rng = np.random.default_rng(0)
    for i, side in enumerate((8, 30, 5, 64, 17)):
        Image.fromarray(rng.integers(0, 256, (side, side + i), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    cfg = make_config(tmp_path / "run", task="image", mode="predict", predict={"input": str(tmp_path), "top_k": 3},
                      train={"eval_batch_size": 2})
    task = build_task(cfg)
    task.prepare_inference(None)
    model = task.build_model().eval()
    decoded = []
    monkeypatch.setattr(image, "gray_square", lambda path, size: (decoded.append(path), gray_square(path, size))[1])
    rows = {}
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        decoded.clear()
        ctx = DistContext(rank, world, rank, torch.device("cpu"), None)  # (no process group: the rank's own rows)
        rows[rank, world] = list(predict.predicted(cfg, ctx, task, model))
        assert len(decoded) == len(rows[rank, world]), (rank, world, decoded)
    assert [r[0] for r in rows[0, 1]] == [f"{i}.png" for i in range(5)]
    ranks = rows[0, 2] + rows[1, 2]  # one chunk: rank 0 the first 3 inputs (2 batches), rank 1 the rest
    assert [r[:2] for r in ranks] == [r[:2] for r in rows[0, 1]]  # (other batches: a last bit apart, as before)
    assert [r[2] for r in ranks] == [pytest.approx(r[2], abs=1e-6) for r in rows[0, 1]]
    # decoded in a loader worker now (data.num_workers), an unreadable image is still its one line, not the
    # worker's traceback around it
    (tmp_path / "5.png").write_bytes(b"not a png")
    lines = []
    for workers in (0, 2):
        cfg.data.num_workers = workers
        with pytest.raises(DataError) as error:
            list(predict.predicted(cfg, DistContext(1, 2, 1, torch.device("cpu"), None), task, model))
        lines.append(str(error.value))
    assert lines[0] == lines[1] and lines[0].startswith(f"predict.input: {tmp_path / '5.png'}: not a readable image ("
                                                        ) and "\n" not in lines[0], lines
