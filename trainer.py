"""The Trainer: train / eval / checkpoint, for any Task under any strategy.

Read `train()` first: it is the whole loop. A training step is `train_step()` and the Data section after it (where
its batches come from); evaluation, checkpoints and the state follow, reached every eval_every / save_every steps.
What a run prints as it trains (log lines, progress bars) is written by core/run_log.py. The Trainer is handed its
parts, built by the composition root (wiring.build_trainer): the task's datasets, the strategy (the model as
dist.strategy wraps it, its optimizer and loss scaler) and the hooks (which also record the run's plan, trackers and
summary). The model's own forward and loss are the task's (tasks/)."""
from __future__ import annotations

import contextlib
import math
import os
import random
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch

from core import checkpoint, distributed, run_log
from core.ema import WeightAverage
from core.errors import ConfigError, Diverged, Stopped
from core.hooks import Hooks
from core.run_log import EvalProgress, LossWindow, setup_logging
from data_loader import GlobalBatchSampler, TrainingLoader, eval_shard_batches, make_loader, split_proportional
from core.model_parts import lora_base_entry
from strategies.base import Strategy
from tasks.base import Task


@dataclass
class TrainState:
    """Everything about progress that a checkpoint must restore (besides model, optimizer, scheduler, RNG)."""
    step: int = 0             # optimizer steps done
    epoch: int = 0            # current epoch
    batch_in_epoch: int = 0   # micro-batches of the current epoch already consumed
    sample_in_epoch: int = 0  # samples of the epoch's order consumed by all ranks: where the epoch resumes
    best_value: Optional[float] = None
    best_step: Optional[int] = None
    best_loss: Optional[float] = None  # the best checkpoint's dev loss: breaks ties of best_value
    evals_without_improvement: int = 0
    best_k: list = field(default_factory=list)  # train.keep_best: [value, dev loss, step] of the k best, best first
    eval_due: bool = False  # a stop saved this step before its evaluation (Trainer.stop): a resume evaluates it first
    bad_steps: int = 0  # the last steps skipped in a row: a non-finite gradient norm, no sample (count_skipped_update)


def finite_or_none(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def autocast_for(device_type: str, precision: str):
    """The context the forward passes run in: autocast to fp16/bf16, or nothing for fp32."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return (lambda: torch.autocast(device_type, dtype=dtype)) if dtype else contextlib.nullcontext


class Trainer:
    def __init__(self, cfg, task: Task, datasets: dict, strategy: Strategy, hooks: Hooks = Hooks(),
                 precision_note: Optional[str] = None):
        """`cfg`: the run's core.config.Config, read here, never checked (its schema and checks ran before);
        `datasets`: the task's splits; `strategy`: the model as dist.strategy prepared it, with its optimizer;
        `hooks`: what resilience/ and extras/ add to the loop (core/hooks.py). All built by wiring.build_trainer."""
        self.cfg, self.task, self.datasets, self.strategy, self.hooks = cfg, task, datasets, strategy, hooks
        self.ctx, self.train_cfg = strategy.ctx, cfg.train
        # what the plan shows (precision auto: what it chose and why)
        self.precision_note = precision_note or cfg.train.precision
        self.log = setup_logging(cfg.output_dir, self.ctx.rank)

        train_set = self.datasets["train"]
        self.lengths = task.lengths(train_set) if cfg.data.group_by_length else None
        self.batch_sizes = self.per_rank_batch_sizes()
        self.sampler = self.make_sampler()
        self.total_steps, self.length_note = self.count_total_steps()
        # LambdaLR applies factor(0) as it is built: step 1 runs at train.lr * factor(0) (a warm-up's first step)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.strategy.optimizer, lr_factor_function(
            self.total_steps, self.train_cfg.warmup, self.train_cfg.schedule, self.train_cfg.min_lr_ratio))
        self.state = TrainState()
        self.best_metric, self.best_mode = best_by(self.train_cfg.best_metric, self.train_cfg.best_mode, task)
        self.pin_memory = self.ctx.device.type == "cuda"  # pinned batches: copies to the GPU are queued, not waited for
        self.autocast = autocast_for(self.ctx.device.type, self.train_cfg.precision)
        self.trackers = None  # rank 0's trackers.Trackers (log.report_to), from hooks.run_starts
        self.resumed_batch_sizes, self.balance_note = None, None  # batch_size auto (extras/balance.py)
        self.resumed_precision = None  # what a resumed run trained in: precision auto keeps it (extras/balance.py)
        self.step_lr = None  # the lr the last step ran at: the training line's (train_step)
        self.loss_window = LossWindow(self.ctx)  # the loss since the last training line (saved: a resume goes on)
        self.pending_save, self.best_step_to_keep = None, None  # a checkpoint being written (train.async_save)
        self.eval_loaders = {}  # split -> (index lists, its loader): eval_loader
        # train.ema_decay: a moving average of the weights this rank holds (core/ema.py)
        self.ema = WeightAverage(strategy.averaged_entries(), cfg.train.ema_decay) if cfg.train.ema_decay else None

    # ---- The loop ------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        # First, resume (resilience/resume.py picks a checkpoint and calls load_state_dict): True if that run was done.
        if self.hooks.resume(self):
            return {}
        self.hooks.before_first_step(self)  # precision auto on a CPU, batch_size auto: timed here
        train_cfg, state = self.train_cfg, self.state
        if self.ctx.is_main:  # config.yml, the plan, and the trackers the run reports to
            self.trackers = self.hooks.run_starts(self)
        stream = self.micro_batches()
        metrics, saved_at, evaluated_at, stop = {}, None, None, False
        if state.eval_due:  # the evaluation a stop left out, as the uninterrupted run made it (improved, patience)
            state.eval_due, evaluated_at = False, state.step
            metrics, improved, stop = self.evaluate_and_rank(last=state.step >= self.total_steps)
            if improved or stop:
                self.save_checkpoint(metrics)
                saved_at = state.step
        window = self.loss_window
        window.open_at(state.step)
        bar = self.progress_bar()
        while not stop and state.step < self.total_steps:
            # -----> one optimizer step; change what happens per step in train_step().
            self.hooks.phase_starts(state.step + 1, "train")
            batches = [next(stream) for _ in range(self.grad_accum_this_step())]  # this rank's micro-batches
            rank_loss_sum, count, grad_norm, updated, any_stop = self.train_step(batches)
            state.step += 1
            if updated:
                state.bad_steps = 0
                reports = self.strategy.counts_its_batch  # one rank per replica counts its samples and tokens
                samples = sum(len(next(iter(b.values()))) for b in batches) if reports else 0
                tokens = run_log.batch_tokens(self.task, batches, reports)
                window.add(rank_loss_sum, count, samples=samples, tokens=tokens)
            else:  # its update was not applied; too many in a row end the run
                self.count_skipped_update(grad_norm, counted=count > 0)
            last = state.step == self.total_steps
            if state.step % train_cfg.log_every == 0 or last:  # the loss window waits for the device here only
                self.log_train(window.flush(state.step), grad_norm, bar)
            if any_stop and not last:  # a signal or the time limit, on any rank: all ranks stop here
                self.stop(bar)

            improved = stop = False
            if (train_cfg.eval_every and state.step % train_cfg.eval_every == 0) or last:
                metrics, improved, stop = self.evaluate_and_rank(last)
                evaluated_at = state.step
            if (train_cfg.save_every and state.step % train_cfg.save_every == 0) or last or improved or stop:
                self.save_checkpoint(metrics if evaluated_at == state.step else {})
                saved_at = state.step
        if stop:
            self.log.info(f"early stopping at step {state.step}: no improvement of {self.best_metric} "
                          f"in {train_cfg.patience} evaluations")
        if bar is not None:
            bar.close()
        self.hooks.phase_starts(state.step, "done")
        if saved_at != state.step and state.step > 0:  # e.g. resumed at the end: make sure the end is saved
            self.save_checkpoint(metrics if evaluated_at == state.step else {})
        self.finish_save()
        self.close()
        if self.ctx.is_main:
            self.hooks.run_ends(self)  # the closing lines
        return metrics

    def train_step(self, batches: list[dict]) -> tuple[torch.Tensor, float, float, bool, bool]:
        """One optimizer step over `batches` (the accumulation micro-batches of this rank). Returns this rank's
        summed loss, the global count (samples, or tokens), the global gradient norm, whether the update was applied
        (the norm was finite), whether any rank asked to stop."""
        strategy, ctx = self.strategy, self.ctx
        # The update is the mean gradient over the GLOBAL batch: the summed loss divided by the global sample count.
        # The count's all-reduce also carries each rank's stop vote, so all ranks stop at the same step.
        # One rank per replica counts its batch (under ddp, every rank; a tp group's ranks share one batch).
        rank_count = sum(self.task.count(b) for b in batches) if strategy.counts_its_batch else 0
        count_and_vote = torch.tensor([float(rank_count), self.hooks.stop_vote()])  # this rank's
        if self.pin_memory:  # (a GPU: the copy is queued, the host does not wait)
            count_and_vote = count_and_vote.pin_memory()
        count_and_vote = count_and_vote.to(ctx.device, non_blocking=self.pin_memory)
        global_count, stop_votes = distributed.all_reduce_sum(ctx, count_and_vote)
        # Each rank's summed loss over the global count: the ranks' gradients, summed (not averaged: DDP's hook is
        # replicated.sum_gradients), are then the mean over the global batch, whatever each rank's share.
        loss_weight = 1 / global_count  # a tensor on the device: the host does not wait
        # -----> the forward and backward of each micro-batch: Strategy.forward_backward (strategies/base.py); all
        # but the last run under DDP's no_sync, and the last backward all-reduces (one micro-batch by default)
        rank_loss_sum = strategy.forward_backward(self.task, [self.to_device(b) for b in batches], loss_weight,
                                                 self.autocast)
        if strategy.scaler:
            strategy.scaler.unscale_(strategy.optimizer)  # clip and measure the true gradients, not the scaled ones
        # Global, so equal on every rank; train.clip_grad_norm 0 (inf here): measured, not clipped.
        norm_on_device = strategy.grad_norm(clip_to=self.train_cfg.clip_grad_norm or math.inf)
        # The one place a step waits for the device: a NaN/Inf gradient must never reach the parameters or the
        # optimizer state, and whether to apply the update depends on the norm. The stop votes come in the same read.
        grad_norm, stop_count, count = torch.stack([norm_on_device.float().reshape(()), stop_votes,
                                                    global_count]).tolist()
        # NaN/Inf, or no sample at all (AdamW would still decay and move the weights): no update; the step still
        # counts, the schedule moves on
        update = math.isfinite(grad_norm) and count > 0
        if strategy.scaler:  # fp16: the scaler skips the update itself when the gradients overflowed (norm inf)
            if count > 0:
                strategy.scaler.step(strategy.optimizer)
            strategy.scaler.update()
        elif update:
            strategy.optimizer.step()
        if self.ema is not None and update:
            self.ema.update()
        strategy.optimizer.zero_grad(set_to_none=True)
        self.step_lr = strategy.optimizer.param_groups[0]["lr"]  # what this step ran at: the log's lr (not the next's)
        self.scheduler.step()
        return rank_loss_sum, count, grad_norm, update, stop_count > 0

    def count_skipped_update(self, norm: float, counted: bool) -> None:
        """The step just done had a NaN/Inf gradient norm, or no sample: train_step did not apply it (it still counts
        as a step, and the schedule moved on). Several in a row mean training has diverged: stop, keeping the
        checkpoints written before (every rank sees the same global norm and count: all stop at the same step)."""
        if counted and self.strategy.scaler is not None and self.strategy.scaler.get_scale() >= 1:
            return  # fp16 overflow: the loss scaler lowers its scale and tries again; that is its job
        self.state.bad_steps += 1
        why = f"gradient norm is {norm}" if counted else "its batch counts no sample (every image skipped by " \
            "data.skip_bad_images, or no target token)"
        self.log.warning(f"step {self.state.step}: {why}: update skipped ({self.state.bad_steps} in "
                         f"a row; train.max_bad_steps={self.train_cfg.max_bad_steps})")
        if self.state.bad_steps >= self.train_cfg.max_bad_steps:
            self.finish_save()
            last = checkpoint.latest(self.cfg.output_dir)
            distributed.barrier(self.ctx)
            raise Diverged(
                f"training {'diverged' if counted else 'stopped'}: {self.state.bad_steps} steps in a row up to step "
                f"{self.state.step} had " + (f"a non-finite gradient norm ({norm})" if counted else "no sample") +
                f"; their updates were skipped and nothing was saved after them; last checkpoint: {last or 'none'} ("
                + ("lower train.lr, set train.clip_grad_norm, or check the data)" if counted else
                   "check the data: data.skip_bad_images names each file it skipped in the log)"))

    def stop(self, bar) -> None:
        """Every rank asked (or was told) to stop after this step: save, and leave with Stopped. (Called before this
        step's evaluation and save, so the checkpoint has no dev metrics, and is always new; an evaluation due at
        this step is made by the resumed run first: eval_due.)"""
        reasons = [r for r in distributed.gather_objects(self.ctx, self.hooks.stop_reason()) if r]
        reason = reasons[0] if reasons else "a signal"
        if reason == "time limit":
            reason = f"the time limit (train.time_limit={self.train_cfg.time_limit})"
        if bar is not None:
            bar.close()
        self.state.eval_due = bool(self.train_cfg.eval_every) and self.state.step % self.train_cfg.eval_every == 0
        self.save_checkpoint({})
        self.finish_save()
        self.close(stopped=True)
        raise Stopped(f"stopped by {reason} at step {self.state.step}; saved step-{self.state.step}; "
                             f"run the same command to resume")

    # ---- Data ----------------------------------------------------------------------------------------------------
    def micro_batches(self) -> Iterator[dict]:
        """Endless stream of this rank's training batches, epoch after epoch, starting where the state says (which
        samples: data_loader.GlobalBatchSampler). The state moves as batches are handed out, so a checkpoint records
        the exact position."""
        state, train_set = self.state, self.datasets["train"]
        # one DataLoader for the stream: its workers (data.num_workers) start once, serve every epoch, end with it
        loader = TrainingLoader(train_set, self.task.collate, self.cfg.data.num_workers, self.pin_memory,
                                self.cfg.seed, self.task.start_epoch)
        while True:
            self.task.start_epoch(train_set, state.epoch)  # e.g. random LM windows drawn per epoch
            batches = self.sampler.epoch_batches(state.epoch, start_sample=state.sample_in_epoch)  # made as consumed
            for batch in loader.epoch(state.epoch, batches):
                state.batch_in_epoch += 1
                # a position in the epoch's order, which all ranks share: it moves by the global batch
                state.sample_in_epoch = min(state.sample_in_epoch + self.sampler.global_batch, self.sampler.n)
                yield batch
            state.epoch, state.batch_in_epoch, state.sample_in_epoch = state.epoch + 1, 0, 0

    def grad_accum_this_step(self) -> int:
        """train.grad_accum_steps; an epoch-limited run's last step takes only the micro-batches left in its last
        epoch (Hugging Face's Trainer's shorter step; train_step weighs it by its samples, as any uneven batch)."""
        t, sampler = self.train_cfg, self.sampler
        left = micro_batches_in(t.epochs, sampler.batches_per_epoch()) - micro_batches_done(self.state, sampler)
        return min(t.grad_accum_steps, left) if t.epochs and left > 0 else t.grad_accum_steps

    def to_device(self, batch: dict) -> dict:
        """Host -> device. On GPU the source is pinned, so the copy is queued and the host does not wait."""
        if self.pin_memory:
            batch = {k: v if v.is_pinned() else v.pin_memory() for k, v in batch.items()}
        return {k: v.to(self.ctx.device, non_blocking=self.pin_memory) for k, v in batch.items()}

    def per_rank_batch_sizes(self) -> list[int]:
        b = self.train_cfg.batch_size
        if b == "auto":  # an equal split until the ranks are timed (extras/balance.py)
            unit = self.strategy.batch_multiple  # pipe: whole sets of micro-batches
            return [n * unit for n in split_proportional(self.train_cfg.global_batch_size // unit,
                                                         [1] * self.strategy.data_shares, minimum=1)]
        return list(b) if isinstance(b, list) else [b] * self.strategy.data_shares  # pipe: one size per pipeline

    def make_sampler(self) -> GlobalBatchSampler:
        """This rank's training batches for the current per-rank batch sizes (see data_loader.py)."""
        train_set = self.datasets["train"]
        return GlobalBatchSampler(len(train_set), self.batch_sizes, self.strategy.data_rank, self.cfg.seed,
                                  shard_sizes=self.task.shard_sizes(train_set), lengths=self.lengths,
                                  drop_last=self.strategy.drop_last)  # pipe: a smaller last batch cannot go through

    def count_total_steps(self) -> tuple[int, str]:
        """The run's optimizer steps: train.epochs or train.max_steps, whichever ends first, and which one it is, for
        the plan and the resume messages (a limit nobody sees is a run that ends for no reason)."""
        train_cfg, sampler = self.train_cfg, self.sampler
        if sampler.global_batch > sampler.n and self.cfg.mode == "train":  # (a config that makes no sense: said now)
            key = "train.global_batch_size" if train_cfg.batch_size == "auto" else "train.batch_size"  # (the one set)
            raise ConfigError(f"`{key}`: the global batch ({sampler.global_batch} samples over all ranks) is larger "
                              f"than the training set ({sampler.n} samples); lower {key}")
        from_epochs = ceil_div(micro_batches_in(train_cfg.epochs, sampler.batches_per_epoch()),
                               train_cfg.grad_accum_steps) if train_cfg.epochs else None
        limits = [(n, f"{key}={value:g}") for n, key, value in (
            (from_epochs, "epochs", train_cfg.epochs), (train_cfg.max_steps or None, "max_steps", train_cfg.max_steps))
                  if n is not None]
        total, first = min(limits)
        others = [what for n, what in limits if what != first]
        verb = "ends together with" if len(limits) == 2 and limits[0][0] == limits[1][0] else "ends before"
        note = first + (f" {verb} {others[0]}" if others else "")
        if train_cfg.warmup >= 1 and train_cfg.warmup > total and self.cfg.mode == "train":
            raise ConfigError(f"`train.warmup` is {train_cfg.warmup:g} steps, longer than the run ({total} optimizer "
                              f"steps: {note}); lower it, or give a fraction of the run (< 1)")
        return total, note

    # ---- Evaluation ----------------------------------------------------------------------------------------------
    def evaluate_dev(self, ranked: bool = False) -> dict:
        """dev's metrics; with train.ema_decay the average's too, as ema_<metric> (the trained weights pick the
        best checkpoint), or the average's alone with train.eval_ema. `ranked`: on the samples of the evaluations
        during training at the last step too (eval_indices)."""
        if self.ema is None:
            return self.evaluate("dev", ranked=ranked)
        metrics = {} if self.train_cfg.eval_ema else self.evaluate("dev", ranked=ranked)
        with self.ema.swapped_in():
            averaged = self.evaluate("dev", shown_as="dev_ema", ranked=ranked)
        return averaged if self.train_cfg.eval_ema else {**metrics, **{f"ema_{k}": v for k, v in averaged.items()}}

    @torch.no_grad()
    def evaluate(self, split: str, shown_as: Optional[str] = None, ranked: bool = False) -> dict:
        """Exact distributed evaluation: each rank evaluates its own contiguous piece, no sample twice. `shown_as`:
        the name of the log line and tracker keys (the split's by default)."""
        ctx, dataset, strategy = self.ctx, self.datasets.get(split), self.strategy
        if dataset is None:
            return {}
        # Replicated strategies evaluate the plain module; sharded ones must go through the wrapper, and then
        # every rank runs the same number of forward passes (extra ones on a dummy batch, results dropped).
        model = strategy.eval_model
        strategy.share_buffers()  # BatchNorm's statistics: rank 0's on every rank, as saved
        was_training = model.training
        model.eval()
        # Positions in `indices` (the whole split, or train.eval_batches' subset), cut per rank, as dataset indices.
        indices = self.eval_indices(split, len(dataset), ranked)
        batches = [[indices[i] for i in batch]
                   for batch in eval_shard_batches(len(indices), strategy.data_rank, strategy.data_shares,
                                                   self.train_cfg.eval_batch_size)]
        loader = self.eval_loader(split, dataset, batches)
        sums, arrays = {}, {}
        progress = EvalProgress(self, split, len(batches))
        for batch in loader:
            self.hooks.phase_starts(self.state.step, "eval")  # a watchdog sees evaluation advance
            out = strategy.eval_batch(self.task, self.to_device(batch), self.autocast)
            progress.batch_done()
            for k, v in out.items():
                if v.dim() == 0:
                    sums[k] = sums.get(k, 0) + v.double()
                else:
                    arrays.setdefault(k, []).append(v)
        if strategy.forward_is_collective:
            most = len(eval_shard_batches(len(indices), 0, strategy.data_shares, self.train_cfg.eval_batch_size))
            dummy = self.to_device(self.task.collate([dataset[0]]))
            for _ in range(most - len(batches)):
                strategy.eval_batch(self.task, dummy, self.autocast)
        local = {k: v.item() for k, v in sums.items()}
        local.update({k: torch.cat(v).cpu().numpy() for k, v in arrays.items()})
        totals = {}
        for part in distributed.gather_objects(ctx, local):  # in rank order = dataset order
            for k, v in part.items():
                if isinstance(v, np.ndarray):
                    totals[k] = np.concatenate([totals[k], v]) if k in totals else v
                else:
                    totals[k] = totals.get(k, 0.0) + v
        model.train(was_training)
        metrics = self.task.metrics(totals)
        if ctx.is_main:
            limited = len(indices) == self.train_cfg.limit_eval_batches * self.train_cfg.eval_batch_size  # its key
            key = "train.limit_eval_batches" if limited else "train.eval_batches"
            subset = f" (on {len(indices)} of {len(dataset)} samples: {key})" if len(indices) < len(dataset) else ""
            shown_as = shown_as or split
            self.log.info(f"step {self.state.step} {shown_as}: "
                          + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()) + subset)
            # (the last step's ranked subset: its line alone; the trackers get the whole split's, one value a tag)
            at_last = ranked and self.state.step >= self.total_steps  # (before it, ranked and reported sets are one)
            if self.trackers and not (at_last and len(indices) != len(self.eval_indices(split, len(dataset)))):
                self.trackers.scalars(self.state.step, {f"{shown_as}/{k}": v for k, v in metrics.items()})
        return metrics

    def eval_loader(self, split: str, dataset, batches: list) -> torch.utils.data.DataLoader:
        """The split's one loader over `batches`: its workers (data.num_workers) start at its first evaluation and are
        kept until close(), as the training stream's are."""
        if split not in self.eval_loaders:
            held = []  # this evaluation's index lists, refilled in place: the loader's next `for` reads them
            self.eval_loaders[split] = held, make_loader(dataset, held, self.task.collate, self.cfg.data.num_workers,
                                                         self.pin_memory, self.cfg.seed, keep_workers=True)
        held, loader = self.eval_loaders[split]
        held[:] = batches
        return loader

    def eval_indices(self, split: str, n: int, ranked: bool = False):
        """The samples of a split of `n` an evaluation covers. train.eval_batches: evaluations of dev during
        training, except the last (unless `ranked`), take eval_batches x eval_batch_size of them, drawn from cfg.seed
        alone, so every rank, every world size and every evaluation gets the same subset (dev curves and the best
        stay comparable). Sorted, so the subset is read in the split's order, as the whole split is. Otherwise (test
        mode too): all of them, or train.limit_eval_batches' subset (drawn alike) where that is set."""
        size = self.train_cfg.eval_batches * self.train_cfg.eval_batch_size
        if split != "dev" or self.cfg.mode != "train" or (self.state.step >= self.total_steps and not ranked):
            size = 0
        limit = self.train_cfg.limit_eval_batches * self.train_cfg.eval_batch_size
        if limit and (not size or limit < size):
            size = limit
        if not size or size >= n:
            return range(n)
        return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed))[:size].tolist())

    def evaluate_and_rank(self, last: bool) -> tuple[dict, bool, bool]:
        """Evaluate dev and rank the values (track_best): (the metrics, worth a checkpoint, should stop). The best
        checkpoints and patience compare values of the same dev samples: where the `last` evaluation reads others
        (train.eval_batches' whole split), it is made on those of the others first, ranked, then reported."""
        metrics = self.evaluate_dev(ranked=True)
        improved, stop = self.track_best(metrics)
        n = len(self.datasets.get("dev") or ())
        if last and len(self.eval_indices("dev", n)) != len(self.eval_indices("dev", n, ranked=True)):
            metrics = self.evaluate_dev()
        return metrics, improved, stop

    def track_best(self, metrics: dict) -> tuple[bool, bool]:
        """Update the best dev value (and train.keep_best's ranking); return (worth a checkpoint, should_stop)."""
        state, train_cfg = self.state, self.train_cfg
        if self.best_metric not in metrics:  # known only now, maybe at the run's end: this step is kept, eval due
            state.eval_due = True
            self.save_checkpoint({})
            self.finish_save()
            bare = self.best_metric.split("_", 1)[-1]  # Hugging Face's eval_loss, Lightning's val_loss: loss here
            raise ConfigError(f"`train.best_metric` is {self.best_metric!r}, not among the dev metrics "
                              f"({', '.join(metrics)})" + (f"; use {bare!r}" if bare in metrics else "") +
                              f"; step-{state.step} is saved: correct it and run again to resume")
        value, loss = metrics[self.best_metric], metrics.get("ema_loss" if "ema_" in self.best_metric else "loss")
        better = math.isfinite(value) and (  # NaN is never best
            state.best_value is None
            or (value > state.best_value if self.best_mode == "max" else value < state.best_value)
            # a tie (accuracy moves in steps of 1/N) goes to the lower dev loss (a NaN one, kept as None: the highest)
            or (value == state.best_value and finite_or_none(loss) is not None
                and (state.best_loss is None or loss < state.best_loss)))
        if better:
            state.best_value, state.best_step, state.evals_without_improvement = value, state.step, 0
            state.best_loss = finite_or_none(loss)
        else:
            state.evals_without_improvement += 1
        ranked = False
        if train_cfg.keep_best > 1 and math.isfinite(value):  # the same order: a tie to the lower loss, then the step
            state.best_k = sorted(state.best_k + [[value, finite_or_none(loss), state.step]],
                                  key=lambda r: (-r[0] if self.best_mode == "max" else r[0],
                                                 math.inf if r[1] is None else r[1], r[2]))[:train_cfg.keep_best]
            ranked = state.step in (r[2] for r in state.best_k)
        return better or ranked, bool(train_cfg.patience) and state.evals_without_improvement >= train_cfg.patience

    # ---- Checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, metrics: dict) -> None:
        self.hooks.phase_starts(self.state.step, "save")
        self.finish_save()  # one save in flight at most (train.async_save)
        self.check_finite_parameters()
        self.strategy.share_buffers()  # every rank holds the BatchNorm statistics saved: a resumed run goes on alike
        own = self.state_dict()
        # every rank's random streams and loss window, so that each resumes its own
        ranks = distributed.gather_objects(self.ctx, (own["rng"], own["loss_window"]))

        def start_files(directory: str):  # the model and optimizer: the strategy's files (Strategy.save)
            wait = self.strategy.start_save(directory) if self.train_cfg.async_save else self.strategy.save(directory)
            if self.ctx.is_main:
                torch.save({"scheduler": own["scheduler"], "scaler": own["scaler"], "rng": [r for r, _ in ranks],
                            "loss_window": [w for _, w in ranks]}, os.path.join(directory, "state.pt"))
                if own["ema"] is not None:
                    torch.save(own["ema"], os.path.join(directory, "ema.pt"))
            return wait or (lambda: None)

        meta = {"step": self.state.step, "state": own["state"], "metrics": metrics,
                "world_size": self.ctx.world_size, "strategy": self.cfg.dist.strategy,
                "format": self.strategy.checkpoint_format,
                "batch_sizes": own["batch_sizes"], "config": self.cfg.to_dict(),
                "train_samples": self.sampler.n,  # the epoch order's length: its position means nothing in another
                "optimizer": checkpoint.hyperparameters(self.strategy.optimizer.param_groups),
                "label_names": self.task.label_names(),  # a classifier's outputs, by name (checkpoint_io)
                "vocabulary_sha256": self.task.vocabulary_sha256(),  # its inputs' ids (checkpoint_io)
                **lora_base_entry(self.strategy.raw_model)}  # LoRA: the frozen base the adapters need
        self.pending_save = checkpoint.start_write(self.cfg.output_dir, self.state.step, self.ctx, start_files, meta)
        self.best_step_to_keep = self.state.best_step
        if not self.train_cfg.async_save:
            self.finish_save()

    # ---- The Trainer's state, both ways, and what resume and balancing may change -------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint holds besides the model and optimizer (the strategy's files: Strategy.save/load): the
        scheduler, the loss scaler, this rank's random streams and loss window, the progress (data position, best),
        batch sizes, the precision (the config's, which meta.json records) and the weights' average (whole: a
        collective under fsdp)."""
        return {"scheduler": self.scheduler.state_dict(),
                "scaler": self.strategy.scaler.state_dict() if self.strategy.scaler else None,
                "rng": rng_state(), "loss_window": self.loss_window.state_dict(),
                "state": asdict(self.state), "batch_sizes": self.batch_sizes,
                "precision": self.train_cfg.precision, "ema": self.ema_state() if self.ema else None}

    def ema_state(self) -> dict:
        """The whole average (a collective under fsdp and pipe); under pipe each stage's part, put together."""
        if not self.strategy.pipelined:
            return self.ema.state_dict()
        whole = {}
        for part in distributed.gather_objects(self.ctx, self.ema.state_dict()):  # in rank order
            # A stage's first replica's: its BatchNorm statistics are the ones evaluation used (share_buffers)
            whole.update({name: a for name, a in part.items() if name not in whole})
        return whole

    def load_state_dict(self, saved: dict) -> None:
        """The inverse of state_dict(), once the strategy has loaded the model and optimizer. `rng` None: the
        checkpoint came from another world size, so this rank keeps its fresh streams; `loss_window` None: an older
        version kept none (at another world size: resume.loss_window_here)."""
        self.scheduler.load_state_dict(per_group(saved["scheduler"], len(self.strategy.optimizer.param_groups)))
        self.apply_lr()  # the same value, except under pipe (its optimizer files keep no param_groups)
        if self.strategy.scaler and saved["scaler"]:
            self.strategy.scaler.load_state_dict(saved["scaler"])
        self.state = TrainState(**saved["state"])
        keep, s = self.train_cfg.keep_best, self.state  # resumed with a lower train.keep_best: its surplus is pruned
        if keep > 1 and not s.best_k and None not in (s.best_value, s.best_step):  # keep_best 1 saved none
            s.best_k = [[s.best_value, s.best_loss, s.best_step]]
        s.best_k = s.best_k[:keep] if keep > 1 else []
        self.resumed_batch_sizes = saved["batch_sizes"]  # batch_size auto reuses them (extras/balance.py)
        self.resumed_precision = saved.get("precision")  # and precision auto this one
        if saved["rng"] is not None:
            set_rng_state(saved["rng"])
        if saved.get("loss_window") is not None:
            self.loss_window.load_state_dict(saved["loss_window"])
        if self.ema is not None and saved.get("ema") is None:  # ema_decay set at a resume: the average starts here
            self.log.warning("resumed from a checkpoint without a weight average (ema.pt): it starts from its weights")
        if self.ema is not None and saved.get("ema") is not None:
            new = self.ema.load_state_dict(saved["ema"], holds_all=not self.strategy.pipelined)
            if new:  # ema.pt of an older version: its average of the running statistics starts here
                self.log.warning(f"ema.pt averages no buffers ({new[0]}, ...: written before they were averaged): "
                                 "their average starts from the loaded values")

    def apply_lr(self) -> None:
        """Every parameter group's lr as the schedule gives it at this step (after its state or length changed)."""
        sched = self.scheduler
        for group, base, factor in zip(self.strategy.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)

    def set_base_lr(self, lr: float) -> None:
        """Resumed with another train.lr: the schedule continues from it (the loaded scheduler holds the old one)."""
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        for group in self.strategy.optimizer.param_groups:
            group["initial_lr"] = lr
        self.apply_lr()

    def set_total_steps(self, total: int) -> None:
        """The run's length counted again (resume.length_from_position): the schedule follows the new length."""
        self.total_steps = total
        factor = lr_factor_function(total, self.train_cfg.warmup, self.train_cfg.schedule,
                                    self.train_cfg.min_lr_ratio)
        self.scheduler.lr_lambdas = [factor] * len(self.scheduler.lr_lambdas)
        self.apply_lr()

    def set_batch_sizes(self, sizes: list[int], note: Optional[str] = None) -> None:
        """batch_size auto (extras/balance.py): new per-rank sizes, same global batch; the sampler is rebuilt."""
        self.batch_sizes, self.balance_note = list(sizes), note
        self.sampler = self.make_sampler()

    def set_precision(self, precision: str, note: str) -> None:
        """precision auto on a CPU (extras/balance.py): the measured choice, what checkpoints and config.yml record."""
        self.cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.train_cfg, precision=precision))
        self.train_cfg, self.precision_note = self.cfg.train, note
        self.autocast = autocast_for(self.ctx.device.type, precision)

    def rank_anew(self) -> None:
        """Resumed with another best_metric or best_mode (resume.best_changes): the best so far, patience's count and
        train.keep_best's ranking start again from this step."""
        s = self.state
        s.best_value, s.best_step, s.best_loss, s.evals_without_improvement, s.best_k = None, None, None, 0, []

    def set_step(self, step: int) -> None:
        """test mode: the step of the checkpoint evaluated, which its log lines name."""
        self.state.step = step

    def finish_save(self) -> None:
        """Wait for the checkpoint being written (every rank), publish it, prune the old ones, and say "saved"."""
        pending, self.pending_save = self.pending_save, None
        if pending is None:
            return
        path = pending.finish()
        if self.ctx.is_main:
            self.prune_checkpoints(self.best_step_to_keep)
            self.log.info(f"saved {path}")

    def prune_checkpoints(self, *steps: Optional[int]) -> list[int]:
        """Rank 0: delete the checkpoints train.keep_last no longer keeps, except `steps` (the best) and
        train.keep_best's; returns theirs. After each save, and when a finished run is run again (resume)."""
        keep = {*steps, *(step for _, _, step in self.state.best_k)}
        return checkpoint.prune(self.cfg.output_dir, self.train_cfg.keep_last, keep=keep)

    def check_finite_parameters(self) -> None:
        """A checkpoint is never written with NaN/Inf parameters. Skipped steps cannot put them there, but a finite
        update can still overflow; then stop and keep the good checkpoints rather than replace them."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.strategy.raw_model.parameters()]
        bad = torch.stack([~torch.isfinite(p).all() for p in local]).sum().float() if local else \
            torch.zeros((), device=self.ctx.device)
        if distributed.all_reduce_sum(self.ctx, bad).item() > 0:
            raise Diverged(f"training diverged: parameters are not finite at step {self.state.step}; not "
                                  f"saving them; last checkpoint: {checkpoint.latest(self.cfg.output_dir) or 'none'}")

    # ---- What the run shows (the lines, bars and traces themselves: run_log.py) ----------------------------------
    def progress_bar(self, **kwargs):
        """Rank 0's bar over the run's steps (log.progress_bar), or with kwargs another one (an evaluation's)."""
        return run_log.progress_bar(self.ctx.is_main and self.cfg.log.progress_bar,
                                    **(kwargs or {"total": self.total_steps, "initial": self.state.step}))

    def log_train(self, w: dict, grad_norm: float, bar) -> None:
        """The training line: the window's loss and throughput (run_log.LossWindow), the lr and the gradient norm, then
        the window's ms_per_step and, for a task with tokens (Task.tokens), tokens_per_s."""
        stats = {"loss": w["loss"], "lr": self.step_lr, "samples_per_s": w["samples_per_s"],
                 "grad_norm": grad_norm, **{k: w[k] for k in ("ms_per_step", "tokens_per_s") if k in w}}
        run_log.train_line(self.log, self.trackers, bar, self.state.step, self.total_steps, stats)

    def close(self, stopped: bool = False) -> None:
        self.eval_loaders.clear()  # (their kept workers end)
        if self.trackers:
            self.trackers.summary(run_log.final_values(self.state, self.best_metric))
            self.trackers.close(stopped=stopped)
            self.trackers = None


def micro_batches_in(epochs: float, per_epoch: int) -> int:
    """The micro-batches of `epochs` epochs, a started one counted whole: 1.1 x 40 is 44 (float says
    44.00000000000001, whose ceil is 45); 1e-7 x 40 is 1, not a run of no step. The run's length and resume's
    recount (resume.py) both use it."""
    return max(math.ceil(round(epochs * per_epoch, 6)), int(epochs > 0 and per_epoch > 0))


def micro_batches_done(state: TrainState, sampler: GlobalBatchSampler) -> int:
    """The run's micro-batches (global batches of `sampler`'s) before `state`'s position in its epochs."""
    per_epoch = sampler.batches_per_epoch()
    return state.epoch * per_epoch + per_epoch - sampler.batches_per_epoch(state.sample_in_epoch)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def best_by(metric: Optional[str], mode: str, task: Task) -> tuple[str, str]:
    """train.best_metric and train.best_mode as a run applies them: the task's metric by default, auto resolved
    (ema_loss, train.ema_decay's average's loss beside the weights', is a loss all the same)."""
    metric = metric or task.best_metric_default
    return metric, mode if mode != "auto" else ("min" if metric.removeprefix("ema_") in task.lower_is_better else "max")


# -----> change the learning-rate schedule here: factor(steps_done) multiplies train.lr (LambdaLR).
def lr_factor_function(total: int, warmup: float, schedule: str, min_lr_ratio: float = 0.0):
    """factor(steps_done): a linear warm-up, then `schedule` from 1 down to min_lr_ratio, the fraction of train.lr
    the last step ends at."""
    warm = warmup_steps(total, warmup)

    def factor(steps_done: int) -> float:  # LambdaLR's count: step 1 runs at factor(0), step 2 at factor(1)
        if steps_done < warm:
            return (steps_done + 1) / warm
        progress = min(1.0, (steps_done - warm) / max(1, total - warm))
        if schedule == "linear":
            decay = 1.0 - progress
        elif schedule == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            return 1.0
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay  # decay goes 1 -> 0, the factor 1 -> min_lr_ratio
    return factor


def warmup_steps(total: int, warmup: float) -> int:
    """train.warmup in optimizer steps: a whole number as it is, a fraction of the run's `total` rounded (Hugging Face
    rounds up). The first of them runs at lr / steps, the last at lr: one step is no warm-up."""
    return int(warmup) if warmup >= 1 else round(warmup * total)


# ---- Random state: seeded at the start, saved by every rank in each checkpoint, restored on resume ---------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": _numpy_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """This rank's random streams as rng_state() saved them."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def per_group(scheduler_state: dict, groups: int) -> dict:
    """A saved LambdaLR state for `groups` parameter groups: its lists hold one entry per group, and all groups
    follow the same schedule, but strategies group parameters differently (tp splits DTensors from the rest)."""
    return {k: v[:1] * groups if isinstance(v, list) and v else v for k, v in scheduler_state.items()}


def _numpy_state():
    """numpy's key array as a tensor: state.pt loads with weights_only=True, which refuses numpy arrays."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]
