"""How a rank joins the others: its device, then the process group (torch.distributed's), met over tcp:// or a
file:// after a roll call (every node must count and place the ranks alike: core/roll_call.py), or over torchrun's
env://. Works under our own spawn, torchrun and SLURM; the context it returns, and the collectives:
core/distributed.py.
"""
from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import Callable, Optional
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from core.distributed import DistContext
from core.errors import ConfigError
from core.roll_call import not_met, roll_call
from core.store_call import StoreCall, TimedStore

STORE_SILENT_S = 60  # a store call unanswered this long (or dist.timeout_s if less): the link is down


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
        while_waiting(lambda given_up: join_group(backend, rendezvous, rank, world_size, cfg, device, given_up),
                      lambda seconds: waiting(seconds, rendezvous))
    except (dist.DistStoreError, dist.DistNetworkError) as e:
        raise not_met(d, rank, world_size, rendezvous, e) from None
    return DistContext(rank, world_size, local_rank, device, backend, rendezvous)


def join_group(backend: str, rendezvous: str, rank: int, world_size: int, cfg, device: torch.device,
               given_up: threading.Event) -> None:
    """The process group. Over tcp:// or a file:// the ranks first answer a roll call in the store (roll_call.py), since
    the store counts arrivals only: nodes that count the ranks differently would meet, then wait at the first
    collective. `given_up`: set when this rank stops waiting (while_waiting)."""
    timeout = datetime.timedelta(seconds=cfg.dist.timeout_s)
    silent_s = min(cfg.dist.timeout_s, STORE_SILENT_S)
    address = urlparse(rendezvous)
    tcp = address.scheme == "tcp"
    where, host = (f"{address.hostname}:{address.port}", "node 0") if tcp else (rendezvous, "a disk")
    if tcp:
        if rank != 0:
            wait_for_store_host(address.hostname, address.port, cfg.dist.timeout_s, given_up)
        # (what took the connection may never answer: a frozen rank 0, whose kernel still accepts, or another program)
        store = StoreCall(lambda: dist.TCPStore(address.hostname, address.port, is_master=rank == 0, timeout=timeout,
                                                wait_for_workers=False, multi_tenant=True),
                          "connect", where, host).result(silent_s)
    elif address.scheme == "file":
        # as init_method="file://..." makes it: the file is removed once world_size clients have closed it
        store = dist.FileStore(address.path, world_size)
        store.set_timeout(timeout)
    else:  # torchrun's env:// (its agents agreed on the world)
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size, timeout=timeout)
        return
    roll_call(TimedStore(store, silent_s, where, host) if tcp else store, rank, world_size, cfg, given_up, rendezvous)
    # torch gives up on the group's store calls (in C++, not timed) after dist.timeout_s: unanswered a store call's
    # time more, the store's host, or the link to it, is down
    StoreCall(lambda: form_group(backend, store, rank, world_size, timeout, device), "init_process_group", where,
              host).result(cfg.dist.timeout_s + silent_s)


def form_group(backend: str, store, rank: int, world_size: int, timeout: datetime.timedelta,
               device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # (the current GPU is the thread's own)
    # the prefix init_method="tcp://..." or "file://..." would give the group's keys
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size,
                            timeout=timeout)


def wait_for_store_host(host: str, port: int, timeout_s: float, given_up: threading.Event) -> None:
    """Poll until rank 0's store takes connections, for at most timeout_s. TCPStore's own connect tries again past
    its timeout (about twice dist.timeout_s in all, torch 2.13), printing each failed try with C++ stack frames."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:  # refused (node 0 not started yet), no route, timed out: try again until the deadline
            if time.monotonic() >= deadline or given_up.is_set():
                raise dist.DistNetworkError(f"nothing took a connection at {host}:{port} in {timeout_s:g} s "
                                            f"({e.strerror or type(e).__name__})") from None
        time.sleep(0.2)


def while_waiting(join: Callable[[threading.Event], None], waiting: Callable[[float], None]) -> None:
    """join(given_up) in a thread of its own, calling waiting(seconds) every half second from this one: in C++, the
    wait for the other ranks would hold off a signal's handler (Ctrl-C) until it ended, up to dist.timeout_s later.
    If waiting raises, given_up is set: the roll call's polling ends, and with it the store rank 0 hosts (left
    running at exit, its thread aborts the process: "terminate called without an active exception")."""
    failed: list = []
    given_up = threading.Event()

    def run():
        try:
            join(given_up)
        except BaseException as e:
            failed.append(e)
    thread, start = threading.Thread(target=run, name="join-process-group", daemon=True), time.monotonic()
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
            if thread.is_alive():
                waiting(time.monotonic() - start)
    except BaseException:
        given_up.set()
        thread.join(0.5)  # (a rank blocked in the store's C++ wait stays blocked: a daemon thread, ended with us)
        raise
    if failed:  # a stop asked meanwhile is what to say: the other ranks left for it, which failed the join
        waiting(time.monotonic() - start)
        raise failed[0]
