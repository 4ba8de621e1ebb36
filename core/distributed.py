"""Who am I among the processes, and how do we talk. Works under our own spawn, torchrun and SLURM.

Rank layout: node k runs procs_per_node[k] processes; global rank = sum(procs_per_node[:k]) + local rank.
Nodes may run different numbers of processes (a borrowed mix of lab machines).
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from core.errors import ConfigError, UserError, first_line


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


def pick_device_type(device: str) -> str:
    """dist.device as `cpu` or `cuda` (auto: cuda where there is one)."""
    return "cpu" if device == "cpu" or (device == "auto" and not torch.cuda.is_available()) else "cuda"


def pick_device(device: str, local_rank: int) -> torch.device:
    if pick_device_type(device) == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def init(cfg, rank: int, world_size: int, local_rank: int, rendezvous: Optional[str] = None,
         waiting: Callable[[float, str], None] = lambda seconds, where: None) -> DistContext:
    """Join the process group (strategies that need one) and return this process's context. While the ranks meet,
    `waiting(seconds so far, where)` is called every half second (it may raise: a stop signal, resilience/)."""
    d = cfg.dist
    if d.strategy in ("none", "dp"):
        return DistContext(0, 1, 0, pick_device(d.device, local_rank), None)
    device_type = pick_device_type(d.device)
    backend = d.backend if d.backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and local_rank >= torch.cuda.device_count():
        # NCCL refuses two ranks on one GPU, and it says so only after the ranks have met, as a traceback.
        gpus = torch.cuda.device_count()
        raise ConfigError(f"dist.procs_per_node: this node runs more ranks than it has GPUs ({gpus}), and NCCL needs "
                          f"one GPU per rank; set dist.procs_per_node to at most {gpus}, or dist.backend=gloo")
    device = pick_device(d.device, local_rank)
    if rendezvous is None:
        if d.init_method.startswith("file://"):
            rendezvous = d.init_method
        else:
            rendezvous = f"tcp://{d.master_addr or '127.0.0.1'}:{d.master_port}"
    try:
        while_waiting(lambda: dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size,
                                                      timeout=datetime.timedelta(seconds=d.timeout_s)),
                      lambda seconds: waiting(seconds, rendezvous), device)
    except (dist.DistStoreError, dist.DistNetworkError) as e:
        raise not_met(d, rank, world_size, rendezvous, e) from None
    return DistContext(rank, world_size, local_rank, device, backend, rendezvous)


def not_met(d, rank: int, world_size: int, rendezvous: str, e: Exception) -> UserError:
    """The line for ranks that did not meet: a node not started, another address or port, or (at once, not after
    the timeout) rank 0 that cannot host the rendezvous on a port in use (srun's ranks are not checked before)."""
    if "EADDRINUSE" in str(e) and rendezvous.startswith("tcp://"):
        return UserError(f"rank {rank}: dist.master_port {d.master_port} is already in use on {socket.gethostname()} "
                         f"(another run?); pick a free one, e.g. --set dist.master_port={d.master_port + 1}")
    fix = (f"start all {d.nodes} nodes (dist.node_rank 0 to {d.nodes - 1}) with the same dist.master_addr and "
           "dist.master_port" if d.nodes > 1 and rendezvous.startswith("tcp://") else "start every rank")
    return UserError(f"rank {rank}: the {world_size} ranks did not all meet at {rendezvous} within dist.timeout_s="
                     f"{d.timeout_s} ({first_line(e)}); {fix}, or raise dist.timeout_s")


def while_waiting(join: Callable[[], None], waiting: Callable[[float], None], device: torch.device) -> None:
    """join() in a thread of its own, calling waiting(seconds) every half second from this one: in C++, the wait for
    the other ranks would hold off a signal's handler (Ctrl-C) until it ended, up to dist.timeout_s later."""
    failed: list = []

    def run():
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # (the current GPU is the thread's own)
            join()
        except BaseException as e:
            failed.append(e)
    thread, start = threading.Thread(target=run, name="join-process-group", daemon=True), time.monotonic()
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        if thread.is_alive():
            waiting(time.monotonic() - start)
    if failed:
        raise failed[0]


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
