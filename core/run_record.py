"""What rank 0 records as a run starts and ends: output_dir/config.yml, the plan, the trackers of log.report_to
(TensorBoard here, the others in trackers.py) and the closing summary. Called through the Trainer's hooks
(wiring.RunHooks), so the Trainer needs none of it to run."""
from __future__ import annotations

import dataclasses
import logging
import os
import shlex
from typing import Optional

import yaml

from core import checkpoint, checkpoint_meta, checkpoint_signing, disk_errors, optimizers, trackers
from core.atomic_write import write_beside
from core.config import Config, dump_yaml, procs_per_node_list
from core.launch_env import launcher_env
from trainer import warmup_steps


def start(cfg: Config, log: logging.Logger, plan: str, step: int = 0) -> Optional[trackers.Trackers]:
    """Rank 0, as training starts at `step` (> 0: resumed): writes output_dir/config.yml (what test, export and
    generate read), opens the trackers of log.report_to (returned, None without any) and gives them the config,
    then prints the plan."""
    # start_over: this start's, not the run's
    saved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, start_over=False))
    write_beside(os.path.join(cfg.output_dir, "config.yml"), lambda f: f.write(dump_yaml(saved)))
    tracked = trackers.Trackers(cfg, step, TensorBoard, log.warning) if trackers.names(cfg) else None
    try:
        if tracked:
            tracked.config(saved.to_dict())
        log.info(plan)
    except BaseException:  # a full disk: the Trainer does not hold them yet, so they are closed here, as after a crash
        if tracked:
            tracked.close(failed=True)
        raise
    return tracked


def plan(tr, notes: list[str] = ()) -> str:
    """The lines a run starts with (`tr`: the Trainer): what it trains, where, how, for how long, into which folder.
    `notes`: lines about the model as it was built (wiring.build_model: LoRA's)."""
    cfg, ctx, t = tr.cfg, tr.ctx, tr.train_cfg
    env = launcher_env()
    per_node = f"launched by {env['launcher']}" if env else str(procs_per_node_list(cfg))
    return "\n".join([
        "plan:",
        f"  task {cfg.task} ({tr.task.data_name()}), {len(tr.datasets['train'])} training samples",
        *([f"  {note}"] if (note := tr.task.classes_note()) else []),
        f"  world size {ctx.world_size}, ranks per node {per_node}, strategy {cfg.dist.strategy}, "
        f"backend {ctx.backend or '-'}, device {ctx.device.type}, precision {tr.precision_note}",
        *([f"  {ctx.cpu_threads}"] if ctx.cpu_threads and ctx.device.type == "cpu" else []),
        *tr.strategy.plan_lines(),
        *(f"  {note}" for note in notes),
        f"  batch per {tr.strategy.replica} {tr.batch_sizes} x {t.grad_accum_steps} "
        f"accumulation, global batch {sum(tr.batch_sizes) * t.grad_accum_steps}",
        *([f"  {tr.balance_note}"] if tr.balance_note else []),
        f"  {tr.total_steps} optimizer steps: {tr.length_note} ({tr.sampler.batches_per_epoch()} "
        f"micro-batches per epoch), starting at step {tr.state.step}",
        f"  {optimizers.plan_line(tr.strategy.optimizer, t)}",
        f"  {schedule_line(tr.total_steps, t)}",
        f"  best checkpoint: the {'highest' if tr.best_mode == 'max' else 'lowest'} dev {tr.best_metric}"
        + ("" if tr.best_metric in ("loss", "ema_loss") else
           f", a tie to the lower dev {'ema_loss' if 'ema_' in tr.best_metric else 'loss'}"),
        f"  {checkpoint_signing.plan_line(cfg.to_dict())}",
        f"  checkpoints kept: the last {t.keep_last} and the " + (f"{t.keep_best} best" if t.keep_best > 1 else "best"),
        f"  output {os.path.abspath(cfg.output_dir)}",
    ])


def schedule_line(total: int, t) -> str:
    """The plan's learning-rate line (trainer.lr_factor_function): the warm-up in steps, where a fraction of a short
    run may come to none, the decay and its end, and the clipping (Hugging Face's clips at 1.0 by default)."""
    warm = warmup_steps(total, t.warmup)
    rise = (f"warm-up over {warm} steps (train.warmup={t.warmup:g}), then " if warm > 1 else
            f"no warm-up (train.warmup={t.warmup:g} is {warm} of {total} steps; it takes 2 or more), then "
            if t.warmup else "")
    decay = "constant" if t.schedule == "constant" else f"{t.schedule} to {t.lr * t.min_lr_ratio:g}"
    clip = f"clipped to {t.clip_grad_norm:g}" if t.clip_grad_norm else "not clipped"
    return f"lr {t.lr:g}: {rise}{decay}; gradient norm {clip}"


class TensorBoard:
    """TensorBoard's writer (SummaryWriter) into `folder`, whose errors name the folder: its writer thread meets
    a full disk with an error that names no file, raised again by the next call here. `first_step`: the first step
    this run writes; TensorBoard hides the points of earlier event files from it on (as metrics.csv drops them)."""

    def __init__(self, folder: str, first_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter  # lazy: a heavy import, for runs that ask for it only
        self.folder = folder
        # purge_step: a resumed run writes the steps after its checkpoint again, in an event file of its own
        with disk_errors.name_unnamed_errors(folder):
            self.writer = SummaryWriter(folder, purge_step=first_step)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        with disk_errors.name_unnamed_errors(self.folder):
            self.writer.add_scalar(tag, value, step)

    # What trackers.Trackers calls on each of its trackers
    def config(self, values: dict) -> None:
        text = yaml.safe_dump(values, sort_keys=False)
        with disk_errors.name_unnamed_errors(self.folder):  # indented: TensorBoard's text tab shows it as a code block
            self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()))

    def scalars(self, step: int, values: dict) -> None:
        for tag, value in values.items():
            self.add_scalar(tag, value, step)

    def summary(self, values: dict) -> None:
        pass  # the curves are the record; the summary's values are the last points of train/ and dev/

    def close(self, failed: bool = False, stopped: bool = False) -> None:
        with disk_errors.name_unnamed_errors(self.folder):
            self.writer.close()


def summary(cfg: Config, state, best_metric: str, task) -> str:
    """The run's last lines: what it did (`state`: the Trainer's TrainState), where its files are, and what to
    run next (export only where the task can be exported)."""
    out, s = cfg.output_dir, state
    best = (f"best dev {best_metric}={s.best_value:.4g} at step {s.best_step}" if s.best_step is not None
            else "no dev result")
    if s.best_step is not None and cfg.train.eval_batches:  # ranked on the subset; the last line above: whole split
        best += f" (on the dev subset of train.eval_batches={cfg.train.eval_batches})"
    params = shlex.quote(os.path.join(out, "config.yml"))  # this run's effective config: all the next commands need
    kept, gone = checkpoint_meta.best(out, s.best_step)  # (the latest where the best was deleted: said, as in test mode)
    if gone:
        kept += f"; the best checkpoint, step-{s.best_step}, is gone: the latest stands in"
    lines = [f"done: {s.step} steps; {best}",
             f"  checkpoints  {checkpoint.root(out)} (best: {kept})",
             f"  logs         {os.path.join(out, 'logs')}"]
    tracked = trackers.names(cfg)
    if "tensorboard" in tracked:
        lines.append(f"  tensorboard  tensorboard --logdir {shlex.quote(os.path.join(out, 'tensorboard'))}")
    if "csv" in tracked:
        lines.append(f"  metrics      {shlex.quote(os.path.join(out, trackers.CSV_FILE))}")
    if "mlflow" in tracked:
        lines.append(f"  mlflow       mlflow ui --backend-store-uri {shlex.quote(trackers.mlflow_uri(cfg))}")
    lines.append(f"  test         python main.py --params {params} --set mode=test")
    if task.export_formats:
        lines.append(f"  export       python main.py --params {params} --set mode=export")
    if task.generates_text:
        lines.append(f"  generate     python generate.py --params {params} --prompt \"...\"")
    return "\n".join(lines)
