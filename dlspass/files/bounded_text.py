"""Text taken from input files, made safe to print: bounded in length, control characters escaped.

Error messages quote the input that is wrong (a name, a value, a path), and ``inspect`` prints
node names from the file. An attacker controls both: a 50 MB name would make a 50 MB error
line, and an ESC byte in a node name would reach the terminal as an escape sequence (retitle
the window, hide text, move the cursor). Everything quoted from an input goes through
``excerpt`` (errors) or ``printable`` (reports).
"""

from __future__ import annotations

import numbers
import re

# C0 controls, DEL and the C1 controls (0x9b is a one-byte CSI), and the Unicode bidi
# overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

EXCERPT_CHARS = 120
"""How many characters of an input value an error message quotes."""


def printable(text: str) -> str:
    """``text`` with every control character (and bidi override) written as ``\\xNN``/``\\uNNNN``."""
    return _CONTROL.sub(lambda m: (f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                   else f"\\u{ord(m.group()):04x}"), text)


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """A printable one-line excerpt of ``value`` of at most about ``limit`` characters.

    Strings are quoted like ``repr``; anything else is shown by type and, for sized values,
    length. Never formats a whole container: ``repr`` of an aliased YAML tree or of a huge
    list would expand it, which is exactly what an error path must not do.
    """
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value[: limit + 1]).decode("utf-8", "replace")
    if isinstance(value, str):
        head = value[: limit + 1]
        text = printable(repr(head[:limit]))
        return text + (f"... ({len(value):,} characters)" if len(value) > limit else "")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<int of {value.bit_length():,} bits>"  # repr would be slow or refused
    if value is None or isinstance(value, numbers.Number):  # also numpy scalars, Fraction
        try:
            text = repr(value)
        except ValueError:  # a Fraction past Python's digit limit for str()
            return f"<{type(value).__name__} too long to print>"
        return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} digits)"
    size = f" of {len(value):,} items" if hasattr(value, "__len__") else ""
    return f"<{type(value).__name__}{size}>"


def one_line(text: str, limit: int) -> str:
    """``text`` on one line (whitespace runs collapsed), printable, cut to ``limit`` characters."""
    flat = printable(" ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 30] + f"... ({len(flat):,} characters)"
