"""The words of a config mistake: "did you mean" and the expected types. Loaded only when a config is wrong."""
from __future__ import annotations

import difflib
import typing
from typing import Literal, Union

from core.config_yaml import shown, shown_text


# Hugging Face's TrainingArguments and Lightning's Trainer name some settings otherwise: their name says ours (the
# nearest spelling is often another setting: eval_steps is not max_steps), with how ours counts where it differs.
THEIR_NAMES = {
    "learning_rate": ("Hugging Face", "train.lr", ""),
    "num_train_epochs": ("Hugging Face", "train.epochs", "; train.max_steps, when set, may end the run first"),
    "max_epochs": ("Lightning", "train.epochs", ""),
    "per_device_train_batch_size": ("Hugging Face", "train.batch_size", ""),
    "per_device_eval_batch_size": ("Hugging Face", "train.eval_batch_size", ""),
    "gradient_accumulation_steps": ("Hugging Face", "train.grad_accum_steps", ""),
    "accumulate_grad_batches": ("Lightning", "train.grad_accum_steps", ""),
    "warmup_steps": ("Hugging Face", "train.warmup", ": optimizer steps (>= 1), or a fraction of the run (< 1)"),
    "warmup_ratio": ("Hugging Face", "train.warmup", ": a fraction of the run (< 1), or optimizer steps (>= 1)"),
    "lr_scheduler_type": ("Hugging Face", "train.schedule", ""),
    "lr_scheduler_kwargs": ("Hugging Face", "train.min_lr_ratio", " (min_lr_rate)"),
    "min_lr": ("", "train.min_lr_ratio", ", a fraction of train.lr"),
    "max_grad_norm": ("Hugging Face", "train.clip_grad_norm", " (0 by default: no clipping)"),
    "gradient_clip_val": ("Lightning", "train.clip_grad_norm", ""),
    "fp16": ("Hugging Face", "train.precision", ": fp16"),
    "bf16": ("Hugging Face", "train.precision", ": bf16"),
    "metric_for_best_model": ("Hugging Face", "train.best_metric", ", a dev metric's name without eval_ (loss)"),
    "greater_is_better": ("Hugging Face", "train.best_mode", ": max or min"),
    "early_stopping_patience": ("Hugging Face", "train.patience", ", in evaluations"),
    "logging_steps": ("Hugging Face", "train.log_every", ", in optimizer steps"),
    "log_every_n_steps": ("Lightning", "train.log_every", ", in optimizer steps"),
    "eval_steps": ("Hugging Face", "train.eval_every", ", in optimizer steps"),
    "val_check_interval": ("Lightning", "train.eval_every", ", in optimizer steps (not batches)"),
    "check_val_every_n_epoch": ("Lightning", "train.eval_every", ", in optimizer steps (the plan says an epoch's)"),
    "eval_strategy": ("Hugging Face", "train.eval_every", ", in optimizer steps (the plan says an epoch's)"),
    "evaluation_strategy": ("Hugging Face", "train.eval_every", ", in optimizer steps (the plan says an epoch's)"),
    "save_strategy": ("Hugging Face", "train.save_every", ", in optimizer steps (the plan says an epoch's)"),
    "monitor": ("Lightning", "train.best_metric", ", a dev metric's name without val_ (loss)"),
    "save_steps": ("Hugging Face", "train.save_every", ", in optimizer steps"),
    "save_total_limit": ("Hugging Face", "train.keep_last", " (the best is kept as well)"),
    "save_top_k": ("Lightning", "train.keep_best", ""),
    "limit_val_batches": ("Lightning", "train.limit_eval_batches", ""),
    "resume_from_checkpoint": ("Hugging Face", "train.resume", ""),
    "dataloader_num_workers": ("Hugging Face", "data.num_workers", ""),
    "gradient_checkpointing": ("Hugging Face", "model.activation_checkpointing", ""),
    "max_time": ("Lightning", "train.time_limit", ": seconds or HH:MM:SS; used up, the run saves and exits 3"),
    "limit_train_batches": ("Lightning", "train.max_steps", " (optimizer steps), or train.epochs (a fraction)"),
    "limit_test_batches": ("Lightning", "train.limit_eval_batches", ", which test mode reads too"),
    "devices": ("Lightning", "dist.procs_per_node", ""),
    "num_nodes": ("Lightning", "dist.nodes", ""),
    "accelerator": ("Lightning", "dist.device", ": auto, cpu or cuda"),
    "use_cpu": ("Hugging Face", "dist.device", ": cpu"),
    "enable_progress_bar": ("Lightning", "log.progress_bar", ""),
    "disable_tqdm": ("Hugging Face", "log.progress_bar", ", the other way round (false: no bars)"),
    "ddp_timeout": ("Hugging Face", "dist.timeout_s", ""),
    "data_seed": ("Hugging Face", "seed", ", the one seed of the data order too"),
    "logging_dir": ("Hugging Face", "output_dir", ": the logs and TensorBoard's files go under it"),
    "eval_accumulation_steps": ("Hugging Face", None, "evaluation keeps sums and predicted labels here, never "
                                                      "logits: nothing to set"),
    "max_seq_length": ("Hugging Face", "data.max_length", ""),
    "seed": ("", "seed", ", at the top level"),
    "output_dir": ("", "output_dir", ", at the top level"),
    "default_root_dir": ("Lightning", "output_dir", ", at the top level"),
    "report_to": ("", "log.report_to", ""),
    "optim": ("Hugging Face", "train.optimizer", ""),
    "adam_epsilon": ("Hugging Face", "train.eps", ""),
}
# Their values of ours: Lightning's precisions ('bf16-true' and '16-true', whole half-precision weights, have no
# equivalent: fp16 and bf16 here are autocast over fp32 weights), Hugging Face's schedules
THEIR_VALUES = {
    "train.precision": {"16-mixed": ("Lightning", "fp16 here"), "16": ("Lightning", "fp16 here"),
                        "bf16-mixed": ("Lightning", "bf16 here"), "32-true": ("Lightning", "fp32 here"),
                        "32": ("Lightning", "fp32 here")},
    "train.schedule": {"constant_with_warmup": ("Hugging Face", "constant here: train.warmup applies to any schedule"),
                       "cosine_with_min_lr": ("Hugging Face", "cosine with train.min_lr_ratio here")},
}


def unknown_key(source: str, prefix: str, key: str, valid: list[str], every: list[str] = ()) -> str:
    """`every`: all the config's keys as written (train.lr), for a key written in another section than its own."""
    if key in THEIR_NAMES:
        whose, ours, how = THEIR_NAMES[key]  # (ours None: no equivalent, `how` says why)
        return f"{source}: unknown key `{prefix}{key}`" + (f" ({whose}'s name)" if whose else "") + \
            (f": here it is `{ours}`{how}" if ours else f": {how}")
    elsewhere = [f"`{k}`" for k in every if k.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"{source}: unknown key `{prefix}{key}`: it is {' or '.join(elsewhere)}"
    close = closest(key, valid)
    hint = f" (did you mean `{prefix}{close}`?)" if close else f" (valid keys: {', '.join(valid)})"
    return f"{source}: unknown key `{prefix}{shown_text(key)}`{hint}"


def closest(key: str, valid: list[str]):
    """The valid key the user most likely meant: one the key extends by a word (`lr_rate`: lr, even though
    min_lr_ratio is spelled closer), else a near spelling, else one that the key starts with."""
    extended = [v for v in valid if key.startswith(v + "_")]
    if extended:
        return max(extended, key=len)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return close[0]
    starts = [v for v in valid if key.startswith(v) or v.startswith(key)]
    return max(starts, key=len) if starts else None


def wrong_type(source: str, key: str, value, hint) -> str:
    options = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    whose, ours = THEIR_VALUES.get(key, {}).get(str(value), (None, None))
    theirs = f" ({whose}'s {str(value)!r} is {ours})" if whose else ""
    return f"{source}: `{key}` must be {' or '.join(type_name(a) for a in options)}, got {shown(value)}{theirs}"


def type_name(hint) -> str:
    if typing.get_origin(hint) is Literal:  # e.g. inside Optional: "one of gpt2, llama or null"
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
            type(None): "null", dict: "a mapping"}.get(hint, str(hint))
