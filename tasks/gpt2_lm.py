"""Causal language modelling with GPT-2 on a JSON array of texts.

Data: `train.json` in data.data_dir, a JSON array of strings; `dev.json` likewise, or, when it is absent, a fixed
data.dev_fraction of the training texts; `test.json` optional. Texts are tokenized once, joined with an
end-of-text token, and cut into blocks: block k is tokens [kT, kT + T] (T = data.max_length), its first T tokens
the input and its last T the targets, so every token is a target exactly once. One unit of the loss is one
TARGET TOKEN: count = batch x T, and dev `loss` is the mean per token, `perplexity` its exp.

Corpora larger than memory: data.data_dir may instead be a folder of token shards made by
`scripts/prepare_text.py --task lm` (it holds manifest.json): they are read lazily, with the same blocks
(tasks/token_shards.py), and the tokenizer is the one they were made with.

Tokenizer: model.pretrained_dir's, or a byte-level BPE trained on the training texts and saved to
<output_dir>/tokenizer (generate.py and `mode: test` load it from there).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from config import DataError
from tasks import token_shards
from tasks.base import Layer, Task
from tasks.text_common import load_or_train_tokenizer, read_utf8

GPT2_PRESETS = {  # randomly initialised sizes (model.pretrained_dir null)
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12),
    "tiny": dict(n_embd=64, n_layer=2, n_head=2),
}


def read_texts(path: str) -> list[str]:
    """The JSON array of strings in `path`. Everything the tokenizer would choke on later (invalid UTF-8, JSON
    that is not an array of strings, a lone surrogate) is a DataError naming the file, and the line or item."""
    try:
        texts = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON at column {e.colno} ({e.msg})") from None
    if not isinstance(texts, list):
        raise DataError(f"{path}: expected a JSON array of strings, got {json_kind(texts)}")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"{path}: expected a JSON array of strings; item {bad} is {json_kind(texts[bad])}")
    if not texts:
        raise DataError(f"{path}: no texts")
    check_surrogates(path, texts)
    return texts


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words (a dict is an object, a float a number)."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "true/false", int: "a number",
             float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def check_surrogates(path: str, texts: list[str]) -> None:
    """JSON may spell a lone UTF-16 surrogate (`"\\ud800"`): valid JSON, but not text. The tokenizer refuses it
    with a bare TypeError naming nothing, so find it here: one encode of all texts, item by item only on error."""
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{path}: item {i} holds a lone surrogate \\u{ord(text[e.start]):04x} at character "
                                f"{e.start}, which is not text; escapes \\ud800-\\udfff must come in valid pairs")


class Blocks(Dataset):
    """[N, T + 1] token ids; sample k is one block (inputs = [:-1], targets = [1:])."""

    def __init__(self, texts: list[str], tokenizer, block: int, path: str):
        ids = []
        for text_ids in tokenizer(texts)["input_ids"]:
            ids += text_ids + [tokenizer.eos_token_id]  # the end-of-text token separates documents
        n = (len(ids) - 1) // block
        if n == 0:
            raise DataError(f"{path}: {len(ids)} tokens, fewer than one block of data.max_length={block} + 1")
        flat = torch.tensor(ids[: n * block + 1])
        self.path = path
        self.blocks = flat.unfold(0, block + 1, block)  # overlapping by one token: [n, block + 1]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i, :-1], "labels": self.blocks[i, 1:]}


class GPT2LMTask(Task):
    best_metric_default = "loss"

    def read_splits(self) -> dict:
        d = self.cfg.data
        path = lambda split: os.path.join(d.data_dir, f"{split}.json")  # noqa: E731
        if not os.path.isfile(path("train")):
            raise DataError(f"{path('train')}: missing. gpt2_lm reads a JSON array of texts from data.data_dir")
        texts = {"train": read_texts(path("train"))}
        if os.path.isfile(path("dev")):
            texts["dev"] = read_texts(path("dev"))
        else:  # a fixed holdout of whole texts, independent of the training seed
            order = np.random.default_rng(0).permutation(len(texts["train"]))
            n_dev = max(1, int(round(len(order) * d.dev_fraction)))
            if n_dev >= len(order):
                raise DataError(f"{path('train')}: {len(order)} texts, too few to hold out a dev split "
                                f"(add {path('dev')})")
            texts["dev"] = [texts["train"][i] for i in sorted(order[:n_dev])]
            texts["train"] = [texts["train"][i] for i in sorted(order[n_dev:])]
        if os.path.isfile(path("test")):
            texts["test"] = read_texts(path("test"))
        return texts

    def build_datasets(self) -> dict:
        if token_shards.is_prepared(self.cfg.data.data_dir):  # scripts/prepare_text.py's folder: read lazily
            return self.build_shard_datasets()
        texts = self.read_splits()
        self.tokenizer = load_or_train_tokenizer(self.cfg, lambda: texts["train"], kind="gpt2")
        where = {split: os.path.join(self.cfg.data.data_dir, f"{split}.json") for split in texts}
        datasets = {s: Blocks(t, self.tokenizer, self.cfg.data.max_length, where[s]) for s, t in texts.items()}
        self.datasets = datasets  # for check_fits, once the model is known
        datasets.setdefault("test", None)
        return datasets

    def build_shard_datasets(self) -> dict:
        """Corpora larger than memory: token shards made by scripts/prepare_text.py --task lm, memory-mapped
        (tasks/token_shards.py). The blocks are the ones the JSON path cuts from the same texts."""
        folder = self.cfg.data.data_dir
        manifest = token_shards.read_manifest(folder, "lm")
        self.tokenizer = token_shards.run_tokenizer(self.cfg, folder, manifest)
        datasets = {split: token_shards.TokenBlocks(folder, manifest, split, self.cfg.data.max_length)
                    for split in manifest["splits"]}
        self.datasets = datasets  # for check_fits
        datasets.setdefault("test", None)
        return datasets

    def build_model(self) -> nn.Module:
        """Needs self.tokenizer (build_datasets, or load_tokenizer for generation)."""
        from transformers import GPT2Config, GPT2LMHeadModel
        m = self.cfg.model
        if m.pretrained_dir:
            # -----> start from another causal LM checkpoint (any GPT-2 style HF folder).
            model = GPT2LMHeadModel.from_pretrained(m.pretrained_dir)
            self.check_fits(model.config)
            return model
        if m.name not in GPT2_PRESETS:
            raise DataError(f"model.name: gpt2_lm builds {', '.join(GPT2_PRESETS)}, not {m.name!r}")
        # -----> the randomly initialised model: change its sizes in GPT2_PRESETS.
        config = GPT2Config(vocab_size=len(self.tokenizer), n_positions=max(1024, self.cfg.data.max_length),
                            resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout,
                            bos_token_id=self.tokenizer.eos_token_id, eos_token_id=self.tokenizer.eos_token_id,
                            **GPT2_PRESETS[m.name])
        return GPT2LMHeadModel(config)

    def check_fits(self, config) -> None:
        """The blocks fit the pretrained model: token ids inside its vocabulary (a tokenizer with added tokens
        and a model not resized to it disagree), data.max_length inside its position table. Checked before
        training; otherwise the embedding lookup fails mid-run with an index error naming no file."""
        if self.cfg.data.max_length > config.n_positions:
            raise DataError(f"data.max_length={self.cfg.data.max_length} is longer than the {config.n_positions} "
                            f"positions of model.pretrained_dir's model; set it to at most {config.n_positions}")
        problem = token_shards.check_vocabulary(getattr(self, "datasets", {}), config.vocab_size)
        if problem:  # shards: their manifest knows the largest id
            raise DataError(problem)
        for split, blocks in getattr(self, "datasets", {}).items():
            if blocks is None or not hasattr(blocks, "blocks"):
                continue
            flat = blocks.blocks.reshape(-1)
            top = int(flat.argmax())
            if int(flat[top]) >= config.vocab_size:
                raise DataError(f"{blocks.path}: block {top // blocks.blocks.shape[1]} has token id {int(flat[top])}, "
                                f"outside the model's vocabulary (vocab_size {config.vocab_size}: ids 0-"
                                f"{config.vocab_size - 1}); model.pretrained_dir's tokenizer and model disagree")

    def load_tokenizer(self):
        """For generation: the tokenizer the training run used (never trains a new one)."""
        self.tokenizer = load_or_train_tokenizer(self.cfg, None, kind="gpt2")
        return self.tokenizer

    def count(self, batch: dict) -> int:
        return batch["labels"].numel()  # one unit = one target token

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.loss_from_output(model(input_ids=batch["input_ids"]).logits, batch["labels"])

    def loss_from_output(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # -----> the LM loss: next-token cross-entropy summed over every target token.
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")

    def eval_batch(self, model: nn.Module, batch: dict) -> dict:
        return self.eval_from_output(model(input_ids=batch["input_ids"]).logits, batch)

    def eval_from_output(self, logits: torch.Tensor, batch: dict) -> dict:
        loss = self.loss_from_output(logits, batch["labels"])
        return {"loss_sum": loss, "tokens": torch.tensor(float(batch["labels"].numel()), device=loss.device)}

    def pipeline_layers(self, model: nn.Module) -> list[nn.Module]:
        """GPT-2 as a chain: embeddings, the blocks, final norm + LM head (GPT2Model.forward without caches or
        padding masks: every block is a fixed-length causal window). The LM head shares its weight with the
        token embedding; under pipe each end holds a copy and their gradients are added up."""
        t = model.transformer

        def embed(input_ids):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            return t.drop(t.wte(input_ids) + t.wpe(positions)[None])

        def head(hidden):
            return model.lm_head(t.ln_f(hidden))
        return [Layer(embed, t.wte, t.wpe, t.drop), *t.h, Layer(head, t.ln_f, model.lm_head)]

    def pipeline_inputs(self, batch: dict) -> tuple:
        return (batch["input_ids"],)

    # mode: export (export.py): a Hugging Face folder for AutoModelForCausalLM / pipeline("text-generation").
    export_formats = ("hf",)
    hf_pipeline = "text-generation"

    def prepare_inference(self) -> None:
        self.load_tokenizer()

    def hf_model(self, model: nn.Module):
        return model

    def metrics(self, totals: dict) -> dict:
        loss = totals["loss_sum"] / max(totals["tokens"], 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(totals["tokens"])}
