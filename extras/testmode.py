"""mode: test: evaluate one checkpoint (test.checkpoint, or the run's best) on test.splits, in one process, and
write each split's metrics to output_dir/<split>_results.json. Called by wiring.worker only.
"""
from __future__ import annotations

import json
import os

from core import checkpoint, checkpoint_io, checkpoint_meta, run_log
from core.atomic_write import refuse_a_folder_at, write_beside
from core.errors import CheckpointError


def test(trainer) -> dict:
    cfg, log = trainer.cfg, trainer.log
    for split in cfg.test.splits:
        where = os.path.join(cfg.output_dir, f"{split}_results.json")
        refuse_a_folder_at(where, f"test mode writes the {split} results")
    path = cfg.test.checkpoint or checkpoint_meta.best_recorded(cfg.output_dir, run_log.warning_note(log))
    if path is None:
        raise CheckpointError(f"{checkpoint.root(cfg.output_dir)}: no complete checkpoint to test")
    meta = checkpoint_io.verify(path, note=log.warning, cfg=cfg)  # meta.json, read once: the step is this record's
    weights = checkpoint_io.load_verified(trainer.strategy.raw_model, path, meta, cfg,
                                          label_names=trainer.task.label_names(),
                                          vocabulary_sha256=trainer.task.vocabulary_sha256())
    trainer.set_step(meta.get("step", 0))  # ({} where allow_unverified loaded one without a readable meta.json)
    # (the results of the average must not pass for the trained weights')
    log.info(f"testing {path}" + (f" with its weight average (ema.pt: {checkpoint_io.why_average(cfg)})"
                                  if weights == "ema" else ""))
    results = {}
    for split in cfg.test.splits:
        if trainer.datasets.get(split) is None:
            log.info(f"no {split} split for this dataset: skipped")
            continue
        results[split] = trainer.evaluate(split)
        if trainer.ctx.is_main:
            where = os.path.join(cfg.output_dir, f"{split}_results.json")
            record = {"checkpoint": os.path.abspath(path), "weights": weights, "split": split,
                      "metrics": results[split]}
            replacing = os.path.exists(where)  # (an earlier test's: said, as predict says its predictions.csv)
            write_beside(where, lambda f: json.dump(record, f, indent=2))
            log.info(f"wrote {where}" + (f", replacing the earlier {split}_results.json" if replacing else ""))
    trainer.close()  # (the splits' loaders, whose workers are kept for another evaluation)
    return results
