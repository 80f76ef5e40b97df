"""Write a file atomically: a whole new file or the old one, never a half file or a stray temp.

``write_atomic(path, write)`` calls ``write(tmp)`` on a hidden temporary file in the target's
folder and ``os.replace``s it onto ``path``. What it also guarantees:

* the file keeps the mode of the file it replaces (a ``0600`` output stays ``0600``); a new
  file gets ``new_mode`` (default: the usual ``0666`` less the umask);
* a ``SIGTERM`` or ``SIGHUP`` that arrives during the write removes the temporary file before
  the process dies of it (the handler is installed for the write only, in the main thread, and
  chains to the handler that was there before); ``KeyboardInterrupt`` and exceptions remove it
  through the ``except`` below. Only ``SIGKILL`` (or a power cut) can leave one behind;
* with ``fsync=True`` the data and the folder entry are on disk before it returns;
* nothing is written through a path an attacker may have planted: the temporary file is
  created exclusively (``mkstemp``: ``O_CREAT | O_EXCL``, a name nobody could predict), it must
  still be that file (same device and inode, not a link) when ``write`` returns, and
  ``os.replace`` replaces a symlink at ``path`` itself rather than the file it points to (a
  symlinked target keeps no mode either: the new file gets ``new_mode``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dlspass.errors import InputRuntimeError

_PENDING: set[str] = set()
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_previous: dict[int, Any] = {}
_depth = 0


def write_atomic(path: str | Path, write: Callable[[str], object], *, fsync: bool = False,
                 new_mode: int | None = None) -> None:
    """Call ``write(tmp_path)`` then move the temporary file onto ``path`` (see the module doc)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    mode = _mode_for(path, new_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=str(folder))
    try:
        made = os.fstat(fd)
    finally:
        os.close(fd)
    with _removed_on_signal(tmp):
        try:
            write(tmp)
            now = os.lstat(tmp)
            if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (made.st_dev, made.st_ino):
                raise InputRuntimeError(f"{tmp}: the temporary file was replaced while being "
                                        "written; not moved onto the target")
            if fsync:
                _fsync(tmp, os.O_RDONLY)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    if fsync:
        with contextlib.suppress(OSError):  # not every platform can open a folder
            _fsync(str(folder), os.O_RDONLY)


def write_text_atomic(path: str | Path, text: str) -> None:
    """``text`` written to ``path`` as UTF-8 by ``write_atomic``."""
    write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _mode_for(path: Path, new_mode: int | None) -> int:
    try:
        st = path.lstat()  # a symlink is replaced, not followed: its target's mode is not ours
    except OSError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode):
        return stat.S_IMODE(st.st_mode)
    if new_mode is not None:
        return new_mode
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync(name: str, flags: int) -> None:
    fd = os.open(name, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_signal(signum: int, frame: Any) -> None:
    for tmp in list(_PENDING):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _PENDING.clear()
    prev = _previous.get(signum) or signal.SIG_DFL  # None: a handler set from C
    signal.signal(signum, prev)
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # die of the signal, as without this handler


@contextlib.contextmanager
def _removed_on_signal(tmp: str) -> Iterator[None]:
    global _depth
    main = threading.current_thread() is threading.main_thread()
    _PENDING.add(tmp)
    if main:
        if _depth == 0:
            for sig in _SIGNALS:
                _previous[sig] = signal.signal(sig, _on_signal)
        _depth += 1
    try:
        yield
    finally:
        _PENDING.discard(tmp)
        if main:
            _depth -= 1
            if _depth == 0:
                for sig in _SIGNALS:
                    if signal.getsignal(sig) is _on_signal:
                        signal.signal(sig, _previous.get(sig) or signal.SIG_DFL)
                _previous.clear()
