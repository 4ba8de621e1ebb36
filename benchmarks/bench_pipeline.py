"""Pipeline parallelism (dist.strategy: pipe): bubble, activation memory and auto split, measured.

    python benchmarks/bench_pipeline.py [--quick] [--timeline] [--stages 2 4] [--microbatches 4 8] [--dump FILE]

The model is a chain of 16 equal blocks (Linear 256x256 + GELU), cut into stages with `strategies.pipeline.Stage`
and driven through `torch.distributed.pipelining` exactly as strategies/pipeline.py does it (PipelineStage per
stage, the schedule class of dist.pp_schedule, scale_grads=False, `schedule.step(*inputs, target=, losses=)`),
on gloo processes on localhost, one per stage, spawned with torch.multiprocessing.

Why the blocks mostly sleep. On this 2-core machine, 4 stages are 4 processes on 2 cores: with real compute,
a stage that has work would wait for a core held by a stage that also has work, and the wall-clock bubble would
measure the OS scheduler rather than the schedule. So each block is a calibrated, sleep-dominated workload, the
way a GPU kernel runs while its host process waits: the forward does the real Linear + GELU (~0.2 ms) and then
sleeps until `--block-ms` has passed; the backward has two custom autograd nodes, one on the input-gradient path
and one on the weight-gradient path, each sleeping `--block-ms` less half of the block's real backward (timed
once, before the ranks start), so backward ~ 2 x forward, and the split schedules (zero_bubble) get
input-gradient (I) and weight-gradient (W) halves of about equal length. Sleeping processes do not compete for
cores, so 4 stages behave like 4 devices. Real tensors still flow between the stages and real autograd graphs
are kept, so communication and memory are real. What the machine's load still distorts shows in `late ms` and
in the spread of F / B.

What is measured, per configuration (schedule, stages p, micro-batches m):
- bubble: each stage's compute actions (forward_one_chunk, backward_one_chunk, backward_weight_one_chunk of its
  PipelineStage) are timed; step time T = last rank's end - first rank's start of schedule.step (all ranks start
  after a barrier; time.perf_counter is one system-wide clock). Columns:
    F / B ms   median forward and backward (I + W for zero_bubble) of one micro-batch on one stage
    late ms    per rank and step, time actions started after both their rank was free and their inputs were
               done: messages, waking the receiver, gloo sends that complete only once the receiver has posted
               its receive, the schedule's bookkeeping
    formula    (p-1)/(m+p-1) for gpipe and 1f1b; (p-1)/(v*m+p-1), v = 2 stages per rank, for interleaved_1f1b;
               none for zero_bubble
    model      the schedule's own bubble with these compute times: one step's order of actions per rank,
               each action the median duration of its kind on its stage, replayed as early as its rank and its
               inputs allow (zero communication time). Differs from the formula when stages are unequal.
    replay     the same with each action's own measured duration (noise in compute included), per step
    measured   1 - mean over ranks of (busy time / T), the share of the step a stage sits idle
  All are medians over the timed steps. measured - replay is the cost of communication and of the schedule's
  overhead (about `late ms` / step ms); replay - model is the noise in compute times.
- activation memory: one more step with torch.autograd.graph.saved_tensors_hooks: the bytes of every tensor
  autograd saves for backward (parameters excluded; a tensor saved twice counted once) are added when saved and
  removed when freed; peak per rank, and peak / (bytes one micro-batch saves on that rank) = micro-batches in
  flight. GPipe keeps all m; torch's 1F1B runs p - s forwards before stage s's first backward, so p - s.
- auto split: 2 stages, rank 1 slowed 2x the way dist.simulate_slowdown does it (Stage's busy-wait in forward),
  1f1b, m = 8. `strategies.pipeline.auto_split` times every layer on each rank (x its factor) and
  `min_max_partition` cuts the chain; steps/s of that split vs the even split [8, 8], the two run in alternating
  rounds. Ideal: the best integer cut's slowest stage vs the even split's (no bubble), and the one-device
  equivalent 1.5x (speeds 1 and 1/2 together do 1.5 units of work when nobody waits).

--timeline prints, for every schedule at the largest p and m, an ASCII timeline of one measured step (the one
with the median step time): rows are ranks, a column is the median forward of one stage (the action covering
the column's middle is shown; shorter ones can fall between two columns); F3/B3 = forward/backward of
micro-batch 3, I3/W3 its input-/weight-gradient halves, lower case for a rank's second stage in the interleaved
schedules, '.' idle. The pictures in docs/pipeline.md come from
`python benchmarks/bench_pipeline.py --stages 2 4 --microbatches 8 --timeline --no-auto` (p = 4) and
`... --stages 2 --microbatches 4 --timeline --no-auto` (p = 2).
--dump FILE writes the raw measurements (every action's start and end on every rank) as JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import types

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: up to 4 ranks on 2 cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from core import process_end  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]


# ---- the workload: sleep-dominated blocks with a real Linear + GELU --------------------------------------------
class _Tick(torch.autograd.Function):
    """Identity; its backward sleeps `seconds` (a slice of simulated device time on that gradient path)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Block(nn.Module):
    """Linear + GELU whose forward takes `seconds` and whose backward takes about 2 x `seconds`: `back` is
    what each of the two backward sleeps lasts, `seconds` less half the block's real backward (calibrate())."""

    def __init__(self, width: int, seconds: float, back: float):
        super().__init__()
        self.linear, self.seconds, self.back = nn.Linear(width, width), seconds, back

    def forward(self, x):
        start = time.perf_counter()
        weight = _Tick.apply(self.linear.weight, self.back)  # the weight-gradient path: W
        y = nn.functional.gelu(_Tick.apply(nn.functional.linear(x, weight, self.linear.bias), self.back))  # I
        rest = self.seconds - (time.perf_counter() - start)
        if rest > 0:
            time.sleep(rest)
        return y


def calibrate(args) -> float:
    """Real backward time of one block without sleeps (fastest of 20), so that sleeps make up the rest."""
    block, x = Block(args.width, 0.0, 0.0), torch.randn(args.rows, args.width, requires_grad=True)
    best = float("inf")
    for _ in range(20):
        y = block(x).sum()
        start = time.perf_counter()
        y.backward()
        best = min(best, time.perf_counter() - start)
    return best


def make_blocks(args, real_backward: float) -> list[nn.Module]:
    torch.manual_seed(0)
    seconds = args.block_ms / 1000
    return [Block(args.width, seconds, max(0.0, seconds - real_backward / 2)) for _ in range(args.layers)]


def loss_fn(output, target):
    return ((output - target) ** 2).sum()


# ---- timing and memory instruments -------------------------------------------------------------------------------
def instrument(pipe_stage, records: list) -> None:
    """Time this PipelineStage's compute calls: (kind, stage, micro-batch, start, end) into `records`."""
    for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        original = getattr(pipe_stage, name)

        def timed(chunk, *args, _original=original, _kind=kind, **kwargs):
            start = time.perf_counter()
            out = _original(chunk, *args, **kwargs)
            k = "I" if _kind == "B" and kwargs.get("full_backward") is False else _kind
            records.append((k, pipe_stage.stage_index, chunk, start, time.perf_counter()))
            return out
        setattr(pipe_stage, name, timed)


class SavedBytes:
    """Live and peak bytes of the tensors autograd saves for backward (parameters excluded)."""

    def __init__(self, params):
        self.skip = {p.data_ptr() for p in params}
        self.refs, self.live, self.peak, self.total = {}, 0, 0, 0

    def pack(self, t):
        if t.device.type == "meta" or t.data_ptr() in self.skip:
            return t
        return _Held(self, t)

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def add(self, key, nbytes):
        if self.refs.get(key, 0) == 0:
            self.live += nbytes
            self.total += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1

    def remove(self, key, nbytes):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes


class _Held:
    def __init__(self, tracker: SavedBytes, t: torch.Tensor):
        self.tracker, self.t, self.key = tracker, t, (t.data_ptr(), t.nbytes)
        tracker.add(self.key, t.nbytes)

    def __del__(self):
        self.tracker.remove(self.key, self.t.nbytes)


# ---- one configuration on one rank ---------------------------------------------------------------------------
def build(layers, sizes, schedule_name, p, m, rank, slowdown=1.0):
    """Stages of this rank (looped placement, as apply_pipe), their PipelineStages and the schedule."""
    from torch.distributed import pipelining
    from strategies.pipeline import SCHEDULES as CLASSES, STAGES_PER_RANK, Stage
    n_stages = p * STAGES_PER_RANK[schedule_name]
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    mine = [i for i in range(n_stages) if i % p == rank]
    modules = {i: Stage(layers[starts[i]:starts[i] + sizes[i]], slowdown) for i in mine}
    pipe_stages = [pipelining.PipelineStage(modules[i], i, n_stages, torch.device("cpu")) for i in mine]
    records: list = []
    for s in pipe_stages:
        instrument(s, records)
    cls = getattr(pipelining, CLASSES[schedule_name])
    schedule = cls(pipe_stages if len(pipe_stages) > 1 else pipe_stages[0], n_microbatches=m, loss_fn=loss_fn,
                   scale_grads=False)
    return modules, schedule, records, 0 in modules, n_stages - 1 in modules


def run_steps(schedule, records, first, last, x, target, steps):
    """`steps` barrier-aligned steps; per step (start, end, records)."""
    out = []
    for _ in range(steps):
        dist.barrier()
        records.clear()
        start = time.perf_counter()
        schedule.step(*((x,) if first else ()), target=target if last else None, losses=[], return_outputs=False)
        out.append((start, time.perf_counter(), list(records)))
    return out


def measure_config(args, rank, p, schedule_name, m, memory: bool):
    from strategies.pipeline import STAGES_PER_RANK, split_layers
    v = STAGES_PER_RANK[schedule_name]
    layers = make_blocks(args, args.real_backward)
    sizes = split_layers(args.layers, p * v, "even")
    modules, schedule, records, first, last = build(layers, sizes, schedule_name, p, m, rank)
    torch.manual_seed(1)
    x, target = torch.randn(m * args.rows, args.width), torch.randn(m * args.rows, args.width)
    run_steps(schedule, records, first, last, x, target, 2)  # shape inference, allocations
    timed = run_steps(schedule, records, first, last, x, target, args.steps)
    peak = per_mb = None
    if memory:
        tracker = SavedBytes([q for mod in modules.values() for q in mod.parameters()])
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            run_steps(schedule, records, first, last, x, target, 1)
        peak, per_mb = tracker.peak, tracker.total / m
    for mod in modules.values():
        mod.zero_grad(set_to_none=True)
    return {"steps": timed, "peak": peak, "per_mb": per_mb}


def measure_auto(args, rank):
    """2 stages, rank 1 slowed 2x: even split vs auto_split's, alternating rounds of 1f1b steps."""
    from strategies.pipeline import auto_split
    factors = [1.0, args.slowdown]
    layers = make_blocks(args, args.real_backward)
    cfg = types.SimpleNamespace(dist=types.SimpleNamespace(simulate_slowdown=factors))
    ctx = types.SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
    example = (torch.randn(args.rows, args.width),)
    auto = auto_split(layers, example, 2, cfg, ctx)  # what apply_pipe does for pp_split: auto
    half = args.layers // 2
    splits = {"even": [half, args.layers - half], "auto": auto}
    m = 8
    torch.manual_seed(1)
    x, target = torch.randn(m * args.rows, args.width), torch.randn(m * args.rows, args.width)
    built = {name: build(make_blocks(args, args.real_backward), sizes, "1f1b", 2, m, rank, factors[rank])
             for name, sizes in splits.items()}
    times, final = {name: [] for name in splits}, {}
    for name, (_, schedule, records, first, last) in built.items():
        run_steps(schedule, records, first, last, x, target, 1)
    for r in range(args.rounds):
        for name in (list(splits) if r % 2 == 0 else list(splits)[::-1]):
            _, schedule, records, first, last = built[name]
            steps = run_steps(schedule, records, first, last, x, target, args.auto_steps)
            times[name] += [(s, e) for s, e, _ in steps]
            final[name] = final.get(name, []) + [records for _, _, records in steps]
    return {"splits": splits, "times": times, "final": final}


def worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for schedule_name in SCHEDULES:
        for m in args.microbatches:
            if schedule_name in ("interleaved_1f1b", "zero_bubble") and (m % world or m != max(args.microbatches)):
                continue  # interleaved: m a multiple of p (config rule); measured at the largest m only
            results[f"{schedule_name}/{m}"] = measure_config(args, rank, world, schedule_name, m,
                                                            memory=m == max(args.microbatches))
    if world == 2 and not args.no_auto:
        results["auto"] = measure_auto(args, rank)
    everything = [None] * world
    dist.all_gather_object(everything, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(everything, f)
    dist.barrier()
    dist.destroy_process_group()
    process_end.end_process(0)  # as main.py's ranks end: the interpreter's teardown can hang or abort on gloo's threads


# ---- analysis (parent process) -----------------------------------------------------------------------------------
def deps(action, n_stages):
    kind, s, k = action
    if kind == "F":
        return [("F", s - 1, k)] if s > 0 else []
    if kind in ("B", "I"):
        return [("F", s, k)] + ([("G", s + 1, k)] if s < n_stages - 1 else [])
    return [("G", s, k)]  # W: after this stage's input-gradient half


def simulate(orders: dict, duration: dict, n_stages: int) -> tuple[float, dict]:
    """Replay each rank's actions in their order, each as soon as its rank is free and its inputs are ready
    (the previous stage's forward, the next stage's input gradient), with zero communication time."""
    done, free, pos = {}, {r: 0.0 for r in orders}, {r: 0 for r in orders}
    busy = {r: 0.0 for r in orders}
    while any(pos[r] < len(orders[r]) for r in orders):
        moved = False
        for r in orders:
            while pos[r] < len(orders[r]):
                action = orders[r][pos[r]]
                need = deps(action, n_stages)
                if not all(d in done for d in need):
                    break
                start = max([free[r]] + [done[d] for d in need])
                took = duration[action] if action in duration else duration[action[:2]]
                end = start + took
                done[action] = end
                if action[0] in ("B", "I"):
                    done[("G",) + action[1:]] = end
                free[r], busy[r] = end, busy[r] + took
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("schedule replay deadlocked")
    return max(free.values()), busy


def analyse(per_rank: list, p: int, schedule_name: str, m: int) -> dict:
    v = 2 if schedule_name in ("interleaved_1f1b", "zero_bubble") else 1
    n_stages = p * v
    bubbles, steps, lates, replays = [], [], [], []
    durations: dict = {}
    for i in range(len(per_rank[0]["steps"])):
        lates.append(late([r["steps"][i] for r in per_rank], n_stages))
        starts = [r["steps"][i][0] for r in per_rank]
        ends = [r["steps"][i][1] for r in per_rank]
        T = max(ends) - min(starts)
        busy = [sum(e - s for _, _, _, s, e in r["steps"][i][2]) for r in per_rank]
        bubbles.append(1 - statistics.mean(busy) / T)
        steps.append(T)
        acts = [sorted(r["steps"][i][2], key=lambda a: a[3]) for r in per_rank]
        T_replay, busy_replay = replay(acts, n_stages)
        replays.append(1 - statistics.mean(busy_replay.values()) / T_replay)
        for r in per_rank:
            for kind, stage, _, s, e in r["steps"][i][2]:
                durations.setdefault((kind, stage), []).append(e - s)
    duration = {k: statistics.median(v_) for k, v_ in durations.items()}
    typical = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]  # the median step: timeline
    last = [sorted(r["steps"][typical][2], key=lambda a: a[3]) for r in per_rank]
    T_model, busy_model = replay(last, n_stages, duration)
    kind_ms = lambda kind: 1000 * statistics.median(  # noqa: E731
        [d for (k, _), ds in durations.items() if k == kind for d in ds] or [0.0])
    formula = None if schedule_name == "zero_bubble" else (p - 1) / (v * m + p - 1)  # v = 1: (p-1)/(m+p-1)
    return {"bubble": statistics.median(bubbles), "step_ms": 1000 * statistics.median(steps),
            "model": 1 - statistics.mean(busy_model.values()) / T_model, "formula": formula,
            "replay": statistics.median(replays), "late_ms": 1000 * statistics.median(lates),
            "peak": [r["peak"] for r in per_rank], "per_mb": [r["per_mb"] for r in per_rank],
            "f_ms": kind_ms("F"), "b_ms": kind_ms("B") + kind_ms("I") + kind_ms("W"), "last": last}


def late(step: list, n_stages: int) -> float:
    """Mean over ranks of the time actions started after both their rank was free and their inputs were done
    on the other rank: what a message, waking the receiver, a send waiting for its receiver (gloo sends
    complete once the other side has posted the receive) and the schedule's bookkeeping cost in one step."""
    end = {}
    for _, _, acts in step:
        for kind, stage, mb, _, e in acts:
            end[(kind, stage, mb)] = e
            if kind in ("B", "I"):
                end[("G", stage, mb)] = e
    total = 0.0
    for start_of_step, _, acts in step:
        previous = start_of_step
        for kind, stage, mb, s, e in sorted(acts, key=lambda a: a[3]):
            ready = max([previous] + [end[d] for d in deps((kind, stage, mb), n_stages) if d in end])
            total += max(0.0, s - ready)
            previous = e
    return total / len(step)


def replay(last: list, n_stages: int, duration: dict = None) -> tuple[float, dict]:
    """simulate() on the order of one measured step's actions per rank, with `duration` per (kind, stage) or,
    by default, each action's own measured duration."""
    orders = {rank: [tuple(a[:3]) for a in acts] for rank, acts in enumerate(last)}
    if duration is None:
        duration = {tuple(a[:3]): a[4] - a[3] for acts in last for a in acts}
    return simulate(orders, duration, n_stages)


def timeline(last: list, column: float) -> list[str]:
    """ASCII art of one step: a row per rank, a column per `column` seconds, the action covering its middle."""
    t0 = min(a[3] for acts in last for a in acts)
    t1 = max(a[4] for acts in last for a in acts)
    n = int(round((t1 - t0) / column))
    lines = []
    for rank, acts in enumerate(last):
        stages = sorted({a[1] for a in acts})
        cells = []
        for c in range(n):
            mid = t0 + (c + 0.5) * column
            hit = next((a for a in acts if a[3] <= mid < a[4]), None)
            if hit is None:
                cells.append(" .")
            else:
                kind = hit[0] if hit[1] == stages[0] else hit[0].lower()
                cells.append(f"{kind}{hit[2]}".ljust(2))
        lines.append(f"rank {rank} |" + "".join(cells).rstrip())
    return lines


def launch(world: int, args) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(world, port, args, path), nprocs=world)
        with open(path) as f:
            return json.load(f)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="m = 8 only, fewer steps (about a minute)")
    ap.add_argument("--timeline", action="store_true", help="print an ASCII timeline of one step per schedule")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--rows", type=int, default=16, help="samples per micro-batch")
    ap.add_argument("--block-ms", type=float, default=2.0, help="simulated forward time of one block")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    ap.add_argument("--slowdown", type=float, default=2.0, help="auto split: rank 1's dist.simulate_slowdown")
    ap.add_argument("--rounds", type=int, default=4, help="auto split: alternating rounds")
    ap.add_argument("--auto-steps", type=int, default=3, help="auto split: steps per round")
    ap.add_argument("--no-auto", action="store_true")
    ap.add_argument("--dump", help="also write the raw per-rank measurements (JSON) to this file")
    ap.add_argument("--tiny", action="store_true",
                    help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = ap.parse_args(argv)
    if args.tiny:  # seconds, not a measurement
        args.stages, args.microbatches, args.layers, args.width, args.steps = [2], [4], 4, 32, 1
        args.no_auto = True
    if args.quick:
        args.microbatches, args.steps, args.rounds, args.auto_steps = [8], 4, 2, 3
    started = time.perf_counter()
    torch.set_num_threads(1)
    args.real_backward = calibrate(args)  # here, once: every rank sleeps the same
    print(f"# bench_pipeline: {args.layers} blocks Linear({args.width})+GELU, {args.rows} samples per micro-batch, "
          f"block forward {args.block_ms} ms (sleep-dominated), backward 2x; gloo, 1 thread per rank; "
          f"real backward of a block {1000 * args.real_backward:.2f} ms (slept the rest); "
          f"{datetime.date.today()}, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    rows, auto, timelines, raw = [], None, [], {}
    for p in args.stages:
        everything = raw[p] = launch(p, args)
        for key in everything[0]:
            if key == "auto":
                auto = [r["auto"] for r in everything]
                continue
            name, m = key.split("/")
            a = analyse([r[key] for r in everything], p, name, int(m))
            rows.append((name, p, int(m), a))
            if args.timeline and p == max(args.stages) and int(m) == max(args.microbatches):
                timelines.append((name, p, int(m), a))

    print("\n## Bubble: share of the step a stage is idle (median over steps)\n")
    print("| schedule | p | m | F / B ms | step ms | late ms | formula | model | replay | measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, p, m, a in rows:
        formula = f"{a['formula']:.3f}" if a["formula"] is not None else "-"
        print(f"| {name} | {p} | {m} | {a['f_ms']:.1f} / {a['b_ms']:.1f} | {a['step_ms']:.0f} | {a['late_ms']:.0f} | "
              f"{formula} | {a['model']:.3f} | {a['replay']:.3f} | {a['bubble']:.3f} |")

    print(f"\n## Activation memory: peak bytes saved for backward per rank, m = {max(args.microbatches)} "
          f"(MiB; in micro-batches)\n")
    print("| schedule | p | " + " | ".join(f"rank {r}" for r in range(max(args.stages))) + " |")
    print("|---|---|" + "---|" * max(args.stages))
    for name, p, m, a in rows:
        if a["peak"][0] is None:
            continue
        cells = [f"{mib(pk)} ({pk / mb:.1f})" for pk, mb in zip(a["peak"], a["per_mb"])]
        cells += [""] * (max(args.stages) - p)
        print(f"| {name} | {p} | " + " | ".join(cells) + " |")

    if auto:
        from strategies.pipeline import min_max_partition
        splits = auto[0]["splits"]
        step = {name: statistics.median(max(r["times"][name][i][1] for r in auto) -
                                        min(r["times"][name][i][0] for r in auto)
                                        for i in range(len(auto[0]["times"][name]))) for name in splits}
        n, f = args.layers, args.slowdown
        cost = [[1.0] * n, [f] * n]  # per-layer work on stage 0 and on the slowed stage 1
        best = min_max_partition(cost)
        bottleneck = lambda s: max(s[0] * 1.0, s[1] * f)  # noqa: E731
        print(f"\n## Auto split: 2 stages, rank 1 slowed {f:g}x (Stage busy-wait), 1f1b, m = 8, "
              f"{args.rounds} x {args.auto_steps} steps each\n")
        print("| split | layers per stage | step ms | steps/s | vs even |")
        print("|---|---|---|---|---|")
        for name in splits:
            print(f"| {name} | {splits[name]} | {1000 * step[name]:.0f} | {1 / step[name]:.2f} | "
                  f"{step['even'] / step[name]:.2f}x |")
        print(f"| ideal: best cut {best}, slowest stage vs even's (no bubble) | | | | "
              f"{bottleneck(splits['even']) / bottleneck(best):.2f}x |")
        print(f"| ideal: one-device equivalent (speeds 1 + 1/{f:g}, nobody waits) | | | | "
              f"{(1 + 1 / f) / (2 / f):.2f}x |")
        print(f"| auto's cut, slowest stage vs even's (no bubble) | | | | "
              f"{bottleneck(splits['even']) / bottleneck(splits['auto']):.2f}x |")
        model = {name: statistics.median(replay([r["final"][name][i] for r in auto], 2)[0]
                                         for i in range(len(auto[0]["final"][name]))) for name in splits}
        print(f"| replay: each step's measured actions without communication (median) | | "
              f"{1000 * model['even']:.0f} / {1000 * model['auto']:.0f} | | {model['even'] / model['auto']:.2f}x |")

    for name, p, m, a in timelines:
        print(f"\n{name}, {p} stages, {m} micro-batches: one column = {a['f_ms']:.1f} ms (one forward); step "
              f"{a['step_ms']:.0f} ms, bubble {a['bubble']:.2f} measured, "
              + (f"{a['formula']:.2f} formula" if a["formula"] is not None else f"{a['model']:.2f} model"))
        print("\n".join(timeline(a["last"], a["f_ms"] / 1000)))
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(raw, f)
    print(f"\n# {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
