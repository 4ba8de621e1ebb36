"""mode: predict: a classifier's labels for new, unlabelled inputs, in one process or under ddp.

    python main.py --params runs/images/config.yml --set mode=predict --set predict.input=new_photos/

predict.input is a folder of images (image tasks) or a file of texts (text classifiers, in a split's formats or
.txt: the task's `predict_chunks` reads it, CHUNK inputs at a time). The checkpoint (predict.checkpoint, else the
run's best) is verified and loaded as test mode loads it, whatever strategy wrote it; output_dir/predictions.csv gets
one row per input, in input order (an image data.skip_bad_images skips: none): the input, then predict.top_k label
names with their probabilities. The inputs are read, predicted and written a chunk at a time: memory is one chunk's,
whatever the input's size; rank 0 shows the inputs predicted so far (a bar, a line every 30 s: Progress). Under
dist.strategy ddp the ranks share each chunk, each encoding only its share where the task's Dataset encodes an item
as it is read (EncodedLazily); a checkpoint of any other strategy is read in one process (main.py).
"""
from __future__ import annotations

import collections
import csv
import os
from typing import Iterable, Iterator, Optional

import torch

from core import checkpoint, checkpoint_io, checkpoint_meta, distributed, run_log
from core.atomic_write import refuse_a_folder_at, write_beside
from core.distributed import DistContext
from core.errors import CheckpointError, DataError, printable
from data_loader import eval_shard_batches, make_loader
from resilience import faults
from tasks import lora
from tasks.base import Task
from trainer import autocast_for


CHUNK = 4096  # inputs read, predicted and written at a time (rounded to the ranks' batches): memory bounded by it


def predict(cfg, ctx: DistContext, task: Task) -> str:
    """Write output_dir/predictions.csv; returns its path. A plain model on this rank's device, no Trainer: what
    the model needs comes from the checkpoint (an image classifier's classes: meta.json), so the training data
    need not be there (task.prepare_inference). The inputs are read, predicted and written a chunk at a time, into
    predictions.csv.tmp, renamed at the end: a predict that fails leaves the earlier predictions.csv whole."""
    log = run_log.setup_logging(cfg.output_dir, ctx.rank)
    faults.progress.phase_starts(0, "predict")  # (a crash's line says so: there is no training step)
    where = os.path.join(cfg.output_dir, "predictions.csv")
    refuse_a_folder_at(where, "predict writes its rows")
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
    average = f" (its weight average, ema.pt: {checkpoint_io.why_average(cfg)})" if weights == "ema" else ""
    log.info(f"predicting the inputs of {cfg.predict.input} with {path}{average}")
    model.to(ctx.device).eval()
    if not ctx.is_main:  # (every rank predicts its share of each chunk; rank 0 writes them all)
        collections.deque(predicted(cfg, ctx, task, model), maxlen=0)
        return where
    # alive to whoever waits an hour (a bar on a terminal, else a line every 30 s); the count alone: no total known
    progress = Progress(log, f"predicting {cfg.predict.input}", run_log.progress_bar(
        cfg.log.progress_bar, desc="predict", unit=" inputs"))
    rows = predicted(cfg, ctx, task, model, progress)
    earlier = os.path.isfile(where)
    written = []
    try:
        write_beside(where, lambda f: written.append(write_rows(f, rows, task.label_names())))
    finally:  # its last count stays on the screen, its line ended: the closing line, or an error's, is one of its own
        if progress.bar is not None:
            progress.bar.close()
    log.info(f"wrote {where} ({written[0]} row{'s' * (written[0] != 1)})"
             + (", replacing the earlier predictions.csv" if earlier else ""))
    return where


def predicted(cfg, ctx: DistContext, task: Task, model, progress: Optional[Progress] = None
              ) -> Iterator[tuple[str, list, list]]:
    """(input name, predict.top_k class numbers, their probabilities) of each input, in input order, on every rank,
    a chunk at a time. Under ddp each rank predicts its contiguous piece of a chunk; gathered in rank order, the
    pieces are the chunk's order. No input at all, or none read, is a DataError at the end. `progress` (rank 0's)
    counts the inputs predicted, each batch (under ddp: rank 0's times the ranks)."""
    autocast = autocast_for(ctx.device.type, cfg.train.precision)
    step = cfg.train.eval_batch_size * ctx.world_size
    size = step * max(1, CHUNK // step)  # whole batches: one process predicts the batches it did before chunks
    inputs = rows = 0
    for names, dataset in task.predict_chunks(cfg.predict.input, size):
        for start in range(0, len(dataset), size):  # (a task's own predict_inputs gives all in one: cut here)
            piece = min(size, len(dataset) - start)
            batches = [[start + i for i in batch] for batch in eval_shard_batches(
                piece, ctx.rank, ctx.world_size, cfg.train.eval_batch_size)]
            loader = make_loader(dataset, batches, task.collate, cfg.data.num_workers, False, cfg.seed)
            top = []
            with torch.no_grad():
                for positions, batch in zip(batches, loader):
                    # data.skip_bad_images: the collate left out the inputs it names (the task logs them); no row
                    skipped = set(batch["skipped"].tolist()) if "skipped" in batch else set()
                    with autocast():
                        logits = task.predict_logits(model, {k: v.to(ctx.device) for k, v in batch.items()})
                    probs = torch.softmax(logits.float(), dim=-1)
                    values, indices = probs.topk(min(cfg.predict.top_k, probs.shape[-1]), dim=-1)
                    top.extend(zip([i for i in positions if i not in skipped], indices.tolist(), values.tolist()))
                    if progress is not None:  # (rank 0's piece is the largest: the count ends at the chunk's)
                        uncounted = inputs + start + piece - progress.done
                        progress.batch_done(min(len(positions) * ctx.world_size, uncounted))
            for part in distributed.gather_objects(ctx, top):
                rows += len(part)
                yield from ((names[i], classes, probabilities) for i, classes, probabilities in part)
        inputs += len(names)
    if not inputs:
        raise DataError(f"predict.input: {cfg.predict.input} holds no inputs")
    if not rows:
        raise DataError(f"predict.input: none of the {inputs} inputs of {cfg.predict.input} could be read "
                        "(data.skip_bad_images skipped them all)")


class Progress(run_log.EvalProgress):
    """Rank 0's count of the inputs predicted so far, as an evaluation's: `bar` moves, `log` gets a line every
    run_log.EVAL_LOG_EVERY_S s. How many inputs there are is not known beforehand (they are read as they come)."""

    def __init__(self, log, what: str, bar):
        self.started(log, what, " inputs", None, bar)


def write_rows(f, rows: Iterable, label_names: Optional[list]) -> int:
    """predictions.csv's header and `rows`, written as they come; returns how many. Classes known by number only
    (no label_names): the number."""
    writer = csv.writer(f, lineterminator="\n")
    count = 0
    for name, classes, probabilities in rows:
        if not count:
            writer.writerow(["input"] + [f"{what}{'' if i == 1 else f'_{i}'}" for i in range(1, len(classes) + 1)
                                         for what in ("label", "probability")])
        writer.writerow([printable(name)]  # (a file name's bytes that are not UTF-8: \xe9)
                        + [x for c, p in zip(classes, probabilities)
                           for x in (label_names[c] if label_names else str(c), f"{p:.6f}")])
        count += 1
    return count
