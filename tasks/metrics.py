"""A classifier's evaluation: what each batch returns (classification_batch) and the split's metrics from them
(classification_metrics: accuracy, F1, MCC, the mean loss)."""
from __future__ import annotations

import numpy as np
import torch


def classification_batch(logits: torch.Tensor, labels: torch.Tensor,
                         loss_sum: torch.Tensor) -> dict[str, torch.Tensor]:
    """eval_batch of a classifier: summed loss and count (summed over batches), predictions and labels
    (concatenated), which classification_metrics turns into the split's metrics. `loss_sum` is the task's own
    training loss on these logits (its loss_from_output), so that the dev loss always follows the training loss."""
    return {"loss_sum": loss_sum.float(), "count": torch.tensor(float(len(logits)), device=logits.device),
            "preds": logits.argmax(-1), "labels": labels}


def classification_metrics(preds: np.ndarray, labels: np.ndarray, loss_sum: float, count: float,
                           average: str = "macro") -> dict:
    """Accuracy, F1 (macro by default; `binary`: of class 1) and MCC, plus the mean loss: scikit-learn's numbers
    (tested against them), from the confusion matrix, because importing sklearn.metrics in every rank costs more
    than a small job's training (benchmarks/RESULTS.md, "CI time with the fault tests")."""
    preds, labels = np.asarray(preds).astype(np.int64), np.asarray(labels).astype(np.int64)
    classes = np.union1d(labels, preds)  # sklearn's unique_labels: the classes seen in either
    cm = np.zeros((len(classes), len(classes)), dtype=np.int64)  # rows: true class, columns: predicted
    np.add.at(cm, (np.searchsorted(classes, labels), np.searchsorted(classes, preds)), 1)
    tp, true, predicted, n = np.diag(cm), cm.sum(1), cm.sum(0), cm.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        f1_per_class = np.where(true + predicted > 0, 2 * tp / (true + predicted), 0.0)  # 0 when undefined
    if average == "binary":
        f1 = float(f1_per_class[classes == 1].sum())  # class 1 never seen: 0, as sklearn
    else:
        f1 = float(f1_per_class.mean()) if len(classes) else 0.0
    # MCC (multiclass form, Gorodkin 2004): (n * correct - sum(true_k * predicted_k)) / sqrt(...), 0 if undefined
    cov_tp = n * tp.sum() - (true * predicted).sum()
    denominator = np.sqrt(float(n * n - (predicted * predicted).sum()) * float(n * n - (true * true).sum()))
    return {
        "loss": float(loss_sum / max(count, 1)),
        "accuracy": float(tp.sum() / n) if n else 0.0,
        "f1": f1,
        "mcc": float(cov_tp / denominator) if denominator else 0.0,
        "samples": int(count),
    }
