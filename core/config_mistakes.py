"""The words of a config mistake: "did you mean" and the expected types. Loaded only when a config is wrong."""
from __future__ import annotations

import difflib
import typing
from typing import Literal, Union

from core.config_yaml import shown, shown_text


def unknown_key(source: str, prefix: str, key: str, valid: list[str]) -> str:
    close = closest(key, valid)
    hint = f" (did you mean `{prefix}{close}`?)" if close else f" (valid keys: {', '.join(valid)})"
    return f"{source}: unknown key `{prefix}{shown_text(key)}`{hint}"


def closest(key: str, valid: list[str]):
    """The valid key the user most likely meant: one the key extends by a word (`lr_rate`: lr, even though
    min_lr_ratio is spelled closer), else a near spelling, else one that the key starts with."""
    extended = [v for v in valid if key.startswith(v + "_")]
    if extended:
        return max(extended, key=len)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return close[0]
    starts = [v for v in valid if key.startswith(v) or v.startswith(key)]
    return max(starts, key=len) if starts else None


def wrong_type(source: str, key: str, value, hint) -> str:
    options = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    return f"{source}: `{key}` must be {' or '.join(type_name(a) for a in options)}, got {shown(value)}"


def type_name(hint) -> str:
    if typing.get_origin(hint) is Literal:  # e.g. inside Optional: "one of gpt2, llama or null"
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
            type(None): "null", dict: "a mapping"}.get(hint, str(hint))
