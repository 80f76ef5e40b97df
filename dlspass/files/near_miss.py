"""Near misses of known names: a key that differs from one only by case, by a letter of another
script drawn like a Latin one, or by one or two edits. Config readers refuse such a key next to
the section it resembles, since a misspelt section reads silently as an absent one."""

from __future__ import annotations

import unicodedata
from collections.abc import Collection
from typing import Any

# Letters other scripts draw like Latin ones (Unicode's confusables for the Latin lowercase
# letters of Model Zoo's keys): a key spelled with one of them is a different key to a dict.
_CONFUSABLE = str.maketrans({
    "а": "a", "в": "b", "с": "c", "ԁ": "d", "е": "e", "һ": "h", "н": "h", "і": "i", "ј": "j",
    "к": "k", "ӏ": "l", "м": "m", "о": "o", "р": "p", "ԛ": "q", "ѕ": "s", "т": "t", "ц": "u",
    "ѵ": "v", "ԝ": "w", "х": "x", "у": "y", "α": "a", "β": "b", "ε": "e", "η": "n", "ι": "i",
    "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u", "χ": "x", "ı": "i",
})


def _skeleton(key: str) -> str:
    return unicodedata.normalize("NFKC", key).casefold().translate(_CONFUSABLE)


def _edit_distance(a: str, b: str, cap: int) -> int:
    """Levenshtein distance with adjacent transpositions, or ``cap + 1`` once it exceeds ``cap``."""
    if abs(len(a) - len(b)) > cap:
        return cap + 1
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) > cap:
            return cap + 1
        prev2, prev = prev, cur
    return prev[-1]


def near_miss(key: Any, known: Collection[str]) -> str | None:
    """The known name ``key`` is a near miss of (another case, a confusable letter from another
    script, one or two edits), or None. ``key`` itself being known is no miss."""
    if not isinstance(key, str) or key in known or len(key) > 200:
        return None
    sk = _skeleton(key)
    for name in known:
        cap = 1 if len(name) <= 5 else 2
        if sk == name or _edit_distance(sk, name, cap) <= cap:
            return name
    return None
