"""Small frictions (issue 33, item 7): the closing summary's commands are shell-quoted (an output_dir with spaces,
non-ASCII or a newline), a control character in the YAML is one line naming the file and line, and a text file
too large for the tokenizer is refused in one line before it is read."""
import os
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest

import main
from conftest import ROOT, make_config

TRAIN = {"max_steps": 2, "epochs": 0, "eval_every": 2, "save_every": 2, "log_every": 1}


def test_the_summarys_commands_survive_spaces_non_ascii_and_newlines(tmp_path, capsys):
    out = tmp_path / "my runs/dígits 'one'\nsecond line"
    assert main.run(make_config(out, train=TRAIN, log={"tensorboard": True})) == 0
    text = capsys.readouterr().out
    summary = text[text.index("  tensorboard  "):]
    tensorboard = summary[len("  tensorboard  "):summary.index("\n  test ")]
    assert shlex.split(tensorboard) == ["tensorboard", "--logdir", f"{out}/tensorboard"]
    for mode, wrote in (("test", "test_results.json"), ("export", "export")):
        start = summary.index(f"\n  {mode} ") + len(f"\n  {mode} ")
        command = summary[start:].lstrip()
        command = command[:command.index("--set mode=") + len(f"--set mode={mode}")]
        argv = shlex.split(command)
        assert argv[:3] == ["python", "main.py", "--params"] and argv[3] == f"{out}/config.yml"
        assert main.main(argv[2:]) == 0
        assert os.path.exists(out / wrote)


def test_the_summarys_mlflow_command_survives_spaces(tmp_path):
    from core import run_record
    out = tmp_path / "my runs/dígits one"
    cfg = make_config(out, log={"report_to": ["mlflow"], "tensorboard": None})
    state = SimpleNamespace(step=2, best_step=2, best_value=0.5)
    summary = run_record.summary(cfg, state, "accuracy", SimpleNamespace(export_formats=(), generates_text=False))
    [mlflow] = [line for line in summary.splitlines() if line.startswith("  mlflow ")]
    assert shlex.split(mlflow) == ["mlflow", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{out}/mlflow.db"]


def test_a_nul_byte_in_the_yaml_is_one_line_naming_file_and_line(tmp_path):
    params = tmp_path / "p.yml"
    params.write_bytes(b"task: image\ntrain:\n  max_steps: 4\x002\n")
    r = subprocess.run([sys.executable, "main.py", "--params", str(params)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.startswith(f"error: {params}: ") and "NUL" in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.slow  # 5 s: a sparse 1 GiB file and a run
def test_a_text_file_over_1_gib_is_refused_before_it_is_read(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "input.txt", "wb") as f:  # sparse: 1.1 GiB long, nothing on disk
        f.truncate(int(1.1 * 2**30))
    r = subprocess.run([sys.executable, "main.py", "--params", "configs/shakespeare_char.yml", "--set",
                        f"data.data_dir={data}", "--set", f"output_dir={tmp_path / 'run'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {data / 'input.txt'}: 1.1 GiB, more than the 1 GiB") \
        and "scripts/prepare_text.py" in lines[0], r.stderr


def test_a_long_text_trains_the_same_tokenizer_in_pieces(monkeypatch):
    """The BPE trainer gets a long text in pieces cut before a space (its memory: ~80 bytes per character of one
    text); the words it counts, hence its vocabulary and merges, are those of the whole text."""
    import random

    from tasks import text_common
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    text = "".join(rng.choice(words) + rng.choice([" ", " ", "  ", "\n", ", "]) for _ in range(6000))
    whole = text_common.train_tokenizer([text], "gpt2")
    monkeypatch.setattr(text_common, "PIECE_CHARS", 500)
    assert len(list(text_common.pieces([text]))) > 50
    cut = text_common.train_tokenizer([text], "gpt2")
    assert cut.get_vocab() == whole.get_vocab()
    assert cut(text)["input_ids"] == whole(text)["input_ids"]
