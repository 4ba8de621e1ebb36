"""Tensor parallelism for Hugging Face's GPT-2 (gpt2_lm with model.arch gpt2): Megatron-LM's split of its blocks.

GPT-2's linear layers are transformers' Conv1D, whose weight is stored (in, out), the transpose of nn.Linear's, so
DTensor's ColwiseParallel and RowwiseParallel (nn.Linear only) get two small subclasses here that cut the other
dimension. attn.c_attn computes q, k and v in one matrix whose output columns are [q | k | v]: a plain column split
would give rank 0 all of q and half of k. Its weight and bias are split with _StridedShard(split_factor=3) instead:
each third is cut over the tp group, so rank r holds [q_r | k_r | v_r], the q, k and v of its own heads, while the
DTensor's global value stays the one-process weight. The attention then cuts its local output in three of
width / tp columns (split_size) and views them as heads / tp heads. Imported only by runs with dist.tp > 1.
"""
from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from config import ConfigError


def gpt2_plan(model: nn.Module, tp: int) -> dict:
    """c_attn (q|k|v, by heads) and mlp.c_fc by columns, attn.c_proj and mlp.c_proj by rows; embeddings, norms and
    the head whole."""
    c = model.config
    hidden = c.n_inner or 4 * c.n_embd
    if c.n_head % tp or hidden % tp:
        raise ConfigError(f"dist.tp: {tp} does not divide the model's {c.n_head} attention heads and {hidden} MLP "
                          "units; pick a divisor of both")
    block = "transformer.h.*."
    return {block + "attn": LocalHeads(), block + "attn.c_attn": Conv1DColwise(parts=3),
            block + "attn.c_proj": Conv1DRowwise(), block + "mlp.c_fc": Conv1DColwise(),
            block + "mlp.c_proj": Conv1DRowwise()}


class LocalHeads(ParallelStyle):
    """GPT2Attention on this rank's heads: its q|k|v output is 3 x width / tp wide (c_attn's local columns)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module.split_size //= mesh.size()
        module.num_heads //= mesh.size()
        return module


def distribute(module: nn.Module, mesh: DeviceMesh, placements: dict) -> None:
    """Replace the module's parameters by DTensors split as `placements` says ({name: placement})."""
    for name, placement in placements.items():
        p = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [placement]),
                                                     requires_grad=p.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for a Conv1D: weight (in, out) split along dim 1, bias along dim 0. With parts > 1 (c_attn:
    q|k|v) each part of the weight's columns is split over the group, so a rank's columns are its piece of each
    part; the bias then stays whole (FSDP2 would shard its only dimension again, across the strides, and label the
    pieces wrongly), and each rank adds its own columns of it."""

    def __init__(self, parts: int = 1):
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        strided = self.parts > 1
        split = {"weight": _StridedShard(1, split_factor=self.parts) if strided else Shard(1),
                 "bias": Replicate() if strided else Shard(0)}
        module = distribute_module(
            module, mesh, lambda _, m, mesh: distribute(m, mesh, split),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            lambda _, output, mesh: output.to_local())  # this rank's columns, in their own layout: no communication
        if strided:  # its gradient comes out split like the columns; whole again, as the parameter is
            module.bias.register_hook(lambda grad: grad.redistribute(placements=[Replicate()]))
        return module


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for a Conv1D: weight (in, out) split along dim 0 (its input rows), bias whole (added once,
    after the all-reduce of the partial products)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, mesh, lambda _, m, mesh: distribute(m, mesh, {"weight": Shard(0), "bias": Replicate()}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
