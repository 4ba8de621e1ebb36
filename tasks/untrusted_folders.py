"""A Hugging Face folder read as untrusted data: no code from it runs and no pickle in it executes.

transformers runs a folder's own .py files when its config.json or tokenizer_config.json maps a class through
`auto_map` and its model_type is one transformers does not know (after asking "Do you wish to run the custom
code?" on stdin). Every load in this project passes trust_remote_code=False; such a folder is refused here first,
in one line. Pickled weights (`pytorch_model*.bin`) are read with torch.load(weights_only=True) before transformers
reads them, so a pickle that would import anything else is refused in one line too.
"""
from __future__ import annotations

import json
import os
import pickle
import re
from typing import Optional

from core.errors import DataError
from core.file_names import shown_name

PICKLED_WEIGHTS = ("pytorch_model", ".bin")  # transformers' names: pytorch_model.bin, pytorch_model-00001-of-2.bin


def check_folder(folder: str, key: str = "model.pretrained_dir") -> None:
    """Refuse, in one DataError line naming `key` and the folder, a folder that needs custom code, whose pickled
    weights would run code, or whose JSON or safetensors files are damaged or missing (a copy cut short)."""
    check_json_files(folder, key)
    refuse_custom_code(folder, key)
    check_pickled_weights(folder, key)
    check_safetensors(folder, key)
    check_weight_indexes(folder, key)


def refuse_custom_code(folder: str, key: str = "model.pretrained_dir") -> None:
    """A folder whose auto_map names a class of its own for a model type transformers does not know: loading it
    would need its .py files to run (transformers imported only then)."""
    config, tokenizer = read_json(folder, "config.json"), read_json(folder, "tokenizer_config.json")
    entry = next(((name, data["auto_map"]) for name, data in (("config.json", config),
                                                              ("tokenizer_config.json", tokenizer))
                  if isinstance(data.get("auto_map"), dict) and data["auto_map"]), None)
    if entry is None:
        return
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in known_model_types():
        return  # transformers' own class is used (trust_remote_code=False): the folder's .py files are ignored
    name, auto_map = entry
    cls, target = next(iter(auto_map.items()))
    shown = f"{cls} -> {target}" if isinstance(target, str) else f"{cls} -> {json.dumps(target)}"
    what = f"model_type {str(model_type)[:40]!r}" if model_type is not None else "no model_type"
    raise DataError(f"{key}: {shown_name(folder)} needs code of its own to load ({name}'s auto_map: {shown[:80]}; "
                    f"{what} is not one transformers knows); this trainer never runs code from a model folder: use a "
                    "folder of a model type transformers supports")


# The JSON files transformers reads from a model or tokenizer folder (and the indexes of sharded weights).
READ_JSON = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "added_tokens.json", "vocab.json", "preprocessor_config.json")


def check_json_files(folder: str, key: str = "model.pretrained_dir") -> None:
    """Each JSON file of the folder that transformers reads parses: one cut short or damaged is one line naming its
    line and column, not an OSError or JSONDecodeError traceback from inside transformers."""
    try:
        names = sorted(n for n in os.listdir(folder) if n in READ_JSON or n.endswith(".index.json"))
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{key}: {shown_name(path)}:{e.lineno}: not valid JSON at column {e.colno} ({e.msg}); "
                            "copy the folder again") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{key}: {shown_name(path)}: unreadable ({first_words(e)})") from None


def known_model_types() -> set:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return set(CONFIG_MAPPING_NAMES)


def read_json(folder: str, name: str) -> dict:
    """A folder's JSON file as a dict ({} when absent or unreadable: transformers says what is wrong with it)."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def files_named(folder: str, wanted) -> list[str]:
    """The paths of the folder's files whose names `wanted` accepts, sorted (none if the folder cannot be listed)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if wanted(n) and os.path.isfile(os.path.join(folder, n))]


def check_pickled_weights(folder: str, key: str = "model.pretrained_dir") -> None:
    """Each pytorch_model*.bin of the folder loaded with weights_only=True (memory-mapped where torch can: the
    tensors are not read): one that holds anything but tensors and plain containers is refused in one line."""
    import torch
    for path in files_named(folder, lambda n: n.startswith(PICKLED_WEIGHTS[0]) and n.endswith(PICKLED_WEIGHTS[1])):
        why = pickle_problem(torch, path)
        if why:
            raise DataError(f"{key}: {shown_name(path)}: refused: {why}; pickled weights are loaded only with "
                            "torch.load(weights_only=True) (or use a folder with model.safetensors)")


def check_safetensors(folder: str, key: str = "model.pretrained_dir") -> None:
    """Each .safetensors file of the folder opened (its header read and checked to cover the file; the tensors are
    memory-mapped, not read): one cut short or with a damaged header is refused in one line, not a traceback from
    inside from_pretrained."""
    from safetensors import SafetensorError, safe_open
    for path in files_named(folder, lambda n: n.endswith(".safetensors")):
        try:
            with safe_open(path, "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise DataError(f"{key}: {shown_name(path)}: not a readable safetensors file ({first_words(e)}); copy it "
                            "again from where it came") from None


def check_weight_indexes(folder: str, key: str = "model.pretrained_dir") -> None:
    """Every file a sharded checkpoint's index (model.safetensors.index.json, pytorch_model.bin.index.json) names is
    in the folder: a download that stopped half-way is one line, not a FileNotFoundError from inside from_pretrained."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".index.json"))
    except OSError:
        return
    for name in names:
        weight_map = read_json(folder, name).get("weight_map")
        files = sorted({str(f) for f in weight_map.values()}) if isinstance(weight_map, dict) else []
        outside = [f for f in files if os.path.basename(f) != f or f in (".", "..")]  # ../x, /x: read from elsewhere
        if outside:
            raise DataError(f"{key}: {shown_name(os.path.join(folder, name))} names {shown_name(outside[0][:80])}, "
                            "outside the folder; a shard is a file name in the folder itself")
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise DataError(f"{key}: {shown_name(os.path.join(folder, name))} names {shown_name(missing[0][:80])}, "
                            f"which is not in the folder ({len(missing)} of its {len(files)} files missing); copy the "
                            "folder again")


def pickle_problem(torch, path: str) -> Optional[str]:
    """Why torch.load(path, weights_only=True) refuses the file, in one short phrase; None if it loads."""
    try:
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # not a zip file (the legacy format) cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch: "... unsupported GLOBAL posix.system whose module ..."
        return f"it would import {found.group(1)[:80]}" if found else f"not plain weights ({first_words(e)})"
    except Exception as e:  # a truncated or foreign file
        return f"cannot be loaded ({': '.join(filter(None, (type(e).__name__, first_words(e))))})"
    return None


def first_words(e: BaseException) -> str:
    """The first line of `e` that says what is wrong (torch's weights_only errors open with general advice)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(("Weights only load failed", "Please file an issue",
                                                                  "Check the documentation"))]
    return (said or lines or [""])[0][:80]
