"""What a task is: model + data + loss + metrics. The Trainer knows nothing else about it.

To add a task, subclass `Task`, fill in the methods below, and register it in `tasks/__init__.py`.

Loss convention (the reason the Trainer can weight uneven batches exactly): `loss_sum` returns the loss SUMMED
over the batch's units, and `count` says how many units that is (samples for classification, target tokens for
language modelling). The Trainer divides by the count summed over all micro-batches and all ranks, so one
optimizer step always follows the mean gradient over the global batch, whatever each rank's share of it.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate


class Task:
    best_metric_default = "accuracy"

    def __init__(self, cfg):
        self.cfg = cfg  # the whole Config: tasks read cfg.data and cfg.model

    # -----> a task builds its model here (random init, or cfg.model.pretrained_dir).
    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def build_datasets(self) -> dict[str, Optional[Dataset]]:
        """{'train': ..., 'dev': ..., 'test': ...}; a split the data lacks is None."""
        raise NotImplementedError

    def collate(self, samples: list) -> dict[str, torch.Tensor]:
        """Turn a list of dataset items into one batch: a flat dict of tensors."""
        return default_collate(samples)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """How many units `loss_sum` adds up for this (CPU) batch. Called before the batch moves to the device."""
        return len(batch["labels"])

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
    # tuple of tensors, e.g. hidden states and an attention mask) and must keep constant shapes from step to step.
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

    def lengths(self, dataset: Dataset) -> Optional[list[int]]:
        """Per-sample lengths for `data.group_by_length` (None: the task has no notion of length)."""
        return None


class Layer(nn.Module):
    """One link of a pipeline chain: `fn(*inputs)` using `modules` of the model (shared, not copied), so that a
    stage holding this layer holds exactly their parameters."""

    def __init__(self, fn, *modules: nn.Module):
        super().__init__()
        self.fn, self.parts = fn, nn.ModuleList(modules)

    def forward(self, *inputs):
        return self.fn(*inputs)


def classification_batch(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """eval_batch of a classifier: summed loss and count (summed over batches), predictions and labels
    (concatenated), which classification_metrics turns into the split's metrics."""
    logits = logits.float()
    return {"loss_sum": torch.nn.functional.cross_entropy(logits, labels, reduction="sum"),
            "count": torch.tensor(float(len(logits)), device=logits.device),
            "preds": logits.argmax(-1), "labels": labels}


def classification_metrics(preds: np.ndarray, labels: np.ndarray, loss_sum: float, count: float,
                           average: str = "macro") -> dict:
    """Accuracy, F1 (macro by default; `binary` for two classes) and MCC via scikit-learn, plus the mean loss."""
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
    return {
        "loss": float(loss_sum / max(count, 1)),
        "accuracy": float(accuracy_score(labels, preds)),
        "f1": float(f1_score(labels, preds, average=average)),
        "mcc": float(matthews_corrcoef(labels, preds)),
        "samples": int(count),
    }
