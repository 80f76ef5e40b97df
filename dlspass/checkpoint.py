"""Crash-safe training checkpoints: model, optimizer, LR scheduler, DLS scaler, step and RNG.

`save_checkpoint` writes atomically: ``torch.save`` into a temporary file in the target's own
directory, ``flush`` + ``fsync``, then ``os.replace`` onto the final name and an ``fsync`` of the
directory. A process killed at any instant leaves either the previous checkpoint or the new
one, never a torn file (at worst a stray ``.tmp`` file that `latest_checkpoint` ignores).

Everything stored is tensors and plain Python values, so the file loads with
``torch.load(weights_only=True)`` (SPEC.md §5.7: scaler state lost or unloadable on resume).
The scaler is stored under the top-level key ``grad_scaler`` as in Cerebras checkpoints; a
checkpoint without it restarts DLS from the configuration (SPEC.md §1). The RNG states (torch
CPU and Python's ``random``) are stored so that a resumed run draws the same numbers.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import DLSInputError

FORMAT = "dlspass-checkpoint"
VERSION = 1
_NAME = re.compile(r"^(?P<stem>.+)-(?P<step>\d+)\.pt$")


class CheckpointError(DLSInputError, ValueError):
    """A checkpoint file is missing, damaged or not a dlspass checkpoint (one-line message)."""


def _scheduler_state(scheduler: Any) -> dict[str, Any] | None:
    if scheduler is None:
        return None
    held = getattr(scheduler, "held_steps", None)
    inner = getattr(scheduler, "scheduler", None)
    if held is not None and inner is not None:  # dlspass.HeldScheduler
        return {"held": True, "held_steps": int(held), "state": inner.state_dict()}
    return {"held": False, "state": scheduler.state_dict()}


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform can open a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler: Any, scaler: Any, step: int,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint of the run at ``step`` (completed steps) atomically to ``path``.

    ``scheduler`` may be None, a torch LR scheduler or a ``dlspass.HeldScheduler``; ``scaler``
    may be None or a ``dlspass.GradScaler`` (for a captured step: ``step.scaler``). ``extra``
    must hold tensors and plain values only.
    """
    path = Path(path)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step: expected an integer >= 0, got {step!r}")
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": _scheduler_state(scheduler),
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
        "rng": _rng_state(),
        "extra": extra or {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint's contents (``weights_only=True``); `CheckpointError` if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for damaged files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a dlspass checkpoint")
    if not isinstance(data.get("version"), int) or data["version"] > VERSION:
        raise CheckpointError(f"{path}: checkpoint version {data.get('version')!r} is newer than "
                              f"this dlspass understands ({VERSION})")
    return data


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, scaler: Any = None, *, restore_rng: bool = True,
                    map_location: str | torch.device = "cpu") -> int:
    """Restore what `save_checkpoint` wrote into the given objects; returns the step.

    A checkpoint without scaler state (``grad_scaler`` None or absent) restarts the scaler from
    its configuration, as Model Zoo does.
    """
    data = read_checkpoint(path, map_location)
    model.load_state_dict(data["model"])
    if optimizer is not None:
        if data.get("optimizer") is None:
            raise CheckpointError(f"{path}: the checkpoint holds no optimizer state")
        optimizer.load_state_dict(data["optimizer"])
    if scheduler is not None:
        sched = data.get("scheduler")
        if sched is None:
            raise CheckpointError(f"{path}: the checkpoint holds no LR-scheduler state")
        if sched["held"]:
            scheduler.scheduler.load_state_dict(sched["state"])
            scheduler.held_steps = sched["held_steps"]
        else:
            getattr(scheduler, "scheduler", scheduler).load_state_dict(sched["state"])
    if scaler is not None:
        scaler.load_state_dict(data.get("grad_scaler") or {})
    if restore_rng and data.get("rng"):
        _set_rng_state(data["rng"])
    return int(data["step"])


def checkpoint_path(directory: str | Path, step: int, stem: str = "ckpt") -> Path:
    """``directory/stem-<step>.pt`` (zero-padded, so names sort by step)."""
    return Path(directory) / f"{stem}-{step:09d}.pt"


def latest_checkpoint(directory: str | Path, stem: str = "ckpt") -> Path | None:
    """The readable checkpoint with the highest step in ``directory`` (None if there is none).

    Temporary files of an interrupted save are ignored, and so is a damaged file (the next
    older one is returned).
    """
    d = Path(directory)
    if not d.is_dir():
        return None
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and m.group("stem") == stem and p.is_file():
            found.append((int(m.group("step")), p))
    for _, p in sorted(found, reverse=True):
        try:
            read_checkpoint(p)
        except CheckpointError:
            continue
        return p
    return None
