"""Signed checkpoints, optional: with a key (the environment's CHECKPOINT_SIGNING_KEY, else the file the config's
signing_key_file names), every save writes into meta.json an HMAC-SHA256 of its content (`signature`), which holds
the size and sha256 of every other file, and every load refuses a checkpoint whose signature is missing or wrong.

What each catches: the sha256 record alone, a file that changed by accident (rot, a truncated copy, an edit);
the signature also someone who rewrites a weight and its hash in meta.json without the key. Neither hides what a
checkpoint holds, stops whoever has the key, or tells an older signed checkpoint put back in place of a newer one.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Optional

from core.errors import ConfigError

ENV = "CHECKPOINT_SIGNING_KEY"
MAX_KEY_BYTES = 4096


def key(config: dict) -> Optional[bytes]:
    """The signing key, or None (checkpoints unsigned): CHECKPOINT_SIGNING_KEY, else the content of
    `config["signing_key_file"]` (`config`: a run's config as a dict, as meta.json holds it)."""
    if os.environ.get(ENV):
        return os.environ[ENV].encode()
    path = config.get("signing_key_file")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_BYTES).strip()
    except OSError as e:
        raise ConfigError(f"signing_key_file: {path}: cannot be read ({e.strerror or e})") from None
    if not data:
        raise ConfigError(f"signing_key_file: {path} is empty; put a secret in it (e.g. openssl rand -hex 32)")
    return data


def signature(meta: dict, secret: bytes) -> str:
    """HMAC-SHA256 of meta.json's content but its `signature`, written canonically (sorted keys, no spaces)."""
    body = json.dumps({k: v for k, v in meta.items() if k != "signature"}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False)
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def problem(path: str, meta: Optional[dict], secret: bytes) -> Optional[str]:
    """What is wrong with checkpoint `path`'s signature (`meta`: its meta.json, None if unreadable), or None."""
    full = os.path.join(path, "meta.json")
    given = (meta or {}).get("signature")
    if given is None:
        return (f"{full}: not signed, but {ENV} (or signing_key_file) is set: refused (saved without the key, or "
                "its signature was removed)")
    if not (isinstance(given, str) and hmac.compare_digest(given, signature(meta, secret))):
        return (f"{full}: the signature does not match (meta.json or a file's recorded hash was changed after the "
                "save, or another key signed it)")
    return None


def plan_line(config: dict) -> str:
    """What the plan says of it."""
    if key(config) is None:
        return f"checkpoints: sha256 of every file checked on load; not signed (set {ENV} to sign them)"
    where = ENV if os.environ.get(ENV) else f"signing_key_file {config['signing_key_file']}"
    return f"checkpoints: signed with HMAC-SHA256 (key from {where}); unsigned or changed ones are refused"
