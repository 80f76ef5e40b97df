"""The checks on a path the user names: a file to read, and a path to write.

Both refuse with one line naming the path (``InputValueError``, CLI exit 2) before any reader or
writer touches it: a missing or empty input, a wrong suffix, an output folder that does not exist
or cannot be written.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from dlspass.errors import InputValueError


def check_input_file(path: str | Path, suffixes: tuple[str, ...] = (".pt2", ".onnx")) -> Path:
    """``path`` as a Path, or ``InputValueError`` when it is missing, empty or has another suffix."""
    p = Path(path)
    if p.suffix not in suffixes:
        raise InputValueError(f"{p}: unsupported file type {p.suffix or '(none)'!r}; "
                              f"expected {' or '.join(suffixes)}")
    if not p.exists():
        raise InputValueError(f"{p}: no such file")
    if not p.is_file():
        raise InputValueError(f"{p}: not a regular file")
    if p.stat().st_size == 0:
        raise InputValueError(f"{p}: the file is empty")
    return p


def check_output_path(path: str | Path, suffixes: tuple[str, ...]) -> Path:
    """``path`` as a Path, or ``InputValueError`` when its suffix is wrong or its folder unwritable."""
    p = Path(path)
    if p.suffix not in suffixes:
        raise InputValueError(f"{p}: output must end in {' or '.join(suffixes)}, "
                              f"not {p.suffix or '(none)'!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputValueError(f"{p}: output folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputValueError(f"{p}: output path is not writable")
    if p.is_dir():
        raise InputValueError(f"{p}: output path is a folder")
    return p


def _is_cwd(entry: str) -> bool:
    try:
        return entry in ("", ".") or os.path.samefile(entry, os.getcwd())
    except OSError:
        return False


@contextlib.contextmanager
def cwd_searched_last() -> Iterator[None]:
    """``sys.path`` with the current folder moved to its end (appended if absent) while inside.

    ``python -m``/``-c`` put the current folder first, so a ``filelock.py`` lying in it would
    replace the installed ``filelock`` at the next lazy import of it (torch imports several
    lazily). Searched last, the folder still resolves a user's module found nowhere else
    (``dlspass export mymodel:make`` beside ``mymodel.py``) but shadows nothing installed.
    """
    saved = list(sys.path)
    sys.path[:] = [e for e in saved if not _is_cwd(e)] + [os.getcwd()]
    try:
        yield
    finally:
        sys.path[:] = saved
