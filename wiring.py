"""One rank, put together: the composition root's second half, imported by main.py once the config's schema has
passed, and by the ranks it starts. The tables (tasks, strategies, which file checks which config keys), and
`worker()`: the process group, then the Trainer with its strategy (strategies/) and its hooks (resilience/, extras/).
To follow a rank, read on: worker(), then build_trainer() and the parts it builds; the config's checks come last.
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from core import config, distributed, optimizers, roll_call, run_record, trackers
from core.config import Config, fail_naming, is_set, world_size
from core.config_mistakes import closest
from core.hooks import Hooks
from extras import balance, export, lr_find, predict, profiling, testmode
from resilience import faults, launcher, resume
from resilience.rank_run import RankRun
from strategies import activation_checkpointing, fsdp, pipeline, replicated, tp, zero
from strategies.base import Strategy
from tasks import bert_pretrain, csv_text, gpt2_lm, image, image_folder, lm_data, lm_models, lora, pretrained, sst2
from tasks.base import Task
from trainer import Trainer, seed_everything

# -----> register a new task here (and write it as a subclass of tasks.base.Task).
TASKS: dict[str, Callable[[Config], Task]] = {
    "image": image.ImageTask,
    "sst2": sst2.SST2Task,
    "bert_pretrain": bert_pretrain.BertPretrainTask,
    "gpt2_lm": gpt2_lm.GPT2LMTask,
    "csv_text": csv_text.CSVTextTask,  # the tutorial's own task (docs/tutorial/07_your_own_task.md)
    "image_folder": image_folder.ImageFolderTask,  # your own photos, a ResNet (docs/image_folder.md)
}

# -----> add a strategy: write apply_<name>(model, cfg, ctx, task, train_set) in a file of strategies/, list it here
# (and in config.DistConfig.strategy).
STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "none": replicated.apply_none,
    "dp": replicated.apply_dp,
    "ddp": replicated.apply_ddp,
    "oss": zero.apply_oss,
    "fsdp": fsdp.apply_fsdp,
    "pipe": pipeline.apply_pipe,  # with dist.tp > 1 too: it splits each stage itself
    "ddp+tp": tp.apply_tp_ddp,  # dist.tp > 1: tp first, then ddp or fsdp over the mesh's "dp"
    "fsdp+tp": tp.apply_tp_fsdp,
}


# ---- one rank -------------------------------------------------------------------------------------------------------
# Each rank's Trainer is kept until the process ends: freed earlier, DDP's gloo group can hang in its destructor.
TRAINERS: list = []


def worker(cfg: Config, place) -> int:
    """One rank (`place`: main.RankPlace): join the process group, build the Trainer, train (or test, predict,
    sweep the lr). Returns the exit code: RankRun reports whatever ends the rank once, naming it, its host and step."""
    with RankRun(cfg, place) as rank:
        ctx = rank.join_group()  # the process group (core/process_group.init), this rank's log file (rank_run.py)
        if cfg.mode == "predict":  # a classifier's labels for new inputs (predictions.csv): a plain model, no Trainer
            predict.predict(balance.auto_precision(cfg, ctx)[0], ctx, build_task(cfg))
        else:  # the datasets, the model made parallel, the Trainer (lr_find: as a fresh training run's)
            trainer = build_trainer(lr_find.as_training(cfg) if cfg.mode == "lr_find" else cfg, ctx)
            TRAINERS.append(trainer)
            if cfg.mode == "lr_find":
                lr_find.sweep(trainer)
            elif cfg.mode == "test":
                testmode.test(trainer)
            else:
                # (train.async_save: see rank_run.py; the trackers: trackers.py)
                with rank.publishing_saves_on_crash(trainer), trackers.closed_failed_on_crash(trainer), \
                        rank.trackers_closed_by_the_watchdog(trainer):
                    trainer.train()
        rank.finished()
    return rank.code


# ---- the Trainer and its parts ------------------------------------------------------------------------------------
def refuse_the_other_ranks(cfg: Config, env: Optional[dict], words: str) -> None:
    """Rank 0 was refused before the ranks meet: under srun, or with other nodes, nothing ends the other ranks
    (torchrun does, and main.py's own launcher has started none), so they read `words` at the roll call."""
    if (env is None and cfg.dist.nodes > 1) or (env is not None and env["launcher"] == "slurm"):
        roll_call.refuse_the_others(cfg, world_size(cfg), words)


def build_trainer(cfg: Config, ctx: distributed.DistContext, task: Optional[Task] = None) -> Trainer:
    """The Trainer of this rank, handed its parts: the task's datasets, the model made parallel (the strategy: the
    wrapped model, its optimizer and loss scaler) and the hooks. train.precision auto is resolved first (what this
    device computes fast in), before anything reads it."""
    task = task or build_task(cfg)
    asked, note = cfg.train.precision, None  # what the config asked for, and what auto chose (the plan says both)
    if cfg.train.precision == "auto":
        cfg, note = balance.auto_precision(cfg, ctx)
    datasets = task.build_datasets()
    # The same seed on every rank: every replica (or shard) starts from the same parameters (DDP also broadcasts
    # rank 0's as it wraps the model; fsdp and pipe cut each rank's own copy, so there the seed is what agrees).
    seed_everything(cfg.seed)
    model, plan_notes = build_model(cfg, task)
    strategy = parallelize(model, cfg, ctx, task, datasets["train"])
    if cfg.train.compile and cfg.mode == "train":
        strategy.compile()  # the first steps (and each new input shape) pay the compilation
    # Then each rank draws its own dropout masks; the ranks of a tp group share one stream (Strategy.seed_offset).
    seed_everything(cfg.seed + strategy.seed_offset)
    return Trainer(cfg, task, datasets, strategy, RunHooks(asked, plan_notes), precision_note=note)


def build_task(cfg: Config) -> Task:
    return TASKS[cfg.task](cfg)


def build_model(cfg: Config, task: Task) -> tuple[nn.Module, list[str]]:
    """The task's model on the CPU, in train mode (from_pretrained gives eval mode), with LoRA adapters
    (model.lora_rank) and activation checkpointing; and the lines the plan shows about them."""
    model, notes = task.build_model().train(), []
    if cfg.model.lora_rank:  # a frozen base + trainable adapters
        model = lora.adapt(model, cfg)
        notes.append(model.lora_note)
    if cfg.model.activation_checkpointing:  # before the strategy, which wraps the checkpointed blocks
        activation_checkpointing.apply_ac(model, cfg.task)
    return model, notes


def parallelize(model: nn.Module, cfg: Config, ctx: distributed.DistContext, task: Task, train_set) -> Strategy:
    """dist.strategy's apply_<name>() on the model (on the CPU: each strategy places it, wraps it and makes its
    optimizer), and this rank's simulated slowdown (dist.simulate_slowdown)."""
    # "ddp" -> STRATEGIES["ddp"] (replicated.apply_ddp); with dist.tp > 1, "ddp+tp" -> tp.apply_tp_ddp
    key = cfg.dist.strategy + ("+tp" if cfg.dist.tp > 1 and cfg.dist.strategy in ("ddp", "fsdp") else "")
    strategy = STRATEGIES[key](model, cfg, ctx, task, train_set)
    factor = cfg.dist.simulate_slowdown[ctx.rank] if cfg.dist.simulate_slowdown else 1.0
    if factor > 1 and cfg.dist.strategy != "pipe":  # pipe's stages simulate it themselves
        balance.install_slowdown(strategy.raw_model, factor, ctx.device)
    return strategy


class RunHooks(Hooks):
    """What resilience/ and extras/ add to the Trainer's loop (core/hooks.py says when each is called)."""

    def __init__(self, precision_asked: str, plan_notes: list[str] = ()):
        self.precision_asked = precision_asked  # `auto` on a CPU: timed before the first step (balance.py)
        self.plan_notes = list(plan_notes)  # what build_model says about the model (LoRA)
        self.profiler: Optional[profiling.StepProfiler] = None

    def resume(self, trainer: Trainer) -> bool:
        return resume.resume_run(trainer)

    def before_first_step(self, trainer: Trainer) -> None:
        precision = self.precision_asked == "auto" and trainer.ctx.device.type == "cpu"
        batches = trainer.train_cfg.batch_size == "auto"
        if precision or batches:
            balance.time_auto_settings(trainer, precision, batches)
        if trainer.train_cfg.profile_steps:  # a trace of chosen steps
            self.profiler = profiling.StepProfiler(trainer.train_cfg.profile_steps, trainer.cfg.output_dir, trainer.ctx,
                                                   trainer.log)

    def run_starts(self, trainer: Trainer):
        return run_record.start(trainer.cfg, trainer.log, run_record.plan(trainer, self.plan_notes), trainer.state.step)

    def run_ends(self, trainer: Trainer) -> None:
        trainer.log.info(run_record.summary(trainer.cfg, trainer.state, trainer.best_metric, trainer.task))

    def phase_starts(self, step: int, phase: str) -> None:
        faults.progress.phase_starts(step, phase)
        if self.profiler is not None and phase in ("train", "done"):
            self.profiler.before_step(step) if phase == "train" else self.profiler.stop()

    def stop_vote(self) -> float:
        return faults.stop_request.vote()

    def stop_reason(self) -> Optional[str]:
        return faults.stop_request.reason


def run_export(cfg: Config) -> int:
    """mode: export, in this process: a checkpoint in, a folder out (extras/export.py). 0, or 128 + a signal's
    number after Ctrl-C, SIGTERM or SIGHUP."""
    return export.main(cfg, build_task(cfg))


# ---- the config: what the schema (core/config.py) leaves to the files that read the keys --------------------------
def check_model_shape(cfg: Config, fail) -> None:
    """model.arch, model.width, ...: each task family reads them its own way (image_folder: a ResNet)."""
    if cfg.task == "image_folder":
        return image_folder.check_config(cfg, fail)
    if cfg.model.sync_batchnorm:
        fail("model.sync_batchnorm", f"is for task image_folder's BatchNorm, not {cfg.task}; remove it")
    if cfg.model.channels_last != "auto":
        fail("model.channels_last", f"is for task image_folder's convolutions, not {cfg.task}; remove it")
    if cfg.model.arch in image_folder.RESNETS:
        fail("model.arch", f"is {cfg.model.arch}, a ResNet of task image_folder; "
                           + ("gpt2_lm takes gpt2 or llama" if cfg.task == "gpt2_lm" else f"remove it for {cfg.task}"))
    lm_models.check_config(cfg, fail)


# Keys that only some runs read, each checked by the file that reads it (its check_config(cfg, fail)) when one of
# them is set (not at its default).
READER_CHECKS: list[tuple[Callable, list[str]]] = [
    (pretrained.check_config, ["model.pretrained_dir"]),
    (lora.check_config, ["model.lora_rank", "model.lora_alpha", "model.lora_dropout", "model.lora_targets"]),
    (check_model_shape, ["model.arch", "model.layers", "model.heads", "model.width", "model.bias",
                         "model.tie_embeddings", "model.sync_batchnorm", "model.channels_last"]),
    (image_folder.check_compile, ["train.compile"]),
    (image_folder.check_activation_checkpointing, ["model.activation_checkpointing"]),
    (image_folder.check_data_config, ["data.image_size", "data.resize_size", "data.crop_scale", "data.image_mean",
                                      "data.image_std", "data.skip_bad_images"]),
    (lm_data.check_config, ["data.tokenizer", "data.windows", "data.dev_split"]),
    (profiling.check_config, ["train.profile_steps"]),
    (optimizers.check_config, ["train.optimizer", "train.optimizer_args"]),
    (trackers.check_config, ["log.report_to", "log.mlflow_tracking_uri"]),
    (fsdp.check_config, ["dist.fsdp_impl", "dist.dp_replicate"]),
    (zero.check_config, ["dist.shard_grads"]),
    (lm_models.check_loss_parallel, ["dist.loss_parallel"]),
    (balance.check_config, ["dist.simulate_slowdown"]),
    (launcher.check_config, ["dist.nodes", "dist.node_rank", "dist.procs_per_node", "dist.master_addr",
                             "dist.master_port", "dist.init_method"]),
]


def check_task(cfg: Config, fail) -> None:
    if cfg.task not in TASKS:
        close = closest(cfg.task, list(TASKS))
        fail("task", f"is {cfg.task!r}, not a known task ({', '.join(TASKS)})"
             + (f"; did you mean {close!r}?" if close else ""))
    if cfg.data.group_by_length and not TASKS[cfg.task].has_lengths:
        fail("data.group_by_length", f"is set, but task {cfg.task} has no sample lengths to batch by (it pads no "
                                     "token sequences): it would do nothing; remove it")
    if cfg.mode == "predict" and not TASKS[cfg.task].reads_new_inputs:
        fail("mode", f"is predict, but task {cfg.task} reads no new inputs to label (Task.reads_new_inputs: a "
                     "classifier's, such as image, csv_text, sst2, image_folder); use mode test")
    if cfg.train.compile and not TASKS[cfg.task].compiles_on_cpu and not cfg.dist.on_gpu():
        fail("train.compile", f"is refused for the {cfg.task} task on CPU: torch 2.13's inductor computes wrong "
                              "(zero) gradients for its convolutions (benchmarks/RESULTS.md); use eager, or a GPU")
    bare, lower = str(cfg.train.best_metric).removeprefix("ema_"), TASKS[cfg.task].lower_is_better
    split, _, ours = bare.partition("_")
    if split in ("eval", "val", "valid", "validation") and ours in lower:  # eval_loss, val_loss: loss, of dev here
        fail("train.best_metric", f"is {cfg.train.best_metric!r} (Hugging Face's or Lightning's name): it is {ours!r} "
                                  "here")
    if cfg.train.best_mode == "auto" and bare.endswith("loss") and bare not in lower:  # auto would maximise it
        fail("train.best_metric", f"is {cfg.train.best_metric!r}, a loss, but task {cfg.task} does not list it in "
                                  "Task.lower_is_better: best_mode auto would keep its highest; set train.best_mode: "
                                  "min (or list it there)")


def check_reader_keys(cfg: Config, fail) -> None:
    for check, keys in READER_CHECKS:
        if any(is_set(cfg, key) for key in keys):
            check(cfg, fail)


def check_batch_split(cfg: Config, fail) -> None:
    """train.batch_size as a list, or auto: one share per rank, or per tp group or pipeline (their own checks)."""
    train_cfg, dist_cfg, world = cfg.train, cfg.dist, world_size(cfg)
    readers, who = world, "ranks"
    if dist_cfg.tp > 1:
        readers, who = tp.check_config(cfg, world, fail), "tp groups (world size / dist.tp)"
    if dist_cfg.strategy == "pipe":
        readers, who = pipeline.check_config(cfg, world, fail), "pipelines (world size / dist.pp_stages)"
    if cfg.mode in ("test", "predict", "export"):  # they read no training batches (test: one process, whatever trained)
        return
    if isinstance(train_cfg.batch_size, list) and len(train_cfg.batch_size) != readers:
        fail("train.batch_size", f"lists {len(train_cfg.batch_size)} sizes but there are {readers} {who}")
    if train_cfg.batch_size == "auto" and train_cfg.global_batch_size < readers:
        fail("train.global_batch_size",
             f"must be >= the number of {who} ({readers}), got {train_cfg.global_batch_size}")


def check_task_parallelism(cfg: Config, fail) -> None:
    """A task without a pipeline chain or a tp plan (it says which it has: Task.has_pipeline_chain, has_tp_plan):
    said before the ranks start (after the layout's own checks)."""
    if cfg.dist.strategy == "pipe" and not TASKS[cfg.task].has_pipeline_chain:
        fail("dist.strategy", f"is pipe, but task {cfg.task} does not cut its model into a chain of layers "
                              "(Task.pipeline_layers); use ddp, oss or fsdp")
    if cfg.dist.tp > 1 and not TASKS[cfg.task].has_tp_plan:
        fail("dist.tp", f"is {cfg.dist.tp}, but task {cfg.task} has no tensor-parallel plan (Task.tp_plan names the "
                        "linear layers to split); use dist.tp: 1")


CHECKS = (check_task, check_reader_keys, check_batch_split, check_task_parallelism)


def check(cfg: Config, source: str) -> None:
    """The checks beyond the schema's (main.py has run those already, before torch loaded)."""
    fail = fail_naming(source)
    for one in CHECKS:
        one(cfg, fail)


def checked_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    """core/config.read_config, then every check here (generate.py's and the tests' way in)."""
    return config.read_config(path, overrides, CHECKS)


def checked_config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    """core/config.config_from_dict, then every check here."""
    return config.config_from_dict(raw, source, CHECKS)
