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

    def lengths(self, dataset: Dataset) -> Optional[list[int]]:
        """Per-sample lengths for `data.group_by_length` (None: the task has no notion of length)."""
        return None


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
