"""model.activation_checkpointing: each block (model_blocks: the members of the model's nn.ModuleLists, i.e. the
transformer layers, which FSDP also shards as units) keeps only its input in forward and recomputes its activations
during backward: less memory for about one more forward pass. Dropout draws the same masks again (the RNG state is
saved), so the gradients are the same. Applied before the strategy wraps the model: FSDP2 gathers a block's parameters
before its backward, hence before the recomputation."""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from core.errors import ConfigError


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, innermost first: what FSDP shards as units of their own (one all-gather each) and
    activation checkpointing recomputes. Every member of an nn.ModuleList, i.e. the blocks of a transformer
    (BERT's encoder.layer, BART's encoder.layers and decoder.layers, GPT-2's h); FSDP's root takes the rest."""
    units = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    return units[::-1]


def apply_ac(model: nn.Module, task: str) -> int:
    """Make every block of `model` recompute its activations in backward; returns the number of blocks."""
    blocks = model_blocks(model)
    if not blocks:
        raise ConfigError(f"model.activation_checkpointing: the {task} model has no blocks to recompute (no "
                          "nn.ModuleList of layers); set it to false")
    for block in blocks:  # instance attribute: the module's own hooks (FSDP2's) still run around it
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)
