"""train.ema_decay: an exponential moving average of the trainable parameters and the float buffers saved with them
(BatchNorm's running statistics), as timm's ModelEmaV2 and Lightning's EMAWeightAveraging keep it, updated after each
applied optimizer step: ema = decay * ema + (1 - decay) * weights.

Each rank averages the parameters it holds, in their own form: the whole model under none/dp/ddp/oss, its shards
under fsdp (DTensors: the average of a shard is the shard of the average), its stages' layers under pipe. A
checkpoint holds the average as a plain, whole state dict (ema.pt, by the names model.pt uses; under pipe the
stages' parts put together), so it loads under another strategy or world size as the weights do; test mode, export
and predict read it with test.weights: ema.
"""
from __future__ import annotations

import contextlib
import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor

from core.errors import CheckpointError


class WeightAverage:
    def __init__(self, params: dict, decay: float):
        """`params`: the tensors this rank averages (model_parts.averaged_entries), by the checkpoint model's names; a
        list under a name: the copies of one tied weight on this rank (pipe), the first averaged, all swapped in."""
        self.decay = decay
        self.copies = {name: p for name, p in params.items() if isinstance(p, list)}
        self.params = {name: p[0] if isinstance(p, list) else p for name, p in params.items()}
        self.average = {name: p.detach().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            self.average[name].lerp_(p.detach(), 1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        """The average in the model's parameters for a while (an evaluation), the trained weights back after."""
        with torch.no_grad():
            trained = {name: p.detach().clone() for name, p in self.params.items()}
            for name, p in self.params.items():
                for copy in self.copies.get(name, [p]):
                    copy.copy_(self.average[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    for copy in self.copies.get(name, [p]):
                        copy.copy_(trained[name])

    def state_dict(self) -> dict:
        """The whole average on the CPU, on every rank (a collective under fsdp: every rank calls it)."""
        return {name: whole(a).cpu() for name, a in self.average.items()}

    def load_state_dict(self, saved: dict, holds_all: bool = True) -> list[str]:
        """The saved average (ema.pt, checked for this model): each rank takes its part of it. `holds_all` false
        (pipe): this rank averages some of the model's entries, and takes those. Returns the buffers an older ema.pt
        did not average: their average starts from their loaded values."""
        buffers = {name for name, p in self.params.items() if not isinstance(p, nn.Parameter)}
        new = sorted(buffers - set(saved))
        mine = set(self.average) - set(new)
        if set(saved) != mine if holds_all else not mine <= set(saved):
            odd = sorted((mine ^ set(saved)) if holds_all else mine - set(saved))
            raise CheckpointError(f"ema.pt does not fit this model's trainable parameters ({odd[0]}, ...): resume "
                                  "without train.ema_decay, or start over")
        with torch.no_grad():
            for name, a in self.average.items():
                a.copy_(part_of(saved[name], a) if name in saved else self.params[name].detach())
        return new


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor's shards, gathered


def part_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` is: this rank's shard of it where `like` is a DTensor."""
    if hasattr(like, "device_mesh"):
        return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements)
    return full.to(like.device, like.dtype)


def load_into(model: nn.Module, ema: dict, path: str) -> None:
    """test.weights: ema: the average into a plain model (test mode, export, predict); an older ema.pt without the
    buffers leaves the model's own (model.pt's)."""
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    unknown = [name for name in ema if name not in own]
    if unknown:
        raise CheckpointError(f"{path}/ema.pt does not fit this model ({unknown[0]} is not one of its parameters)")
    with torch.no_grad():
        for name, a in ema.items():
            own[name].copy_(a)
