"""The helper scripts as a user runs them: --help and a wrong command line write nothing and say one line."""
from __future__ import annotations

import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_sample_text_data as sample  # noqa: E402


def test_make_sample_text_data_help_and_extra_arguments_write_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # once wrote the data into a folder named --help
        sample.main(["--help"])
    assert e.value.code == 0 and "data/sample" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a second folder was ignored without a word
        sample.main(["one", "two"])
    assert e.value.code == 2 and "unrecognized arguments: two" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    assert sample.main(["out"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["bert_text.txt", "gpt2", "sst2"]
