"""Scaler persistence on disk, in one place: whole-run checkpoints and DCP scaler folders.

`save_checkpoint` / `load_checkpoint` keep a run's model, optimizer, LR scheduler, DLS scaler,
step and RNG in one ``torch.save`` file. `save_scaler` / `load_scaler` keep the scaler state in a
``torch.distributed.checkpoint`` (DCP) folder beside a sharded model (`dcp_state_dict` /
`load_dcp_state_dict` for a DCP state dict of your own). What a scaler ``state_dict`` may hold is
checked by ``dlspass.scaler.state_dict``, for both, before anything is restored.

`save_checkpoint` writes atomically (``dlspass.files.atomic_write``): ``torch.save`` into a temporary
file in the target's own directory, ``fsync``, then ``os.replace`` onto the final name and an
``fsync`` of the directory. A process killed at any instant leaves either the previous
checkpoint or the new one, never a torn file; SIGTERM removes the temporary file, and after a
SIGKILL the stray ``.tmp`` file is one that `latest_checkpoint` ignores.

Everything stored is tensors and plain Python values, so the file loads with
``torch.load(weights_only=True)``: scaler state that cannot be loaded on resume is a known
failure of other tools (docs/SEMANTICS.md §1.7). The scaler is stored under the top-level key
``grad_scaler`` as in Cerebras checkpoints; a checkpoint without it restarts DLS from the
configuration (docs/SEMANTICS.md §1.7). The RNG states (torch CPU and Python's ``random``) are
stored so that a resumed run draws the same numbers.

DCP folders are read as untrusted by default (``dlspass.files.dcp_reader``); plain tensors in
the DCP state dict are treated as replicated, so DCP writes one copy however many ranks save.
"""

from __future__ import annotations

import io
import json
import math
import random
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlspass.errors import DLSInputError, InputValueError
from dlspass.files.atomic_write import write_atomic
from dlspass.files.bounded_text import excerpt
from dlspass.files.dcp_reader import load_untrusted
from dlspass.files.zip_view import UnsafeArchiveError, check_zip_bounds
from dlspass.scale_policy import STATE_DTYPES, STATE_FIELDS
from dlspass.scaler import GradScaler, ScalerStateError
from dlspass.scaler.state_dict import (
    MAX_COUNTER,
    TORCH_TRACKER_MAX,
    checked_count,
    checked_scale,
    normalized_checkpoint,
)

FORMAT = "dlspass-checkpoint"
VERSION = 1
_NAME = re.compile(r"^(?P<stem>.+)-(?P<step>\d+)\.pt$")


class CheckpointError(InputValueError):
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
    # new checkpoints are private (0600), as they always were; a replaced one keeps its mode
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(payload, f)

    write_atomic(path, write, fsync=True, new_mode=0o600)
    return path


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint's contents (``weights_only=True``); `CheckpointError` if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    _check_declared_size(path)
    # torch.load allocates the sizes a file declares before reading them: only torch.save's
    # zip format is read, and its directory is bounded first (a zip bomb is refused from it)
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a readable checkpoint (not in torch.save's zip format)")
    try:
        raw = check_zip_bounds(path)  # torch reads these bytes, not the file a second time
    except UnsafeArchiveError as e:
        raise CheckpointError(str(e)) from None
    try:
        data = torch.load(io.BytesIO(raw), map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for damaged files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a dlspass checkpoint")
    if not isinstance(data.get("version"), int) or data["version"] > VERSION:
        raise CheckpointError(f"{path}: checkpoint version {data.get('version')!r} is newer than "
                              f"this dlspass understands ({VERSION})")
    return data


MAX_CHECKPOINT_BYTES = 4 * 2**30
"""Largest checkpoint file read (it is read whole into memory, then loaded from there)."""
MAX_LATEST_TRIES = 8
"""Most unreadable files newer than the one `latest_checkpoint` returns."""


def _check_declared_size(path: Path) -> None:
    """Refuse, from its size alone, a file too large to read or with holes: ``torch.save``
    writes every byte, so a file whose blocks on disk cover far less than its size is not one
    (a 6 GiB sparse file takes 4 kB of disk and 6 GiB of memory to read)."""
    st = path.stat()
    if st.st_size > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(f"{path}: {st.st_size:,} bytes, more than the {MAX_CHECKPOINT_BYTES:,} "
                              "a checkpoint may have")
    blocks = getattr(st, "st_blocks", None)
    if blocks is not None and st.st_size > 2**20 and blocks * 512 < st.st_size // 2:
        raise CheckpointError(f"{path}: a sparse file ({st.st_size:,} bytes, {blocks * 512:,} on "
                              "disk): not a checkpoint torch.save wrote")


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, scaler: Any = None, *, restore_rng: bool = True,
                    map_location: str | torch.device = "cpu") -> int:
    """Restore what `save_checkpoint` wrote into the given objects; returns the step.

    Everything is checked before anything is restored (`check_checkpoint`: model keys, shapes
    and dtypes, optimizer groups and state shapes, finite hyperparameters, a finite positive
    float32 loss scale and non-negative counters, RNG states), so a damaged or crafted
    checkpoint raises `CheckpointError` and leaves model, optimizer, scheduler, scaler and RNG
    as they were. A checkpoint without scaler state (``grad_scaler`` None or absent) restarts
    the scaler from its configuration, as Model Zoo does.
    """
    data = read_checkpoint(path, map_location)
    check_checkpoint(data, path, model=model, optimizer=optimizer, scheduler=scheduler,
                     restore_rng=restore_rng)
    # the fallible restores first, each undone if a later one fails; the model (fully
    # checked above) and the RNG (checked on a scratch generator) last
    undo: list[Any] = []
    try:
        if scaler is not None:
            old = scaler.state_dict()
            scaler.load_state_dict(data.get("grad_scaler") or {})
            undo.append(lambda: scaler.load_state_dict(old))
        if scheduler is not None:
            undo.append(_restore_scheduler(scheduler, data["scheduler"]))
        if optimizer is not None:
            old_opt = optimizer.state_dict()
            optimizer.load_state_dict(data["optimizer"])
            undo.append(lambda: optimizer.load_state_dict(old_opt))
    except Exception as e:
        for fn in reversed(undo):
            fn()
        if isinstance(e, DLSInputError):
            raise
        raise CheckpointError(f"{path}: cannot restore the checkpoint ({type(e).__name__}: "
                              f"{excerpt(str(e), 160)}); nothing was changed") from None
    model.load_state_dict(data["model"])
    if restore_rng and data.get("rng"):
        _set_rng_state(data["rng"])
    return int(data["step"])


def _restore_scheduler(scheduler: Any, sched: dict[str, Any]) -> Any:
    """Load ``sched`` into ``scheduler``; returns the function that undoes it."""
    inner = scheduler.scheduler if sched["held"] else getattr(scheduler, "scheduler", scheduler)
    old_state, old_held = inner.state_dict(), getattr(scheduler, "held_steps", None)
    inner.load_state_dict(sched["state"])
    if sched["held"]:
        scheduler.held_steps = sched["held_steps"]

    def undo() -> None:
        inner.load_state_dict(old_state)
        if old_held is not None:
            scheduler.held_steps = old_held
    return undo


def check_checkpoint(data: dict[str, Any], path: str | Path, *, model: nn.Module | None = None,
                     optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                     restore_rng: bool = True) -> None:
    """Raise `CheckpointError` naming the first entry of ``data`` that cannot be restored.

    Without ``model``/``optimizer``/``scheduler`` only what needs no live object is checked:
    the step, the scaler state, the RNG states and the types of the other entries.
    """
    def bad(where: str, why: str) -> CheckpointError:
        return CheckpointError(f"{path}: {where}: {why}")

    step = data.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad("step", f"expected an integer >= 0, got {excerpt(step)}")
    if not isinstance(data.get("model"), dict):
        raise bad("model", "expected a state dict")
    for key in ("optimizer", "scheduler", "grad_scaler", "rng"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise bad(key, f"expected a dict or None, got {type(data[key]).__name__}")
    _check_scaler_state(data.get("grad_scaler"), path)
    if restore_rng and data.get("rng"):
        _check_rng(data["rng"], bad)
    if model is not None:
        _check_model(data["model"], model, bad)
    if optimizer is not None:
        if data.get("optimizer") is None:
            raise CheckpointError(f"{path}: the checkpoint holds no optimizer state")
        _check_optimizer(data["optimizer"], optimizer, bad)
    if scheduler is not None:
        sched = data.get("scheduler")
        if sched is None:
            raise CheckpointError(f"{path}: the checkpoint holds no LR-scheduler state")
        held = sched.get("held")
        if not isinstance(held, bool) or not isinstance(sched.get("state"), dict):
            raise bad("scheduler", "expected {'held': bool, 'state': dict}")
        if held and (getattr(scheduler, "scheduler", None) is None
                     or not _is_count(sched.get("held_steps"))):
            raise bad("scheduler", "a held scheduler's state needs a HeldScheduler and "
                      "held_steps >= 0")
        _check_numbers(sched["state"], "scheduler.state", bad)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _check_scaler_state(sd: Any, path: str | Path) -> None:
    """Scales finite, > 0 and representable in float32; counters integers in the range
    ``load_state_dict`` accepts (a tensor on the meta device is no number): its checks, here
    without a live scaler."""
    if not sd:
        return
    _, flat = normalized_checkpoint(sd)
    try:
        for key in ("scale", "_growth_tracker", *STATE_FIELDS):  # torch.amp's keys, then dlspass's
            if key in flat:
                name, value = f"grad_scaler.{key}", flat[key]
                if key == "scale" or STATE_DTYPES.get(key) == torch.float32:
                    checked_scale(name, value)
                else:
                    top = TORCH_TRACKER_MAX if key == "_growth_tracker" else MAX_COUNTER
                    checked_count(name, value, maximum=top)
    except ScalerStateError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _check_rng(rng: dict[str, Any], bad: Any) -> None:
    """Each state is set on a scratch generator first: a bad one fails there, not globally."""
    t = rng.get("torch")
    if t is not None:
        try:
            torch.Generator().set_state(t)
        except Exception as e:
            raise bad("rng.torch", f"not a torch CPU generator state ({type(e).__name__})") from None
    py = rng.get("python")
    if py is not None:
        try:
            version, internal, gauss = py
            random.Random().setstate((version, tuple(internal), gauss))
        except Exception as e:
            raise bad("rng.python", f"not a Python random state ({type(e).__name__})") from None


def _check_model(sd: dict[str, Any], model: nn.Module, bad: Any) -> None:
    want = model.state_dict()
    missing = [k for k in want if k not in sd]
    extra = [k for k in sd if k not in want]
    if missing or extra:
        raise bad("model", f"keys do not match the model (missing {excerpt(', '.join(missing[:5]))}, "
                  f"unexpected {excerpt(', '.join(map(str, extra[:5])))})")
    params = {name for name, _ in model.named_parameters()}
    for k, ref in want.items():
        v = sd[k]
        if type(v) is not torch.Tensor or v.shape != ref.shape:
            raise bad(f"model.{k}", f"expected a tensor of shape {tuple(ref.shape)}, got "
                      f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        if v.dtype.is_floating_point != ref.dtype.is_floating_point or v.is_complex() != ref.is_complex():
            raise bad(f"model.{k}", f"dtype {v.dtype} cannot be restored into {ref.dtype}")
        if k in params and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise bad(f"model.{k}", "holds non-finite values")


def _check_numbers(d: dict[str, Any], where: str, bad: Any) -> None:
    """Float hyperparameters (lr, momentum, betas, eps, ...) must be finite."""
    for k, v in d.items():
        vals = v if isinstance(v, (tuple, list)) and len(v) <= 8 else [v]
        for x in vals:
            if isinstance(x, float) and not math.isfinite(x):
                raise bad(f"{where}.{k}", f"expected a finite number, got {x!r}")


# torch.optim state entries shaped like their parameter (others, such as Adafactor's factored
# row/column statistics, have shapes of their own and are only checked to be finite)
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                           "square_avg", "acc_delta", "sum", "grad_avg", "prev", "step_size",
                           "exp_inf", "ax"})


def _check_optimizer(sd: dict[str, Any], optimizer: torch.optim.Optimizer, bad: Any) -> None:
    groups, state = sd.get("param_groups"), sd.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise bad("optimizer", "expected {'state': dict, 'param_groups': list}")
    if len(groups) != len(optimizer.param_groups):
        raise bad("optimizer.param_groups", f"{len(groups)} groups, the optimizer has "
                  f"{len(optimizer.param_groups)}")
    shapes: dict[Any, torch.Size] = {}
    for i, (g, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) \
                or len(g["params"]) != len(live["params"]):
            raise bad(f"optimizer.param_groups[{i}]", "does not match the optimizer's parameters")
        _check_numbers({k: v for k, v in g.items() if k != "params"}, f"optimizer.param_groups[{i}]", bad)
        for key in ("lr", "weight_decay", "momentum", "eps"):
            v = g.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                raise bad(f"optimizer.param_groups[{i}].{key}", f"expected >= 0, got {v!r}")
        shapes.update(zip(g["params"], (p.shape for p in live["params"]), strict=True))
    for pid, entry in state.items():
        if pid not in shapes or not isinstance(entry, dict):
            raise bad("optimizer.state", f"entry {excerpt(pid)} is not one of the optimizer's parameters")
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                if type(v) is not torch.Tensor:
                    raise bad(f"optimizer.state[{pid}].{k}", "is not a plain tensor")
                if k in _PARAM_SHAPED and v.shape != shapes[pid]:
                    raise bad(f"optimizer.state[{pid}].{k}", f"shape {tuple(v.shape)} does not match "
                              f"the parameter's {tuple(shapes[pid])}")
                if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    raise bad(f"optimizer.state[{pid}].{k}", "holds non-finite values")
            elif isinstance(v, float) and not math.isfinite(v):
                raise bad(f"optimizer.state[{pid}].{k}", f"expected a finite number, got {v!r}")


def checkpoint_path(directory: str | Path, step: int, stem: str = "ckpt") -> Path:
    """``directory/stem-<step>.pt`` (zero-padded, so names sort by step)."""
    return Path(directory) / f"{stem}-{step:09d}.pt"


def latest_checkpoint(directory: str | Path, stem: str = "ckpt") -> Path | None:
    """The readable checkpoint with the highest step in ``directory`` (None if there is none).

    Temporary files of an interrupted save are ignored, and so is a damaged file (one that
    does not load, or whose step, scaler state or RNG state `check_checkpoint` refuses): the
    next older one is returned. Each file's size is checked before it is read (sparse and
    oversized files are refused unread); after `MAX_LATEST_TRIES` unreadable files it raises
    `CheckpointError` rather than read on.
    """
    d = Path(directory)
    if not d.is_dir():
        return None
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and m.group("stem") == stem and p.is_file():
            found.append((int(m.group("step")), p))
    refused = 0
    for _, p in sorted(found, reverse=True):
        try:
            check_checkpoint(read_checkpoint(p), p)
        except CheckpointError:
            refused += 1
            if refused >= MAX_LATEST_TRIES:
                # returning None would restart the run from scratch; so would an hour spent
                # reading decoys: say so instead
                raise CheckpointError(f"{d}: the {MAX_LATEST_TRIES} newest checkpoints named "
                                      f"{stem}-*.pt are all unreadable; remove them or name one "
                                      "to load") from None
            continue
        return p
    return None


# ---- DCP scaler folders --------------------------------------------------------------------------
DCP_KEY = "grad_scaler"


def dcp_state_dict(scaler: GradScaler) -> dict[str, Any]:
    """The scaler state as DCP wants it: ``{"grad_scaler": {field: 0-d tensor, ...}}``.

    The configuration goes in as a JSON string (DCP stores non-tensor values as bytes); tensors
    are plain (replicated), so DCP writes one copy however many ranks save.
    """
    # dlspass's own layout even for TorchGradScaler, whose state_dict() speaks torch's keys:
    # it carries the format version and config, and TorchGradScaler loads it back.
    sd = GradScaler.state_dict(scaler)
    out: dict[str, Any] = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out["format_version"] = sd["format_version"]
    out["config_json"] = json.dumps(sd.get("config", {}), sort_keys=True)
    return {DCP_KEY: out}


def load_dcp_state_dict(scaler: GradScaler, state: dict[str, Any]) -> None:
    """Load what `dcp_state_dict` produced (after ``dcp.load`` filled it in) into ``scaler``.

    A missing entry, a value of the wrong type or a ``config_json`` that is not JSON raises
    `CheckpointError` (an input error) before the scaler is touched.
    """
    entry = state.get(DCP_KEY) if isinstance(state, dict) else None
    if not isinstance(entry, dict):
        raise CheckpointError(f"load_dcp_state_dict: no {DCP_KEY!r} entry in the state dict")
    sd = dict(entry)
    raw = sd.pop("config_json", None)
    if raw is not None:
        if not isinstance(raw, str):
            raise CheckpointError(f"{DCP_KEY}.config_json: expected a JSON string, got {excerpt(raw)}")
        try:
            sd["config"] = json.loads(raw)
        except (ValueError, RecursionError):
            raise CheckpointError(f"{DCP_KEY}.config_json is not valid JSON: {excerpt(raw)}") from None
    scaler.load_state_dict(sd)


def save_scaler(scaler: GradScaler, checkpoint_id: str, process_group: Any = None) -> None:
    """Save the scaler state with ``torch.distributed.checkpoint`` (collective over the group)."""
    import torch.distributed.checkpoint as dcp  # slow to import: only where DCP is used

    dcp.save(dcp_state_dict(scaler), checkpoint_id=checkpoint_id, process_group=process_group)


def load_scaler(scaler: GradScaler, checkpoint_id: str, process_group: Any = None, *,
                trusted: bool = False) -> None:
    """Restore the scaler state saved by `save_scaler` on every rank (collective).

    By default the folder is read as untrusted (``dlspass.files.dcp_reader``): its ``.metadata`` may
    name only DCP's own metadata classes, values load with ``weights_only=True`` and storage
    entries must lie inside the folder, so a crafted folder raises an input error instead of
    running code. ``trusted=True`` uses plain ``dcp.load`` (which unpickles ``.metadata`` and
    non-tensor values): only for folders you wrote yourself, e.g. with a custom storage layout.
    """
    state = dcp_state_dict(scaler)
    if trusted:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=checkpoint_id, process_group=process_group)
    else:
        load_untrusted(state, checkpoint_id, process_group)
    load_dcp_state_dict(scaler, state)
