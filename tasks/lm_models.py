"""The causal language models of gpt2_lm, built by configuration, and what the model section's shape keys mean for
the other text tasks.

model.arch picks the decoder: `gpt2` (transformers' GPT2LMHeadModel: learned positions, LayerNorm, exact-GELU MLP
of 4 x width) or `llama` (LlamaForCausalLM: rotary positions, RMSNorm, SwiGLU MLP of 8/3 x width rounded up to a
multiple of 64, no biases by default). model.layers, heads and width size it (null: model.name's preset), the
context is data.max_length positions, model.dropout its dropout (llama has dropout on attention weights only),
model.bias and model.tie_embeddings its biases and output layer. With model.pretrained_dir the folder's model is
loaded as it is, and a shape key that disagrees with it is refused in one line.

Also here, for the tasks: the model as a pipeline chain (pipeline_layers) and its tensor-parallel plan (tp_plan).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from core.errors import ConfigError, DataError
from core.file_names import shown_name
from strategies.tp import PerRankDropout
from tasks.base import PipelineLayer
from tasks.gpt2_tp import gpt2_plan
from tasks.text_common import WEIGHTS_DTYPE, check_pretrained_dir, load_report, pretrained_dropout

# -----> the sizes model.name names (a shape key set in the model section overrides its preset value).
PRESETS = {
    "gpt2": dict(layers=12, heads=12, width=768),
    "tiny": dict(layers=2, heads=2, width=64),
}
SHAPE_KEYS = ("layers", "heads", "width")
PRESET_WORDS = {k: (k,) for k in SHAPE_KEYS}  # PRESETS name them as the model section does


def build_causal_lm(cfg, vocab_size: int, eos_id: int) -> nn.Module:
    """The model of a gpt2_lm run: model.pretrained_dir's, or a random one of the configured shape."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    m = cfg.model
    if m.pretrained_dir:
        return load_causal_lm(cfg)
    s, dropout = sized(cfg, PRESETS, PRESET_WORDS), m.random_dropout()
    tied = m.tie_embeddings is not False  # null: tied, as GPT-2 and nanoGPT are
    if (m.arch or "gpt2") == "gpt2":
        # "gelu": torch's one fused kernel (nanoGPT's); GPT-2's "gelu_new" is ~8 element-wise ops each way (slow).
        config = GPT2Config(vocab_size=vocab_size, n_positions=cfg.data.max_length, n_embd=s["width"],
                            n_layer=s["layers"], n_head=s["heads"], resid_pdrop=dropout, embd_pdrop=dropout,
                            attn_pdrop=dropout, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=tied,
                            activation_function="gelu")
        model = GPT2LMHeadModel(config)
        if m.bias is False:
            freeze_biases(model)
        return model
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=s["width"], intermediate_size=swiglu_width(s["width"]),
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["heads"], max_position_embeddings=cfg.data.max_length,
                         attention_bias=bool(m.bias), mlp_bias=bool(m.bias), attention_dropout=dropout,
                         bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def built_shape(cfg, model: dict, presets: dict, names: dict, arch: Optional[str] = None) -> dict:
    """`model`, a model section as a config holds it (saved with a checkpoint, or this run's), with each null shape
    key read as the value it builds: layers, heads and width model.name's preset in `presets` (in `names`' words, as
    sized takes them), bias the architecture's own (llama: none; the others: biases), tie_embeddings tied (GPT-2,
    nanoGPT and BERT are), arch `arch`; or, where it names a model.pretrained_dir, that folder's (cfg's)."""
    if model.get("pretrained_dir") and cfg.model.pretrained_dir:
        from transformers import AutoConfig
        folder = AutoConfig.from_pretrained(check_pretrained_dir(cfg.model.pretrained_dir), trust_remote_code=False)
        own = {**folder_shape(folder), "arch": folder.model_type}
    else:
        preset = presets.get(model.get("name") if isinstance(model.get("name"), str) else None, {})
        own = {key: preset[names[key][0]] for key in SHAPE_KEYS if names[key][0] in preset}
        own.update(bias=model.get("arch") != "llama", tie_embeddings=True, arch=arch)
    if arch is None:  # a task without model.arch: it stays as it is
        del own["arch"]
    return {**model, **{key: value for key, value in own.items() if key in model and model[key] is None}}


def swiglu_width(width: int) -> int:
    """Llama's MLP hidden units: 8/3 x width (three matrices with the parameters of GPT-2's two 4 x width ones),
    rounded up to a multiple of 64 (Llama rounds to 256) so that tensor-parallel degrees divide it."""
    return 64 * math.ceil(8 * width / 3 / 64)


def sized(cfg, presets: dict, names: dict) -> dict:
    """model.name's preset (keyword arguments of a transformers config) with the shape keys the model section
    sets put over it. `names` maps layers, heads, width (and mlp, 4 x width when width is set) to the config's
    own keywords. A name that is no preset is fine when all three keys are set."""
    m = cfg.model
    asked = {k: getattr(m, k) for k in SHAPE_KEYS}
    if m.name not in presets and None in asked.values():
        raise ConfigError(f"model.name: {cfg.task} builds {', '.join(presets)}, not {m.name!r} (or set all of "
                          "model.layers, model.heads and model.width)")
    kwargs = dict(presets.get(m.name, {}))
    if m.width is not None:
        asked["mlp"] = 4 * m.width
    for key, value in asked.items():
        if value is not None:
            kwargs.update(dict.fromkeys(names.get(key, ()), value))
    width, heads = kwargs[names["width"][0]], kwargs[names["heads"][0]]
    if width % heads:
        raise ConfigError(f"model.heads: {heads} heads do not divide the width {width} (model.width); each head "
                          "takes width / heads of it")
    return kwargs


def freeze_biases(model: nn.Module) -> None:
    """model.bias false for a transformers class that always has biases (GPT-2, BERT, BART): every bias, of the
    linear layers and the norms, becomes zeros that never train (no gradient, not in the optimizer). The model
    computes what a bias-free one does; the zeros stay in checkpoints and exports, so any loader reads them."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            with torch.no_grad():
                p.zero_()
            p.requires_grad_(False)


def load_causal_lm(cfg) -> nn.Module:
    """model.pretrained_dir's causal LM (GPT-2 or Llama), after checking the model section agrees with it."""
    from transformers import AutoConfig, GPT2LMHeadModel, LlamaForCausalLM
    folder = check_pretrained_dir(cfg.model.pretrained_dir)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    classes = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}
    if config.model_type not in classes:
        raise DataError(f"model.pretrained_dir: {shown_name(folder)} holds a {config.model_type} model; gpt2_lm builds "
                        f"{' and '.join(classes)} models")
    if cfg.model.arch not in (None, config.model_type):
        raise ConfigError(f"model.arch is {cfg.model.arch} but model.pretrained_dir holds a {config.model_type} "
                          f"model; set model.arch to null (or {config.model_type})")
    check_folder_shape(cfg, config)
    # -----> start from another causal LM checkpoint (a GPT-2 or Llama style Hugging Face folder).
    dropout = pretrained_dropout(cfg, config)
    with load_report(cfg):
        return classes[config.model_type].from_pretrained(folder, trust_remote_code=False, dtype=WEIGHTS_DTYPE,
                                                           **dropout)


def check_folder_shape(cfg, config) -> None:
    """A shape key set in the model section equals model.pretrained_dir's (transformers' common attribute names
    work for GPT-2, Llama, BERT and BART alike); null keys take the folder's."""
    m = cfg.model
    for key, value in folder_shape(config).items():
        if getattr(m, key) is not None and getattr(m, key) != value:
            raise ConfigError(f"model.{key} is {getattr(m, key)} but model.pretrained_dir's model has {value}; "
                              f"set it to null (the folder's) or {value}")


def folder_shape(config) -> dict:
    """The shape keys of a pretrained folder's transformers config (their common attribute names work for GPT-2,
    Llama, BERT and BART alike)."""
    return {"layers": config.num_hidden_layers, "heads": config.num_attention_heads, "width": config.hidden_size,
            "bias": getattr(config, "attention_bias", True), "tie_embeddings": config.tie_word_embeddings}


# ---- pipe and tp: the model as a chain of layers, and its tensor-parallel split ----------------------------------
def pipeline_layers(model: nn.Module, seq_shards: int = 1) -> list[nn.Module]:
    """The model as a chain: embeddings, the blocks, final norm + LM head (the model's forward without caches or
    padding masks: every block is a fixed-length causal window). A tied LM head shares its weight with the token
    embedding; under pipe each end holds a copy and their gradients are added up. seq_shards: dist.tp under
    sequence parallelism, where the blocks after the first receive 1 / seq_shards of the positions."""
    if hasattr(model, "transformer"):  # GPT-2
        t = model.transformer

        def embed(input_ids):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            return t.drop(t.wte(input_ids) + t.wpe(positions)[None])

        def head(hidden):
            return model.lm_head(t.ln_f(hidden))
        return [PipelineLayer(embed, t.wte, t.wpe, t.drop), *t.h, PipelineLayer(head, t.ln_f, model.lm_head)]
    return llama_pipeline_layers(model, seq_shards)


def llama_pipeline_layers(model: nn.Module, seq_shards: int = 1) -> list[nn.Module]:
    """Llama: each decoder layer computes its rotary position embeddings and causal mask itself (cheap), as
    LlamaModel.forward does once for all, so that no stage needs another's; each holds the (parameter-free)
    rotary module for it. Under sequence parallelism they are made for all the positions, which the attention
    all-gathers, not for the rank's own."""
    from transformers.masking_utils import create_causal_mask
    inner = model.model

    def block(layer, shards: int):
        def run(hidden):
            whole = hidden.new_empty(hidden.shape[0], hidden.shape[1] * shards, 1) if shards > 1 else hidden
            positions = torch.arange(whole.shape[1], device=hidden.device)[None]
            mask = create_causal_mask(config=model.config, inputs_embeds=whole, attention_mask=None,
                                      past_key_values=None, position_ids=positions)
            return layer(hidden, attention_mask=mask, position_ids=positions,
                         position_embeddings=inner.rotary_emb(whole, positions))
        return PipelineLayer(run, layer, inner.rotary_emb)

    def embed(input_ids):
        return inner.embed_tokens(input_ids)

    def head(hidden):
        return model.lm_head(inner.norm(hidden))
    # the first block cuts the positions (tp_plan's sequence_plan), so it receives them all
    return [PipelineLayer(embed, inner.embed_tokens),
            *[block(x, seq_shards if i else 1) for i, x in enumerate(inner.layers)],
            PipelineLayer(head, inner.norm, model.lm_head)]


def tp_plan(model: nn.Module, tp: int, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
    """Llama's split (torchtitan's, and LlamaConfig.base_model_tp_plan): q, k, v and the MLP's gate and up by
    columns, o and down by rows. Attention reshapes to (-1 heads, head size), so each rank computes heads / tp
    heads of its own with no change to the model. GPT-2's Conv1D layers and fused q|k|v: tasks/gpt2_tp.py.
    sequence_parallel: between blocks each rank keeps T / tp positions; loss_parallel: the head split by vocabulary
    (strategies/tp.py says both)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if hasattr(model, "transformer"):
        return gpt2_plan(model, tp, sequence_parallel, loss_parallel)
    c = model.config
    if c.num_attention_heads % tp or c.num_key_value_heads % tp or c.intermediate_size % tp:
        raise ConfigError(f"dist.tp: {tp} does not divide the model's {c.num_attention_heads} attention heads and "
                          f"{c.intermediate_size} MLP units; pick a divisor of both")
    if loss_parallel and model.lm_head.weight is model.model.embed_tokens.weight:  # splitting one would untie them
        raise ConfigError("dist.loss_parallel: the head shares its weight with the embedding (model.tie_embeddings), "
                          "which would split it too; use model.tie_embeddings: false, or dist.loss_parallel: false")
    layer = "model.layers.*."
    rows = Shard(1) if sequence_parallel else Replicate()  # a row split's output: summed whole, or summed and cut
    plan = {layer + f"self_attn.{x}_proj": ColwiseParallel() for x in "qkv"}
    plan.update({layer + f"mlp.{x}_proj": ColwiseParallel() for x in ("gate", "up")})
    plan.update({layer + f"{x}_proj": RowwiseParallel(output_layouts=rows) for x in ("self_attn.o", "mlp.down")})
    if sequence_parallel:
        plan.update(sequence_plan(layer))
    if loss_parallel:  # logits stay a DTensor split by vocabulary, for the loss under loss_parallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=rows, output_layouts=Shard(-1), use_local_output=False)
    if c.attention_dropout > 0:  # on each rank's own heads: its own masks (Llama has no other dropout)
        plan[layer + "self_attn"] = PerRankDropout(plan.get(layer + "self_attn"))
    return plan


def sequence_plan(layer: str) -> dict:
    """Sequence parallelism (Megatron-LM's, torchtitan's): the residual stream between blocks is cut along the
    positions, so the norms run on T / tp positions; the attention and MLP all-gather their input, and the row
    splits reduce-scatter their output (the same bytes as an all-reduce, in two halves)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel
    whole, cut = (Replicate(),), (Shard(1),)
    return {"model.layers.0": PrepareModuleInput(input_layouts=whole, desired_input_layouts=cut, use_local_output=True),
            layer + "input_layernorm": SequenceParallel(), layer + "post_attention_layernorm": SequenceParallel(),
            layer + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": cut[0]},
                                                    desired_input_kwarg_layouts={"hidden_states": whole[0]}),
            layer + "mlp": PrepareModuleInput(input_layouts=cut, desired_input_layouts=whole),
            "model.norm": SequenceParallel(use_local_output=True),
            # the head, whole or split by vocabulary, takes all positions (loss_parallel's plan replaces this)
            "lm_head": PrepareModuleInput(input_layouts=cut, desired_input_layouts=whole, use_local_output=True)}


def check_loss_parallel(cfg, fail) -> None:
    """dist.loss_parallel on gpt2_lm's own model, whose head is tied to the embedding unless model.tie_embeddings is
    false: said before the ranks start (tp_plan refuses it too, and a pretrained_dir's tying, once built)."""
    if cfg.task == "gpt2_lm" and cfg.dist.loss_parallel and not cfg.model.pretrained_dir \
            and cfg.model.tie_embeddings is not False:
        fail("dist.loss_parallel", "splits the head by vocabulary, but it shares its weight with the embedding "
                                   "(model.tie_embeddings, tied by default), which would split it too; use "
                                   "model.tie_embeddings: false, or dist.loss_parallel: false")


def check_config(cfg, fail) -> None:
    """The model section's shape keys, set (config.validate asks): only the tasks that build a model by them take
    them; elsewhere they are refused, not ignored."""
    m, shaped = cfg.model, ("gpt2_lm", "bert_pretrain", "sst2")
    for key in ("layers", "heads", "width"):
        if getattr(m, key) is not None and getattr(m, key) < 1:
            fail(f"model.{key}", f"must be >= 1 (or null: the preset's), got {getattr(m, key)}")
    if m.heads and m.width and m.width % m.heads:
        fail("model.heads", f"({m.heads}) must divide model.width ({m.width}): each head takes width / heads of it")
    if m.arch is not None and cfg.task != "gpt2_lm":
        fail("model.arch", f"is {m.arch}, but only gpt2_lm picks its architecture by it; remove it for {cfg.task}")
    for key in ("layers", "heads", "width", "bias", "tie_embeddings"):
        if getattr(m, key) is not None and cfg.task not in shaped:
            fail(f"model.{key}", f"is for the transformer tasks ({', '.join(shaped)}), not {cfg.task}; remove it")
    if m.tie_embeddings is not None and cfg.task == "sst2":
        fail("model.tie_embeddings", "is for models with an output layer over the vocabulary (gpt2_lm, "
                                     "bert_pretrain), not sst2's classifiers; remove it")
