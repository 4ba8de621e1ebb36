"""mode: predict: a classifier's labels for new, unlabelled inputs, in one process or under ddp.

    python main.py --params runs/images/config.yml --set mode=predict --set predict.input=new_photos/

predict.input is a folder of images (image tasks) or a file of texts (text classifiers, in a split's formats or
.txt: the task's `predict_inputs` reads it). The checkpoint (predict.checkpoint, else the run's best) is verified
and loaded as test mode loads it, whatever strategy wrote it; output_dir/predictions.csv gets one row per input, in
input order (an image data.skip_bad_images skips: none): the input, then predict.top_k label names with their
probabilities. Under dist.strategy ddp the ranks share the inputs; a checkpoint of any other strategy is read in
one process (main.py).
"""
from __future__ import annotations

import csv
import io
import os

import torch

from core import checkpoint, checkpoint_io, checkpoint_meta, distributed, run_log
from core.atomic_write import write_beside
from core.distributed import DistContext
from core.errors import CheckpointError, DataError
from data_loader import eval_shard_batches, make_loader
from tasks import lora
from tasks.base import Task
from trainer import autocast_for


def predict(cfg, ctx: DistContext, task: Task) -> str:
    """Write output_dir/predictions.csv; returns its path. A plain model on this rank's device, no Trainer: what
    the model needs comes from the checkpoint (an image classifier's classes: meta.json), so the training data
    need not be there (task.prepare_inference)."""
    log = run_log.setup_logging(cfg.output_dir, ctx.rank)
    path = cfg.predict.checkpoint or checkpoint_meta.best_recorded(cfg.output_dir, run_log.warning_note(log),
                                                                  "predict.checkpoint")
    if path is None:
        raise CheckpointError(f"{checkpoint.root(cfg.output_dir)}: no complete checkpoint to predict with")
    meta = checkpoint_io.verify(path, note=log.warning, cfg=cfg)  # meta.json, read once: the classes are this record's
    task.prepare_inference(checkpoint_io.recorded_label_names(path, meta))
    model = lora.adapt(task.build_model(), cfg)  # model.lora_rank: the base, the checkpoint's adapters go over it
    # sizes and sha256 checked first, as test mode; and the classes are the ones it was trained on
    weights = checkpoint_io.load_verified(model, path, meta, cfg, label_names=task.label_names(),
                                          vocabulary_sha256=task.vocabulary_sha256())
    names, dataset = task.predict_inputs(cfg.predict.input)
    if not names:
        raise DataError(f"predict.input: {cfg.predict.input} holds no inputs")
    average = f" (its weight average, ema.pt: {checkpoint_io.why_average(cfg)})" if weights == "ema" else ""
    log.info(f"predicting {len(names)} inputs of {cfg.predict.input} with {path}{average}")
    model.to(ctx.device).eval()
    autocast = autocast_for(ctx.device.type, cfg.train.precision)
    top = []
    # Under ddp each rank predicts its contiguous piece; gathered in rank order, the pieces are the input order.
    batches = eval_shard_batches(len(dataset), ctx.rank, ctx.world_size, cfg.train.eval_batch_size)
    loader = make_loader(dataset, batches, task.collate, cfg.data.num_workers, False, cfg.seed)
    with torch.no_grad():
        for positions, batch in zip(batches, loader):
            # data.skip_bad_images: the collate left out the inputs it names (the task logs them); no row for them
            skipped = set(batch["skipped"].tolist()) if "skipped" in batch else set()
            with autocast():
                logits = task.predict_logits(model, {k: v.to(ctx.device) for k, v in batch.items()})
            probs = torch.softmax(logits.float(), dim=-1)
            values, indices = probs.topk(min(cfg.predict.top_k, probs.shape[-1]), dim=-1)
            top.extend(zip([i for i in positions if i not in skipped], indices.tolist(), values.tolist()))
    top = [row for part in distributed.gather_objects(ctx, top) for row in part]
    if not top:
        raise DataError(f"predict.input: none of the {len(names)} inputs of {cfg.predict.input} could be read "
                        "(data.skip_bad_images skipped them all)")
    where = os.path.join(cfg.output_dir, "predictions.csv")
    if ctx.is_main:
        classes = task.label_names() or [str(i) for i in range(model_classes(top))]  # known by number: the number
        write_beside(where, lambda f: f.write(rows(names, top, classes, len(top[0][1]))))
        log.info(f"wrote {where} ({len(top)} rows)")
    return where


def model_classes(top: list) -> int:
    return max(max(indices) for _, indices, _ in top) + 1


def rows(names: list, top: list, classes: list, k: int) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["input"] + [f"{what}{'' if i == 1 else f'_{i}'}" for i in range(1, k + 1)
                                 for what in ("label", "probability")])
    for position, indices, values in top:
        writer.writerow([run_log.printable(names[position])]  # (a file name's bytes that are not UTF-8: \xe9)
                        + [x for c, p in zip(indices, values) for x in (classes[c], f"{p:.6f}")])
    return out.getvalue()
