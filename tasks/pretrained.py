"""model.pretrained_dir: the Hugging Face folder a run starts from, resolved (`pkg:`) and checked. Loaded only by
runs that set it (wiring.READER_CHECKS)."""
from __future__ import annotations

import importlib.util
import os

from tasks.untrusted_folders import refuse_custom_code


def check_config(cfg, fail) -> None:
    """model.pretrained_dir, set (config.validate asks): the folder the run will read, which must exist."""
    m = cfg.model
    m.pretrained_dir = resolve_package_path(m.pretrained_dir)
    if not os.path.isdir(m.pretrained_dir):
        fail("model.pretrained_dir", f"{m.pretrained_dir!r} is not a folder: download a model into it where the "
                                     "Hugging Face hub is reachable (python scripts/download_pretrained.py HUB_ID "
                                     f"{m.pretrained_dir}; with no arguments it fetches facebook/bart-base into "
                                     "pretrained/bart-base), or set null for a random model")
    refuse_custom_code(m.pretrained_dir)  # before any rank starts, and before transformers could prompt


def resolve_package_path(path: str) -> str:
    """`pkg:name/sub/dir` -> that folder inside the installed package `name`; other paths unchanged."""
    if not path.startswith("pkg:"):
        return path
    package, _, sub = path[4:].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return path  # reported as "not a folder" by check_config
    return os.path.join(list(spec.submodule_search_locations)[0], sub)
