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

# What never reaches a terminal, an HTML/SVG document or a JSON file raw: C0 controls, DEL and
# the C1 controls (0x9b is a one-byte CSI); the Unicode bidi controls that reorder what a
# terminal shows (embeddings, overrides, isolates, marks); lone surrogates (a file name that is
# not UTF-8 decodes to them: no encoder writes them, so printing one raises); and the
# non-characters (U+FDD0..U+FDEF and the last two code points of every plane), which XML
# forbids, so an SVG holding one is not a document.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
                      "\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff]"
                      "|[\U0001fffe-\U0001ffff\U0002fffe-\U0002ffff\U0003fffe-\U0003ffff"
                      "\U0004fffe-\U0004ffff\U0005fffe-\U0005ffff\U0006fffe-\U0006ffff"
                      "\U0007fffe-\U0007ffff\U0008fffe-\U0008ffff\U0009fffe-\U0009ffff"
                      "\U000afffe-\U000affff\U000bfffe-\U000bffff\U000cfffe-\U000cffff"
                      "\U000dfffe-\U000dffff\U000efffe-\U000effff\U000ffffe-\U000fffff"
                      "\U0010fffe-\U0010ffff]")

EXCERPT_CHARS = 120
"""How many characters of an input value an error message quotes."""


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"


def printable(text: str) -> str:
    """``text`` with every character that must not be written raw (module doc) as ``\\xNN``,
    ``\\uNNNN`` or ``\\UNNNNNNNN``: the one escaper of what dlspass writes to a terminal, an
    HTML or SVG report or a JSON file. The result always encodes as UTF-8."""
    return _CONTROL.sub(_escape, text)


def excerpt(value: object, limit: int = EXCERPT_CHARS, *, plain: bool = False) -> str:
    """A printable one-line excerpt of ``value`` of at most about ``limit`` characters.

    Strings are quoted like ``repr``; anything else is shown by type and, for sized values,
    length. Never formats a whole container: ``repr`` of an aliased YAML tree or of a huge
    list would expand it, which is exactly what an error path must not do. ``plain`` words
    it as the configuration errors do (``list of 2 items``, ``an integer of 100 bits``).
    """
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value[: limit + 1]).decode("utf-8", "replace")
    if isinstance(value, str):
        head = value[: limit + 1]
        text = printable(repr(head[:limit]))
        if len(value) <= limit:
            return text
        if plain:
            return f"{text[:-1]}...{text[-1]} ({len(value)} characters)"
        return text + f"... ({len(value):,} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and (
            value.bit_length() > (64 if plain else 4 * limit)):
        return (f"an integer of {value.bit_length()} bits" if plain  # repr would be slow or refused
                else f"<int of {value.bit_length():,} bits>")
    if value is None or isinstance(value, (bool, int, float)) or (
            not plain and isinstance(value, numbers.Number)):  # also numpy scalars, Fraction
        try:
            text = repr(value)
        except ValueError:  # a Fraction past Python's digit limit for str()
            return f"<{type(value).__name__} too long to print>"
        return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} digits)"
    if plain:
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            return f"{type(value).__name__} of {len(value)} items"
        return f"a {type(value).__name__}"
    size = f" of {len(value):,} items" if hasattr(value, "__len__") else ""
    return f"<{type(value).__name__}{size}>"


def one_line(text: str, limit: int) -> str:
    """``text`` on one line (whitespace runs collapsed), printable, cut to ``limit`` characters."""
    flat = printable(" ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 30] + f"... ({len(flat):,} characters)"
