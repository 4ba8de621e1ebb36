"""What a task is: model + data + loss + metrics. The Trainer knows nothing else about it.

To add a task, subclass `Task`, fill in the methods below, and register it in wiring.py's TASKS.

Loss convention (the reason the Trainer can weight uneven batches exactly): `loss_sum` returns the loss SUMMED
over the batch's units, and `count` says how many units that is (samples for classification, target tokens for
language modelling). The Trainer divides by the count summed over all micro-batches and all ranks, so one
optimizer step always follows the mean gradient over the global batch, whatever each rank's share of it.
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterator, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from core.errors import ConfigError


class Task:
    best_metric_default = "accuracy"
    lower_is_better: tuple = ("loss",)
    """The metrics (of `metrics()`) where lower is better: train.best_mode auto takes min for them, max for others."""
    compiles_on_cpu = True
    """False: train.compile is refused on a CPU (torch 2.13's inductor computes wrong gradients for the model)."""
    generates_text = False
    """True: generate.py samples from this task's checkpoints (the run's closing lines say how)."""
    has_lengths = False
    """True: lengths() gives each sample's length, which data.group_by_length batches by (refused elsewhere)."""
    has_pipeline_chain = False
    """True: pipeline_layers() cuts the model into a chain, which dist.strategy pipe needs (refused elsewhere)."""
    has_tp_plan = False
    """True: tp_plan() names the linear layers dist.tp > 1 splits (refused elsewhere)."""
    reads_new_inputs = False
    """True: predict_inputs(path) (or predict_chunks) reads a file of new inputs, which mode predict labels (refused
    elsewhere)."""

    def __init__(self, cfg):
        self.cfg = cfg  # the whole Config: tasks read cfg.data and cfg.model

    # -----> a task builds its model here (random init, or cfg.model.pretrained_dir).
    def build_model(self) -> nn.Module:
        raise NotImplementedError

    # -----> a task reads its data here: one Dataset per split, items that `collate` turns into batches.
    def build_datasets(self) -> dict[str, Optional[Dataset]]:
        """{'train': ..., 'dev': ..., 'test': ...}; a split the data lacks is None."""
        raise NotImplementedError

    def start_epoch(self, dataset: Dataset, epoch: int) -> None:
        """Before each training epoch: a dataset that draws its samples per epoch (lm_data.RandomWindows) has a
        set_epoch, called here; others need nothing. Called in the main process and in each loader worker."""
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)

    def shard_sizes(self, dataset: Dataset) -> Optional[list[int]]:
        """The sizes of the shards a dataset reads one at a time (its `shard_sizes`: token shards, HDF5 shards), so
        that an epoch's order is drawn a shard at a time; None: any order is cheap."""
        return getattr(dataset, "shard_sizes", None)

    def collate(self, samples: list) -> dict[str, torch.Tensor]:
        """Turn a list of dataset items into one batch: a flat dict of tensors."""
        return default_collate(samples)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """How many units `loss_sum` adds up for this (CPU) batch. Called before the batch moves to the device."""
        return len(batch["labels"])

    def tokens(self, batch: dict[str, torch.Tensor]) -> Optional[int]:
        """Input tokens in this (CPU) batch, for the training line's tokens_per_s: the attention mask's ones (real
        tokens, padding left out), else the size of input_ids. None (no tokens_per_s): a batch without either."""
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return batch["input_ids"].numel() if "input_ids" in batch else None

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward pass and the loss summed (not averaged) over the batch's units."""
        raise NotImplementedError

    def eval_batch(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-batch results. 0-d tensors are summed over batches and ranks; 1-d tensors are concatenated."""
        raise NotImplementedError

    def metrics(self, totals: dict[str, np.ndarray]) -> dict[str, float]:
        """Final metrics from the summed / concatenated results of `eval_batch` over the whole split."""
        raise NotImplementedError

    # ---- pipe (dist.strategy: pipe, strategies/pipeline.py): the model as a chain of layers --------------------
    # -----> to pipeline a new model: list its layers in order; each takes the previous one's output (a tensor or a
    # tuple of tensors, e.g. hidden states and an attention mask) and must keep constant shapes from step to step;
    # then say so: has_pipeline_chain = True.
    def pipeline_layers(self, model: nn.Module) -> list[nn.Module]:
        """The model's forward as a chain: layers[0](*pipeline_inputs(batch)), then each layer on the previous
        output; the last layer's output goes to loss_from_output / eval_from_output. The stages cut this list."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its model splits into pipeline stages "
                                  "(Task.pipeline_layers)")

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple:
        """What the first layer takes."""
        raise NotImplementedError

    def pipeline_target(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One tensor the last stage's loss needs, cut into micro-batches along dim 0 like the inputs."""
        return batch["labels"]

    def loss_from_output(self, output, target: torch.Tensor) -> torch.Tensor:
        """loss_sum computed from the model's (the last layer's) output, for one micro-batch."""
        raise NotImplementedError

    def eval_from_output(self, output, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """eval_batch computed from the model's (the last layer's) output, for a whole evaluation batch."""
        raise NotImplementedError

    # ---- tensor parallelism (dist.tp > 1, strategies/tp.py): which linear layers split over a tp group ----------
    # -----> to split a new model's blocks: map each linear layer's name (wildcards allowed) to ColwiseParallel()
    # (split by output features) or RowwiseParallel() (by input features; its output is all-reduced); then say so:
    # has_tp_plan = True.
    def tp_plan(self, model: nn.Module, tp: int) -> dict:
        raise ConfigError(f"dist.tp: the {self.cfg.task} task has no tensor-parallel plan (Task.tp_plan names the "
                          "linear layers to split; tasks/text_common.bert_tp_plan is one); use dist.tp: 1")

    def label_names(self) -> Optional[list[str]]:
        """A classifier's class names as the data names them, in the order of its outputs (the plan lists them,
        an `hf` export's config.json maps ids to them): the task's `classes` where it has them (csv_text); None:
        not a classifier, or classes known only by number."""
        return getattr(self, "classes", None)

    def vocabulary_sha256(self) -> Optional[str]:
        """The sha256 of what turns inputs into ids (the task's tokenizer's vocabulary, or csv_text's words), which
        meta.json records and every load checks: another run's vocabulary reads each input as other ids, silently.
        None: inputs need none (images). Hashed once per tokenizer (every checkpoint save records it)."""
        tokenizer = getattr(self, "tokenizer", None)
        source = tokenizer if tokenizer is not None else getattr(self, "vocab", None)
        cached = getattr(self, "_vocabulary_hash", None)  # (what was hashed, its hash): held, so never another's id
        if cached is None or cached[0] is not source:
            vocabulary = tokenizer.get_vocab() if tokenizer is not None else source
            self._vocabulary_hash = (source, hashlib.sha256(json.dumps(sorted(vocabulary.items())).encode())
                                     .hexdigest() if vocabulary else None)
        return self._vocabulary_hash[1]

    def model_built(self, model: dict) -> dict:
        """`model`, a model section as a config holds it (saved with a checkpoint, or this run's), with each null
        key read as the value this task builds from it: a resume compares the two so (null and the value it means
        are one run). Here: as it is (the task has no such key)."""
        return model

    def classes_note(self) -> Optional[str]:
        """What the run's plan says of a classifier's classes (`3 classes: neg, neu, pos`, cut to ~80 characters);
        None where label_names() has none."""
        names = self.label_names()
        if not names:
            return None
        shown = ", ".join(map(str, names))
        return f"{len(names)} classes: " + (shown if len(shown) <= 80 else shown[:77].rsplit(",", 1)[0] + ", ...")

    def data_name(self) -> str:
        """What the run's plan names as this task's data."""
        return self.cfg.data.data_dir

    def lengths(self, dataset: Dataset) -> Optional[list[int]]:
        """Per-sample lengths for `data.group_by_length` (a task that has them says so: has_lengths)."""
        return None

    # ---- mode: export (export.py) and generate.py: the trained model outside the training loop ----------------
    export_formats: tuple = ()
    """What `mode: export` can write for this task (export.format); `auto` writes all of them."""

    def prepare_inference(self, label_names: Optional[list[str]]) -> None:
        """Set up what build_model needs for export and predict, without preparing training: by default the
        datasets (csv_text: only for a run older than its vocabulary.json); text tasks load the tokenizer the training
        run used, and image_folder takes `label_names`, the classes the checkpoint records (None: an older one), for the folders'."""
        self.build_datasets()

    # -----> mode: predict (extras/predict.py): a classifier's new inputs (say so: reads_new_inputs) and its logits.
    def predict_inputs(self, path: str) -> tuple[list[str], Dataset]:
        """The inputs in predict.input `path`: their names (predictions.csv's first column) and a Dataset of them.
        The tasks here give them a chunk at a time (predict_chunks), this their one chunk of all."""
        if type(self).predict_chunks is Task.predict_chunks:
            raise NotImplementedError(f"{type(self).__name__} does not read new inputs (Task.predict_inputs)")
        (names, dataset), = self.predict_chunks(path, None)
        return names, dataset

    def predict_chunks(self, path: str, size: Optional[int]) -> Iterator[tuple[list[str], Dataset]]:
        """predict_inputs' names and Dataset, `size` inputs at a time (None: all; at least one chunk, maybe empty):
        predict holds one chunk, so a file of millions of texts fits in memory. By default: predict_inputs' one."""
        yield self.predict_inputs(path)

    def predict_logits(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's logits for a batch of `predict_inputs`' items, on the device."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its model labels inputs")

    # -----> what an `hf` export saves: the transformers model (save_pretrained) inside the task's model, its
    # tokenizer, and the transformers.pipeline task that serves it (named in the export's README).
    def hf_model(self, model: nn.Module):
        raise NotImplementedError(f"{type(self).__name__} does not say which Hugging Face model to export")

    def hf_tokenizer(self):
        return getattr(self, "tokenizer", None)

    def hf_image_processor(self):
        """hf_pipeline "image-classification": the evaluation preprocessing as a transformers image processor."""
        raise NotImplementedError(f"{type(self).__name__} has no image processor for its export")

    hf_pipeline: Optional[str] = None

    # -----> what a `state_dict` / `torch_export` export needs: how to rebuild the model (written to config.json,
    # {"class": "module:Class", "init": {constructor arguments}, "input": "what it takes"}) and example inputs.
    def export_config(self, model: nn.Module) -> dict:
        raise NotImplementedError(f"{type(self).__name__} does not say how to rebuild its model")

    def example_inputs(self) -> tuple:
        raise NotImplementedError(f"{type(self).__name__} has no example inputs for torch.export")


class PipelineLayer(nn.Module):
    """One link of a pipeline chain: `fn(*inputs)` using `modules` of the model (shared, not copied), so that a
    stage holding this layer holds exactly their parameters."""

    def __init__(self, fn, *modules: nn.Module):
        super().__init__()
        self.fn, self.parts = fn, nn.ModuleList(modules)

    def forward(self, *inputs):
        return self.fn(*inputs)
