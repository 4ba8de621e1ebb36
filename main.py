"""Entry point.

    python main.py --params parameters.yml [--set section.key=value ...]

Reads and validates the config (a user mistake exits with code 2 and one line, before any process starts),
then starts one process per device on this node with torch.multiprocessing.spawn, or runs as the single process
that torchrun or SLURM's srun started. Each process builds the task and a Trainer, then trains or tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from config import Config, UserError, load_config, procs_per_node_list


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train or test a model as described by a parameters file.")
    p.add_argument("--params", default="parameters.yml", help="YAML config (default: parameters.yml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field, e.g. --set dist.strategy=ddp (repeatable)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.params, args.set)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(cfg)


def run(cfg: Config) -> int:
    """Start this node's processes and wait for them. Returns the exit code (0 ok, 2 user error)."""
    import torch.multiprocessing as mp
    from distributed import launcher_env

    if cfg.mode == "test":  # test mode always runs in one process, whatever trained the checkpoint
        cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, strategy="none", nodes=1,
                                                                procs_per_node=1, node_rank=0))
    env = launcher_env()
    if env is not None:  # torchrun / srun started us: we are exactly one rank
        return worker(env["local_rank"], cfg, env["rank"] - env["local_rank"], env["world_size"],
                      env["rendezvous"], 1)
    procs = procs_per_node_list(cfg)
    here, first_rank, world = procs[cfg.dist.node_rank], sum(procs[: cfg.dist.node_rank]), sum(procs)
    if here == 1:
        return worker(0, cfg, first_rank, world, None, 1)
    try:
        mp.spawn(_spawned_worker, args=(cfg, first_rank, world, None, here), nprocs=here, join=True)
    except mp.ProcessExitedException as e:
        return 2 if e.exit_code == 2 else 1
    except mp.ProcessRaisedException:
        return 1
    return 0


def _spawned_worker(local_rank: int, *args) -> None:
    code = worker(local_rank, *args)
    if code:
        sys.exit(code)


def worker(local_rank: int, cfg: Config, first_rank: int, world: int, rendezvous, local_procs: int) -> int:
    """One rank: join the group, build task and Trainer, train or test."""
    import torch
    import distributed as D
    from tasks import build_task
    from trainer import Trainer

    rank = first_rank + local_rank
    # Processes sharing a CPU should not each start one thread per core.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_procs))
    ctx = None
    try:
        ctx = D.init(cfg, rank, world, local_rank, rendezvous)
        os.makedirs(cfg.output_dir, exist_ok=True)
        trainer = Trainer(cfg, build_task(cfg), ctx)
        trainer.test() if cfg.mode == "test" else trainer.train()
        D.barrier(ctx)  # all ranks finish before any closes its connections (else gloo can abort at exit)
        return 0
    except UserError as e:
        prefix = f"rank {rank}: " if world > 1 else ""
        print(f"error: {prefix}{e}", file=sys.stderr)
        return 2
    finally:
        if ctx is not None:
            D.shutdown(ctx)


if __name__ == "__main__":
    sys.exit(main())
