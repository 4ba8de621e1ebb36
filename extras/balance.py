"""What is measured before training: each rank's speed (a slow rank gets a smaller share of the global batch) and
train.precision auto (on a CPU: whether bf16 trains faster). Loaded only by the runs that set either to auto or
simulate a slowdown.

With `train.batch_size: auto`, every rank times forward+backward on a few real batches of equal size before
training, the speeds are gathered, and `train.global_batch_size` is split in proportion to them. Then all ranks
finish their micro-batch at about the same time, so the fast ones do not sit idle at the gradient all-reduce.
The Trainer divides the summed loss by the global sample count, so each optimizer step is still the exact mean
gradient over the global batch, whatever the split.

`dist.simulate_slowdown` makes chosen ranks artificially slower, so all of this can be tried on one laptop CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
import time
from typing import Optional

import torch

from core import distributed
from core.config import world_size
from core.rank_timing import synchronize, time_forward_backward
from core.errors import ConfigError
from data_loader import GlobalBatchSampler, split_proportional


def check_config(cfg, fail) -> None:
    """dist.simulate_slowdown, set (config.validate asks): one factor >= 1 per rank."""
    slow, world = cfg.dist.simulate_slowdown, world_size(cfg)
    if not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f >= 1 for f in slow):
        fail("dist.simulate_slowdown", f"must hold numbers >= 1 (1 = full speed), got {slow}")
    if len(slow) != world:
        fail("dist.simulate_slowdown", f"lists {len(slow)} factors but there are {world} ranks")


def install_slowdown(model: torch.nn.Module, factor: float, device: torch.device) -> list:
    """dist.simulate_slowdown: this rank behaves like a device `factor` times slower, its gradients ready `factor`
    times later. Installed once on the model (wiring.parallelize), so the strategies' step knows nothing of it.
    Returns the hooks' handles."""
    clock = {"start": 0.0, "waited": 0.0}

    def forward_starts(_module, _inputs):  # a micro-batch's compute starts here
        synchronize(device)
        clock["start"], clock["waited"] = time.perf_counter(), 0.0

    # Each time backward has accumulated a parameter's gradient, wait until the time since the forward started is
    # `factor` x the compute in it. Waiting there, before DDP hands that gradient to the all-reduce, delays the
    # other ranks exactly as a slow device would; waiting after backward would stretch the rank's wait for the
    # others' gradients too, and delay nobody until the next step.
    def stretch(_param):
        synchronize(device)
        computed = time.perf_counter() - clock["start"] - clock["waited"]
        end = clock["start"] + factor * computed
        # Busy-wait rather than sleep: on a CPU shared with other processes the OS scheduler favours a process
        # that slept, so a sleeping rank would get more than its share of the CPU and look less slow than it is.
        while time.perf_counter() < end:
            pass
        clock["waited"] = (factor - 1.0) * computed

    return [model.register_forward_pre_hook(forward_starts)] + [
        p.register_post_accumulate_grad_hook(stretch) for p in model.parameters() if p.requires_grad]


def measure_speed(trainer, batch_size: int, steps: int) -> float:
    """This rank's samples/s for forward+backward on real training batches of `batch_size` (the ranks of a tp
    group read the same ones and compute them together).

    One untimed batch first (it pays for allocations and lazy initialisation), then `steps` timed ones. The run
    must not notice: gradients stay local (no_sync) and are dropped, there is no optimizer step, and buffers and
    the random state are restored afterwards.
    """
    strategy, task, ctx, cfg = trainer.strategy, trainer.task, trainer.ctx, trainer.cfg
    dataset = trainer.datasets["train"]
    sampler = GlobalBatchSampler(len(dataset), [batch_size] * strategy.data_shares, strategy.data_rank, cfg.seed)
    batches = list(itertools.islice(sampler.epoch_batches(0), steps + 1))  # not a whole epoch's lists
    model = strategy.model
    loss_context = getattr(strategy, "loss_context", contextlib.nullcontext)  # tp's dist.loss_parallel needs it

    def forward_backward(i: int) -> float:
        batch = trainer.to_device(task.collate([dataset[j] for j in batches[i % len(batches)]]))
        synchronize(ctx.device)
        start = time.perf_counter()
        with loss_context():  # (a simulated slowdown is in the model's hooks)
            with trainer.autocast():
                loss = task.loss_sum(model, batch)
            loss.float().backward()
        synchronize(ctx.device)
        return time.perf_counter() - start

    was_training = model.training
    model.train()
    with strategy.no_sync():
        seconds = time_forward_backward(strategy, ctx, forward_backward, steps, trainer.hooks.stop_reason)
    model.train(was_training)
    return batch_size * steps / seconds


def time_auto_settings(trainer, precision: bool, batches: bool) -> None:
    """Before the first step (wiring.RunHooks): train.precision auto on a CPU (`precision`), then train.batch_size
    auto (`batches`, timed in the chosen precision). The global batch, hence the batches per epoch and the steps,
    stays as it is; only the sampler is rebuilt. A stop signal ends the timing after the batch each rank times, and
    the run with it (rank_timing.time_forward_backward)."""
    if precision:
        choose_cpu_precision(trainer)
    if batches:
        trainer.set_batch_sizes(*auto_batch_sizes(trainer, trainer.resumed_batch_sizes))


def auto_precision(cfg, ctx: distributed.DistContext):
    """train.precision auto, as the Trainer starts: (cfg with the precision chosen, how the plan shows it)."""
    bf16 = ctx.device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)  # not emulated
    precision, note = resolve_precision(cfg.train.precision, ctx.device.type, bf16)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision)), note


def resolve_precision(precision: str, device_type: str, bf16_supported: bool) -> tuple[str, str]:
    """train.precision `auto`: bf16 autocast on GPUs that compute in bf16 (Ampere and later), fp32 everywhere
    else for now. On a CPU, choose_cpu_precision later measures which of the two trains faster (bf16 pays
    only with bf16 matrix units and large enough matrices); fp16 needs a loss scaler: a choice to make knowingly,
    not a default. Returns the precision and how the plan shows it."""
    if precision != "auto":
        return precision, precision
    if device_type == "cuda":
        chosen, why = ("bf16", "GPU with bf16") if bf16_supported else ("fp32", "GPU without bf16")
    else:
        chosen, why = "fp32", device_type.upper()
    return chosen, f"auto -> {chosen} ({why})"


def choose_cpu_precision(trainer) -> None:
    """train.precision auto on a CPU (time_auto_settings): the measured choice (cpu_precision) becomes the
    Trainer's precision, what its checkpoints and config.yml record. Collective."""
    trainer.set_precision(*cpu_precision(trainer))


def cpu_precision(trainer) -> tuple[str, str]:
    """train.precision auto on a CPU (choose_cpu_precision): (precision, plan note). Whether bf16 autocast pays
    depends on the CPU and the job, so every rank times forward+backward in both on the run's next batches
    (time_precisions) and all take bf16 only where it is clearly faster (pick_cpu_precision). Collective."""
    units = distributed.gather_objects(trainer.ctx, cpu_bf16_units())
    if not all(units):  # without the units bf16 is emulated, slower: not worth measuring
        return "fp32", "auto -> fp32 (CPU without bf16 matrix units, AMX or AVX512-BF16: not measured)"
    # its precision is fixed when it wraps the model, or a forward waits for the others
    if not trainer.strategy.can_be_timed_alone:
        return "fp32", (f"auto -> fp32 (CPU with {units[0]}, not measured under {trainer.cfg.dist.strategy}: its "
                        "precision is fixed when it wraps the model, or a forward waits for other ranks; set "
                        "train.precision: bf16 to try it)")
    if trainer.resumed_precision in ("fp32", "bf16"):  # measured again, a close call could flip it mid-run
        return trainer.resumed_precision, (f"auto -> {trainer.resumed_precision} (CPU with {units[0]}: the resumed "
                                           "run's, measured when it started)")
    timings = distributed.gather_objects(trainer.ctx, time_precisions(trainer, trainer.train_cfg.balance_steps))
    return pick_cpu_precision(timings, units[0])


def cpu_bf16_units() -> str:
    """This CPU's bf16 matrix instructions, as Linux lists them in /proc/cpuinfo: "AMX" (Intel Xeon since Sapphire
    Rapids), "AVX512-BF16" (Cooper Lake, AMD Zen 4 and later), or "" where there are none or no /proc/cpuinfo to
    read (macOS, Windows). Without them torch emulates bf16 with conversions, slower than fp32: nothing to measure."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return ""
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else ""


BF16_GAIN = 1.10  # train.precision auto on a CPU takes bf16 only if fp32 needs >= 10% more time: less is noise


def pick_cpu_precision(timings: list[dict], units: str) -> tuple[str, str]:
    """(precision, plan note) from every rank's seconds per forward+backward {"fp32": s, "bf16": s}. A step waits
    for the slowest rank, so each precision counts at its slowest rank's time; every rank decides from the same
    gathered numbers, so all take the same decision."""
    fp32, bf16 = (max(t[p] for t in timings) for p in ("fp32", "bf16"))
    chosen = "bf16" if fp32 >= BF16_GAIN * bf16 else "fp32"
    slowest = ", the slowest rank's" if len(timings) > 1 else ""
    return chosen, (f"auto -> {chosen} (CPU with {units}: forward+backward {bf16 * 1e3:.0f} ms bf16 vs "
                    f"{fp32 * 1e3:.0f} ms fp32{slowest}; bf16 when >= {BF16_GAIN - 1:.0%} faster)")


def time_precisions(trainer, steps: int) -> dict[str, float]:
    """train.precision auto on a CPU (time_auto_settings): this rank's median seconds of one forward+backward
    in fp32 and in bf16 autocast, `steps` of each, on the run's next training batches. Interleaved (fp32 then bf16,
    then bf16 then fp32, ...) so that whatever else slows the machine down meanwhile slows both alike. The
    optimizer step is left out: it updates fp32 parameters in either precision. Unnoticed by the run, as
    measure_speed (time_forward_backward)."""
    strategy, task, ctx, s = trainer.strategy, trainer.task, trainer.ctx, trainer.state
    dataset = trainer.datasets["train"]
    batches = list(itertools.islice(trainer.sampler.epoch_batches(s.epoch, start_sample=s.sample_in_epoch), steps + 1))
    seconds: dict[str, list[float]] = {"fp32": [], "bf16": []}

    def one(batch: dict, precision: str) -> float:
        start = time.perf_counter()
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = task.loss_sum(strategy.model, batch)
        loss.float().backward()
        return time.perf_counter() - start

    def both(i: int) -> float:  # 0: untimed (allocations, lazy init, compilation of each); steps + 1: busy
        batch = trainer.to_device(task.collate([dataset[j] for j in batches[i % len(batches)]]))
        took = {p: one(batch, p) for p in (("fp32", "bf16") if i % 2 else ("bf16", "fp32"))}
        if 1 <= i <= steps:
            for p, t in took.items():
                seconds[p].append(t)
        return sum(took.values())

    was_training = strategy.model.training
    strategy.model.train()
    with strategy.no_sync():
        time_forward_backward(strategy, ctx, both, steps, trainer.hooks.stop_reason)
    strategy.model.train(was_training)
    return {p: statistics.median(t) for p, t in seconds.items()}


def auto_batch_sizes(trainer, stored: Optional[list]) -> tuple[list[int], str]:
    """(per-replica batch sizes for `train.batch_size: auto`, a line for the plan). Collective: all ranks call it.

    `stored`: the sizes a resumed checkpoint trained with. They are reused as they are, so the current epoch
    continues in exactly the same data order (re-measuring could give a different split).
    """
    t, strategy = trainer.train_cfg, trainer.strategy
    if strategy.replicas_wait_for_each_other:
        raise ConfigError(f"`train.batch_size` is auto, which needs a replicated strategy such as ddp; under "
                          f"{trainer.cfg.dist.strategy} every forward waits for all ranks, so no rank's own speed "
                          "can be measured (give per-rank sizes as a list instead)")
    if stored is not None and len(stored) == strategy.data_shares and sum(stored) == t.global_batch_size:
        return list(stored), f"batch_size auto: per-{strategy.replica} batches {stored} reused from the checkpoint"
    if strategy.data_shares == 1:
        return [t.global_batch_size], f"batch_size auto: one {strategy.replica} takes the whole global batch"
    return replica_batch_sizes(trainer)


def replica_batch_sizes(trainer) -> tuple[list[int], str]:
    """Every rank times its forward+backward per sample on an equal share of the global batch: alone (measure_speed),
    with its tp group (the group's time: a forward is a collective), or its own stages on one micro-batch under
    pipe (PipeStrategy.seconds_per_sample). A replica (a rank, a tp group, a pipeline) goes at the pace of its
    slowest rank, so the global batch is split over the replicas by 1 / that time, in whole units of
    strategy.batch_multiple (pipe: sets of micro-batches)."""
    strategy, t, ctx, unit = trainer.strategy, trainer.train_cfg, trainer.ctx, trainer.strategy.batch_multiple
    equal = t.global_batch_size // strategy.data_shares
    if strategy.pipelined:
        dataset = trainer.datasets["train"]
        batch = trainer.to_device(trainer.task.collate([dataset[i] for i in range(equal // unit)]))
        seconds = strategy.seconds_per_sample(trainer.task, batch, t.balance_steps, trainer.hooks.stop_reason)
    else:
        seconds = 1 / measure_speed(trainer, equal, t.balance_steps)
    every = distributed.gather_objects(ctx, (strategy.data_rank, seconds))
    slowest = [max(s for r, s in every if r == j) for j in range(strategy.data_shares)]
    units = split_proportional(t.global_batch_size // unit, [1 / s for s in slowest], minimum=1)
    sizes = [u * unit for u in units]  # same inputs, same answer on every rank
    shown = ", ".join(f"{1 / s:.0f}" for s in slowest)
    pace = " (its slowest stage)" if strategy.pipelined else ""
    return sizes, (f"batch_size auto: measured samples/s per {strategy.replica}{pace} [{shown}] (batch {equal}) -> "
                   f"per-{strategy.replica.replace(' ', '-')} batches {sizes}")
