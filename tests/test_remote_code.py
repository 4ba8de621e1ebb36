"""A pretrained folder is untrusted data (tasks/untrusted_folders.py): one that needs its own code (`auto_map` and a
model type transformers does not know) is refused in one line before transformers could ask "Do you wish to run
the custom code?", even with "y" waiting on stdin; a pickled pytorch_model.bin that would run code is refused in
one line; the .py and the pickle never run (their marker files stay absent). Every loader call in the product files
passes trust_remote_code=False (checked on their syntax trees)."""
import ast
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, save_tiny_minilm

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_sample_text_data as sample  # noqa: E402

from core.errors import DataError
from tasks import untrusted_folders  # noqa: E402
from tasks.text_common import check_pretrained_dir, load_tokenizer_folder  # noqa: E402


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return save_tiny_minilm(tmp_path_factory.mktemp("minilm") / "model")


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    return sample.write_sst2(str(tmp_path_factory.mktemp("sst2")), random.Random(0))


def custom_code_folder(minilm, tmp_path, where="config.json"):
    """The tiny BERT made to need its own code: an unknown model_type, an auto_map in `where`, and the .py it names,
    which creates a marker file when imported."""
    folder = tmp_path / "custom"
    os.system(f"cp -r {minilm} {folder}")
    marker = tmp_path / "custom_code_ran"
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                             "from transformers import BertConfig, BertModel\n"
                                             "class EvilConfig(BertConfig):\n    model_type = 'evil-bert'\n"
                                             "class EvilModel(BertModel):\n    config_class = EvilConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evil-bert"
    entry = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModel": "modeling_evil.EvilModel",
             "AutoModelForSequenceClassification": "modeling_evil.EvilModel"}
    if where == "tokenizer_config.json":
        tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
        tokenizer["auto_map"] = {"AutoTokenizer": ["modeling_evil.EvilTokenizer", None]}
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    else:
        config["auto_map"] = entry
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def evil_pickle_folder(minilm, tmp_path):
    """The tiny BERT with its weights as a pickle (pytorch_model.bin, no safetensors) that runs a command when
    unpickled without weights_only."""
    folder = tmp_path / "pickled"
    os.system(f"cp -r {minilm} {folder}")
    os.remove(folder / "model.safetensors")
    marker = tmp_path / "pickle_ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    torch.save({"bert.embeddings.word_embeddings.weight": torch.zeros(2, 2), "evil": Evil()},
               folder / "pytorch_model.bin")
    return folder, marker


def run_main(tmp_path, sst2, folder, stdin="y\n" * 5):
    return subprocess.run([sys.executable, "main.py", "--params", "configs/sst2_minilm.yml",
                           "--set", f"model.pretrained_dir={folder}", "--set", f"data.data_dir={sst2}",
                           "--set", f"output_dir={tmp_path / 'run'}", "--set", "train.max_steps=2",
                           "--set", "log.tensorboard=false"],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr and "[y/N]" not in result.stdout + result.stderr
    return lines[0]


def test_a_folder_needing_custom_code_is_refused_in_one_line_even_with_y_on_stdin(minilm, sst2, tmp_path):
    folder, marker = custom_code_folder(minilm, tmp_path)
    line = one_line(run_main(tmp_path, sst2, folder))
    assert str(folder) in line and "auto_map" in line and "modeling_evil.EvilConfig" in line and "evil-bert" in line
    assert not marker.exists()


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_check_pretrained_dir_refuses_custom_code_from_either_file(minilm, tmp_path, where):
    folder, marker = custom_code_folder(minilm, tmp_path, where)
    with pytest.raises(DataError, match=rf"{where}'s auto_map") as e:
        check_pretrained_dir(str(folder))
    assert "\n" not in str(e.value) and str(folder) in str(e.value)
    with pytest.raises(DataError, match="data.tokenizer"):
        load_tokenizer_folder(str(folder))
    assert not marker.exists()


def test_every_loader_passes_trust_remote_code_false(minilm, tmp_path):
    """Past our check (called directly), transformers itself refuses to run the folder's code: no prompt."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    folder, marker = custom_code_folder(minilm, tmp_path)
    for load in (AutoConfig.from_pretrained, AutoModelForSequenceClassification.from_pretrained):
        with pytest.raises(ValueError):
            load(str(folder), trust_remote_code=False)
    assert not marker.exists()
    calls, unsafe = loader_calls(ROOT)
    assert calls >= 10 and unsafe == [], unsafe  # (a dozen loaders in tasks/, generate.py, scripts/, benchmarks/)


LOADERS = ("from_pretrained", "pipeline", "AutoConfig")  # a call of any of these names may load a folder's code


def loader_calls(root: str, sources: dict = None) -> tuple[int, list[str]]:
    """(how many calls of LOADERS, `file:line` of each that does not pass trust_remote_code=False) in every .py
    file under `root` but tests/ (or in `sources`: {name: code})."""
    if sources is None:
        sources = {}
        for parent, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "runs", "__pycache__")]
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(parent, name)) as f:
                        sources[os.path.relpath(os.path.join(parent, name), root)] = f.read()
    calls, unsafe = 0, []
    for name, code in sorted(sources.items()):
        for node in ast.walk(ast.parse(code, name)):
            func = getattr(node, "func", None)
            called = getattr(func, "attr", None) or getattr(func, "id", None)
            if isinstance(node, ast.Call) and called in LOADERS:
                calls += 1
                given = {k.arg: k.value for k in node.keywords}.get("trust_remote_code")
                if not (isinstance(given, ast.Constant) and given.value is False):
                    unsafe.append(f"{name}:{node.lineno}")
    return calls, unsafe


def test_the_loader_check_finds_each_unsafe_call():
    code = ("from transformers import AutoConfig, AutoModel, pipeline\n"
            "AutoConfig.from_pretrained(d)\n"
            "x = dict(a=AutoModel.from_pretrained(d, trust_remote_code=True))\n"
            "pipeline('text-classification', model=d, **kwargs)\n"
            "AutoModel.from_pretrained(d, trust_remote_code=False)\n")
    calls, unsafe = loader_calls("", {"x.py": code})
    assert calls == 4 and sorted(unsafe) == ["x.py:2", "x.py:3", "x.py:4"]


def test_a_known_model_type_with_an_auto_map_loads_transformers_own_class(minilm, tmp_path):
    folder, marker = custom_code_folder(minilm, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    assert check_pretrained_dir(str(folder)) == str(folder)
    from transformers import AutoModelForSequenceClassification
    AutoModelForSequenceClassification.from_pretrained(str(folder), trust_remote_code=False)
    assert not marker.exists()


@pytest.mark.slow  # 5 s: `python main.py` on the folder; quick loop: the pretrained loaders' unit tests
def test_a_malicious_pickle_is_refused_in_one_line(minilm, sst2, tmp_path):
    folder, marker = evil_pickle_folder(minilm, tmp_path)
    line = one_line(run_main(tmp_path, sst2, folder))
    assert f"{folder}/pytorch_model.bin: refused" in line and "posix.system" in line and "weights_only" in line
    assert not marker.exists()


def test_pickled_weights_of_plain_tensors_load(minilm, tmp_path):
    from transformers import BertModel
    folder = tmp_path / "bin"
    os.system(f"cp -r {minilm} {folder}")
    os.remove(folder / "model.safetensors")
    torch.save(BertModel.from_pretrained(minilm).state_dict(), folder / "pytorch_model.bin")
    untrusted_folders.check_pickled_weights(str(folder))
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="pytorch_model.bin: refused: "):
        untrusted_folders.check_pickled_weights(str(folder))


def test_a_rank_reads_no_stdin():
    """faults.no_stdin, called first in every rank (wiring.worker, launcher.rank_main): a prompt gets end-of-file."""
    code = ("import os\nfrom resilience import faults\nfaults.no_stdin()\nassert os.read(0, 10) == b''\n"
            "try:\n    input('run the custom code? [y/N] ')\nexcept EOFError:\n    print('eof')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, input="y\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.endswith("eof\n"), r.stderr
