"""Recipe knobs (issue 21, item 3): AdamW betas and eps, a floor for the linear and cosine schedules
(train.min_lr_ratio), evaluation on a fixed seeded dev subset (train.eval_batches), and ms_per_step / tokens_per_s
in the training line."""
import json
import os
import random
import re
import sys

import pytest
import torch

import trainer as trainer_module
from extras import testmode
from conftest import ROOT, logged, make_config, spawn
from wiring import checked_config
from core.errors import ConfigError

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_sample_text_data as sample  # noqa: E402

SHORT = {"batch_size": 16, "max_steps": 6, "epochs": 0, "log_every": 2, "eval_every": 0, "save_every": 0}


def build_trainer(cfg):
    from core import process_group
    import wiring
    torch.set_num_threads(1)
    return wiring.build_trainer(cfg, process_group.init(cfg, 0, 1, 0))


def log_of(output_dir) -> str:
    return open(os.path.join(output_dir, "logs", "rank0.log")).read()


# ---------------------------------------------------------------------------------------------------------------
# AdamW betas and eps
# ---------------------------------------------------------------------------------------------------------------
def test_betas_and_eps_reach_the_optimizer(tmp_path):
    t = build_trainer(make_config(tmp_path, train={"betas": [0.8, 0.95], "eps": 1e-6}))
    assert t.strategy.optimizer.param_groups, "no parameter groups"
    for group in t.strategy.optimizer.param_groups:  # every group: matrices (decayed) and biases alike
        assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6, group


def test_default_betas_and_eps_are_torchs(tmp_path):
    # The defaults must leave existing runs unchanged: the same values AdamW uses when given none.
    defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    cfg = checked_config(os.path.join(ROOT, "parameters.yml"), [f"output_dir={tmp_path}"])
    assert tuple(cfg.train.betas) == defaults["betas"] and cfg.train.eps == defaults["eps"]


@pytest.mark.parametrize("sets, match", [
    (["train.optimizer=sgd", "train.betas=[0.9, 0.99]"], "adamw only"),
    (["train.optimizer=sgd", "train.eps=1e-6"], "adamw only"),
    (["train.betas=[0.9]"], "two numbers"),
    (["train.betas=[0.9, 1.0]"], "two numbers"),
    (["train.eps=0"], "must be > 0"),
    (["train.min_lr_ratio=1.5"], "between 0 and 1"),
    (["train.eval_batches=-1"], "must be >= 0"),
])
def test_bad_recipe_values_are_one_line_errors(tmp_path, sets, match):
    with pytest.raises(ConfigError, match=match):
        checked_config(os.path.join(ROOT, "parameters.yml"), [f"output_dir={tmp_path}", *sets])


# ---------------------------------------------------------------------------------------------------------------
# The minimum learning rate
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_min_lr_ratio_floors_the_decay(schedule):
    floored = trainer_module.lr_factor_function(110, 10, schedule, 0.1)
    plain = trainer_module.lr_factor_function(110, 10, schedule)
    assert floored(110) == pytest.approx(0.1) and plain(110) == pytest.approx(0.0)  # the end: the floor, or 0
    # Half-way through the decay both schedules are at half of it: 0.1 + 0.9 * 0.5.
    assert floored(60) == pytest.approx(0.55) and plain(60) == pytest.approx(0.5)
    assert floored(5) == plain(5) == pytest.approx(0.6)  # warm-up is not touched
    assert all(floored(s) >= 0.1 - 1e-12 for s in range(10, 200))  # never below the floor, even past the end


def test_the_schedule_ends_at_min_lr_ratio_a_line_shows_its_steps_lr_and_ms_per_step_is_logged(tmp_path):
    cfg = make_config(tmp_path, train={**SHORT, "lr": 1e-3, "warmup": 0, "schedule": "cosine",
                                       "min_lr_ratio": 0.1})
    trainer = build_trainer(cfg)
    trainer.train()
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(1e-4)  # after the last step: lr x min_lr_ratio
    # The line of step N shows the lr step N ran at, factor(N - 1) (factor(N) is the next step's).
    factor = trainer_module.lr_factor_function(6, 0, "cosine", 0.1)
    assert logged(tmp_path, "lr") == pytest.approx([1e-3 * factor(n - 1) for n in (2, 4, 6)], rel=1e-3)
    ms, sps = logged(tmp_path, "ms_per_step"), logged(tmp_path, "samples_per_s")
    assert len(ms) == 3 and all(m > 0 for m in ms), ms
    # One clock for both: ms per step x samples per s = samples per step, the global batch (4 digits logged).
    for m, s in zip(ms, sps):
        assert m * s / 1000 == pytest.approx(16, rel=2e-3)
    assert "tokens_per_s" not in log_of(tmp_path)  # images have no tokens


# ---------------------------------------------------------------------------------------------------------------
# train.eval_batches: a fixed seeded subset of dev during training, the whole split at the end
# ---------------------------------------------------------------------------------------------------------------
EVAL = {**SHORT, "eval_batches": 3, "eval_batch_size": 10}  # 30 of the digits dev split's 225 images


class Recorded(torch.utils.data.Dataset):
    """`dataset`, each read written to `path` as `pid index` (by whichever process reads it: a loader's worker, or
    this one)."""

    def __init__(self, dataset, path: str):
        self.dataset, self.path = dataset, path

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
        return self.dataset[i]


def evaluated(t, step) -> list[int]:
    """The dev indices an evaluation at `step` reads (through the trainer's data loader), in order."""
    if not isinstance(t.datasets["dev"], Recorded):  # (before the first evaluation: its loader is kept)
        t.datasets["dev"] = Recorded(t.datasets["dev"], os.path.join(t.cfg.output_dir, "dev_reads"))
    open(t.datasets["dev"].path, "w").close()
    t.state.step = step
    metrics = t.evaluate("dev")
    seen = [int(line.split()[1]) for line in open(t.datasets["dev"].path)]
    assert metrics["samples"] == len(seen)  # the metrics are over what was read, no more
    return seen


def test_eval_batches_is_the_same_seeded_subset_and_the_end_is_whole(tmp_path):
    t = build_trainer(make_config(tmp_path, train=EVAL))
    first, again = evaluated(t, 2), evaluated(t, 4)
    assert len(first) == 30 and first == again  # the same subset at every evaluation
    assert first == sorted(set(first)) and first != list(range(30))  # distinct, in split order, drawn at random
    assert evaluated(t, t.total_steps) == list(range(225))  # the last evaluation: the whole split
    log = log_of(tmp_path)
    dev = {int(s): line for s, line in re.findall(r"step (\d+) dev: (.*)", log)}
    assert "loss=" in dev[2] and "(on 30 of 225 samples: train.eval_batches)" in dev[2]
    assert "samples=225" in dev[6].split() and "train.eval_batches" not in dev[6]  # no subset note on the whole split

    other = build_trainer(make_config(tmp_path / "other", seed=7, train=EVAL))
    assert evaluated(other, 2) != first  # the subset follows the seed


def test_test_mode_evaluates_the_whole_split(tmp_path):
    build_trainer(make_config(tmp_path, train={**EVAL, "max_steps": 2})).train()  # a checkpoint to test
    t = build_trainer(make_config(tmp_path, mode="test", train={**EVAL, "max_steps": 2}))
    assert evaluated(t, 1) == list(range(225))  # at a step that would take the subset in training
    assert testmode.test(t)["dev"]["samples"] == 225  # test mode's own path


def _evaluate_rank(local_rank, cfg, world, out):
    """Spawned: each rank evaluates the initial model's dev subset at step 2; rank 0 writes the metrics."""
    from core import distributed, process_group
    import wiring
    torch.set_num_threads(1)
    ctx = process_group.init(cfg, local_rank, world, local_rank)
    try:
        t = wiring.build_trainer(cfg, ctx)
        t.state.step = 2
        metrics = t.evaluate("dev")
        if local_rank == 0:
            with open(out, "w") as f:
                json.dump(metrics, f)
    finally:
        distributed.shutdown(ctx)
    from core import process_end
    process_end.end_process(0)  # as main.py's ranks end (gloo's threads can abort the interpreter's teardown)


def test_eval_batches_subset_is_exact_across_ranks(tmp_path):
    one = build_trainer(make_config(tmp_path / "one", train=EVAL))
    one.state.step = 2
    alone = one.evaluate("dev")
    cfg = make_config(tmp_path / "two", train=EVAL, dist={"strategy": "ddp", "procs_per_node": 2})
    out = str(tmp_path / "two.json")
    spawn(_evaluate_rank, args=(cfg, 2, out), nprocs=2)
    together = json.load(open(out))
    # Two ranks of 15 (10 + 5 per rank): the same 30 samples as one process's 10 + 10 + 10.
    assert alone["samples"] == together["samples"] == 30
    assert abs(alone["loss"] - together["loss"]) < 1e-6 and alone["accuracy"] == together["accuracy"]


def test_evaluation_workers_start_once_and_give_the_values_of_no_workers(tmp_path):
    """data.num_workers 2: the dev loader's workers were started anew at each of the 4 evaluations (steps 2, 4 and 6
    on the subset, 6 on the whole split), 8 processes, where the training stream keeps its own. Now the same 2 read
    every evaluation and end with the run; the values are those of a run without workers."""
    import psutil
    run = {**SHORT, "eval_every": 2, "eval_batches": 1, "eval_batch_size": 16}
    lines, before = {}, {p.pid for p in psutil.Process().children()}  # (a spawned test's resource tracker)
    for workers in (0, 2):
        t = build_trainer(make_config(tmp_path / str(workers), data={"num_workers": workers}, train=run))
        t.datasets["dev"] = Recorded(t.datasets["dev"], str(tmp_path / f"reads{workers}"))
        t.train()
        lines[workers] = re.findall(r"step \d+ dev: .*", log_of(tmp_path / str(workers)))
        pids = {line.split()[0] for line in open(tmp_path / f"reads{workers}")}
        assert len(pids) == max(1, workers) and (str(os.getpid()) in pids) == (workers == 0)
    assert len(lines[0]) == 4 and lines[0] == lines[2]
    assert {p.pid for p in psutil.Process().children()} <= before, "the workers must end with the run"


# ---------------------------------------------------------------------------------------------------------------
# tokens_per_s for a text task
# ---------------------------------------------------------------------------------------------------------------
def test_task_tokens_counts_real_tokens():
    from tasks.base import Task
    task = Task(None)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert task.tokens({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": mask}) == 4  # no padding
    assert task.tokens({"input_ids": torch.ones(3, 5, dtype=torch.long)}) == 15
    assert task.tokens({"images": torch.zeros(2, 8, 8), "labels": torch.zeros(2)}) is None


def test_gpt2_training_line_has_tokens_per_s(tmp_path):
    data = sample.write_gpt2(str(tmp_path / "gpt2"), random.Random(0))
    cfg = make_config(tmp_path / "run", task="gpt2_lm", data={"data_dir": data, "max_length": 32},
                      model={"name": "tiny", "dropout": 0.0}, train={**SHORT, "max_steps": 4, "best_metric": "loss"})
    build_trainer(cfg).train()
    tps, sps = logged(cfg.output_dir, "tokens_per_s"), logged(cfg.output_dir, "samples_per_s")
    assert len(tps) == 2 and all(t > 0 for t in tps), tps
    for t, s in zip(tps, sps):  # every sample is a window of max_length input tokens, timed by one clock
        assert t / s == pytest.approx(32, rel=2e-3)
    assert len(logged(cfg.output_dir, "ms_per_step")) == 2


def test_best_mode_auto_is_what_the_task_says(tmp_path):
    """train.best_mode auto: min for the metrics the task lists in lower_is_better, max for the others."""
    from tasks.bert_pretrain import BertPretrainTask
    from tasks.gpt2_lm import GPT2LMTask
    modes = {metric: build_trainer(make_config(tmp_path / metric, train={**SHORT, "best_metric": metric})).best_mode
             for metric in ("loss", "accuracy", "f1")}
    assert modes == {"loss": "min", "accuracy": "max", "f1": "max"}
    assert "perplexity" in GPT2LMTask.lower_is_better and "mlm_loss" in BertPretrainTask.lower_is_better
    assert "mlm_accuracy" not in BertPretrainTask.lower_is_better
