"""Parts of a model that strategies and checkpoints treat apart: under LoRA (tasks/lora.py) the part that trains,
which is all a checkpoint holds besides a reference to the frozen base, and what the weight average follows."""
from __future__ import annotations

import torch


def trains_part(model: torch.nn.Module) -> bool:
    """Whether only some of the model trains (LoRA's adapters and head), so checkpoints hold just that part."""
    return getattr(model, "lora_base", None) is not None


def trained_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def state_to_save(model: torch.nn.Module) -> dict:
    """What a checkpoint holds of the model: its state dict, or under LoRA the entries that train."""
    state = model.state_dict()
    if trains_part(model):
        names = trained_names(model)
        state = {k: v for k, v in state.items() if k in names}
    return state


def averaged_entries(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """train.ema_decay: what the weight average follows, by the names model.pt uses: the trainable parameters and
    the floating-point buffers saved beside them (BatchNorm's running statistics, which timm and Lightning average
    too: the averaged weights are then evaluated with statistics of their own; an integer count is left live)."""
    saved = set() if trains_part(model) else set(model.state_dict())  # (LoRA saves no buffer)
    entries = {name: p for name, p in model.named_parameters() if p.requires_grad}
    entries.update({name: b for name, b in model.named_buffers() if name in saved and b.is_floating_point()})
    return entries


def lora_base_entry(model: torch.nn.Module) -> dict:
    """meta.json's reference to the frozen base the checkpoint's adapters were trained on ({} without LoRA)."""
    return {"lora_base": model.lora_base} if trains_part(model) else {}
