"""train.keep_best (issue 41): the k best checkpoints by best_metric are kept whatever keep_last prunes, across a
resume; test mode's best is the first of them; the plan says what is kept; a crafted ranking in meta.json is one
line."""
import dataclasses
import json
import os
import re

import pytest

from conftest import make_config
from core import checkpoint, checkpoint_meta
from core.errors import Unloadable
from test_text_tasks import train


def test_the_k_best_checkpoints_and_the_last_are_kept_across_a_resume(tmp_path):
    run = {"epochs": 0, "eval_every": 1, "save_every": 1, "keep_last": 1, "keep_best": 3, "log_every": 1, "lr": 3e-3}
    cfg = make_config(tmp_path, train={**run, "max_steps": 10})
    train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=5)), 1)  # 5 steps, then resumed
    train(cfg, 1)
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert "checkpoints kept: the last 1 and the 3 best" in log and "resumed from" in log
    dev = {int(step): (float(acc), float(loss)) for step, loss, acc in
           re.findall(r"step (\d+) dev: loss=(\S+) accuracy=(\S+)", log)}
    assert sorted(dev) == list(range(1, 11))
    assert len({acc for acc, _ in dev.values()}) > 3, "accuracies must differ for the ranking to mean something"
    best3 = sorted(dev, key=lambda s: (-dev[s][0], dev[s][1], s))[:3]
    kept = [step for step, _ in checkpoint.complete_checkpoints(str(tmp_path))]
    assert sorted(kept) == sorted(set(best3) | {10})
    assert checkpoint_meta.best_recorded(str(tmp_path)).endswith(f"step-{best3[0]}")  # test mode's best


@pytest.mark.parametrize("ranked", ["x", [[0.9, 0.1]], [[float("inf"), 0.1, 1]], [[0.9, 0.1, 99]]])
def test_a_crafted_ranking_in_meta_json_is_one_line(tmp_path, ranked):
    from conftest import write_checkpoint
    from test_checkpoint_faults import SINGLE
    path = write_checkpoint(tmp_path, 5, SINGLE, lambda d: None, {"step": 5, "state": {"step": 5}})
    meta = json.load(open(os.path.join(path, "meta.json")))
    meta["state"]["best_k"] = ranked
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write(json.dumps(meta).replace("Infinity", "1e999"))
    with pytest.raises(Unloadable, match=r"state\.best_k.*not a list of \[value, loss, step\]"):
        checkpoint_meta.read(path)
