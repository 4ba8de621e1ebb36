"""Every classifier exports with its labels (issue 34, item 1): csv_text's bag of words becomes a Hugging Face
folder that pipeline("text-classification") reads with the data's label names and test mode's predictions;
sst2's prepared shards export the names given to scripts/prepare_text.py --labels; the plan names the classes."""
import csv
import dataclasses
import json
import os
import re
import random

import pytest
import torch

import main
from conftest import ROOT, free_port
from wiring import checked_config

CLASSES = {"billing": ["invoice", "refund", "charged", "payment", "price"],
           "bug report": ["crash", "error", "broken", "freezes", "fails"],
           "praise": ["love", "great", "thanks", "wonderful", "helpful"]}
FILLER = ["the", "app", "my", "today", "it", "again", "please", "this", "account", "when", "i", "was", "so"]


pytestmark = pytest.mark.usefixtures("hf_offline")  # (conftest.py)


def write_tickets(folder, sizes=(240, 60)) -> dict:
    """Support tickets as CSV with three named classes; a ticket's class follows from its keywords (with noise)."""
    rng = random.Random(0)
    os.makedirs(folder)
    rows = {}
    for split, n in zip(("train", "dev"), sizes):
        rows[split] = []
        for i in range(n):
            label = list(CLASSES)[i % 3]
            words = rng.sample(FILLER, 5) + rng.sample(CLASSES[label], 2) + [rng.choice(CLASSES[list(CLASSES)[
                rng.randrange(3)]])]
            rng.shuffle(words)
            rows[split].append((" ".join(words).capitalize() + rng.choice([".", "!", "?!"]), label))
        with open(os.path.join(folder, f"{split}.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["ticket", "team"])
            w.writerows(rows[split])
    return rows


def test_csv_text_trains_tests_and_exports_for_pipeline_under_ddp(tmp_path):
    """configs/csv_text.yml with no code, on 2 ranks: train, test, export, then pipeline() on the dev texts gives
    the label names and the checkpoint's predictions."""
    from transformers import pipeline
    from core import checkpoint
    from core import checkpoint_meta
    from core import checkpoint_io
    from wiring import build_task
    rows = write_tickets(tmp_path / "tickets")
    out = tmp_path / "run"
    cfg = checked_config(os.path.join(ROOT, "configs", "csv_text.yml"), [
        f"data.data_dir={tmp_path / 'tickets'}", "data.text_column=ticket", "data.label_column=team",
        f"output_dir={out}", "dist.strategy=ddp", "dist.procs_per_node=2", f"dist.master_port={free_port()}",
        "train.max_steps=40", "log.progress_bar=false", "log.tensorboard=false"])
    assert main.run(cfg) == 0
    log = open(out / "logs" / "rank0.log").read()
    assert "task csv_text (" in log and re.search(r"3 classes: billing \d+, bug report \d+, praise \d+", log), log[:2000]
    assert main.run(dataclasses.replace(cfg, mode="test")) == 0
    tested = json.load(open(out / "dev_results.json"))["metrics"]
    assert main.run(dataclasses.replace(cfg, mode="export")) == 0

    folder = out / "export"
    config = json.load(open(folder / "config.json"))
    assert config["id2label"] == {"0": "billing", "1": "bug report", "2": "praise"}
    assert config["label2id"] == {"billing": 0, "bug report": 1, "praise": 2}
    texts, labels = zip(*rows["dev"])
    pipe = pipeline("text-classification", model=str(folder), device="cpu")
    results = pipe(list(texts), top_k=None, function_to_apply="none", truncation=True, batch_size=16)
    exported = torch.tensor([[{s["label"]: s["score"] for s in row}[name] for name in CLASSES] for row in results])
    assert [pipe(t, truncation=True)[0]["label"] for t in texts[:3]] == [list(CLASSES)[i] for i in
                                                                         exported[:3].argmax(-1)]

    task = build_task(cfg)  # the checkpoint's model on the same texts, batched as the task batches them
    task.prepare_inference(None)
    model = task.build_model()
    checkpoint_io.load_model(model, checkpoint_meta.best_recorded(str(out)), cfg)
    dev = task.build_datasets()["dev"]
    with torch.no_grad():
        ours = model.eval()(task.collate([dev[i] for i in range(len(dev))])["ids"])
    assert torch.allclose(exported, ours, atol=1e-4), (exported - ours).abs().max()
    preds = exported.argmax(-1)
    assert torch.equal(preds, ours.argmax(-1))
    gold = torch.tensor([list(CLASSES).index(y) for y in labels])
    assert (preds == gold).double().mean().item() == pytest.approx(tested["accuracy"])
    assert len(set(preds.tolist())) == 3, "a classifier that says one label for everything proves little"
    readme = open(folder / "README.md").read()
    assert 'pipeline("text-classification", model=FOLDER)' in readme


def test_bag_of_words_export_equals_the_model_on_odd_texts(tmp_path):
    """The conversion alone, in this process, on a random model: unknown words, case, punctuation, apostrophes,
    repeated words, long texts cut at data.max_length and texts without a word (an emoji: was NaN) give the model's
    logits."""
    from torch import nn
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from tasks import bag_of_words_hf
    from tasks.csv_text import words
    torch.manual_seed(0)
    vocab = {w: i for i, w in enumerate(["a", "don't", "good", "ok", "the", "x1"], 2)}
    model = nn.Sequential(nn.EmbeddingBag(len(vocab) + 2, 8, mode="mean", padding_idx=0), nn.Dropout(0.5),
                          nn.Linear(8, 4)).eval()
    with torch.no_grad():
        model[0].weight.mul_(5)  # logits far apart, some very negative: the offsets must cope
    bag_of_words_hf.hf_classifier(model, ["w", "x", "y", "z"]).save_pretrained(tmp_path)
    bag_of_words_hf.hf_tokenizer(vocab, 6).save_pretrained(tmp_path)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["GOOD good, good!", "Don't -- x1?", "unseen words only", "the a ok good the a ok good x1",
             "Ünïcode ok; tabs\tand\nlines", "\N{GRINNING FACE}!!", " -- \n"]  # no word: csv_text's one unknown
    enc = tok(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf(**enc).logits
        ours = torch.cat([model(torch.tensor([[vocab.get(w, 1) for w in words(t)][:6] or [1]])) for t in texts])
    assert torch.allclose(theirs, ours, atol=1e-4), (theirs - ours).abs().max()
    assert hf.config.id2label == {0: "w", 1: "x", 2: "y", 3: "z"}


def test_sst2_on_prepared_shards_exports_their_label_names(tmp_path):
    import sys
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import prepare_text
    from transformers import pipeline
    rows = write_tickets(tmp_path / "tickets", sizes=(60, 30))
    names = list(CLASSES)
    for split in ("train", "dev"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows[split])
    assert prepare_text.main(["--task", "classification", "--train", str(tmp_path / "train.jsonl"), "--dev",
                              str(tmp_path / "dev.jsonl"), "--output", str(tmp_path / "shards"), "--labels",
                              ",".join(names), "--train-tokenizer", "bpe", "--workers", "1"]) == 0
    from conftest import make_config
    cfg = make_config(tmp_path / "run", task="sst2", data={"data_dir": str(tmp_path / "shards"), "max_length": 32},
                      model={"name": "tiny"}, train={"max_steps": 2, "epochs": 0, "batch_size": 16,
                                                     "eval_every": 0})
    assert main.run(cfg) == 0
    assert "3 classes: billing, bug report, praise" in open(tmp_path / "run" / "logs" / "rank0.log").read()
    assert main.run(dataclasses.replace(cfg, mode="export")) == 0
    pipe = pipeline("text-classification", model=str(tmp_path / "run" / "export"), device="cpu")
    assert pipe.model.config.id2label == dict(enumerate(names))
    assert {r["label"] for r in pipe([t for t, _ in rows["dev"]][:8], truncation=True)} <= set(names)
    # the shards gone (the run copied elsewhere): predict takes the classes from the checkpoint, as the export does
    os.rename(tmp_path / "shards", tmp_path / "elsewhere")
    (tmp_path / "new.txt").write_text("".join(t + "\n" for t, _ in rows["dev"][:8]))
    assert main.run(dataclasses.replace(cfg, mode="predict", predict=dataclasses.replace(
        cfg.predict, input=str(tmp_path / "new.txt"), top_k=3))) == 0
    table = list(csv.reader(open(tmp_path / "run" / "predictions.csv", newline="")))
    assert len(table) == 9 and all(sorted(row[1::2]) == sorted(names) for row in table[1:]), table


def test_sst2_shards_without_label_names_export_label_n_and_a_count_mismatch_is_one_line(tmp_path, capsys,
                                                                                        monkeypatch):
    """Issue 40, item 7: two classes known only by number used to export as SST-2's negative/positive."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import prepare_text
    from conftest import make_config
    from tasks.sst2 import SST2Task
    rows = write_tickets(tmp_path / "tickets", sizes=(40, 20))
    for split in ("train", "dev"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t, "label": int(y == "praise")}) + "\n" for t, y in rows[split])
    assert prepare_text.main(["--task", "classification", "--train", str(tmp_path / "train.jsonl"), "--dev",
                              str(tmp_path / "dev.jsonl"), "--output", str(tmp_path / "shards"),
                              "--train-tokenizer", "bpe", "--workers", "1"]) == 0
    cfg = make_config(tmp_path / "run", task="sst2", data={"data_dir": str(tmp_path / "shards"), "max_length": 32},
                      model={"name": "tiny"}, train={"max_steps": 1, "epochs": 0, "batch_size": 16,
                                                     "eval_every": 0})
    assert main.run(cfg) == 0
    assert main.run(dataclasses.replace(cfg, mode="export")) == 0
    from transformers import AutoConfig

    def labels(folder):
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False).id2label
    assert labels(tmp_path / "run" / "export") == {0: "LABEL_0", 1: "LABEL_1"}
    os.rename(tmp_path / "shards", tmp_path / "elsewhere")  # the run copied without its shards: still by number
    assert main.run(dataclasses.replace(cfg, mode="export", export=dataclasses.replace(
        cfg.export, dir=str(tmp_path / "export-1")))) == 0
    assert labels(tmp_path / "export-1") == {0: "LABEL_0", 1: "LABEL_1"}
    os.rename(tmp_path / "elsewhere", tmp_path / "shards")
    capsys.readouterr()
    monkeypatch.setattr(SST2Task, "label_names", lambda self: ["a", "b", "c"])
    assert main.run(dataclasses.replace(cfg, mode="export", export=dataclasses.replace(
        cfg.export, dir=str(tmp_path / "export-2")))) == 0
    assert "note: the data names 3 classes but the model has 2 outputs: config.json labels them LABEL_0 to " \
           "LABEL_1" in capsys.readouterr().out.splitlines()
    assert labels(tmp_path / "export-2") == {0: "LABEL_0", 1: "LABEL_1"}
