"""Resuming a run (train.resume): the newest checkpoint that loads on every rank (or the one named), checked against
this run, restored into the Trainer. The Trainer calls it first thing in train() (its resume hook: wiring.RunHooks)."""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Callable, Optional

from core import checkpoint, checkpoint_hashes, checkpoint_io, checkpoint_meta
from core.config import RANDOM_DROPOUT, TrainConfig
from core.distributed import DistContext, broadcast_object, gather_objects
from core.errors import CheckpointError, Unloadable
from data_loader import GlobalBatchSampler
from resilience import run_dir
from trainer import TrainState, best_by, ceil_div, micro_batches_done, micro_batches_in

EVAL_DEFAULTS = asdict(TrainConfig())  # for a checkpoint written before a setting existed


def resume_run(trainer) -> bool:
    """Make sure output_dir holds this run only, then continue from a checkpoint if there is one (train.resume).
    True: that run was complete, nothing is left to do. Collective."""
    claim_output_dir(trainer)
    which = False if trainer.train_cfg.start_over else trainer.train_cfg.resume
    if which not in (False, "auto"):
        which = explicit_or_newer(trainer, which)
    if which == "auto" and not broadcast_object(trainer.ctx, checkpoint.latest(trainer.cfg.output_dir)):
        which = False  # nothing to resume: a fresh run
    return bool(which) and resume(trainer, which)


def claim_output_dir(trainer) -> None:
    """Once an earlier run has left checkpoints/ in output_dir, or train.start_over asks to move one aside
    (run_dir.py): this run's only. Collective."""
    out, refusal = trainer.cfg.output_dir, None
    if trainer.ctx.is_main and (trainer.train_cfg.start_over or os.path.lexists(checkpoint.root(out))):
        refusal = run_dir.claim(out, trainer.train_cfg, trainer.log)
    refusal = broadcast_object(trainer.ctx, refusal)
    if refusal:
        raise CheckpointError(refusal)


def explicit_or_newer(trainer, path: str) -> str:
    """train.resume: PATH, started again. Once this run went on from PATH and saved (a stop, then the same command
    again): "auto", its newest checkpoint. Refused: a later checkpoint that it did not write, which resume, test
    mode and pruning would take for its own. Collective."""
    which, refusal = path, None
    found = checkpoint.complete_checkpoints(trainer.cfg.output_dir) if trainer.ctx.is_main else []
    if found and not same_path(found[-1][1], path):
        last_step, last = found[-1]
        try:
            saved = checkpoint_meta.saved_train(checkpoint_meta.read(last))
        except Unloadable:
            saved = {}
        except CheckpointError as e:  # the machine cannot read it (errors.unreadable): said on every rank
            saved, refusal = {}, str(e)
        step = checkpoint.STEP_DIR.match(os.path.basename(os.path.normpath(path)))
        if refusal is None and same_path(saved.get("resume"), path):
            which = "auto"
            trainer.log.info(f"train.resume: this run went on from {path} before: resuming its newest checkpoint")
        elif refusal is None and step and int(step.group(1)) < last_step:
            refusal = (f"train.resume: {path} is older than {last}, which was not written from it (resume, test "
                       "mode and pruning would take it for this run's): resume it into another output_dir, or move "
                       "the later checkpoints aside")
    which, refusal = broadcast_object(trainer.ctx, (which, refusal))
    if refusal:
        raise CheckpointError(refusal)
    return which


def same_path(a, b) -> bool:
    return isinstance(a, str) and isinstance(b, str) and os.path.abspath(a) == os.path.abspath(b)


def resume(trainer, which: str) -> bool:
    """`which` auto: the newest checkpoint that loads on every rank, skipping (with a warning) any that cannot be
    read; a path: that one, or stop. True: the run is complete (already_complete)."""
    saved = {}  # the train section of the config the loaded checkpoint was saved with

    def load_here(path: str) -> None:
        saved["train"] = load(trainer, path)

    if which == "auto":
        path = load_newest(trainer.cfg.output_dir, trainer.ctx, load_here, trainer.log.warning)
    else:  # an explicit path never falls back to another checkpoint
        if os.path.islink(os.path.normpath(which)):
            raise CheckpointError(f"train.resume: {checkpoint_hashes.linked_checkpoint_refused(which)}")
        if not checkpoint.is_complete(which):
            raise CheckpointError(f"train.resume: {which} is not a complete checkpoint directory (step-N/meta.json)")
        path = load_on_every_rank(trainer.ctx, load_here, which)
    ranked = ()  # the best as the checkpoint ranks them, kept by a finished run run again (ranked anew or not)
    if path is not None:
        s = trainer.state
        trainer.log.info(f"resumed from {path} at step {s.step} (epoch {s.epoch}, batch {s.batch_in_epoch}, "
                         f"sample {s.sample_in_epoch})")
        schedule_changes(trainer, saved["train"])
        training_changes(trainer, saved["train"])
        ranked = (s.best_step, *(step for _, _, step in s.best_k))
        best_changes(trainer, saved["train"])
        length_from_position(trainer)
    return already_complete(trainer, path, ranked)


def already_complete(trainer, path: Optional[str], ranked: tuple = ()) -> bool:
    """Run again after the end (or after early stopping) of the run `path` continues: say so instead of pretending
    to train and save. `ranked`: the checkpoint's best, kept though another best_metric reset the ranking (nothing
    was ranked since)."""
    s, t = trainer.state, trainer.train_cfg
    stopped_early = bool(t.patience and s.evals_without_improvement >= t.patience)
    done = s.step > 0 and not s.eval_due and (s.step >= trainer.total_steps or stopped_early)
    if done:
        why, longer = (f"this run ends at step {trainer.total_steps} ({trainer.length_note})",
                       "raise train.max_steps or train.epochs")
        if stopped_early:
            why = f"it stopped early (train.patience={t.patience})"
            longer = "raise train.patience (0: never stop early)"
        trainer.log.info(f"already complete at step {s.step} ({path}): {why}; "
                         f"nothing to do. To train longer {longer}; for a new run use another output_dir or --set "
                         "train.start_over=true")
        # train.keep_last (or keep_best) lowered since: pruned now, as the next save would have
        pruned = trainer.prune_checkpoints(s.best_step, s.step, *ranked) if trainer.ctx.is_main else []
        if pruned:
            trainer.log.info(f"removed {', '.join(f'step-{step}' for step in pruned)}: train.keep_last is "
                             f"{t.keep_last} (and the best are kept)")
    return done


def load_on_every_rank(ctx: DistContext, load: Callable[[str], None], path: str) -> str:
    """Collective: `load(path)` on every rank. If it failed on any rank, every rank raises that rank's error
    (as Unloadable if it was one), so all ranks go on, or stop, together. Returns `path`."""
    error = None
    try:
        load(path)
    except CheckpointError as e:
        error = (isinstance(e, Unloadable), str(e))
    failed = [e for e in gather_objects(ctx, error) if e is not None]
    if failed:
        unloadable, message = failed[0]
        raise (Unloadable if unloadable else CheckpointError)(message)
    return path


def load_newest(output_dir: str, ctx: DistContext, load: Callable[[str], None],
                warn: Callable[[str], None]) -> Optional[str]:
    """Collective, for `resume: auto`: `load(path)` on every rank the newest complete checkpoint that loads on
    all of them; return its path (None: there is none). One that cannot be read (Unloadable, on any rank) is
    skipped with a warning, and once an older one has loaded, moved aside to `step-N.unloadable`, so that this run
    can save step N again."""
    paths = broadcast_object(ctx, [p for _, p in checkpoint.complete_checkpoints(output_dir)])  # one list for all
    skipped, why = [], []
    for path in reversed(paths):
        try:
            load_on_every_rank(ctx, load, path)
        except Unloadable as e:
            skipped.append(path)
            why.append(str(e))
            warn(f"resume: skipping {path}, which cannot be loaded: {e}")
            continue
        if ctx.is_main:
            for bad in skipped:
                aside = run_dir.unused_path(f"{bad}.unloadable")
                os.rename(bad, aside)
                warn(f"resume: moved {bad} aside to {aside}, and resumed from {path} instead")
        return path
    if skipped:  # nothing to fall back to: the newest one's reason, and how to start over
        older = "no older checkpoint loads either" if len(skipped) > 1 else "there is no older checkpoint"
        raise CheckpointError(f"{why[0]}; {older} (to start over, set train.start_over: true or use another "
                              "output_dir)")
    return None


def load(trainer, path: str) -> dict:
    """Checkpoint `path` into the Trainer; returns the train section of the config it was saved with. Everything
    that may fail is read and checked before the run's state changes, except model and optimizer (a later file may
    fail after them); the next checkpoint tried overwrites both entirely."""
    t, strategy = trainer.train_cfg, trainer.strategy
    meta = verified_meta(trainer, path)
    saved = meta.get("format") or "full"
    if saved not in strategy.resumes_from:
        *others, last = strategy.resumes_from
        reads = f"{', '.join(others)} or {last}" if others else last
        raise CheckpointError(f"{path}: written by strategy {meta.get('strategy')} in format {saved}, "
                              f"cannot resume under {trainer.cfg.dist.strategy} (it reads {reads})")
    saved_train = checkpoint_meta.saved_train(meta)
    was = saved_train.get("optimizer", t.optimizer)
    if str(was).lower() != t.optimizer.lower():  # (any case: adamw is AdamW) its state would fail at step()
        raise CheckpointError(f"{path}: holds {was} optimizer state, but train.optimizer is {t.optimizer}; resume "
                              f"with {was}, or start over with train.start_over: true")
    try:
        state = TrainState(**meta["state"])
    except TypeError as e:
        raise Unloadable(f"{path}/meta.json: unreadable (`state`: {e})") from None
    if "sample_in_epoch" not in meta["state"]:  # written before positions were kept in samples
        state.sample_in_epoch = min(state.batch_in_epoch * sum(meta.get("batch_sizes") or [0]), trainer.sampler.n)
    extra = checkpoint_io.load_file(path, "state.pt", keys=("scheduler", "scaler", "rng"))
    has_ema = trainer.ema is not None and os.path.isfile(os.path.join(path, "ema.pt"))
    ema = checkpoint_io.load_file(path, "ema.pt") if has_ema else None  # train.ema_decay's average
    checkpoint_io.check_label_names(path, trainer.task.label_names(), meta)  # the data's classes are the trained ones
    checkpoint_io.check_vocabulary(path, trainer.task.vocabulary_sha256(), meta)  # and its inputs' ids
    changed = []  # the optimizer's hyperparameters that differ from the saved run's; this run's apply
    with checkpoint_io.fits_model(path, trainer.cfg, meta), \
            checkpoint_io.configured_hyperparameters(strategy.optimizer, meta.get("optimizer"), changed):
        strategy.load(path, meta)
    check_same_run(trainer, path, meta)
    state.sample_in_epoch = min(state.sample_in_epoch, trainer.sampler.n)  # a smaller training set (resume_changed)
    saved_batch = sum(meta.get("batch_sizes") or [trainer.sampler.global_batch])  # per micro-step, over all ranks
    trainer.sampler.check_position(state.sample_in_epoch, saved_batch)  # group_by_length: the same one mid-epoch
    same_world = len(extra["rng"]) == trainer.ctx.world_size  # else each rank keeps its fresh random streams
    trainer.load_state_dict({"scheduler": extra["scheduler"], "scaler": extra["scaler"], "state": asdict(state),
                             "rng": extra["rng"][trainer.ctx.rank] if same_world else None,
                             "loss_window": loss_window_here(extra.get("loss_window"), trainer.ctx, same_world),
                             "batch_sizes": meta.get("batch_sizes"), "ema": ema,
                             "precision": saved_train.get("precision")})
    if changed:
        trainer.log.warning(f"resuming with optimizer {', '.join(changed)}: the configured values apply from step "
                            f"{state.step} on")
    changes = [] if same_world else [  # (batch_size auto too, whose sizes are chosen later: extras/balance.py)
        f"at world size {trainer.ctx.world_size} (the checkpoint's: {len(extra['rng'])}, each rank's random stream "
        "starts again from the seed, as at step 0)"]
    if t.batch_size != "auto" and meta.get("batch_sizes") != trainer.batch_sizes:  # (global batch: check_same_run)
        changes.append(f"with per-rank batches {trainer.batch_sizes} instead of {meta.get('batch_sizes')}")
    if changes:
        trainer.log.warning(f"resuming {' and '.join(changes)}: random draws such as dropout's differ from here on")
    return saved_train


def verified_meta(trainer, path: str) -> dict:
    """Collective: meta.json as rank 0 reads it (an unreadable one: Unloadable on every rank, naming the key, and the
    next is tried), every file checked by it on every node (checkpoint_io.verify); every rank goes on from that
    record, none from its own read of meta.json (another node's copy, or one changed since)."""
    ctx, meta, error = trainer.ctx, None, None
    if ctx.is_main:
        try:
            meta = checkpoint_meta.read(path)
        except CheckpointError as e:  # Unloadable, or one the machine cannot read (errors.unreadable)
            error = (isinstance(e, Unloadable), str(e))
    error = broadcast_object(ctx, error)
    if error:
        raise (Unloadable if error[0] else CheckpointError)(error[1])
    return checkpoint_io.verify(path, ctx, trainer.log.warning, trainer.cfg, meta)


def loss_window_here(windows: Optional[list], ctx: DistContext, same_world: bool) -> Optional[dict]:
    """This rank's loss since the last training line, from every saved rank's (None: an older state.pt kept none).
    At another world size rank 0 takes the ranks' sum (the line sums them; the count is already global): the next
    line averages the same steps as the uninterrupted run's, not those since the resume alone."""
    if not windows:
        return None
    if same_world:
        return windows[ctx.rank]
    return {"loss": sum(w["loss"] for w in windows) if ctx.rank == 0 else 0.0, "count": windows[0]["count"]}


def check_same_run(trainer, path: str, meta: dict) -> None:
    """A checkpoint continues the run that wrote it. One whose run differs in what changes the result (task, seed,
    model, data, the training set's size, global batch) would silently make a run that is neither: refused with the
    differences listed, unless train.resume_changed says that is what is wanted."""
    t, saved, now = trainer.train_cfg, meta.get("config") or {}, trainer.cfg.to_dict()
    # null and the value it builds are one run, but the refusal shows what each config wrote
    diffs = checkpoint_meta.differences(saved, now, compared=(model_built(saved, trainer.task),
                                                              model_built(now, trainer.task)))
    sizes, accum = meta.get("batch_sizes"), (saved.get("train") or {}).get("grad_accum_steps")
    if isinstance(sizes, list) and all(isinstance(b, int) for b in sizes) and isinstance(accum, int):
        was, now = sum(sizes) * accum, sum(trainer.batch_sizes) * t.grad_accum_steps
        if was != now:
            diffs.append(f"global batch {was} (now {now}: {batch_changes(trainer, saved, sizes)})")
    # the same files, edited since: the epoch's order and the position in it are another set's (samples repeated
    # or never seen), and a position past the end was taken without a word
    samples = meta.get("train_samples")  # (none in an older checkpoint)
    if isinstance(samples, int) and samples != trainer.sampler.n:
        diffs.append(f"a training set of {samples} samples (now {trainer.sampler.n})")
    if not diffs:
        return
    if not t.resume_changed:
        raise CheckpointError(f"{path} was written by another run: {', '.join(diffs)}; use another output_dir, "
                              "start over (--set train.start_over=true), or resume it anyway "
                              "(--set train.resume_changed=true)")
    trainer.log.warning(f"resuming {path}, written by a run that differs: {', '.join(diffs)} (train.resume_changed)")


def batch_changes(trainer, saved: dict, sizes: list) -> str:
    """What made the global batch another: the keys that differ from the saved run's, and the number of ranks (or
    pipelines) sharing it, so that the refusal names what to set back."""
    t, saved_train = trainer.train_cfg, saved.get("train") or {}
    keys = [f"train.{k} {saved_train[k]} -> {getattr(t, k)}" for k in ("batch_size", "grad_accum_steps",
                                                                       "global_batch_size")
            if k in saved_train and saved_train[k] != getattr(t, k)]
    if len(sizes) != len(trainer.batch_sizes):
        keys.append(f"{len(sizes)} {trainer.strategy.replica}s -> {len(trainer.batch_sizes)}")
    return ", ".join(keys) or f"per-{trainer.strategy.replica} batches {sizes} -> {trainer.batch_sizes}"


def model_built(config: dict, task) -> dict:
    """`config` with its model section read as the model it builds (Task.model_built): model.layers 2 over null is
    the same run where model.name's preset has 2 layers (so for heads, width, bias, tie_embeddings), 4 another."""
    model = config.get("model")
    if not isinstance(model, dict):
        return config
    if "dropout" in model and model["dropout"] is None:  # a run saved before null existed holds 0.25, its default
        model = {**model, "dropout": RANDOM_DROPOUT}
    return {**config, "model": task.model_built(model)}


def schedule_changes(trainer, saved: dict) -> None:
    """Resuming with another lr, length or schedule is allowed (a common way to extend a run), but the learning
    rate from here on is not what the first run would have used: say so. The new lr takes effect (the scheduler's
    saved state would otherwise keep the old one)."""
    t = trainer.train_cfg
    keys = ("lr", "max_steps", "epochs", "warmup", "schedule", "min_lr_ratio")
    changed = [f"train.{k} {saved[k]} -> {getattr(t, k)}" for k in keys if k in saved and saved[k] != getattr(t, k)]
    if not changed:
        return
    trainer.set_base_lr(t.lr)
    trainer.log.warning(f"resuming with {', '.join(changed)}: the learning-rate schedule changes from step "
                        f"{trainer.state.step} on (now {trainer.total_steps} steps in all: {trainer.length_note})")


def training_changes(trainer, saved: dict) -> None:
    """Other train settings that change the run from here on (the optimizer's own: load): said in one line.
    train.precision auto is not compared: the saved run recorded what auto chose, this one chooses again."""
    t = trainer.train_cfg
    keys = ("clip_grad_norm", "ema_decay", "patience") + (("precision",) if trainer.precision_note == t.precision
                                                          else ())
    changed = [f"train.{k} {saved[k]} -> {getattr(t, k)}" for k in keys if k in saved and saved[k] != getattr(t, k)]
    if changed:
        trainer.log.warning(f"resuming with {', '.join(changed)}: the run differs from the saved one's from step "
                            f"{trainer.state.step} on")


def best_changes(trainer, saved: dict) -> None:
    """Resumed with another train.best_metric or best_mode, train.eval_ema turned on or off (the same metric of the
    other weights: the average's or the trained ones'), or another dev subset: the best so far was ranked another way,
    and comparing this run's values with it would mix them (an accuracy taken for a loss). The ranking starts again."""
    if "best_metric" not in saved:
        return
    was = best_by(saved.get("best_metric"), saved.get("best_mode") or "auto", trainer.task)
    was_eval_ema, eval_ema = saved.get("eval_ema") is True, trainer.train_cfg.eval_ema
    changed = [] if was == (trainer.best_metric, trainer.best_mode) else [
        f"train.best_metric {was[0]} ({was[1]}) -> {trainer.best_metric} ({trainer.best_mode})"]
    if was_eval_ema != eval_ema:
        changed.append(f"train.eval_ema {was_eval_ema} -> {eval_ema}")
    was_eval, eval_now = eval_settings(saved), eval_settings(asdict(trainer.train_cfg))
    if dev_samples(was_eval) != dev_samples(eval_now):  # its values come from other dev samples
        said = [" ".join(f"{k}={v}" for k, v in e.items()) for e in (was_eval, eval_now)]
        changed.append(f"train.{said[0]} -> {said[1]}")
    if not changed:
        return
    trainer.rank_anew()
    trainer.log.warning(f"resuming with {', '.join(changed)}: the best checkpoint and train.patience count from "
                        f"step {trainer.state.step} on")


def eval_settings(train: dict) -> dict:
    """The train settings that choose an evaluation's dev samples (an older checkpoint's missing ones: defaults)."""
    return {k: train.get(k, EVAL_DEFAULTS[k]) for k in ("eval_batches", "limit_eval_batches", "eval_batch_size")}


def dev_samples(settings: dict) -> tuple[int, int]:
    """How many dev samples evaluations during training read, and every evaluation at most (0: the whole split)."""
    size = settings["eval_batch_size"]
    return settings["eval_batches"] * size, settings["limit_eval_batches"] * size


def length_from_position(trainer) -> None:
    """After a resume with another global batch (train.resume_changed), an epoch-based length is counted again from
    where the run is, in samples: the epochs end where they would have, never early, and the learning-rate schedule
    follows the new number of steps from here on (said in one line). At another world size with the same global
    batch, an epoch's last batch may be fewer samples than the ranks (left out): that length change is said too."""
    t, s, sampler = trainer.train_cfg, trainer.state, trainer.sampler
    if not t.epochs:
        return
    total = steps_in_all(trainer, sampler)
    theirs = trainer.resumed_batch_sizes  # the checkpoint's per-rank batches
    if theirs and sum(theirs) == sampler.global_batch and len(theirs) != len(sampler.batch_sizes):
        was = steps_in_all(trainer, GlobalBatchSampler(sampler.n, theirs, 0, 0, drop_last=sampler.drop_last))
        if was != total:
            trainer.log.warning(
                f"the run's length is {total} steps at {len(sampler.batch_sizes)} {trainer.strategy.replica}s, "
                f"where the checkpoint's {len(theirs)} counted {was}: an epoch's last batch "
                f"({sampler.n % sampler.global_batch} samples) is trained only when every {trainer.strategy.replica} "
                "gets a sample")
    if total == trainer.total_steps:
        return
    trainer.log.warning(f"the run's length is {total} steps from sample {s.sample_in_epoch} of epoch {s.epoch} at "
                        f"this global batch (was {trainer.total_steps}); the learning-rate schedule follows it")
    trainer.set_total_steps(total)


def steps_in_all(trainer, sampler: GlobalBatchSampler) -> int:
    """The run's optimizer steps, an epoch-based length counted from the resumed position with `sampler`'s batches."""
    t, s = trainer.train_cfg, trainer.state
    done = micro_batches_done(s, sampler)  # micro-batches, as the sampler's global batch counts them
    total = s.step + max(0, ceil_div(micro_batches_in(t.epochs, sampler.batches_per_epoch()) - done,
                                     t.grad_accum_steps))
    return min(total, t.max_steps) if t.max_steps else total
