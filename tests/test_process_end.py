"""How a process that loaded torch ends (core/process_end.py): the project's exit handlers run, through its own list
and public calls only, and a run leaves nothing behind in the temporary folder, W&B's included."""
import ast
import os
import subprocess
import sys

import pytest

from cluster import clean_env
from conftest import ROOT
from test_layers import product_files


def script(body: str) -> str:
    return (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom core import process_end\n" + body)


def test_a_process_ended_without_the_interpreters_teardown_runs_the_projects_exit_handlers(tmp_path):
    """end_process: the handlers registered with at_end run last first, one that fails is named in one line and the
    rest still run, buffered output is flushed, the code is the process's; nothing after it runs."""
    ran = tmp_path / "ran"
    body = ("def note(word):\n"
            f"    return lambda: open({str(ran)!r}, 'a').write(word + ' ')\n"
            "def broken():\n"
            "    raise OSError('the server went away')\n"
            "process_end.at_end(note('first'))\n"
            "process_end.at_end(broken)\n"
            "process_end.at_end(note('last'))\n"
            "print('before', flush=False)\n"  # still in the buffer: end_process flushes it
            "process_end.end_process(3)\n"
            "print('after')\n")
    p = subprocess.run([sys.executable, "-c", script(body)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert p.stdout.split() == ["before"]
    assert ran.read_text().split() == ["last", "first"]
    said = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "broken" in said[0] and "the server went away" in said[0], p.stderr


def test_an_ordinary_exit_runs_the_same_handlers_once(tmp_path):
    """A process that ends the ordinary way (a test calling main.main() in its own process) runs the list through
    atexit, each handler once."""
    ran = tmp_path / "ran"
    body = (f"process_end.at_end(lambda: open({str(ran)!r}, 'a').write('once '))\n"
            "sys.exit(5)\n")
    p = subprocess.run([sys.executable, "-c", script(body)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 5, p.stderr
    assert ran.read_text().split() == ["once"]


def test_no_product_file_reaches_into_atexit_or_registers_with_it_but_process_end():
    """Python's atexit handlers do not run when a process ends through end_process, and atexit has no public call
    that runs them: the product's exit handlers go on the project's list (process_end.at_end), and no file uses a
    private name of atexit (atexit._run_exitfuncs was one)."""
    found = []
    for module, path in product_files().items():
        tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "atexit"
                    and (node.attr.startswith("_") or module != "core.process_end")):
                found.append(f"{path}:{node.lineno} atexit.{node.attr}")
    assert not found, found


@pytest.mark.parametrize("procs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_wandb_run_leaves_nothing_in_the_temporary_folder(tmp_path, procs):
    """W&B makes two folders in the temporary folder as it is imported and one for its service, and removes them in
    atexit handlers, which a process ending through end_process skips: the tracker imports it with a folder of
    ours, and stops W&B's service as it closes. Counted in a private TMPDIR, one process and two ranks."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    env = clean_env(TMPDIR=str(tmp), WANDB_MODE="offline", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for name in ("WANDB_DIR", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    strategy = ["--set", "dist.strategy=ddp", "--set", "dist.procs_per_node=2"] if procs == 2 else []
    p = subprocess.run([sys.executable, "main.py", "--params", "parameters.yml", "--set", f"output_dir={out}",
                        "--set", "train.max_steps=2", "--set", "log.report_to=[wandb, mlflow]", *strategy],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))  # the run was tracked
    assert sorted(os.listdir(tmp)) == []
