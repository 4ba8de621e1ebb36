"""A full disk or a read-only folder outside the checkpoint save (issue 20, item 7): the logs, TensorBoard,
config.yml, *_results.json, the tokenizer folder, checkpoints/. Each ends the run with one line naming the path and
what to do, exit 2, no traceback, no '--- Logging error ---', and the checkpoints saved before it intact.

The faults are injected where the kernel's errors come from (a file's write, TensorBoard's record writer), so the
trainer's own handling runs; one test mounts a real read-only folder when it may (root)."""
import errno
import io
import os
import subprocess
import sys

import pytest
import torch

from core import checkpoint
from core import atomic_write, disk_errors
from core import errors
from resilience import faults
import main
from core import run_log
from conftest import ROOT, free_port, make_config, tmpfs

TRAIN = {"max_steps": 6, "eval_every": 0, "save_every": 2, "keep_last": 10, "log_every": 1}


def run(out, train=None, **sections) -> int:
    import torch.distributed as dist
    code = main.run(make_config(out, train={**TRAIN, **(train or {})}, **sections))
    if dist.is_initialized():  # wiring.worker leaves the group up after a failure
        dist.destroy_process_group()
    return code


def no_space(path=None) -> OSError:
    """What the kernel raises on a full disk; a buffered write's flush names no file."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([path] if path else []))


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err and "Exception in thread" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def saved_steps(out) -> list[int]:
    """The complete checkpoints, each loaded to be sure it is intact."""
    steps = [step for step, _ in checkpoint.complete_checkpoints(str(out))]
    for step in steps:
        torch.load(os.path.join(out, "checkpoints", f"step-{step}", "model.pt"), weights_only=True)
    return steps


class FillsAfter(io.StringIO):
    """A log file that meets a full disk after `lines` writes."""

    def __init__(self, lines: int):
        super().__init__()
        self.left = lines

    def write(self, text):
        self.left -= 1
        if self.left < 0:
            raise no_space()
        return super().write(text)


@pytest.fixture
def thread_hook():
    """wiring.worker installs resource_errors.thread_exception for the process: put Python's back after the test."""
    import threading
    yield
    threading.excepthook = threading.__excepthook__


def test_log_file_full_mid_run_is_one_line_and_resumes(tmp_path, capsys, monkeypatch, thread_hook):
    monkeypatch.setattr(run_log.LogFile, "_open", lambda self: FillsAfter(8))  # about step 4 of 6
    assert run(tmp_path) == errors.EXIT_USER_ERROR
    line = one_error(capsys)
    assert line.startswith(f"error: {tmp_path / 'logs' / 'rank0.log'}: No space left on device: free some space")
    assert "checkpoints saved so far are intact" in line
    assert 2 <= max(saved_steps(tmp_path)) < TRAIN["max_steps"]  # stopped mid-run, its checkpoints whole
    monkeypatch.undo()
    assert run(tmp_path) == 0  # space freed: the same command resumes
    assert saved_steps(tmp_path)[-1] == TRAIN["max_steps"]
    assert "resumed from" in (tmp_path / "logs" / "rank0.log").read_text()


def test_a_failed_log_write_in_another_thread_is_raised_by_the_main_thread(tmp_path, monkeypatch):
    import threading
    monkeypatch.setattr(run_log, "quiet_libraries", lambda: None)  # (rank 3's quiet would last the session)
    log = run_log.setup_logging(str(tmp_path), rank=3)
    handler = log.handlers[0]
    handler.stream = FillsAfter(0)
    t = threading.Thread(target=lambda: log.info("from a thread"))
    t.start()
    t.join()  # no exception, no '--- Logging error ---' in the thread
    with pytest.raises(OSError) as e:
        log.info("next line")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "logs" / "rank3.log")
    log.info("dropped")  # raised once: the report that follows is not refused
    handler.stream = None


@pytest.mark.parametrize("after", [0, 12], ids=["at start", "mid-run"])
def test_tensorboard_full_is_one_line(tmp_path, capsys, monkeypatch, thread_hook, after):
    from tensorboard.summary.writer import record_writer
    writes = [0]
    real = record_writer.RecordWriter.write

    def write(self, data):
        writes[0] += 1
        if writes[0] > after + 1:  # (the first record is the file's version: always written)
            raise no_space()
        return real(self, data)
    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    assert run(tmp_path, log={"tensorboard": True}) == errors.EXIT_USER_ERROR
    line = one_error(capsys)
    assert line.startswith(f"error: {tmp_path / 'tensorboard'}: No space left on device: free some space")
    assert saved_steps(tmp_path) == ([] if after == 0 else [2])


def test_results_json_full_in_test_mode_leaves_no_partial_file(tmp_path, capsys, monkeypatch, thread_hook):
    assert run(tmp_path, train={"max_steps": 2}) == 0
    capsys.readouterr()

    class Full(io.StringIO):
        def close(self):  # the data reach the disk as the file closes: ENOSPC there, naming no file
            raise no_space()
    real_open = open
    monkeypatch.setattr(atomic_write, "open", lambda path, mode="r", **kw: Full() if mode == "w" else
                        real_open(path, mode, **kw), raising=False)
    assert run(tmp_path, mode="test") == errors.EXIT_USER_ERROR
    assert one_error(capsys).startswith(f"error: {tmp_path / 'dev_results.json'}: No space left on device")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("dev_results.json")]


def test_config_yml_on_a_full_disk_keeps_the_previous_one(tmp_path, capsys, monkeypatch, thread_hook):
    assert run(tmp_path, train={"max_steps": 2}) == 0
    before = (tmp_path / "config.yml").read_text()
    capsys.readouterr()

    class Full(io.StringIO):
        def write(self, text):
            raise no_space()
    monkeypatch.setattr(atomic_write, "open", lambda path, mode="r", **kw: Full(), raising=False)
    assert run(tmp_path, train={"max_steps": 4}) == errors.EXIT_USER_ERROR
    assert one_error(capsys).startswith(f"error: {tmp_path / 'config.yml'}: No space left on device")
    assert (tmp_path / "config.yml").read_text() == before  # test and export still read a whole one
    assert saved_steps(tmp_path) == [2]


def test_read_only_checkpoints_folder_at_save_is_one_line(tmp_path, capsys, monkeypatch, thread_hook):
    real = os.makedirs

    def makedirs(path, *a, **k):
        if os.path.basename(path).startswith(".tmp-step-"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, *a, **k)
    monkeypatch.setattr(checkpoint.os, "makedirs", makedirs)
    assert run(tmp_path) == errors.EXIT_USER_ERROR
    assert one_error(capsys) == (f"error: {tmp_path / 'checkpoints'}: Read-only file system: make it writable for "
                                 f"this run (or choose another output_dir), then run the same command again (the "
                                 f"checkpoints saved so far are intact)")


def test_tokenizer_folder_not_writable_is_one_line(tmp_path, capsys, monkeypatch, thread_hook):
    from transformers import PreTrainedTokenizerFast
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("".join(f"ROMEO:\nO speak again, angel {i}\n\n" for i in range(30)))

    def save_pretrained(self, folder, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.path.join(folder, "tokenizer.json"))
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", save_pretrained)
    code = run(tmp_path / "out", task="gpt2_lm", data={"data_dir": str(tmp_path / "data"), "max_length": 16,
                                                       "tokenizer": "char"},
               model={"name": "tiny"}, train={"best_metric": "loss", "batch_size": 4, "epochs": 0})
    assert code == errors.EXIT_USER_ERROR
    assert one_error(capsys).startswith(f"error: {tmp_path / 'out' / 'tokenizer.part'}: Permission denied: make it "
                                        f"writable")


def test_write_beside_writes_a_regular_file_never_through_what_was_planted(tmp_path):
    """write_beside (config.yml, metrics.csv, trackers.json, the launch record, a rank's report, the vocabulary):
    a symlink or FIFO planted at the file or its temporary name is replaced, never followed nor blocked on; a folder
    there is an error naming it, and a failed write leaves the previous file and no temporary one."""
    outside, path = tmp_path / "outside.txt", tmp_path / "run" / "file.txt"
    path.parent.mkdir()
    outside.write_text("outside")
    for case, plant in [("symlink", lambda p: p.symlink_to(outside)), ("fifo", lambda p: os.mkfifo(p)),
                        ("dangling symlink", lambda p: p.symlink_to(tmp_path / "nowhere"))]:
        for planted in (path, tmp_path / "run" / "file.txt.tmp"):
            for p in (path, tmp_path / "run" / "file.txt.tmp"):
                if os.path.lexists(p):
                    p.unlink()
            plant(planted)
            atomic_write.write_beside(str(path), lambda f: f.write(case))
            assert path.read_text() == case and not path.is_symlink(), (case, planted)
            assert outside.read_text() == "outside" and os.listdir(path.parent) == ["file.txt"], (case, planted)
            assert not (tmp_path / "nowhere").exists()
    path.unlink()
    path.mkdir()
    with pytest.raises(IsADirectoryError) as e:
        atomic_write.write_beside(str(path), lambda f: f.write("x"))
    assert str(path) in str(e.value) and os.listdir(path.parent) == ["file.txt"]
    path.rmdir()
    path.write_text("before")

    def full(f):
        f.write("half")
        raise no_space()
    with pytest.raises(OSError) as e:
        atomic_write.write_beside(str(path), full)
    assert e.value.filename == str(path) and e.value.errno == errno.ENOSPC  # the file named, not its temporary
    assert path.read_text() == "before" and os.listdir(path.parent) == ["file.txt"]


def test_disk_problem_names_only_disk_errors(tmp_path):
    assert disk_errors.disk_problem(ValueError("x"), "out") is None
    assert disk_errors.disk_problem(OSError(errno.EPERM, "Operation not permitted"), "out") is None  # no file: not a disk
    assert disk_errors.disk_problem(FileNotFoundError(errno.ENOENT, "No such file", "f"), "out") is None
    try:
        try:
            raise no_space()
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        assert disk_errors.disk_problem(e, "out").startswith("a file in output_dir out: No space left on device")
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(tmp_path / "f"))
    assert disk_errors.disk_problem(quota, "out").startswith(f"{tmp_path / 'f'}: Disk quota exceeded: free some space")


def test_read_only_checkpoints_folder_is_refused_at_start(tmp_path, capsys):
    """A real read-only mount (root only): refused before training, not at the first save hours later."""
    with tmpfs(tmp_path / "checkpoints", "ro,size=64k") as folder:
        assert run(tmp_path) == errors.EXIT_USER_ERROR
        assert one_error(capsys) == (f"error: checkpoint folder {str(folder)!r} is not a writable directory "
                                     f"(Read-only file system): make it writable for this run, or choose another "
                                     f"output_dir")
        assert not (tmp_path / "logs").exists()  # nothing started


def test_an_output_dir_on_a_full_disk_is_refused_at_start(tmp_path, capsys):
    """A real full tmpfs (root only): the run's lock file could not be written (output_dir/.lock), a traceback
    from run_dir_lock before anything started; now one line, nothing started."""
    with tmpfs(tmp_path / "full", "size=64k") as folder:
        with open(folder / "filler", "wb") as f:
            with pytest.raises(OSError):
                f.write(b"x" * (1 << 20))
                f.flush()
        assert run(folder) == errors.EXIT_USER_ERROR
        line = one_error(capsys)
        assert line.startswith(f"error: output_dir {str(folder)!r}: No space left on device") and \
            "free some space" in line, line
        assert not (folder / "logs").exists()  # nothing started


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_on_a_full_disk_stops_every_rank_with_one_line(tmp_path, rank):
    """2-rank ddp under main.py's launcher: rank `rank`'s log file fills at step 5. Every rank leaves with the
    same line (the others' watchdogs read it), exit 2, nothing else on stderr, step-4 loadable."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_", "FAULT"))}
    env.update(OMP_NUM_THREADS="1", FAULT=f"full:{rank}:5")
    argv = [sys.executable, "tests/faulty_main.py", "--set", f"output_dir={out}", "--set", "dist.strategy=ddp",
            "--set", "dist.procs_per_node=2", "--set", f"dist.master_port={free_port()}", "--set", "train.epochs=0",
            "--set", "train.max_steps=40", "--set", "train.save_every=2", "--set", "train.log_every=1",
            "--set", "train.eval_every=0", "--set", "log.tensorboard=false", "--set", "log.progress_bar=false"]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == errors.EXIT_USER_ERROR, r.stderr
    assert r.stderr.strip() == (f"error: {out / 'logs' / f'rank{rank}.log'}: No space left on device: free some "
                                f"space, then run the same command again (the checkpoints saved so far are intact)")
    assert 4 in saved_steps(out)



def test_a_closed_pipe_on_the_console_is_not_a_full_disk(tmp_path, monkeypatch):
    """`python main.py | head`: logging's own handling, as before (the run is not stopped for it)."""
    import logging

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
    monkeypatch.setattr(logging, "raiseExceptions", False)  # (logging's report itself: not the point here)
    handler = run_log.ConsoleHandler(ClosedPipe())
    handler.handle(logging.makeLogRecord({"msg": "a line"}))  # no exception
    assert handler.failed is None
