"""Habits from Hugging Face's Trainer and Lightning: their names for our settings are pointed at ours, never at a
near spelling that means something else; their metric names for the best checkpoint say ours."""
import os

import pytest

from conftest import load_model_state, make_config, max_diff
from core import checkpoint, checkpoint_meta, run_record
from core.config import TrainConfig
from wiring import checked_config
from core.errors import ConfigError
import main

# (their key as a user writes it under train:, the key it is here)
THEIR_NAMES = [
    ("train.learning_rate", "train.lr"), ("train.per_device_train_batch_size", "train.batch_size"),
    ("train.accumulate_grad_batches", "train.grad_accum_steps"), ("train.warmup_ratio", "train.warmup"),
    ("train.lr_scheduler_type", "train.schedule"), ("train.max_grad_norm", "train.clip_grad_norm"),
    ("train.gradient_clip_val", "train.clip_grad_norm"), ("train.bf16", "train.precision"),
    ("train.metric_for_best_model", "train.best_metric"), ("train.logging_steps", "train.log_every"),
    ("train.eval_steps", "train.eval_every"), ("train.val_check_interval", "train.eval_every"),
    ("train.save_steps", "train.save_every"), ("train.save_total_limit", "train.keep_last"),
    ("train.save_top_k", "train.keep_best"), ("train.dataloader_num_workers", "data.num_workers"),
    ("train.seed", "seed"), ("train.output_dir", "output_dir"), ("train.max_epochs", "train.epochs"),
    ("train.check_val_every_n_epoch", "train.eval_every"), ("train.eval_strategy", "train.eval_every"),
    ("train.monitor", "train.best_metric"), ("train.lr_scheduler_kwargs", "train.min_lr_ratio"),
    ("train.gradient_checkpointing", "model.activation_checkpointing"), ("train.max_seq_length", "data.max_length"),
    ("train.max_time", "train.time_limit"), ("train.limit_train_batches", "train.max_steps"),
    ("train.devices", "dist.procs_per_node"), ("train.ddp_timeout", "dist.timeout_s"),
    ("train.disable_tqdm", "log.progress_bar"), ("train.data_seed", "seed"),
]


def test_other_trainers_names_point_at_ours_in_one_line():
    """difflib's nearest spelling sent eval_steps to max_steps, save_total_limit to time_limit, logging_steps to
    profile_steps: a user who followed it changed the run's length instead of its cadence."""
    for their, ours in THEIR_NAMES:
        with pytest.raises(ConfigError) as e:
            checked_config("parameters.yml", [f"{their}=1"])
        message = str(e.value)
        assert f"unknown key `{their}`" in message and f"`{ours}`" in message, message
        assert "did you mean" not in message and "\n" not in message, message
    with pytest.raises(ConfigError) as e:  # theirs without an equivalent: not a near spelling (grad_accum_steps)
        checked_config("parameters.yml", ["train.eval_accumulation_steps=4"])
    assert str(e.value).endswith("`train.eval_accumulation_steps` (Hugging Face's name): evaluation keeps sums and "
                                 "predicted labels here, never logits: nothing to set"), str(e.value)
    # TrainingArguments is flat: a key of another section, written under train (or the other way), is pointed there
    for their, ours in (("train.max_length", "data.max_length"), ("train.num_workers", "data.num_workers"),
                        ("train.dropout", "model.dropout"), ("data.batch_size", "train.batch_size"),
                        ("lr", "train.lr"), ("train.checkpoint", "`test.checkpoint` or `predict.checkpoint`")):
        with pytest.raises(ConfigError) as e:
            checked_config("parameters.yml", [f"{their}=1"])
        assert f"unknown key `{their}`: it is " in str(e.value) and (ours if "`" in ours else f"`{ours}`") in \
            str(e.value), str(e.value)
    for key, value, ours in (("precision", "16-mixed", "Lightning's '16-mixed' is fp16 here"),
                             ("precision", "bf16-mixed", "Lightning's 'bf16-mixed' is bf16 here"),
                             ("precision", "32-true", "Lightning's '32-true' is fp32 here"),
                             ("schedule", "constant_with_warmup", "Hugging Face's 'constant_with_warmup' is constant"),
                             ("schedule", "cosine_with_min_lr", "is cosine with train.min_lr_ratio here")):
        with pytest.raises(ConfigError) as e:
            checked_config("parameters.yml", [f"train.{key}={value}"])
        assert ours in str(e.value), str(e.value)


def test_a_best_metric_named_as_hugging_face_does_keeps_the_run(tmp_path, capsys):
    """best_metric eval_accuracy (Hugging Face's name), known wrong only at the first evaluation: with eval_every 0,
    the run's end, whose checkpoint was never written. Now that step is saved and its evaluation due, and the
    message names ours; the corrected command resumes there and ends as a run with the right name from the start."""
    train = {"max_steps": 3, "eval_every": 0, "save_every": 0, "schedule": "constant", "warmup": 0.5}
    cfg = make_config(tmp_path / "named", train={**train, "best_metric": "eval_accuracy"})
    assert main.run(cfg) == 2
    err = capsys.readouterr().err.strip()
    assert "`train.best_metric` is 'eval_accuracy', not among the dev metrics (loss, accuracy" in err, err
    assert "use 'accuracy'" in err and "step-3 is saved" in err and len(err.splitlines()) == 1, err
    assert checkpoint.latest(str(tmp_path / "named")).endswith("step-3")
    assert main.run(make_config(tmp_path / "named", train={**train, "best_metric": "accuracy"})) == 0
    assert main.run(make_config(tmp_path / "right", train={**train, "best_metric": "accuracy"})) == 0
    for out in ("named", "right"):
        assert checkpoint_meta.best_recorded(str(tmp_path / out)).endswith("step-3")
    named, right = (checkpoint_meta.read(checkpoint.latest(str(tmp_path / out))) for out in ("named", "right"))
    assert named["metrics"] == right["metrics"] and named["metrics"]["loss"] > 0
    assert max_diff(load_model_state(tmp_path / "named", 3), load_model_state(tmp_path / "right", 3)) == 0
    with open(os.path.join(tmp_path / "right", "logs", "rank0.log")) as f:
        plan = f.read()
    assert "  lr 0.001: warm-up over 2 steps (train.warmup=0.5), then constant; gradient norm not clipped" in plan


def test_the_plan_says_the_warm_up_in_steps_and_the_clipping():
    """Hugging Face's warmup_ratio rounds up (ceil); ours rounds, and a warm-up of one step is none (its first step
    is at the full lr): a short run's 0.05 was no warm-up without a word. The plan's lr line says what it is."""
    def line(total, **train):
        return run_record.schedule_line(total, TrainConfig(**train))
    assert line(9, warmup=0.05) == "lr 0.001: no warm-up (train.warmup=0.05 is 0 of 9 steps; it takes 2 or more), " \
                                   "then cosine to 0; gradient norm not clipped"
    assert line(9, warmup=1).startswith("lr 0.001: no warm-up (train.warmup=1 is 1 of 9 steps")
    assert line(100, warmup=10, schedule="linear", min_lr_ratio=0.1, clip_grad_norm=1.0) == \
        "lr 0.001: warm-up over 10 steps (train.warmup=10), then linear to 0.0001; gradient norm clipped to 1"
    assert line(100) == "lr 0.001: cosine to 0; gradient norm not clipped"


def test_settings_that_would_do_nothing_are_refused():
    """min_lr_ratio with schedule constant (Hugging Face's constant takes no min_lr_rate), patience with eval_every 0
    (its EarlyStoppingCallback refuses a run without evaluations): each did nothing, silently."""
    for sets, start in ((["train.schedule=constant", "train.min_lr_ratio=0.1"],
                         "`train.min_lr_ratio` is 0.1, but train.schedule constant never decays"),
                        (["train.patience=3", "train.eval_every=0"],
                         "`train.patience` is 3, but train.eval_every is 0: the one evaluation is the run's last")):
        with pytest.raises(ConfigError) as e:
            checked_config("parameters.yml", sets)
        assert str(e.value).startswith(f"parameters.yml + --set: {start}"), str(e.value)
    assert checked_config("parameters.yml", ["train.schedule=constant", "train.eval_every=0"]).train.patience == 0


def test_a_loss_the_task_does_not_list_is_not_maximised_unsaid():
    """best_mode auto takes the task's lower_is_better: a metric named `*_loss` that a user's task does not list there
    was maximised (Hugging Face takes any name ending in "loss" as lower-is-better): the worst checkpoint kept."""
    with pytest.raises(ConfigError) as e:
        checked_config("parameters.yml", ["train.best_metric=nll_loss"])
    assert "is 'nll_loss', a loss, but task image does not list it in Task.lower_is_better" in str(e.value)
    assert "train.best_mode: min" in str(e.value)
    assert checked_config("parameters.yml", ["train.best_metric=nll_loss", "train.best_mode=min"]).train.best_mode == \
        "min"
    assert checked_config("parameters.yml", ["train.best_metric=ema_loss", "train.ema_decay=0.99"])  # (listed)
    for theirs in ("eval_loss", "val_loss"):  # their names for ours: said at start, not at the first evaluation
        with pytest.raises(ConfigError, match=f"is '{theirs}' \\(Hugging Face's or Lightning's name\\): it is 'loss'"):
            checked_config("parameters.yml", [f"train.best_metric={theirs}"])
