"""train.async_save for the replicated strategies (none, dp, ddp): rank 0 copies model and optimizer state to the
host now (the save's only stall) and a thread writes them while training goes on. fsdp and pipe use DCP's
async_save instead (strategies/fsdp.py)."""
from __future__ import annotations

import os
import threading
from typing import Callable

import torch

from core import checkpoint
from core.model_parts import state_to_save
from strategies.base import Strategy


def start_save(strategy: Strategy, directory: str) -> Callable[[], None]:
    """Start writing model.pt and optimizer.pt into `directory`; return a wait() for the writer."""
    if not strategy.ctx.is_main:
        return lambda: None
    model, optimizer = host_copy(state_to_save(strategy.raw_model)), host_copy(strategy.optimizer.state_dict())

    def write():  # and flush to disk here, so that publishing (fsync, rename) holds the loop only briefly
        for obj, name in ((model, "model.pt"), (optimizer, "optimizer.pt")):
            torch.save(obj, os.path.join(directory, name))
            checkpoint.fsync(os.path.join(directory, name))
    return in_thread(write)


def host_copy(obj):
    """A copy of a (nested) state dict whose tensors are on the host and belong to no one else: what a background
    writer may read while training changes the originals."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


def in_thread(work: Callable[[], None]) -> Callable[[], None]:
    """Run `work` in a thread; return a wait() that joins it and raises what it raised."""
    failed = []

    def run():
        try:
            work()
        except BaseException as e:  # handed to wait(), which raises it in the training thread
            failed.append(e)
    thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
    thread.start()

    def wait():
        thread.join()
        if failed:
            raise failed[0]
    return wait
