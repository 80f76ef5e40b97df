"""Cells of the matrix that fail today, with where the failure comes from.

`test_matrix.py` marks these ``xfail(strict=True)``: when a fix lands the test passes, the
strict xfail fails, and whoever fixed it removes the entry here and reruns
``tools/compat/run_models.py`` to regenerate docs/COMPATIBILITY.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    """Why a cell fails: a short cause (and the torch issue where torch is the limit)."""

    summary: str


KNOWN: dict[str, Known] = {}
