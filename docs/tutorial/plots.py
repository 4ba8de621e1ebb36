"""The tutorial's figures and checks, made from what runs wrote: TensorBoard event files, checkpoints, JSON.

    python docs/tutorial/plots.py curves  OUT.png RUN [RUN ...] [--tags train/loss dev/accuracy]
    python docs/tutorial/plots.py compare RUN_OR_CHECKPOINT RUN_OR_CHECKPOINT [...]
    python docs/tutorial/plots.py memory  OUT.png MEMORY.json      (from benchmarks/bench_sharded_memory.py --json)
    python docs/tutorial/plots.py throughput OUT.png RUN [RUN ...]
    python docs/tutorial/plots.py tp OUT.json [--hidden 128 --layers 4 --heads 4]   (4 CPU ranks; `memory` draws it)

A RUN is an output_dir; its label in a figure is its folder name. `compare` prints the largest difference between
the final parameters of the first run and each other one (a run's newest complete checkpoint, or a checkpoint
folder). notebooks/inspect_run.ipynb imports the same functions.

The chapters write their figures under runs/tutorial/img/ (git-ignored). `--img-dir DIR` (or the environment
variable TUTORIAL_IMG_DIR=DIR) writes OUT's file name into DIR instead: `--img-dir docs/tutorial/img` regenerates
the figures the chapters show.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # checkpoint.py and checkpoint_io.py, for compare


def mistake(line: str) -> SystemExit:
    """A wrong run or path given: the line on stderr, exit code 2 (as main.py and scripts/ say a user's mistake)."""
    print(f"error: {line}", file=sys.stderr)
    return SystemExit(2)


def scalars(run: str) -> dict[str, tuple[list[int], list[float]]]:
    """{tag: (steps, values)} of a run's TensorBoard event files (train/loss, train/samples_per_s, dev/accuracy,
    ...). A resumed run repeats the steps after its checkpoint in a second event file, which hides the first
    file's points from there on (purge_step): TensorBoard, like this, shows each step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    folder = os.path.join(run, "tensorboard")
    if not os.path.isdir(folder):
        raise mistake(f"{folder}: no TensorBoard events (log.report_to without tensorboard?)")
    acc = EventAccumulator(folder, size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        by_step = {e.step: e.value for e in acc.Scalars(tag)}
        steps = sorted(by_step)
        out[tag] = (steps, [by_step[s] for s in steps])
    return out


def label(run: str) -> str:
    return os.path.basename(os.path.normpath(run))


def plt():
    import matplotlib.pyplot as pyplot
    return pyplot


def save(fig, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt().close(fig)
    print(f"wrote {out}")


def curves(out: str, runs: list[str], tags=("train/loss", "dev/accuracy")) -> dict:
    """One panel per tag, one line per run. Returns {run label: {tag: last value}}."""
    pyplot = plt()
    fig, axes = pyplot.subplots(1, len(tags), figsize=(4.2 * len(tags), 3.2), squeeze=False)
    last = {}
    for i, run in enumerate(runs):
        data = scalars(run)
        last[label(run)] = {}
        for ax, tag in zip(axes[0], tags):
            if tag in data:
                steps, values = data[tag]
                # lines that coincide (chapter 2) stay visible: dashed and thinner, one after the other
                ax.plot(steps, values, marker="." if len(steps) < 12 else None, label=label(run),
                        linestyle=["-", "--", ":", "-."][i % 4], linewidth=max(3.0 - i, 1.0))
                last[label(run)][tag] = values[-1]
    for ax, tag in zip(axes[0], tags):
        ax.set_title(tag)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    save(fig, out)
    for name, values in last.items():
        print(name + ": " + " ".join(f"{tag}={v:.4g}" for tag, v in values.items()))
    return last


def final_parameters(path: str) -> dict:
    """The parameters of a checkpoint folder, or of a run's newest complete checkpoint."""
    from core import checkpoint
    from core import checkpoint_io
    if not os.path.isfile(os.path.join(path, "meta.json")):  # not a checkpoint (a copy may have any name): a run
        found = checkpoint.complete_checkpoints(path)
        if not found:
            raise mistake(f"{path}: neither a checkpoint nor a run with one")
        path = found[-1][1]
    return checkpoint_io.model_state_dict(path)


def compare(paths: list[str]) -> dict[str, float]:
    """Largest |difference| of any parameter between the first and each other run. Returns {path: difference}."""
    reference = final_parameters(paths[0])
    result = {}
    for other_path in paths[1:]:
        other = final_parameters(other_path)
        if other.keys() != reference.keys():
            raise mistake(f"{other_path} and {paths[0]} hold different parameters")
        diff = max((reference[k].float() - other[k].float()).abs().max().item() for k in reference)
        scale = max(reference[k].float().abs().max().item() for k in reference)
        result[other_path] = diff
        print(f"{label(paths[0])} vs {label(other_path)}: largest parameter difference {diff:.2e} "
              f"(largest parameter {scale:.2f})")
    return result


def memory(out: str, json_path: str) -> list:
    """Per-rank bytes of parameters, gradients and optimizer state (rank 0, stacked) next to the ZeRO formula."""
    with open(json_path) as f:
        bench = json.load(f)
    pyplot = plt()
    rows, mib, n = bench["rows"], 2 ** 20, bench["parameters"]
    fig, ax = pyplot.subplots(figsize=(max(6.0, 1.25 * len(rows)), 3.8))
    for i, row in enumerate(rows):
        rank0, bottom = row["per_rank"][0], 0.0
        for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
            ax.bar(i - 0.18, rank0[part] / mib, 0.36, bottom=bottom, color=color, label=part if i == 0 else None)
            bottom += rank0[part] / mib
        ax.bar(i + 0.18, row["formula"] * n / mib, 0.36, color="lightgray", edgecolor="black", hatch="//",
               label=bench.get("formula_label", "ZeRO formula") if i == 0 else None)
        for r, rank in enumerate(row["per_rank"][1:], 1):  # the other ranks' totals: equal, unless split unevenly
            ax.plot(i - 0.18, sum(rank.values()) / mib, marker="_", markersize=22, markeredgewidth=2, color="black",
                    label="total of another rank" if i == 1 and r == 1 else None)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['label']}\nx{r['procs']}".replace(" (", "\n(") for r in rows], fontsize=7)
    ax.set_ylabel("MiB (bars: rank 0)")
    ax.set_title(bench.get("title") or f"{bench['model']}: {n / 1e6:.1f}M parameters, fp32 AdamW, model state held "
                 "per rank")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    save(fig, out)
    for row in rows:
        totals = [sum(rank.values()) for rank in row["per_rank"]]
        print(f"{row['label']:34s} x{row['procs']}: rank 0 holds {totals[0] / mib:6.2f} MiB; bytes/param per rank "
              + " ".join(f"{t / n:5.2f}" for t in totals) + f" (formula {row['formula']:.2f})")
    return rows


def throughput(out: str, runs: list[str]) -> dict[str, float]:
    """Samples/s over the run (train/samples_per_s, the first log interval left out: it holds the start-up)."""
    pyplot = plt()
    fig, (left, right) = pyplot.subplots(1, 2, figsize=(9, 3.2))
    means = {}
    for run in runs:
        steps, values = scalars(run)["train/samples_per_s"]
        kept = values[1:] or values
        means[label(run)] = sum(kept) / len(kept)
        left.plot(steps, values, marker=".", label=label(run))
    left.set_title("train/samples_per_s")
    left.set_xlabel("optimizer step")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.bar(list(means), list(means.values()), color=[f"C{i}" for i in range(len(means))])  # the lines' colors
    right.set_title("mean samples/s (after the first interval)")
    right.grid(axis="y", alpha=0.3)
    save(fig, out)
    for name, value in means.items():
        print(f"{name}: {value:.0f} samples/s")
    return means


# Chapter 9's layouts of 4 ranks: label, dist.strategy, dist.tp. ddp with tp 1 holds what one process holds.
TP_LAYOUTS = [("tp 1 (ddp 4)", "ddp", 1), ("ddp 2 x tp 2", "ddp", 2), ("tp 4", "ddp", 4),
              ("fsdp 2 x tp 2", "fsdp", 2), ("fsdp 4", "fsdp", 1)]


# CommDebugMode's names for one collective: DTensor's (functional) ops and the process group's (c10d) ones.
COLLECTIVES = {"all_reduce": "all-reduce", "allreduce_": "all-reduce", "_allgather_base_": "all-gather",
               "all_gather_into_tensor": "all-gather", "_reduce_scatter_base_": "reduce-scatter",
               "reduce_scatter_tensor": "reduce-scatter", "broadcast_": "broadcast"}


def bert_model(hidden: int, layers: int, heads: int):
    """A random BERT for pre-training (BERT's 30,522-token vocabulary), as tasks/bert_pretrain.py builds its
    presets; the same parameters on every rank (seed 0)."""
    import torch
    from transformers import BertConfig, BertForPreTraining
    from tasks.bert_pretrain import PretrainingModel
    torch.manual_seed(0)
    return PretrainingModel(BertForPreTraining(BertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))


def _tp_rank(rank: int, world: int, port: int, size: tuple, queue) -> None:
    """One of the spawned ranks of `tp`: each layout in turn, through the project's own wiring.parallelize."""
    import contextlib
    import warnings
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from wiring import checked_config_from_dict
    from core.distributed import DistContext
    from wiring import parallelize as apply
    from tests.rank_memory import state_bytes
    from wiring import build_task
    torch.set_num_threads(1)
    # Warnings that each rank would print once per layout: CommDebugMode's module hooks (no input needs a gradient,
    # Hugging Face's outputs are not tensors) and FSDP2 on the view a block returns (no in-place op follows it).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="For backward hooks to be called")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    g = torch.Generator().manual_seed(1)  # one batch of 4 sequences of 32 tokens, 5 of them masked
    ids = torch.randint(1000, 30000, (4, 32), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 3:8] = ids[:, 3:8]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
             "mlm_labels": labels, "nsp_labels": torch.tensor([0, 1, 0, 1])}
    for name, strategy, tp in TP_LAYOUTS:
        cfg = checked_config_from_dict({"task": "bert_pretrain", "output_dir": "unused", "model": {"name": "tiny"},
                                        "log": {"progress_bar": False, "tensorboard": False},
                                        "dist": {"strategy": strategy, "tp": tp, "procs_per_node": world}}, "tp")
        task = build_task(cfg)
        strategy = apply(bert_model(*size), cfg, ctx, task, None)
        with CommDebugMode() as forward:
            task.loss_sum(strategy.model, batch)
        with CommDebugMode() as step:  # forward and backward, with the gradients' reduction over dp
            strategy.forward_backward(task, [batch], 1.0, contextlib.nullcontext)
        strategy.optimizer.step()  # AdamW's two moments now exist
        counts = [{} for _ in range(2)]
        for total, mode in zip(counts, (forward, step)):
            for op, n in mode.get_comm_counts().items():
                what = COLLECTIVES.get(str(op).split(".")[-1], str(op))
                total[what] = total.get(what, 0) + n
        queue.put((name, rank, counts, state_bytes(strategy)))
    dist.barrier()
    dist.destroy_process_group()


def tp(out: str, hidden: int, layers: int, heads: int, world: int = 4) -> dict:
    """Spawns `world` CPU ranks (gloo); in each layout of TP_LAYOUTS they spread the same random BERT with
    wiring.parallelize, count the collectives of one forward and of one forward+backward (CommDebugMode), take one
    AdamW step and report the bytes each holds (tests/rank_memory.state_bytes). Writes a JSON that `memory` draws, with
    the formula: 16 bytes x (whole tensors / s + split tensors / (tp x s)), s = the dp size under fsdp, else 1;
    split tensors are those the task's tp plan cuts (a ColwiseParallel layer's weight and bias, a RowwiseParallel
    layer's weight)."""
    import socket
    import torch
    import torch.multiprocessing as mp
    from torch.distributed.tensor.parallel import ColwiseParallel
    from tasks.text_common import bert_tp_plan

    def sizes(model) -> tuple[int, int]:  # all parameters, those the plan splits
        modules = dict(model.named_modules())
        split = sum(p.numel() for name, style in bert_tp_plan(model, 1).items() for pname, p in
                    modules[name].named_parameters() if pname == "weight" or isinstance(style, ColwiseParallel))
        return sum(p.numel() for p in model.parameters()), split

    n, split = sizes(bert_model(hidden, layers, heads))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(_tp_rank, args=(world, port, (hidden, layers, heads), queue), nprocs=world,
                               join=False, start_method="spawn")
    reports = [queue.get() for _ in range(world * len(TP_LAYOUTS))]
    while not ranks.join():
        pass
    rows = []
    print(f"BERT hidden {hidden}, {layers} layers, {heads} heads: {n / 1e6:.2f}M parameters, {split / 1e6:.2f}M of "
          f"them split by tp")
    for name, strategy, tp_size in TP_LAYOUTS:
        ranks = sorted((r for r in reports if r[0] == name), key=lambda r: r[1])
        shard = world // tp_size if strategy == "fsdp" else 1
        formula = 16 * ((n - split) / shard + split / (tp_size * shard)) / n  # bytes per parameter
        forward, step = ranks[0][2]
        rows.append({"label": name, "procs": world, "formula": formula, "per_rank": [r[3] for r in ranks],
                     "forward": forward, "step": step})
        print(f"{name}: forward {', '.join(f'{k} {v}' for k, v in sorted(forward.items())) or 'nothing'}; "
              f"forward+backward {', '.join(f'{k} {v}' for k, v in sorted(step.items())) or 'nothing'}")
    with torch.device("meta"):  # no memory: only the sizes
        base_n, base_split = sizes(bert_model(768, 12, 12))
    held = [f"{(base_n - base_split + base_split / t) / base_n:.0%} under tp {t}" for t in (2, 4, 8)]
    print(f"the formula for BERT-base: {base_n / 1e6:.1f}M parameters, {base_split / 1e6:.1f}M split; a rank holds "
          + ", ".join(held))
    title = f"BERT {hidden}x{layers}, {n / 1e6:.1f}M parameters ({split / 1e6:.2f}M split by tp), fp32 AdamW"
    result = {"model": f"BERT {hidden}x{layers}", "parameters": n, "split": split, "title": title,
              "formula_label": "formula", "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    # Only an explicit flag or variable writes into the tracked docs/tutorial/img/: following the chapters leaves
    # the git tree as it was.
    img = argparse.ArgumentParser(add_help=False)
    img.add_argument("--img-dir", default=os.environ.get("TUTORIAL_IMG_DIR") or None, metavar="DIR",
                     help="write OUT's file name into DIR (default: $TUTORIAL_IMG_DIR, else OUT as given)")
    p = sub.add_parser("curves", parents=[img])
    p.add_argument("out")
    p.add_argument("runs", nargs="+")
    p.add_argument("--tags", nargs="+", default=["train/loss", "dev/accuracy"])
    p = sub.add_parser("compare")
    p.add_argument("paths", nargs="+")
    p = sub.add_parser("memory", parents=[img])
    p.add_argument("out")
    p.add_argument("json")
    p = sub.add_parser("throughput", parents=[img])
    p.add_argument("out")
    p.add_argument("runs", nargs="+")
    p = sub.add_parser("tp")
    p.add_argument("out", help="JSON for `memory`")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    if getattr(args, "img_dir", None):
        args.out = os.path.join(args.img_dir, os.path.basename(args.out))
    if "MPLBACKEND" not in os.environ:
        import matplotlib
        matplotlib.use("Agg")  # from the command line: files only, no window
    if args.what == "curves":
        curves(args.out, args.runs, args.tags)
    elif args.what == "compare":
        compare(args.paths)
    elif args.what == "memory":
        memory(args.out, args.json)
    elif args.what == "tp":
        tp(args.out, args.hidden, args.layers, args.heads)
    else:
        throughput(args.out, args.runs)


if __name__ == "__main__":
    main()
