"""Library log lines never end a run because a stream went away: a handler left on a closed stream (pytest's
capsys closes its stream after each test) loses the line in logging's own report, and raises nothing."""
import io
import logging
import os
import subprocess
import sys

from conftest import ROOT


def test_a_transformers_line_to_a_closed_stream_raises_nothing(monkeypatch):
    from tasks.text_common import plain_transformers_output
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    failed = []
    monkeypatch.setattr(handler, "handleError", failed.append)  # logging's own report of the failed write
    library, level = logging.getLogger("transformers"), logging.getLogger("transformers").level
    library.addHandler(handler)
    library.setLevel(logging.WARNING)  # an earlier test may have quieted transformers
    try:
        plain_transformers_output()  # our filter on each of transformers' handlers, this one included
        logging.getLogger("transformers.models").warning("\x1b[1mbefore\x1b[0m")
        stream.close()
        logging.getLogger("transformers.models").warning("\x1b[1mafter\x1b[0m")  # raised ValueError here
    finally:
        library.removeHandler(handler)
        library.setLevel(level)
    assert [r.getMessage() for r in failed] == ["after"]  # no terminal: colours stripped, the write failed


INNER = '''
import logging

def test_first_import_of_transformers_under_capsys(capsys):
    import transformers.utils.logging  # noqa: F401

def test_a_later_transformers_warning():
    logging.getLogger("transformers.models").warning("a later warning")
    for name in ("transformers", "huggingface_hub"):
        assert not any(getattr(h.stream, "closed", False) for h in logging.getLogger(name).handlers), name
'''


def test_library_handlers_do_not_keep_a_closed_capsys_stream(tmp_path):
    """The slow tests alone once failed so: a test with capsys imported transformers first, whose console
    handler kept that test's stream; a later run's transformers warning met it closed. conftest imports it first."""
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                        str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr
