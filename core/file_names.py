"""A user's file name as a message shows it: on one line, whatever the name holds. A file may be named with a
newline, a carriage return or a terminal's escape sequence (`touch $'a\\nb.png'`); said as it is, a one-line error
became two lines, or recoloured the console. No torch here: main.py reads it before torch loads (trackers.py)."""
from __future__ import annotations

import os
import re

from core.errors import printable

# What splits a line (str.splitlines splits at \x1c-\x1e, \x85, \u2028 and \u2029 too) or drives a terminal (\x1b)
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def shown_name(path) -> str:
    """`path` (str, bytes or a PathLike) with its control characters as Python writes them (\\n, \\x1b, \\u2028) and
    its bytes that are not UTF-8 as \\xe9 (errors.printable, as the log shows them); any other name unchanged."""
    return CONTROL.sub(lambda found: repr(found.group())[1:-1], printable(os.fsdecode(path)))
