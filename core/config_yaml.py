"""Reading YAML that may be hostile: a size cap, a nesting cap, a cap on values (aliases counted expanded, so a
"billion laughs" costs nothing), duplicate keys refused, and values shown cut. config.py turns a `Refused` into a
one-line ConfigError naming the file (or the --set item) and the line.
"""
from __future__ import annotations

import os
import re
import reprlib
from typing import Any, Optional

import yaml

MAX_BYTES = 1_000_000  # a config is a few KB; a bigger file is another file given by mistake (a corpus, a checkpoint)
MAX_DEPTH = 32         # a config nests 2 or 3 levels; PyYAML's composer recurses, so deep input ends in RecursionError
MAX_VALUES = 10_000    # scalars, lists and mappings, aliases expanded: a list per rank of a large cluster still fits


class Refused(Exception):
    """YAML this program will not read. `why` is one line; `line` counts from 1 (None: unknown)."""

    def __init__(self, why: str, line: Optional[int] = None):
        super().__init__(why)
        self.why, self.line = why, line


class NotYAML(Refused):
    """Text that does not parse as YAML (a --set value then stays a plain string)."""


def read_file(path: str) -> Any:
    """The YAML document in `path`, refused (Refused) when it is too large, binary or hostile."""
    size = os.stat(path).st_size
    if size > MAX_BYTES:
        raise Refused(f"{size:,} bytes; a parameters file holds at most {MAX_BYTES:,} (is it the right file?)")
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)  # a file still growing is read no further than the cap
    if len(data) > MAX_BYTES:
        raise Refused(f"more than {MAX_BYTES:,} bytes; a parameters file holds at most {MAX_BYTES:,}")
    if b"\0" in data:  # a binary file (a checkpoint, an archive) given as --params
        raise NotYAML("not valid YAML (it holds NUL bytes: a binary file, not a text file)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise NotYAML(f"not valid YAML (not UTF-8 text: byte {e.start} is {data[e.start]:#04x}; a binary file?)") \
            from None
    return parse(text)


def parse(text: str) -> Any:
    """The YAML document in `text` (a file's or one --set value's), within the caps above."""
    if len(text) > MAX_BYTES:
        raise Refused(f"{len(text):,} characters; a YAML value holds at most {MAX_BYTES:,}")
    loader = None
    try:
        loader = LOADER(text)  # (PureLoader's Reader refuses a NUL or other control character here)
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, 1, "", {}, set())
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise NotYAML(f"not valid YAML ({one_line(e.problem or e.context)})",
                      mark.line + 1 if mark else None) from None
    except yaml.reader.ReaderError as e:
        code = e.character[0] if isinstance(e.character, bytes) else e.character
        raise NotYAML(f"not valid YAML (character {code:#04x} at offset {e.position}: {e.reason})",
                      text.count("\n", 0, e.position) + 1) from None
    except yaml.YAMLError as e:
        raise NotYAML(f"not valid YAML ({one_line(e)})") from None
    except UnicodeError as e:  # (a --set value with bytes that are not UTF-8: libyaml cannot take it)
        raise NotYAML(f"not valid YAML ({one_line(e)})") from None
    except (ValueError, OverflowError) as e:  # e.g. an integer of more than 4300 digits (int()'s limit)
        raise Refused(f"holds a value Python cannot read ({one_line(e)})") from None
    finally:
        if loader is not None:
            loader.dispose()


class _Caps:
    """Composing (PyYAML's composer, which recurses) stops past MAX_DEPTH levels or MAX_VALUES nodes; what aliases
    add is counted after composing (_measure)."""

    depth = nodes = 0

    def compose_node(self, parent, index):
        line = self.peek_event().start_mark.line + 1
        self.nodes += 1
        if self.nodes > MAX_VALUES:
            raise Refused(f"more than {MAX_VALUES:,} values; a config holds a few hundred", line)
        if self.depth >= MAX_DEPTH:
            raise Refused(f"nested more than {MAX_DEPTH} levels deep; a config nests 2 or 3", line)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class PureLoader(_Caps, yaml.SafeLoader):
    """The capped loader in pure Python (where PyYAML has no libyaml)."""

    def fetch_flow_collection_start(self, token_class):
        # Here, in the scanner: each open `[` or `{` keeps a possible key that every later token re-checks.
        if self.flow_level >= MAX_DEPTH:
            raise Refused(f"nested more than {MAX_DEPTH} levels deep; a config nests 2 or 3", self.get_mark().line + 1)
        super().fetch_flow_collection_start(token_class)


# YAML 1.1 (PyYAML's) reads `1e-3` and `1.0e5` as strings: a float needs a dot and a signed exponent there. YAML 1.2
# and JSON read them as numbers, as users mean them, in lists and mappings too (train.betas, optimizer_args).
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
PureLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+0123456789."))

LOADER = PureLoader
if getattr(yaml, "__with_libyaml__", False):
    class FastLoader(_Caps, yaml.composer.Composer, yaml.cyaml.CParser, yaml.constructor.SafeConstructor,
                     yaml.resolver.Resolver):
        """libyaml's parser (C: a 1 MB file is scanned in milliseconds, not seconds) under the Python composer
        with the caps, and SafeLoader's constructor and resolver: the same values as PureLoader."""

        def __init__(self, text: str):
            yaml.cyaml.CParser.__init__(self, text)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            yaml.composer.Composer.__init__(self)

    FastLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+0123456789."))
    LOADER = FastLoader


def _measure(node, depth: int, path: str, memo: dict, open_nodes: set) -> tuple[int, int]:
    """(values, levels) under `node` with every alias expanded, refusing too many, too deep, an alias inside itself
    and a key given twice in one mapping. A node that aliases share is measured once (memo), so this is fast."""
    line = node.start_mark.line + 1
    if id(node) in memo:
        size, height = memo[id(node)]
    elif id(node) in open_nodes:
        raise Refused("an alias (*name) refers to the list or mapping it is in", line)
    elif isinstance(node, yaml.ScalarNode):
        size, height = 1, 1
    else:
        open_nodes.add(id(node))
        size, height = 1, 1
        if isinstance(node, yaml.SequenceNode):
            children = [(child, f"{path}[{i}]") for i, child in enumerate(node.value)]
        else:
            children = _keys_once(node, path)
        for child, where in children:
            s, h = _measure(child, depth + 1, where, memo, open_nodes)
            size, height = size + s, max(height, h + 1)
            if size > MAX_VALUES:
                raise Refused(f"more than {MAX_VALUES:,} values once its aliases (*name) are expanded; a config "
                              "holds a few hundred", line)
        open_nodes.discard(id(node))
        memo[id(node)] = size, height
    if depth + height - 1 > MAX_DEPTH:
        raise Refused(f"nested more than {MAX_DEPTH} levels deep once its aliases (*name) are expanded; a config "
                      "nests 2 or 3", line)
    return size, height


def _keys_once(node: yaml.MappingNode, path: str) -> list:
    """The mapping's key and value nodes, each with its path (train.lr). A key given twice is refused, naming both
    lines (the last would win silently); keys merged in by `<<: *name` may be overridden, as YAML intends."""
    seen, pairs = {}, []
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            pairs.append((value_node, path))
            continue
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
        name = f"{path}.{key}" if path else str(key)
        if isinstance(key_node, yaml.ScalarNode) and (key_node.tag, key) in seen:
            first, again = seen[(key_node.tag, key)], key_node.start_mark.line + 1
            raise Refused(f"key `{shown_text(name)}` is given twice, at lines {first} and {again} (the last would "
                          "win silently); keep one", again)
        seen[(key_node.tag, key)] = key_node.start_mark.line + 1
        pairs += [(key_node, name), (value_node, name)]
    return pairs


_REPR = reprlib.Repr()  # at most 3 levels, 6 items each: bounded however large (or shared) the value
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 6, 6, 6, 6
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 70


def shown(value: Any, limit: int = 80) -> str:
    """repr(value) in at most `limit` characters; bounded work for any value, even lists that share sub-lists."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int too long to print (Python refuses beyond 4300 digits)
        text = "<an integer of more than 4300 digits>"
    return shown_text(text, limit)


def shown_text(text: str, limit: int = 80) -> str:
    """`text` on one line, cut to `limit` characters."""
    text = " ".join(str(text).split()) if "\n" in str(text) else str(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(message) -> str:
    return shown_text(message, 160)
