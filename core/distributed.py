"""Who am I among the processes, and how do we talk: a rank's context, its share of the cores, and the small
collectives the Trainer uses. How a rank joins the others: core/process_group.py.

Rank layout: node k runs procs_per_node[k] processes; global rank = sum(procs_per_node[:k]) + local rank.
Nodes may run different numbers of processes (a borrowed mix of lab machines).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: Optional[str]  # None: no process group (strategies none and dp)
    rendezvous: Optional[str] = None  # tcp://host:port, env:// or file://...: where the ranks met (faults.py)
    cpu_threads: str = ""  # this rank's CPU threads and why (share_cores); the plan prints it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def share_cores(ctx: DistContext, local_procs: int) -> str:
    """This rank's share of the host's cores for torch's threads (cores // ranks on this host, at least 1), so that
    ranks on one CPU do not fight over them; OMP_NUM_THREADS, when set, is kept. Returns the plan's line."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if os.environ.get("OMP_NUM_THREADS"):
        why = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    else:
        torch.set_num_threads(max(1, cores // local_procs))
        why = f"{cores} cores shared by {local_procs} rank{'s' if local_procs > 1 else ''} on this host"
    wait = os.environ.get("OMP_WAIT_POLICY")
    if wait is None and local_procs > 1 and ctx.device.type == "cpu":
        wait = "unset (idle threads spin: export OMP_WAIT_POLICY=PASSIVE before the launcher)"
    return f"CPU threads per rank {torch.get_num_threads()} ({why}), OMP_WAIT_POLICY {wait or 'unset'}"


def shutdown(ctx: DistContext) -> None:
    """Close the process group (gloo's threads live on until the process ends: see process_end.end_process)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


# ---- small collectives; all of them are no-ops in a single process ---------------------------------------------
def all_reduce_sum(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over all ranks, in place (every rank gets the sum); one process: as it is."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(ctx: DistContext, obj: Any) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_tensors(ctx: DistContext, tensors: list, group=None) -> None:
    """Every rank of `group` (default: all ranks) takes its first rank's values of `tensors`, in place."""
    if not ctx.distributed:
        return
    src = 0 if group is None else dist.get_global_rank(group, 0)
    for t in tensors:
        dist.broadcast(t, src=src, group=group)


def broadcast_object(ctx: DistContext, obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()
