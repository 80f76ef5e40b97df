"""Read the precision settings of a Cerebras Model Zoo ``params.yaml`` into a `DLSConfig`.

Three layouts are understood (SPEC.md §2):

- current: ``trainer.init.precision`` holds ``enabled``, ``fp16_type``, ``precision_opt_level``,
  ``loss_scaling_factor``, ``initial_loss_scale``, ``steps_per_increase``, ``min_loss_scale``,
  ``max_loss_scale``, ``max_gradient_norm`` / ``max_gradient_value`` and ``log_loss_scale``;
- legacy: the DLS keys (plus ``log_summaries``) under ``optimizer:``, ``mixed_precision``,
  ``fp16_type`` (and the older ``use_bfloat16``) under ``model:``, ``precision_opt_level`` and
  ``load_checkpoint_states`` under ``runconfig:``;
- flat: a dict of `DLSConfig` field names, as `DLSConfig.to_dict` returns it.

Model Zoo configs are full of unrelated keys (learning rates, model sizes, data paths): those are
ignored. Inside the precision settings every key must be known and well typed; mistakes are a
one-line `ConfigError` that names the file and the key path. In the legacy sections, which mix
precision keys with everything else, a key that is a near miss of a precision key (a typo such as
``loss_scaling_factr``) is an error too, so that a typo cannot silently turn DLS off.

Absent keys take Model Zoo's defaults, which differ from `DLSConfig`'s in one place: an absent
``loss_scaling_factor`` means 1.0 (no scaling), as in Model Zoo's ``MixedPrecision``; mixed
precision defaults to on (Cerebras hardware forces it on) and ``fp16_type`` to float16 (SPEC §1).
A config without any precision settings gives fp32 training without scaling.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from .config import FP16_TYPES, ConfigError, DLSConfig

__all__ = ["config_from_params", "config_from_yaml", "load_yaml"]

_MISSING = object()

# Model Zoo precision key -> DLSConfig field (None: kept in DLSConfig.extras)
_DLS_KEYS = {
    "loss_scaling_factor": "loss_scale",
    "initial_loss_scale": "initial_loss_scale",
    "steps_per_increase": "steps_per_increase",
    "min_loss_scale": "min_loss_scale",
    "max_loss_scale": "max_loss_scale",
    "max_gradient_norm": "max_gradient_norm",
    "max_gradient_value": "max_gradient_value",
    "log_loss_scale": "log_loss_scale",
}
_CURRENT_KEYS = {
    "enabled": "mixed_precision",
    "fp16_type": "fp16_type",
    "precision_opt_level": None,
    **_DLS_KEYS,
}
_LEGACY_SECTIONS = {
    "optimizer": {**_DLS_KEYS, "log_summaries": None},
    "model": {"mixed_precision": "mixed_precision", "fp16_type": "fp16_type", "use_bfloat16": None},
    "runconfig": {"precision_opt_level": None, "load_checkpoint_states": None},
}
# How close an unknown legacy key must be to a precision key to count as its typo.
_TYPO_CUTOFF = 0.85


# ---- value checkers: (value, where) -> normalised value, raising ConfigError ---------------------
def _fail(where: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{where}: expected {expected}, got {value!r}")


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "true or false", value)
    return value


def _optional_bool(value: Any, where: str) -> bool | None:
    return None if value is None else _bool(value, where)


def _positive(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, "a positive number or null", value)
    if not math.isfinite(value) or value <= 0:
        raise _fail(where, "a finite number > 0", value)
    return float(value)


def _positive_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(where, "a positive integer or null", value)
    return value


def _loss_scale(value: Any, where: str) -> str | float | None:
    if value is None or value == "dynamic":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, '"dynamic", a number or null', value)
    if not math.isfinite(value) or value <= 0:
        raise _fail(where, '"dynamic" or a finite number > 0', value)
    return float(value)


def _fp16_type(value: Any, where: str) -> str:
    if value not in FP16_TYPES:
        raise _fail(where, "one of " + " | ".join(FP16_TYPES), value)
    return value


def _opt_level(value: Any, where: str) -> int | None:
    if value is not None and (isinstance(value, bool) or value not in (0, 1, 2)):
        raise _fail(where, "0, 1, 2 or null", value)
    return value


def _state_names(value: Any, where: str) -> list[str] | None:
    # Model Zoo writes the list as "model,optimizer"; lists are accepted as well.
    if value is None:
        return None
    if isinstance(value, str):
        names = [s.strip() for s in value.split(",") if s.strip()]
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        names = [s.strip() for s in value]
    else:
        raise _fail(where, 'a comma-separated string such as "model,optimizer" or a list of names', value)
    return names


_CHECKERS: dict[str, Callable[[Any, str], Any]] = {
    "enabled": _bool,
    "mixed_precision": _bool,
    "use_bfloat16": _bool,
    "fp16_type": _fp16_type,
    "precision_opt_level": _opt_level,
    "loss_scaling_factor": _loss_scale,
    "initial_loss_scale": _positive,
    "steps_per_increase": _positive_int,
    "min_loss_scale": _positive,
    "max_loss_scale": _positive,
    "max_gradient_norm": _positive,
    "max_gradient_value": _positive,
    "log_loss_scale": _optional_bool,
    "log_summaries": _bool,
    "load_checkpoint_states": _state_names,
}


# ---- layouts ------------------------------------------------------------------------------------
def _mapping(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _read_current(data: Mapping, src: str) -> dict[str, Any]:
    trainer = _mapping(data["trainer"], f"{src}trainer")
    init = trainer.get("init", _MISSING)
    if init is _MISSING:
        return {}
    init = _mapping(init, f"{src}trainer.init")
    precision = init.get("precision", _MISSING)
    if precision is _MISSING:
        return {}
    if precision is None:
        precision = {}
    precision = _mapping(precision, f"{src}trainer.init.precision")
    out = {}
    for key, value in precision.items():
        where = f"{src}trainer.init.precision.{key}"
        if key not in _CURRENT_KEYS:
            raise ConfigError(f"{where}: unknown precision key{_hint(key, _CURRENT_KEYS)}")
        out[key] = _CHECKERS[key](value, where)
    return out


def _read_legacy(data: Mapping, src: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, known in _LEGACY_SECTIONS.items():
        body = data.get(section, _MISSING)
        if body is _MISSING or body is None:
            continue
        body = _mapping(body, f"{src}{section}")
        for key, value in body.items():
            where = f"{src}{section}.{key}"
            if key in known:
                out[key] = _CHECKERS[key](value, where)
            elif isinstance(key, str) and difflib.get_close_matches(key, known, 1, _TYPO_CUTOFF):
                raise ConfigError(f"{where}: unknown key{_hint(key, known)}")
    # `use_bfloat16` predates `fp16_type`; it may only agree with it.
    use_bf16 = out.pop("use_bfloat16", None)
    if use_bf16:
        if out.get("fp16_type", "bfloat16") != "bfloat16":
            raise ConfigError(
                f"{src}model.use_bfloat16: true contradicts model.fp16_type: {out['fp16_type']}"
            )
        out["fp16_type"] = "bfloat16"
    if "mixed_precision" in out:
        out["enabled"] = out.pop("mixed_precision")
    return out


def _hint(key: Any, known: Mapping) -> str:
    close = difflib.get_close_matches(str(key), list(known), 1, 0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return "; known keys: " + ", ".join(sorted(known))


def _build(values: dict[str, Any], src: str, dls: str, *, found: bool) -> DLSConfig:
    """Turn checked Model Zoo keys into a DLSConfig, applying Model Zoo's defaults.

    ``dls`` is the key path of the section holding the DLS keys, for error messages.
    """
    if not found:
        # No precision settings at all: Model Zoo trains in fp32 without a scaler.
        return DLSConfig(mixed_precision=False, loss_scale=None)
    if values.get("max_gradient_norm") is not None and values.get("max_gradient_value") is not None:
        raise ConfigError(
            f"{src}{dls}max_gradient_norm and {dls}max_gradient_value: set at most one of them"
        )
    enabled = values.get("enabled", True)
    fp16_type = values.get("fp16_type", "float16")
    loss_scale = values.get("loss_scaling_factor", 1.0)
    if enabled and fp16_type == "cbfloat16" and loss_scale != "dynamic":
        got = (f"got {values['loss_scaling_factor']!r}" if "loss_scaling_factor" in values
               else "absent means 1.0")
        raise ConfigError(
            f"{src}{dls}loss_scaling_factor: cbfloat16 requires loss_scaling_factor: dynamic "
            f"({got}); a static scale lets gradients underflow or overflow"
        )
    kwargs: dict[str, Any] = {"mixed_precision": enabled, "fp16_type": fp16_type,
                              "loss_scale": loss_scale}
    for key, field_name in _DLS_KEYS.items():
        if key != "loss_scaling_factor" and values.get(key) is not None:
            kwargs[field_name] = values[key]
    if values.get("log_loss_scale", _MISSING) is None:
        # Model Zoo: null means "log when the scale is dynamic".
        kwargs["log_loss_scale"] = loss_scale == "dynamic"
    extras = {k: values[k] for k in ("precision_opt_level", "log_summaries", "load_checkpoint_states")
              if values.get(k) is not None}
    try:
        return DLSConfig(**kwargs, extras=extras)
    except ConfigError as exc:
        # DLSConfig names its own fields; name the YAML keys the user wrote instead.
        yaml_key = {field_name: key for key, field_name in _DLS_KEYS.items()}
        msg = re.sub(r"\b(" + "|".join(yaml_key) + r")\b",
                     lambda m: dls + yaml_key[m.group(1)], str(exc))
        raise ConfigError(f"{src}{msg}") from None


def _read_flat(data: Mapping, src: str) -> DLSConfig:
    names = {f.name for f in fields(DLSConfig)}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(
                f"{src}{key}: unknown DLSConfig field{_hint(key, dict.fromkeys(names))} "
                "(Model Zoo files put precision settings under trainer.init.precision)"
            )
        if key in ("mixed_precision", "log_loss_scale", "consecutive_hysteresis"):
            _bool(value, f"{src}{key}")
        if key == "extras":
            _mapping(value, f"{src}extras")
    kwargs = dict(data)
    if "extras" in kwargs:
        kwargs["extras"] = dict(kwargs["extras"])
    try:
        return DLSConfig(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{src}{exc}") from None


def config_from_params(data: dict[str, Any], *, source: str = "<dict>") -> DLSConfig:
    """Build a `DLSConfig` from a parsed Model Zoo params dict (current, legacy or flat layout).

    ``source`` names the origin in error messages (usually the YAML file's path).

    Example:
        >>> cfg = config_from_params({"trainer": {"init": {"precision": {
        ...     "fp16_type": "cbfloat16", "loss_scaling_factor": "dynamic"}}}})
        >>> cfg.init_scale == 2.0**31
        True
    """
    src = f"{source}: "
    if not isinstance(data, Mapping):
        got = "nothing (empty document)" if data is None else type(data).__name__
        raise ConfigError(f"{source}: the top level must be a mapping of settings, got {got}")
    legacy_present = any(
        isinstance(data.get(s), Mapping) and any(k in data[s] for k in keys)
        for s, keys in _LEGACY_SECTIONS.items()
    )
    if "trainer" in data:
        if legacy_present:
            raise ConfigError(
                f"{source}: precision settings found both under trainer.init.precision (current "
                "layout) and under optimizer/model/runconfig (legacy layout); keep one layout"
            )
        values = _read_current(data, src)
        trainer = data["trainer"]
        found = isinstance(trainer.get("init"), Mapping) and "precision" in trainer["init"]
        return _build(values, src, "trainer.init.precision.", found=found)
    if any(s in data for s in _LEGACY_SECTIONS):
        values = _read_legacy(data, src)
        return _build(values, src, "optimizer.", found=bool(values))
    return _read_flat(data, src)


# ---- YAML ---------------------------------------------------------------------------------------
class _Loader:
    """A PyYAML SafeLoader that also reads ``1e-4``/``2e15`` as floats (YAML 1.2 does; 1.1 does not)."""

    _cls: Any = None

    @classmethod
    def get(cls) -> Any:
        if cls._cls is None:
            import yaml

            class Loader(yaml.SafeLoader):
                pass

            Loader.add_implicit_resolver(
                "tag:yaml.org,2002:float",
                re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                list("-+0123456789"),
            )
            cls._cls = Loader
        return cls._cls


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file, turning every failure into a one-line `ConfigError` naming the file."""
    import yaml

    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{name}: is a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: cannot read: {exc}") from None
    try:
        return yaml.load(text, Loader=_Loader.get())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{name}: invalid YAML{where}: {problem}") from None


def config_from_yaml(path: str | Path) -> DLSConfig:
    """Read the precision settings of a Model Zoo ``params.yaml`` (see the module docstring).

    Example:
        >>> cfg = config_from_yaml("params.yaml")  # doctest: +SKIP
        >>> cfg.loss_scale, cfg.fp16_type  # doctest: +SKIP
        ('dynamic', 'cbfloat16')
    """
    return config_from_params(load_yaml(path), source=str(path))
