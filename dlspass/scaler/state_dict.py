"""What a scaler ``state_dict`` holds, and the checks a checkpoint passes before it is restored.

`write_state_dict` is `GradScaler.state_dict`'s layout: the `ScalerState` tensors, the effective
growth factor, backoff factor and interval, ``format_version`` and the config; tensors and plain
values only, so ``torch.load(weights_only=True)`` reads it. `plan_load` reads that layout, a
cstorch/Model Zoo one (``grad_scaler.<key>`` or a nested ``{"grad_scaler": {...}}``) and a
torch.amp.GradScaler one, checks every entry and returns the config and state to install:
a bad entry raises `ScalerStateError` naming its key before anything changes. Scales must
survive the cast to float32, the dtype every scale is kept in, as finite numbers > 0
(`checked_scale`); counters are integers in ``[0, MAX_COUNTER]`` (`checked_count`), which
`write_state_dict` saturates at, so a scaler always accepts its own state.

Files are written and read elsewhere: ``dlspass.checkpoint`` (whole-run checkpoints and DCP
scaler folders), which uses these checks.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dlspass.config import FLOAT32_MAX, ConfigError, DLSConfig
from dlspass.files.bounded_text import excerpt
from dlspass.scale_policy import STATE_DTYPES, STATE_FIELDS, ScalerState
from dlspass.scaler.errors import ScalerStateError

FORMAT_VERSION = 1
# docs/SEMANTICS.md §1.7: the keys a dynamic checkpoint must carry (the others have safe defaults).
REQUIRED_DYNAMIC_KEYS = ("loss_scale", "steps_since_rescale", "overflows_since_rescale",
                         "num_skipped_steps")
TORCH_AMP_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

# The smallest positive float32 (a subnormal): a scale must survive the cast to float32, the
# dtype every scale is kept in, as a finite number > 0 (1e39 would become inf, 1e-50 zero).
FLOAT32_TINY = 2.0**-149
_INT64_MAX = 2**63 - 1
MAX_COUNTER = 2**62
"""Largest counter a scaler state may hold. Counters grow by at most one per step, so an
accepted state runs 2**62 steps before int64 could wrap; ``write_state_dict`` saturates here,
so a scaler always accepts its own state."""
TORCH_TRACKER_MAX = 2**31 - 1
"""torch.amp keeps its growth tracker in int32 (``torch._amp_update_scale_``)."""


def _as_float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def _plain_number(key: str, value: object, error: type[Exception]) -> float | int:
    """A Python number from an int/float (not bool) or a one-element real tensor."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise error(f"{key}: expected a number or a one-element real tensor, got a "
                        f"{value.dtype} tensor of shape {tuple(value.shape)}")
        if value.device.type == "meta":
            raise error(f"{key}: a tensor on the meta device holds no value")
        try:
            value = value.detach().reshape(()).item()
        except Exception as e:  # a device or tensor subclass that cannot be read back
            raise error(f"{key}: the tensor on {value.device} cannot be read "
                        f"({type(e).__name__})") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{key}: expected a number, got {type(value).__name__}")
    return value


def checked_scale(key: str, value: object, error: type[Exception] = ScalerStateError) -> float:
    """``value`` as a float that float32 holds as a finite number > 0, else ``error`` naming
    ``key`` (NaN, inf, 0, negative, 1e39 -> inf, 1e-50 -> 0 are all refused)."""
    v = _plain_number(key, value, error)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f <= 0:
        raise error(f"{key}: must be a finite number > 0, got {excerpt(v)}")
    f32 = _as_float32(f)
    if not math.isfinite(f32) or f32 == 0.0:
        raise error(f"{key}: {excerpt(v)} does not fit float32, the dtype of the scale (it "
                    f"would become {f32!r}); use a value in [{FLOAT32_TINY!r}, {FLOAT32_MAX!r}]")
    return f


def checked_count(key: str, value: object, minimum: int = 0, maximum: int = _INT64_MAX) -> int:
    """A counter: an integer (an integral float is accepted) in ``[minimum, maximum]``."""
    v = _plain_number(key, value, ScalerStateError)
    if isinstance(v, numbers.Integral):
        n = int(v)
    else:
        f = float(v)
        if not math.isfinite(f) or not f.is_integer():
            raise ScalerStateError(f"{key}: expected an integer, got {excerpt(v)}")
        n = int(f)
    if not minimum <= n <= maximum:
        top = {_INT64_MAX: "2**63 - 1", MAX_COUNTER: "2**62", TORCH_TRACKER_MAX: "2**31 - 1"}
        raise ScalerStateError(f"{key}: must be an integer in [{minimum}, "
                               f"{top.get(maximum, maximum)}], got {excerpt(n)}")
    return n


def _checked_interval_tracker(key: str, tracker: int, config: DLSConfig) -> None:
    """torch's and Keras's update grow the scale when the tracker *equals* the interval: one
    at or past it would never grow again. torch's tracker is int32 (torch.amp refuses more
    itself; ``torch._amp_update_scale_`` would truncate and wrap)."""
    if config.policy == "torch" and tracker > TORCH_TRACKER_MAX:
        raise ScalerStateError(f"{key}: must be an integer in [0, 2**31 - 1] (torch keeps it "
                               f"in int32), got {excerpt(tracker)}")
    if config.policy in ("torch", "keras") and not tracker < config.growth_interval:
        raise ScalerStateError(f"{key}: {tracker} is not below growth_interval "
                               f"{config.growth_interval} (the scale would never grow again)")


def checked_factor(key: str, value: object, *, growth: bool) -> float | int:
    """A growth factor (finite, > 1) or a backoff factor (in (0, 1)), returned as given."""
    v = _plain_number(key, value, ScalerStateError)
    f = float(v)
    ok = (math.isfinite(f) and f > 1.0) if growth else (0.0 < f < 1.0)
    if not ok:
        want = "a finite number > 1" if growth else "a number in (0, 1)"
        raise ScalerStateError(f"{key}: must be {want}, got {excerpt(v)}")
    return v


def effective_factors(config: DLSConfig) -> tuple[float, float, int]:
    """``(growth factor, backoff factor, growth interval)`` the scale follows under ``config``."""
    growth = config.growth_factor if config.growth_factor is not None else config.growth
    backoff = config.backoff_factor if config.backoff_factor is not None else config.backoff
    interval = (config.steps_per_increase if config.steps_per_increase is not None
                else config.growth_interval)
    return growth, backoff, interval


def write_state_dict(config: DLSConfig, state: ScalerState) -> dict[str, Any]:
    """`GradScaler.state_dict`'s contents: tensors and plain values only.

    A dynamic configuration also writes its effective ``growth_factor``, ``backoff_factor``
    and ``growth_interval``, which `plan_load` restores, and torch.amp's ``scale`` and
    ``_growth_tracker`` beside its own keys, so that ``torch.amp.GradScaler`` loads the same
    dict (dlspass reads its own keys). The tracker is kept below the interval: the cerebras
    rule grows one clean step later than torch's, whose tracker never grows once it passes the
    interval. A static or disabled configuration writes only its ``loss_scale``.
    """
    cfg = {k: v for k, v in config.to_dict().items() if k != "extras"}
    if config.dynamic:
        out: dict[str, Any] = {f: getattr(state, f).detach().clone() for f in STATE_FIELDS}
        for f in STATE_FIELDS:  # saturate: the state stays loadable however long the run
            if STATE_DTYPES[f] == torch.int64:
                out[f] = out[f].clamp(max=MAX_COUNTER)
        out["growth_factor"], out["backoff_factor"], out["growth_interval"] = (
            effective_factors(config))
        out["scale"] = float(state.loss_scale)
        out["_growth_tracker"] = min(int(state.steps_since_rescale), out["growth_interval"] - 1)
    else:
        out = {"loss_scale": state.loss_scale.detach().clone()}
    out["format_version"] = FORMAT_VERSION
    out["config"] = cfg
    return out


def normalized_checkpoint(state_dict: object) -> tuple[bool, dict[Any, Any]]:
    """The scaler entries of a checkpoint in one flat dict, and whether they are torch.amp's.

    Accepted forms: a nested ``{"grad_scaler": {...}}`` (a whole Cerebras/Model Zoo
    checkpoint), flattened ``grad_scaler.<key>`` keys, `write_state_dict`'s dict, and
    torch.amp.GradScaler's (``scale`` and ``_growth_tracker`` among its keys, no
    ``loss_scale``).
    """
    if not isinstance(state_dict, Mapping):
        raise ScalerStateError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
    sd = dict(state_dict)
    if isinstance(sd.get("grad_scaler"), Mapping):
        sd = dict(sd["grad_scaler"])
    prefix = "grad_scaler."
    flat = {k[len(prefix):] if isinstance(k, str) and k.startswith(prefix) else k: v
            for k, v in sd.items()}
    # dlspass's own dicts carry torch's keys too (for torch.amp); theirs are read then
    torch_amp = "scale" in flat and "_growth_tracker" in flat and "loss_scale" not in flat
    return torch_amp, flat


def plan_load(config: DLSConfig, device: torch.device, state_dict: object
              ) -> tuple[DLSConfig, ScalerState | None]:
    """Check every entry of ``state_dict`` for a scaler configured by ``config``; return the
    config and state to install (the state on ``device``).

    Three steps: bring the accepted forms to one dict (`normalized_checkpoint`), check its
    entries under the names the checkpoint uses, then rebuild the state from the checked
    values. ``None`` for the state: a static or disabled scaler keeps its configuration.
    """
    torch_amp, sd = normalized_checkpoint(state_dict)
    checked = _checked_torch_amp if torch_amp else _checked_entries
    new_config, vals = checked(config, sd)
    return new_config, (None if vals is None else _state_from(new_config, vals, device))


def _checked_entries(config: DLSConfig, sd: Mapping[str, Any]
                     ) -> tuple[DLSConfig, dict[str, float | int] | None]:
    """dlspass's own entries (also cstorch's): the config and the state values."""
    version = sd.get("format_version", FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version > FORMAT_VERSION:
        raise ScalerStateError(f"format_version: {excerpt(version)} is not a format this "
                               f"dlspass understands (newest: {FORMAT_VERSION})")
    ck_cfg = sd.get("config")
    if ck_cfg is None:
        ck_cfg = {}
    if not isinstance(ck_cfg, Mapping):
        raise ScalerStateError(f"config: expected a dict, got {type(ck_cfg).__name__}")
    new_config = _config_with_factors(config, sd, ck_cfg)
    vals: dict[str, float | int] = {
        f: (checked_scale(f, sd[f]) if STATE_DTYPES[f] == torch.float32
            else checked_count(f, sd[f], maximum=MAX_COUNTER))
        for f in STATE_FIELDS if f in sd
    }
    if "steps_since_rescale" in vals:
        _checked_interval_tracker("steps_since_rescale", int(vals["steps_since_rescale"]),
                                  new_config)
    if not config.dynamic:
        return config, None  # a static/disabled scaler's scale is its configuration
    missing = [k for k in REQUIRED_DYNAMIC_KEYS if k not in sd]
    static = "loss_scale" in ck_cfg and ck_cfg["loss_scale"] != "dynamic"
    if static or (missing and "loss_scale" in sd):
        raise ScalerStateError(
            f"load_state_dict: the checkpoint holds a static loss scale (no "
            f"{', '.join(missing) or 'dynamic state'}); it cannot resume a dynamic scaler. "
            f"Pass load_state_dict({{}}) to restart DLS from the configuration instead")
    if missing:
        raise ScalerStateError(f"load_state_dict: missing key(s) {', '.join(missing)}")
    return new_config, vals


def _checked_torch_amp(config: DLSConfig, sd: Mapping[str, Any]
                       ) -> tuple[DLSConfig, dict[str, float | int] | None]:
    """torch.amp.GradScaler's five entries, as the same config and state values."""
    if config.policy != "torch":
        raise ScalerStateError("load_state_dict: this is a torch.amp.GradScaler state_dict; "
                               "it loads into policy='torch' (dlspass.TorchGradScaler) only")
    missing = [k for k in TORCH_AMP_KEYS if k not in sd]
    if missing:
        raise ScalerStateError(f"load_state_dict: missing key(s) {', '.join(missing)}")
    scale = checked_scale("scale", sd["scale"])
    tracker = checked_count("_growth_tracker", sd["_growth_tracker"], maximum=TORCH_TRACKER_MAX)
    new_config = _config_with_factors(config, sd, {})
    _checked_interval_tracker("_growth_tracker", tracker, new_config)
    if not config.dynamic:
        return config, None
    return new_config, {"loss_scale": scale, "steps_since_rescale": tracker}


def _state_from(config: DLSConfig, vals: Mapping[str, float | int],
                device: torch.device) -> ScalerState:
    """The state rebuilt from checked values; a key not given takes its fresh value."""
    given = {"hysteresis": config.hysteresis_steps, "non_clamped_scale": vals["loss_scale"],
             **vals}
    return ScalerState(**{f: torch.tensor(given.get(f, 0), dtype=STATE_DTYPES[f], device=device)
                          for f in STATE_FIELDS})


def _config_with_factors(config: DLSConfig, sd: Mapping[str, Any],
                         ck_cfg: Mapping[str, Any]) -> DLSConfig:
    """``config`` with the checkpoint's growth factor, backoff factor and interval."""
    changes: dict[str, Any] = {}
    resolved = {"growth_factor": config.growth, "backoff_factor": config.backoff,
                "steps_per_increase": config.growth_interval}
    for key, field in (("growth_factor", "growth_factor"), ("backoff_factor", "backoff_factor"),
                       ("growth_interval", "steps_per_increase")):
        if key in sd:
            name, raw = key, sd[key]
        elif ck_cfg.get(field) is not None:
            name, raw = f"config.{field}", ck_cfg[field]
        else:
            continue
        if field == "steps_per_increase":
            value = checked_count(name, raw, minimum=1)
        else:
            value = checked_factor(name, raw, growth=field == "growth_factor")
        # A value equal to what the config already resolves to (the preset's default)
        # leaves the config as it is: a restored scaler then equals a fresh one.
        if value != resolved[field]:
            changes[field] = value
    if not changes:
        return config
    try:
        return dataclasses.replace(config, **changes)
    except ConfigError as e:  # pragma: no cover - the checks above are DLSConfig's
        raise ScalerStateError(str(e)) from e
