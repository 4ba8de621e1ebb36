"""The dev run (--dev-run, train.dev_run): every stage of a job for a step or two, in a temporary folder; a stage that
fails is named with its error, and the real output_dir is never written."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from extras import dev_run

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_a_dev_run_passes_every_stage_and_writes_nothing_to_output_dir(tmp_path):
    real = tmp_path / "real"
    out = subprocess.run([sys.executable, "main.py", "--params", "parameters.yml", "--dev-run",
                          "--set", f"output_dir={real}", "--set", "log.tensorboard=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    for stage in ("train", "resume", "test", "export"):
        assert re.search(rf"^  {stage} .*: ok in [\d.]+ s$", out.stdout, re.M), out.stdout
    assert "dev run passed" in out.stdout
    assert not real.exists()  # nothing written to the real output_dir, not even its folder
    temporary = re.search(r" in (\S+) \(nothing is written", out.stdout).group(1)
    assert not os.path.exists(temporary)  # removed once every stage passed


@pytest.mark.slow
def test_a_dev_run_names_the_stage_that_fails_and_keeps_its_files(tmp_path, capsys, monkeypatch):
    """A fault in step 3 is the resume stage's (the train stage runs steps 1-2): it is named, with the error."""
    monkeypatch.setenv("FAULT", "raise:0:3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = dev_run.run(os.path.join(ROOT, "tests", "faulty_main.py"), os.path.join(ROOT, "parameters.yml"),
                       ["log.tensorboard=false"], str(tmp_path / "real"), exports=True)
    out = capsys.readouterr()
    assert code != 0
    assert re.search(r"^  train .*: ok in", out.out, re.M)
    assert "resume" in out.err and "FAILED" in out.err and "injected fault" in out.err
    assert "test " not in out.out  # nothing after the failing stage
    kept = re.search(r"every stage's output is in (\S+)", out.err).group(1)
    assert os.path.isfile(os.path.join(kept, "resume.log"))
    assert not (tmp_path / "real").exists()
