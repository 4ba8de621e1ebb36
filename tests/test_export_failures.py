"""mode: export ends as training does (export.py: main, write_atomically): a full disk or a read-only folder is one
line (exit 2), Ctrl-C one line (exit 130; SIGTERM 143), and no temporary folder is left beside the destination
however it ends; one left by a killed export (SIGKILL) is removed by the next export."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from extras import export as exporter
from conftest import make_config, tmpfs
from test_export import cnn_run, export  # noqa: F401  (a module-scoped fixture: a CNN trained a few steps)


def one_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture
def small_disk(tmp_path):
    """A 128 KiB tmpfs (root only): the digits CNN's export (215 KB of weights) does not fit."""
    with tmpfs(tmp_path / "small", "size=128k") as folder:
        yield folder


@pytest.mark.parametrize("fmt", ["state_dict", "torch_export"])
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(cnn_run, small_disk, capsys, fmt):  # noqa: F811
    dest = small_disk / "export"
    assert export(cnn_run, dir=str(dest), format=fmt) == 2
    line = one_error(capsys)
    assert line.startswith(f"error: {dest}: no space left on device") and "free some space" in line, line
    assert os.listdir(small_disk) == []


@pytest.mark.parametrize("where", ["export", "nested/export"])
def test_an_export_into_a_read_only_folder_is_one_line(cnn_run, tmp_path, capsys, where):  # noqa: F811
    """A real read-only mount (root only): the export's temporary folder cannot be made there; one line naming
    the folder (was a traceback from tempfile.mkdtemp, or from os.makedirs when the parent is missing)."""
    with tmpfs(tmp_path / "ro", "ro,size=64k") as folder:
        assert export(cnn_run, dir=str(folder / where), format="state_dict") == 2
    line = one_error(capsys)
    assert line.startswith(f"error: {folder}: Read-only file system: make it writable") and "run the same" in line, line


def interrupting(signum):
    """A format writer that receives `signum` half way (as Ctrl-C or a scheduler's SIGTERM would arrive)."""
    def write(folder, task, model):
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"x" * 1000)
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler interrupts this
        raise AssertionError("not interrupted")
    return write


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_export_is_one_line_and_leaves_nothing(cnn_run, tmp_path, capsys, monkeypatch,  # noqa: F811
                                                               signum, code):
    monkeypatch.setattr(exporter, "write_state_dict", interrupting(signum))
    before = signal.getsignal(signal.SIGTERM)
    assert export(cnn_run, dir=str(tmp_path / "out"), format="state_dict") == code
    line = one_error(capsys)
    assert signal.Signals(signum).name in line and "nothing exported" in line, line
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_exports_folder_is_removed_by_the_next_export(cnn_run, tmp_path, capsys):  # noqa: F811
    host = socket.gethostname()
    stale = tmp_path / f".out.part-{host}-{dead_pid()}-abc_1234"
    running = tmp_path / f".out.part-{host}-{os.getpid()}-xyz_9876"  # a live process's export: left alone
    other = tmp_path / f".out.part-elsewhere-{dead_pid()}-abc_1234"  # another host's: its pids mean nothing here
    for folder in (stale, running, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    assert export(cnn_run, dir=str(tmp_path / "out"), format="state_dict") == 0
    assert sorted(os.listdir(tmp_path)) == sorted(["out", running.name, other.name])
    assert f"removed {stale}" in capsys.readouterr().out


@pytest.mark.slow  # 4 s: a real export killed; quick loop: the stale folder's removal below
def test_a_killed_export_by_sigkill_leaves_a_folder_the_next_one_removes(cnn_run, tmp_path):  # noqa: F811
    """A real `python main.py` export killed with SIGKILL while it writes, then the same command again."""
    import yaml
    params = tmp_path / "params.yml"
    params.write_text(yaml.safe_dump({"output_dir": cnn_run.output_dir, "mode": "export",
                                      "export": {"dir": str(tmp_path / "out"), "format": "state_dict"},
                                      "log": {"progress_bar": False, "tensorboard": False}}))
    hook = tmp_path / "hook.py"  # main.py with a writer that hangs once its folder is made
    hook.write_text("import sys, time, main\nfrom extras import export\n"
                    "export.write_state_dict = lambda folder, task, model: time.sleep(60)\n"
                    "sys.exit(main.main(sys.argv[1:]))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, str(hook), "--params", str(params)], cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    deadline = time.monotonic() + 60
    while not [n for n in os.listdir(tmp_path) if ".part-" in n] and time.monotonic() < deadline:
        time.sleep(0.2)
    p.kill()
    p.wait()
    assert [n for n in os.listdir(tmp_path) if ".part-" in n]
    assert export(make_config(cnn_run.output_dir), dir=str(tmp_path / "out"), format="state_dict") == 0
    assert not [n for n in os.listdir(tmp_path) if ".part-" in n]


def test_an_export_dir_under_a_file_is_one_line(cnn_run, tmp_path, capsys):  # noqa: F811
    """export.dir with a file in its path (a typo, another run's file): os.makedirs' FileExistsError was a
    traceback and exit 1."""
    (tmp_path / "file").write_text("not a folder\n")
    dest = tmp_path / "file" / "export"
    assert export(cnn_run, dir=str(dest), format="state_dict") == 2
    line = one_error(capsys)
    assert line.startswith(f"error: export.dir: {dest}: ") and f"{tmp_path / 'file'}: a file, not a folder" in line
