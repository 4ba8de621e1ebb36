"""Tensor parallelism for Hugging Face's GPT-2 (gpt2_lm with model.arch gpt2): Megatron-LM's split of its blocks.

GPT-2's linear layers are transformers' Conv1D, whose weight is stored (in, out), the transpose of nn.Linear's, so
DTensor's ColwiseParallel and RowwiseParallel (nn.Linear only) get two small subclasses here that cut the other
dimension. attn.c_attn computes q, k and v in one matrix whose output columns are [q | k | v]: a plain column split
would give rank 0 all of q and half of k. Its weight is split with _StridedShard(split_factor=3) instead: each
third is cut over the tp group, so rank r holds [q_r | k_r | v_r], the q, k and v of its own heads, while the
DTensor's global value stays the one-process weight (checkpoints keep the one-process layout; DCP takes such a
tensor as a plain split copy: strategies/fsdp.state_in_dcp_boxes). The attention then cuts its local output in three of
width / tp columns (split_size) and views them as heads / tp heads. dist.sequence_parallel and dist.loss_parallel
work as in Llama's plan (tasks/lm_models.tp_plan). Imported only by runs with dist.tp > 1.
"""
from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.placement_types import _StridedShard

from core.errors import ConfigError
from strategies.tp import PerRankDropout


def gpt2_plan(model: nn.Module, tp: int, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
    """c_attn (q|k|v, by heads) and mlp.c_fc by columns, attn.c_proj and mlp.c_proj by rows; embeddings, norms and
    the head whole. sequence_parallel and loss_parallel as in Llama's plan (tasks/lm_models.tp_plan)."""
    c = model.config
    hidden = c.n_inner or 4 * c.n_embd
    if c.n_head % tp or hidden % tp:
        raise ConfigError(f"dist.tp: {tp} does not divide the model's {c.n_head} attention heads and {hidden} MLP "
                          "units; pick a divisor of both")
    if loss_parallel and model.lm_head.weight is model.transformer.wte.weight:  # splitting one would untie them
        raise ConfigError("dist.loss_parallel: the head shares its weight with the embedding (model.tie_embeddings), "
                          "which would split it too; use model.tie_embeddings: false, or dist.loss_parallel: false")
    block = "transformer.h.*."
    whole, cut = Replicate(), Shard(1)  # the residual stream between blocks: all positions, or T / tp of them
    rows = cut if sequence_parallel else whole  # a row split's output: summed whole, or summed and cut
    heads = LocalHeads(input_layouts=cut, desired_input_layouts=whole) if sequence_parallel else LocalHeads()
    plan = {block + "attn": heads, block + "attn.c_attn": Conv1DColwise(parts=3),
            block + "attn.c_proj": Conv1DRowwise(output_layouts=rows), block + "mlp.c_fc": Conv1DColwise(),
            block + "mlp.c_proj": Conv1DRowwise(output_layouts=rows)}
    if sequence_parallel:  # cut after the embeddings' dropout; norms on T / tp positions; the head takes them all
        plan.update({"transformer.drop": PrepareModuleOutput(output_layouts=whole, desired_output_layouts=cut,
                                                             use_local_output=True),
                     block + "ln_1": SequenceParallel(), block + "ln_2": SequenceParallel(),
                     block + "mlp": PrepareModuleInput(input_layouts=cut, desired_input_layouts=whole),
                     "transformer.ln_f": SequenceParallel(),  # a DTensor: GPT2Model views it as [B, T, D]
                     "lm_head": PrepareModuleInput(input_layouts=cut, desired_input_layouts=whole,
                                                   use_local_output=True)})
    if loss_parallel:  # logits stay a DTensor split by vocabulary, for the loss under loss_parallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=rows, output_layouts=Shard(-1), use_local_output=False)
    return own_dropout(plan, c, sequence_parallel)


def own_dropout(plan: dict, c, sequence_parallel: bool) -> dict:
    """Each rank draws its own dropout masks where the data is split (strategies/tp.PerRankDropout): the attention
    probabilities of its heads, up to c_proj, whose output resid_dropout sees whole; under sequence parallelism
    the whole attention and the MLP's dropout, on its own positions. The embeddings' dropout runs whole."""
    block = "transformer.h.*."
    if c.attn_pdrop > 0 or (sequence_parallel and c.resid_pdrop > 0):
        plan[block + "attn"] = PerRankDropout(plan[block + "attn"], until=None if sequence_parallel else "c_proj")
    if sequence_parallel and c.resid_pdrop > 0:
        plan[block + "mlp.dropout"] = PerRankDropout()
    return plan


class LocalHeads(PrepareModuleInput):
    """GPT2Attention on this rank's heads: its q|k|v output is 3 x width / tp wide (c_attn's local columns). With
    input layouts (sequence parallelism), its input is gathered first."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module.split_size //= mesh.size()
        module.num_heads //= mesh.size()
        return super()._apply(module, mesh) if self.input_layouts else module


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
        if strided and module.bias.requires_grad:  # its gradient comes out split like the columns; whole again
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
