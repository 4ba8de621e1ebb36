"""mode: predict: a classifier's labels for new, unlabelled inputs, in one process.

    python main.py --params runs/images/config.yml --set mode=predict --set predict.input=new_photos/

predict.input is a folder of images (image tasks) or a CSV/TSV/text file of texts (text classifiers: the task's
`predict_inputs` reads it). The checkpoint (predict.checkpoint, else the run's best) is verified and loaded as test
mode loads it, whatever strategy wrote it; output_dir/predictions.csv gets one row per input, in input order: the
input, then predict.top_k label names with their probabilities.
"""
from __future__ import annotations

import csv
import io
import os

import torch

from core import checkpoint, checkpoint_io, checkpoint_meta, run_log
from core.errors import CheckpointError, ConfigError, DataError
from data_loader import eval_batches, make_loader

def predict(trainer) -> str:
    """Write output_dir/predictions.csv; returns its path."""
    cfg, log, task = trainer.cfg, trainer.log, trainer.task
    path = cfg.predict.checkpoint or checkpoint_meta.best_recorded(cfg.output_dir)
    if path is None:
        raise CheckpointError(f"{checkpoint.root(cfg.output_dir)}: no complete checkpoint to predict with")
    model = trainer.strategy.raw_model
    checkpoint_io.load_model(model, path, cfg, note=log.warning)  # sizes and sha256 checked first, as test mode
    if not hasattr(task, "predict_inputs"):  # (a classifier's inputs: tasks/image_folder.py's, csv_text.py's)
        raise ConfigError(f"mode: predict: task {cfg.task} does not read new inputs (no predict_inputs method)")
    names, dataset = task.predict_inputs(cfg.predict.input)
    if not names:
        raise DataError(f"predict.input: {cfg.predict.input} holds no inputs")
    log.info(f"predicting {len(names)} inputs of {cfg.predict.input} with {path}")
    model.eval()
    top = []
    batches = eval_batches(len(dataset), 0, 1, trainer.train_cfg.eval_batch_size)
    with torch.no_grad():
        for batch in make_loader(dataset, batches, task.collate, cfg.data.num_workers, trainer.pin, cfg.seed):
            with trainer.autocast():
                logits = task.predict_logits(model, trainer.to_device(batch))
            probs = torch.softmax(logits.float(), dim=-1)
            k = min(cfg.predict.top_k, probs.shape[-1])
            values, indices = probs.topk(k, dim=-1)
            top.extend(zip(indices.tolist(), values.tolist()))
    classes = task.label_names() or [str(i) for i in range(probs.shape[-1])]  # known by number: the number
    where = os.path.join(cfg.output_dir, "predictions.csv")
    run_log.write_file(where, rows(names, top, classes, k))
    log.info(f"wrote {where} ({len(names)} rows)")
    return where


def rows(names: list, top: list, classes: list, k: int) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["input"] + [f"{what}{'' if i == 1 else f'_{i}'}" for i in range(1, k + 1)
                                 for what in ("label", "probability")])
    for name, (indices, values) in zip(names, top):
        writer.writerow([name] + [x for c, p in zip(indices, values) for x in (classes[c], f"{p:.6f}")])
    return out.getvalue()
