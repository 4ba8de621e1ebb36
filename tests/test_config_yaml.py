"""Hostile or mistaken YAML (issue 33, item 4): size, nesting and alias caps, duplicate keys, binary files, values cut
in messages. Each is one line naming the file (and line), exit code 2, refused in well under a second."""
import os
import time
import tracemalloc

import pytest

from core import config_yaml
import main
from wiring import checked_config
from core.errors import ConfigError
from conftest import ROOT

PARAMS = os.path.join(ROOT, "parameters.yml")


def laughs(levels: int = 9, width: int = 9) -> str:
    """A "billion laughs" flow list: each level lists the previous one `width` times (width**levels strings)."""
    items = [f"&l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        items.append(f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return f"[{', '.join(items)}]"


@pytest.fixture(params=["FastLoader", "PureLoader"])
def loader(request, monkeypatch):
    """Each cap holds with libyaml's parser (the default where PyYAML has it) and in pure Python."""
    if not hasattr(config_yaml, request.param):
        pytest.skip("PyYAML without libyaml")
    monkeypatch.setattr(config_yaml, "LOADER", getattr(config_yaml, request.param))


def refused_quickly(path, overrides=(), seconds: float = 2.0, memory: bool = False) -> str:
    """checked_config's one-line ConfigError, raised within `seconds` (and with `memory`, allocating < 50 MB)."""
    if memory:  # (tracing slows Python down several times: only where memory is the point)
        tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ConfigError) as e:
            checked_config(str(path) if path else None, list(overrides))
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] if memory else 0
    finally:
        tracemalloc.stop()
    assert elapsed < seconds, f"{elapsed:.2f} s"
    assert peak < 50e6, f"{peak / 1e6:.0f} MB"
    message = str(e.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def write(tmp_path, text, name="p.yml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- aliases, nesting, size ----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["train.lr", "model.lora_targets"])
def test_billion_laughs_in_a_file_is_refused_at_once(tmp_path, loader, key):
    section, name = key.split(".")
    path = write(tmp_path, f"{section}:\n  {name}: {laughs()}\n")
    message = refused_quickly(path, memory=True)
    assert message.startswith(f"{path}: line 2: more than 10,000 values once its aliases"), message


def test_billion_laughs_in_a_set_value_is_refused_at_once(loader):
    message = refused_quickly(PARAMS, [f"model.lora_targets={laughs()}"], memory=True)
    assert message.startswith("--set model.lora_targets=[&l0 [lol, lol") and "more than 10,000 values" in message
    assert len(message.split(": more")[0]) <= 6 + 80, message  # the --set item is cut


def test_aliases_within_the_budget_and_merge_keys_still_work(tmp_path, loader):
    path = write(tmp_path, "train:\n  lr: &lr 0.002\n  epochs: 3\n"
                           "model:\n  lora_targets: &t [query, value]\n  lora_alpha: *lr\n")
    cfg = checked_config(str(path), [f"output_dir={tmp_path / 'run'}"])
    assert cfg.train.lr == cfg.model.lora_alpha == 0.002 and cfg.model.lora_targets == ["query", "value"]
    assert config_yaml.parse("base: &b {lr: 1, eps: 2}\ntrain:\n  <<: *b\n  lr: 3\n")["train"] == {"lr": 3, "eps": 2}
    assert config_yaml.parse(f"x: {laughs(levels=4, width=9)}")["x"][3][0][0][0][0] == "lol"  # 9**4 = 6,561 values


@pytest.mark.parametrize("text, line", [
    ("train:\n  batch_size: " + "[" * 10_000 + "]" * 10_000 + "\n", 2),  # a list 10,000 deep
    ("train:\n  lr: " + "{a: " * 3_000 + "1" + "}" * 3_000 + "\n", 2),  # a map 3,000 deep, flow style
    ("".join("  " * i + f"k{i}:\n" for i in range(300)), 32),  # a map 300 deep, block style
])
def test_deep_nesting_is_refused_in_one_line(tmp_path, loader, text, line):
    path = write(tmp_path, text)
    message = refused_quickly(path)
    assert message.startswith(f"{path}: line {line}: nested more than 32 levels deep"), message


def test_an_alias_inside_itself_is_refused(tmp_path, loader):
    message = refused_quickly(write(tmp_path, "model:\n  lora_targets: &a [query, *a]\n"))
    assert "line 2: an alias (*name) refers to the list or mapping it is in" in message


def test_deep_nesting_made_of_aliases_is_refused(loader):
    text = "a: &a " + "[" * 20 + "1" + "]" * 20 + "\nb: " + "[" * 20 + "*a" + "]" * 20 + "\n"
    with pytest.raises(config_yaml.Refused, match="nested more than 32 levels deep once its aliases"):
        config_yaml.parse(text)


def test_too_many_values_are_refused(loader):
    with pytest.raises(config_yaml.Refused, match="more than 10,000 values"):
        config_yaml.parse("[" + "1, " * 20_000 + "]")


def test_a_large_file_is_refused_by_its_size_before_reading(tmp_path):
    big = tmp_path / "corpus.txt"
    with open(big, "wb") as f:  # 100 MB, sparse: only its size is ever looked at
        f.truncate(100 * 2**20)
    message = refused_quickly(big, seconds=0.5)
    assert message == f"{big}: 104,857,600 bytes; a parameters file holds at most 1,000,000 (is it the right file?)"
    two_mb = write(tmp_path, "train:\n  lr: 0.1\n" + "# padding\n" * 200_000, name="two_mb.yml")
    assert f"{os.path.getsize(two_mb):,} bytes; a parameters file holds at most 1,000,000" in refused_quickly(two_mb)


def test_a_text_corpus_given_as_params_is_one_line(tmp_path):
    prose = "".join(f"It was the best of times, it was the worst of times: line {i}.\n" for i in range(12_000))
    path = write(tmp_path, prose, name="book.txt")
    assert 500_000 < os.path.getsize(path) < 1_000_000
    message = refused_quickly(path)
    assert message.startswith(f"{path}: "), message


# ---- duplicates ----------------------------------------------------------------------------------------------
def test_duplicate_key_names_both_lines(tmp_path, loader):
    path = write(tmp_path, "train:\n  lr: 0.1\n  epochs: 2\n  lr: 0.3\n")
    assert refused_quickly(path) == (f"{path}: line 4: key `train.lr` is given twice, at lines 2 and 4 (the last "
                                     "would win silently); keep one")


def test_duplicate_section_names_both_lines(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.1\nmodel:\n  dropout: 0.1\ntrain:\n  epochs: 2\n")
    message = refused_quickly(path)
    assert "line 5: key `train` is given twice, at lines 1 and 5" in message, message


def test_duplicate_key_in_a_set_value_is_refused():
    message = refused_quickly(PARAMS, ["train={lr: 1, lr: 2}"])
    assert message.startswith("--set train={lr: 1, lr: 2}: key `lr` is given twice, at lines 1 and 1"), message


def test_a_set_key_goes_into_a_section_the_file_leaves_empty(tmp_path):
    path = write(tmp_path, "train:\n  # lr: 0.1\nlog:\n")  # every key commented out: the defaults, and --set's
    cfg = checked_config(str(path), ["train.max_steps=3", "log.progress_bar=false"])
    assert cfg.train.max_steps == 3 and cfg.log.progress_bar is False and cfg.train.lr == 1e-3


# ---- what is not YAML ------------------------------------------------------------------------------------------
def test_nul_byte_binary_and_syntax_errors_are_one_line(tmp_path, loader):
    nul = tmp_path / "nul.yml"
    nul.write_bytes(b"train:\n  lr: 0.1\x00\n")
    assert refused_quickly(nul) == f"{nul}: not valid YAML (it holds NUL bytes: a binary file, not a text file)"
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"\x80\x02weights")
    assert refused_quickly(binary).startswith(f"{binary}: not valid YAML (not UTF-8 text: byte 0 is 0x80")
    control = write(tmp_path, "train:\n  lr: 0.1\x07\n", name="bell.yml")
    assert refused_quickly(control).startswith(f"{control}: line 2: not valid YAML (character 0x07")
    bad = write(tmp_path, "train:\n  lr: 0.1\n   epochs: 3\n", name="bad.yml")
    assert refused_quickly(bad).startswith(f"{bad}: line 3: not valid YAML (")
    two = write(tmp_path, "train: {}\n---\nmodel: {}\n", name="two.yml")
    assert "line 2: not valid YAML (but found another document)" in refused_quickly(two)


def test_an_integer_python_cannot_read_is_one_line(tmp_path):
    message = refused_quickly(write(tmp_path, "seed: " + "1" * 5000 + "\n"))
    assert "holds a value Python cannot read" in message, message
    message = refused_quickly(PARAMS, ["seed=" + "9" * 5000])
    assert message.startswith("--set seed=99999") and "cannot read" in message, message


def test_wrong_type_message_cuts_the_value(tmp_path):
    message = refused_quickly(PARAMS, ["train.lr=" + "x" * 10_000])
    assert "`train.lr` must be a number, got 'xxx" in message and len(message) < 160, message
    message = refused_quickly(PARAMS, ["train.lr=[" + ", ".join(map(str, range(5000))) + "]"])
    assert "`train.lr` must be a number, got [0, 1, 2, 3, 4, 5, ...]" in message, message
    assert config_yaml.shown("y" * 1000) == "'" + "y" * 32 + "..." + "y" * 33 + "'"
    assert len(config_yaml.shown(list(range(10**5)))) <= 80


def test_set_value_that_is_not_yaml_stays_a_string():
    cfg = checked_config(PARAMS, ["data.data_dir=a: b: c", "output_dir=runs/x"])
    assert cfg.data.data_dir == "a: b: c"


# ---- end to end ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    (f"train:\n  lr: {laughs()}\n", "line 2: more than 10,000 values"),
    ("train:\n  lr: 0.1\n  lr: 0.2\n", "line 3: key `train.lr` is given twice, at lines 2 and 3"),
    ("model:\n  lora_targets: " + "[" * 10_000 + "]" * 10_000 + "\n", "line 2: nested more than 32 levels deep"),
])
def test_main_refuses_hostile_yaml_in_one_line_with_exit_2(tmp_path, capsys, text, words):
    path = write(tmp_path, text)
    start = time.perf_counter()
    assert main.main(["--params", str(path)]) == 2
    assert time.perf_counter() - start < 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: {words}" + err.split(words, 1)[1] and err.count("\n") == 1, err


def test_a_set_value_over_the_size_cap_is_refused():
    message = refused_quickly(PARAMS, ["data.data_dir=" + "x" * 1_000_001])
    assert message.startswith("--set data.data_dir=xxx") and "1,000,001 characters; a YAML value holds at most" \
        in message, message


def test_both_loaders_read_the_shipped_configs_as_safe_load_does(loader):
    import glob
    import yaml
    for path in [PARAMS, *sorted(glob.glob(os.path.join(ROOT, "configs", "*.yml")))]:
        text = open(path).read()
        assert config_yaml.parse(text) == yaml.safe_load(text), path


def test_numbers_with_an_exponent_are_numbers_inside_lists_and_mappings_too(tmp_path, loader):
    """YAML 1.1 reads `1e-3` as a string (a float wants a dot and a signed exponent): a scalar field turned it back
    into a number, but in train.betas it was refused as "must be two numbers" and in optimizer_args it reached the
    optimizer as a string. Read as YAML 1.2 and JSON read it, with either loader; other strings stay strings."""
    cfg = checked_config(str(write(tmp_path, "train:\n  betas: [0.9, 1e-3]\n  lr: 1.0e5\n")), ["train.eps=2E-8"])
    assert cfg.train.betas == [0.9, 0.001] and cfg.train.lr == 1e5 and cfg.train.eps == 2e-8
    cfg = checked_config(str(write(tmp_path, "train:\n  optimizer: SGD\n  optimizer_args: {momentum: 9e-1}\n")))
    assert cfg.train.optimizer_args == {"momentum": 0.9}
    assert config_yaml.parse("[1e3x, 1e, .5e-1, -2E+3, 1_0e2]") == ["1e3x", "1e", 0.05, -2000.0, 1000.0]
