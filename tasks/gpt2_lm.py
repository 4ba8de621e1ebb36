"""Causal language modelling (GPT-2, or the model section's decoder) on your text.

Data (tasks/lm_data.py): text files in data.data_dir (plain text, a JSON array of texts or JSON lines), tokenized
once by data.tokenizer into one token stream per split, each text followed by the end-of-text token. Dev is the
dev files or, by data.dev_split, the tail of the training stream or whole held-out texts. Training samples are
windows of T + 1 tokens (T = data.max_length; inputs the first T, targets the last T) by data.windows:
non-overlapping blocks (block k starts at kT, so every token is a target once per epoch) or random offsets
(nanoGPT's). Dev and test are blocks. One unit of the loss is one TARGET TOKEN: count = batch x T, and dev `loss`
is the mean per token, `perplexity` its exp.

Corpora larger than memory: data.data_dir may instead be a folder of token shards made by
`scripts/prepare_text.py --task lm` (it holds manifest.json): they are read lazily, with the same windows
(tasks/token_shards.py), and the tokenizer and splits are the ones they were made with.

Tokenizer (data.tokenizer): model.pretrained_dir's; `bpe` a byte-level BPE trained on the training texts; `char`
one id per character; `byte` one per byte; or a tokenizer folder. Saved to <output_dir>/tokenizer (resume,
`mode: test`, export and generate.py load it from there).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import DataError
from core.file_names import shown_name
from tasks import lm_data, lm_models, token_shards
from tasks.base import Task
from tasks.lm_data import Blocks
from tasks.text_common import load_or_train_tokenizer

TOKENIZER_KINDS = {"auto": "gpt2", "bpe": "gpt2", "char": "char", "byte": "byte"}  # data.tokenizer -> trained kind


class GPT2LMTask(Task):
    best_metric_default = "loss"
    lower_is_better = ("loss", "perplexity")
    generates_text = True
    has_pipeline_chain = has_tp_plan = True

    def build_datasets(self) -> dict:
        if token_shards.is_prepared(self.cfg.data.data_dir):  # scripts/prepare_text.py's folder: read lazily
            return self.build_shard_datasets()
        d = self.cfg.data
        texts, where = lm_data.read_splits(d)
        self.tokenizer = self.make_tokenizer(lambda: texts["train"])
        streams = {split: lm_data.token_stream(t, self.tokenizer) for split, t in texts.items()}
        if "dev" not in streams:  # data.dev_split tail: the end of the training stream
            streams["train"], streams["dev"] = lm_data.split_tail(streams["train"], d.dev_fraction, d.max_length,
                                                                  where["train"])
            where["dev"] = f"{where['train']} (last {d.dev_fraction:g} of its tokens)"
        datasets = {s: lm_data.windows(self.cfg, Blocks(t, d.max_length, where[s]), s) for s, t in streams.items()}
        self.datasets = datasets  # for check_fits, once the model is known
        datasets.setdefault("test", None)
        return datasets

    def read_splits(self) -> dict:
        """The texts of each split (dev: files or held-out texts; none yet with dev_split tail)."""
        return lm_data.read_splits(self.cfg.data)[0]

    def make_tokenizer(self, texts):
        """data.tokenizer's tokenizer: trained on `texts()` (bpe, char, byte) or a folder's, saved in output_dir."""
        choice = self.cfg.data.tokenizer
        return load_or_train_tokenizer(self.cfg, texts, TOKENIZER_KINDS.get(choice, "gpt2"),
                                       folder_from=None if choice in TOKENIZER_KINDS else choice)

    def build_shard_datasets(self) -> dict:
        """Corpora larger than memory: token shards made by scripts/prepare_text.py --task lm, memory-mapped
        (tasks/token_shards.py). The windows are the ones the text path cuts from the same texts."""
        d = self.cfg.data
        folder = d.data_dir
        if d.tokenizer != "auto" or d.dev_split not in ("auto", "files"):
            key = "data.tokenizer" if d.tokenizer != "auto" else "data.dev_split"
            raise DataError(f"{shown_name(folder)}: token shards carry their tokenizer and dev split "
                            f"(scripts/prepare_text.py --tokenizer, --dev-fraction); {key} must stay auto with them")
        manifest = token_shards.read_manifest(folder, "lm")
        self.tokenizer = token_shards.run_tokenizer(self.cfg, folder, manifest)
        datasets = {split: lm_data.windows(self.cfg, token_shards.TokenBlocks(folder, manifest, split, d.max_length),
                                           split) for split in manifest["splits"]}
        self.datasets = datasets  # for check_fits
        datasets.setdefault("test", None)
        return datasets

    def build_model(self) -> nn.Module:
        """Needs self.tokenizer (build_datasets, or load_tokenizer for generation)."""
        # -----> the model: its architecture and shape come from the model section (tasks/lm_models.py).
        model = lm_models.build_causal_lm(self.cfg, len(self.tokenizer), self.tokenizer.eos_token_id)
        if self.cfg.model.pretrained_dir:
            self.check_fits(model.config)
        return model

    def model_built(self, model: dict) -> dict:
        return lm_models.built_shape(self.cfg, model, lm_models.PRESETS, lm_models.PRESET_WORDS, arch="gpt2")

    def check_fits(self, config) -> None:
        """The blocks fit the pretrained model: token ids inside its vocabulary (a tokenizer with added tokens
        and a model not resized to it disagree), data.max_length inside its position table. Checked before
        training; otherwise the embedding lookup fails mid-run with an index error naming no file."""
        positions = getattr(config, "n_positions", None) or config.max_position_embeddings  # GPT-2's, Llama's
        if self.cfg.data.max_length > positions:
            raise DataError(f"data.max_length={self.cfg.data.max_length} is longer than the {positions} "
                            f"positions of model.pretrained_dir's model; set it to at most {positions}")
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
        self.tokenizer = self.make_tokenizer(None)
        return self.tokenizer

    def count(self, batch: dict) -> int:
        return batch["labels"].numel()  # one unit = one target token

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        # No KV cache (transformers builds one by default): nothing reuses it, and writing it inside a checkpointed
        # block is a side effect that makes TorchDynamo leave the block uncompiled (train.compile under fsdp).
        return self.loss_from_output(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["labels"])

    def loss_from_output(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # -----> the LM loss: next-token cross-entropy summed over every target token.
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")

    def eval_batch(self, model: nn.Module, batch: dict) -> dict:
        return self.eval_from_output(model(input_ids=batch["input_ids"], use_cache=False).logits, batch)

    def eval_from_output(self, logits: torch.Tensor, batch: dict) -> dict:
        loss = self.loss_from_output(logits, batch["labels"])
        return {"loss_sum": loss, "tokens": torch.tensor(float(batch["labels"].numel()), device=loss.device)}

    def pipeline_layers(self, model: nn.Module) -> list[nn.Module]:
        d = self.cfg.dist
        return lm_models.pipeline_layers(model, d.tp if d.sequence_parallel else 1)

    def tp_plan(self, model: nn.Module, tp: int) -> dict:
        return lm_models.tp_plan(model, tp, self.cfg.dist.sequence_parallel, self.cfg.dist.loss_parallel)

    def pipeline_inputs(self, batch: dict) -> tuple:
        return (batch["input_ids"],)

    # mode: export (export.py): a Hugging Face folder for AutoModelForCausalLM / pipeline("text-generation").
    export_formats = ("hf",)
    hf_pipeline = "text-generation"

    def prepare_inference(self, label_names: Optional[list[str]]) -> None:
        self.load_tokenizer()

    def hf_model(self, model: nn.Module):
        return model

    def metrics(self, totals: dict) -> dict:
        loss = totals["loss_sum"] / max(totals["tokens"], 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(totals["tokens"])}
