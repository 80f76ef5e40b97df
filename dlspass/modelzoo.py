"""Read the precision settings of a Cerebras Model Zoo ``params.yaml`` as `DLSConfig` arguments.

`DLSConfig.from_yaml` / `DLSConfig.from_dict` are the entry points; this module sits below
`dlspass.config` and returns keyword arguments (`ModelZooSettings`), which the config checks.

Three layouts are understood:

- current (Model Zoo >= 2.3): ``trainer.init.precision`` holds ``enabled``, ``fp16_type``,
  ``precision_opt_level``, ``loss_scaling_factor``, ``initial_loss_scale``,
  ``steps_per_increase``, ``min_loss_scale``, ``max_loss_scale``, ``max_gradient_norm`` /
  ``max_gradient_value`` and ``log_loss_scale``;
- legacy: the DLS keys (plus ``log_summaries``) under ``optimizer:``; ``mixed_precision``,
  ``fp16_type``, the older ``use_bfloat16`` and (up to 2.0) ``precision_opt_level`` under
  ``model:``; ``precision_opt_level`` and ``load_checkpoint_states`` under ``runconfig:``;
  ``use_cbfloat16`` under ``csconfig:`` (up to 1.9);
- flat: a dict of `DLSConfig` field names, as `DLSConfig.to_dict` returns it.

What an absent key means depends on the Model Zoo release that runs the file (``fp16_type``
became bfloat16 by default in 2.4, ``log_loss_scale`` follows ``loss_scaling_factor`` since 2.5,
GPT-style models defaulted to bfloat16 from 1.7 to 2.2, and in 2.2 every model with a config
class): `ModelZooRules` holds those rules per release, read from each release's code;
docs/MODELZOO.md lists them with their sources. Without ``modelzoo_release`` the newest release's
rules apply (what running the file on Model Zoo today does), unless the file uses keys only older
releases read (``use_bfloat16``, ``csconfig.use_cbfloat16``, ``model.precision_opt_level``): then
it is read as a 2.0 file.

Model Zoo configs are full of unrelated keys (learning rates, model sizes, data paths): those are
ignored. Inside the precision settings every key must be known and well typed; mistakes are a
one-line error (a ``ConfigError`` from `DLSConfig.from_yaml`) that names the file and the key
path and shows a bounded excerpt of the value. In the legacy sections, which mix precision keys
with everything else, a near miss of a precision key (``loss_scaling_factr``) is an error too,
so that a typo cannot turn DLS off.

Files are read defensively: regular files only, at most `MAX_YAML_BYTES`, no duplicate keys
(Model Zoo's loader rejects them since 2.5), a bound on nesting depth and on the size of the
tree that aliases expand to, so that a crafted file fails fast with one line.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlspass.errors import InputValueError
from dlspass.files.bounded_yaml import load_yaml
from dlspass.files.near_miss import near_miss
from dlspass.modelzoo_releases import (
    BFLOAT16_DEFAULTS,
    LATEST_RELEASE,
    ModelZooRules,
    model_from_params,
    model_from_path,
    modelzoo_rules,
)
from dlspass.presets import FLOAT32_MAX, FP16_TYPES, excerpt, preset_defaults

__all__ = ["ModelZooRules", "ModelZooSettings", "load_yaml", "modelzoo_rules",
           "settings_from_params", "settings_from_yaml"]

_MISSING = object()

# Model Zoo precision key -> DLSConfig field
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
    "model": {"mixed_precision": None, "fp16_type": None, "use_bfloat16": None,
              "precision_opt_level": None},
    "runconfig": {"precision_opt_level": None, "load_checkpoint_states": None, "log_steps": None},
    "csconfig": {"use_cbfloat16": None},
}
# How close an unknown legacy key must be to a precision key to count as its typo.
_TYPO_CUTOFF = 0.85
# cstorch's GradScaler refuses a dynamic min_loss_scale below 2**-14 ("min_loss_scale too small").
_CSTORCH_MIN_LOSS_SCALE = 2.0**-14

# ---- value checkers: (value, where) -> normalized value, raising InputValueError ---------------------
def _key(key: Any) -> str:
    """A mapping key as it appears in a key path: short strings as they are, others as an excerpt."""
    return key if isinstance(key, str) and len(key) <= 60 and key.isprintable() else excerpt(key)


def _fail(where: str, expected: str, value: Any) -> InputValueError:
    return InputValueError(f"{where}: expected {expected}, got {excerpt(value)}")


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "true or false", value)
    return value


def _optional_bool(value: Any, where: str) -> bool | None:
    return None if value is None else _bool(value, where)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, inf, NaN, or too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        v = float(value)
    except OverflowError:
        return None
    return v if v == v and abs(v) != float("inf") else None


def _positive_number(value: Any, where: str, either: str = "") -> float:
    """A finite number > 0; ``either`` names the alternative a key also takes (``"dynamic"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, f"{either}, a number or null" if either else "a positive number or null",
                    value)
    v = _finite(value)
    if v is None or v <= 0:
        raise _fail(where, f"{either} or a finite number > 0" if either else "a finite number > 0",
                    value)
    return v


def _positive(value: Any, where: str) -> float | None:
    return None if value is None else _positive_number(value, where)


def _positive_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(where, "a positive integer or null", value)
    return value


def _loss_scale(value: Any, where: str) -> str | float | None:
    if value is None or value == "dynamic":
        return value
    return _positive_number(value, where, either='"dynamic"')


def _fp16_type(value: Any, where: str) -> str:
    if not isinstance(value, str) or value not in FP16_TYPES:
        raise _fail(where, "one of " + " | ".join(FP16_TYPES), value)
    return value


def _opt_level(value: Any, where: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2)):
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
    "use_cbfloat16": _bool,
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
    "log_steps": _positive_int,
}


# ---- layouts ------------------------------------------------------------------------------------
def _mapping(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise InputValueError(f"{where}: expected a mapping, got {excerpt(value)}")
    return value


def _read_current(data: Mapping, src: str) -> dict[str, Any] | None:
    """The checked keys of trainer.init.precision; None when there is no precision callback."""
    trainer = _mapping(data["trainer"], f"{src}trainer")
    _refuse_near_misses(trainer, _TRAINER_SECTIONS, f"{src}trainer.")
    init = trainer.get("init", _MISSING)
    if init is _MISSING:
        return None
    init = _mapping(init, f"{src}trainer.init")
    _refuse_near_misses(init, _INIT_SECTIONS, f"{src}trainer.init.")
    precision = init.get("precision", _MISSING)
    if precision is _MISSING or precision is None:
        # trainer/validate.py: `precision: Optional[MixedPrecision config] = None`, and
        # trainer/utils.py builds no Precision callback from None: fp32 without a scaler.
        return None
    precision = _mapping(precision, f"{src}trainer.init.precision")
    out = {}
    for key, value in precision.items():
        where = f"{src}trainer.init.precision.{_key(key)}"
        if key not in _CURRENT_KEYS:
            raise InputValueError(f"{where}: unknown precision key{_hint(key, _CURRENT_KEYS)}")
        out[key] = _CHECKERS[key](value, where)
    return out


def _current_log_steps(data: Mapping, src: str) -> dict[str, Any]:
    """``{"log_steps": n}`` from trainer.init.logging.log_steps (how often the scale is logged;
    `dlspass.scale_log`), else empty."""
    logging_ = data["trainer"].get("init", {})
    logging_ = logging_.get("logging") if isinstance(logging_, Mapping) else None
    if not isinstance(logging_, Mapping) or logging_.get("log_steps") is None:
        return {}
    return {"log_steps": _positive_int(logging_["log_steps"], f"{src}trainer.init.logging.log_steps")}


def _read_legacy(data: Mapping, src: str) -> dict[str, Any]:
    """The checked precision keys of the legacy sections, as ``section.key``."""
    out: dict[str, Any] = {}
    for section, known in _LEGACY_SECTIONS.items():
        body = data.get(section, _MISSING)
        if body is _MISSING or body is None:
            continue
        body = _mapping(body, f"{src}{section}")
        for key, value in body.items():
            where = f"{src}{section}.{_key(key)}"
            if key in known:
                out[f"{section}.{key}"] = _CHECKERS[key](value, where)
            elif near_miss(key, known) is not None or isinstance(key, str) and len(key) < 200 \
                    and difflib.get_close_matches(key, known, 1, _TYPO_CUTOFF):
                raise InputValueError(f"{where}: unknown key{_hint(key, known)}")
    return out


def _legacy_to_current(values: dict[str, Any], src: str, rules: ModelZooRules) -> dict[str, Any]:
    """Fold legacy keys into the current layout's names, as the given release reads them."""
    out = {k.split(".", 1)[1]: v for k, v in values.items()
           if k.startswith("optimizer.") and k != "optimizer.log_summaries"}
    if "model.mixed_precision" in values:
        out["enabled"] = values["model.mixed_precision"]
    if "model.fp16_type" in values:
        out["fp16_type"] = values["model.fp16_type"]
    use_bf16 = values.get("model.use_bfloat16")
    if use_bf16 is not None and not rules.reads_use_bfloat16:
        raise InputValueError(f"{src}model.use_bfloat16: Model Zoo {_name(rules)} rejects this key "
                              "(deprecated in 2.1; use model.fp16_type)")
    if use_bf16:
        if out.get("fp16_type", "bfloat16") != "bfloat16":
            raise InputValueError(f"{src}model.use_bfloat16: true contradicts model.fp16_type: {out['fp16_type']}")
        out["fp16_type"] = "bfloat16"
    elif use_bf16 is False and "fp16_type" not in out:
        out["fp16_type"] = "float16"
    use_cb16 = values.get("csconfig.use_cbfloat16")
    if use_cb16 is not None and not rules.reads_csconfig:
        raise InputValueError(f"{src}csconfig.use_cbfloat16: Model Zoo {_name(rules)} does not read this "
                              "key (last read by 1.9); use model.fp16_type: cbfloat16")
    if use_cb16:
        if use_bf16 or out.get("fp16_type", "cbfloat16") != "cbfloat16":
            raise InputValueError(f"{src}csconfig.use_cbfloat16: true contradicts the model's bfloat16/float16 setting")
        out["fp16_type"] = "cbfloat16"
    model_pol = values.get("model.precision_opt_level")
    if model_pol is not None and not rules.reads_model_precision_opt_level:
        raise InputValueError(f"{src}model.precision_opt_level: Model Zoo {_name(rules)} no longer reads "
                              "it here; use runconfig.precision_opt_level")
    # run_cstorch_flow.py (1.9, 2.0): runconfig's value wins over the deprecated model one.
    pol = values.get("runconfig.precision_opt_level", model_pol)
    if pol is not None:
        out["precision_opt_level"] = pol
    if "optimizer.log_summaries" in values and not rules.logs_scale_with_scaler:
        logs = values["optimizer.log_summaries"] and rules.log_summaries_logs_scale
        out["log_loss_scale"] = logs
    return out


def _name(rules: ModelZooRules) -> str:
    return f"{rules.release[0]}.{rules.release[1]}"


# The sections a precision setting lives in, by the mapping that holds them: a key next to
# them that is a near miss of one is a typo that would read as "no precision settings".
_TOP_SECTIONS = ("trainer", *_LEGACY_SECTIONS)
_TRAINER_SECTIONS = ("init",)
_INIT_SECTIONS = ("precision", "logging")


def _refuse_near_misses(body: Mapping, known: Collection[str], where: str) -> None:
    """One line naming the first key of ``body`` that is a near miss of a section in ``known``."""
    for key in body:
        close = near_miss(key, known)
        if close is not None:
            raise InputValueError(
                f"{where}{_key(key)}: unknown key, a near miss of {close!r} (a misspelt section "
                "would silently read as no precision settings); spell it exactly")


def _hint(key: Any, known: Mapping) -> str:
    close = [near_miss(key, known)] if near_miss(key, known) else \
        difflib.get_close_matches(str(key)[:200], list(known), 1, 0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return "; known keys: " + ", ".join(sorted(known))


@dataclass(frozen=True)
class ModelZooSettings:
    """What a Model Zoo file says: ``kwargs`` for `DLSConfig`, and how to name its fields in a
    message the way the file does (``source`` prefix, ``key_paths``: field -> key path)."""

    kwargs: dict[str, Any]
    source: str
    key_paths: dict[str, str] = field(default_factory=dict)

    def in_file_terms(self, message: str) -> str:
        """``message`` (about `DLSConfig` fields) naming the file and the keys the file wrote."""
        if self.key_paths:
            message = re.sub(r"\b(" + "|".join(self.key_paths) + r")\b",
                             lambda m: self.key_paths[m.group(1)], message)
        return f"{self.source}{message}"


def _build(values: dict[str, Any] | None, src: str, dls: str, rules: ModelZooRules,
           extras: dict[str, Any]) -> ModelZooSettings:
    """Turn checked Model Zoo keys into DLSConfig arguments, applying the release's defaults.

    ``values`` None means no precision callback (fp32 without a scaler); ``dls`` is the key path
    of the section holding the DLS keys, for error messages.
    """
    if values is None:
        off = {"mixed_precision": False, "loss_scale": None, "extras": extras}
        return ModelZooSettings(off, src)
    if values.get("max_gradient_norm") is not None and values.get("max_gradient_value") is not None:
        raise InputValueError(
            f"{src}{dls}max_gradient_norm and {dls}max_gradient_value: set at most one of them"
        )
    enabled = values.get("enabled", True)
    fp16_type = values.get("fp16_type") or rules.default_fp16_type()
    loss_scale = values.get("loss_scaling_factor", 1.0)
    if enabled and not values.get("fp16_type") and rules.model is None and rules.release in BFLOAT16_DEFAULTS:
        _warn_family_unknown(src, rules, fp16_type, loss_scale)
    if enabled and fp16_type == "cbfloat16" and loss_scale != "dynamic":
        got = (f"got {excerpt(values['loss_scaling_factor'])}" if "loss_scaling_factor" in values
               else "absent means 1.0")
        raise InputValueError(
            f"{src}{dls}loss_scaling_factor: cbfloat16 requires loss_scaling_factor: dynamic "
            f"({got}); a static scale lets gradients underflow or overflow"
        )
    kwargs: dict[str, Any] = {"mixed_precision": enabled, "fp16_type": fp16_type, "loss_scale": loss_scale}
    for key, field_name in _DLS_KEYS.items():
        if key not in ("loss_scaling_factor", "log_loss_scale") and values.get(key) is not None:
            kwargs[field_name] = values[key]
    log = values.get("log_loss_scale")
    if log is None and rules.logs_scale_with_scaler:
        log = enabled and loss_scale != 1.0
    elif log is None:
        log = rules.log_follows_dynamic and loss_scale == "dynamic"
    kwargs["log_loss_scale"] = log
    if loss_scale == "dynamic" and fp16_type != "bfloat16":
        _cstorch_dynamic_rules(kwargs, values, src, dls)
    if values.get("precision_opt_level") is not None:
        extras = {"precision_opt_level": values["precision_opt_level"], **extras}
    if enabled and fp16_type == "bfloat16" and loss_scale not in (None, 1.0):
        # MixedPrecision.setup: "No need to use loss scaling when half dtype is bfloat16".
        why = f" (Model Zoo {_name(rules)}'s default)" if "fp16_type" not in values else ""
        warnings.warn(f"{src}{dls}loss_scaling_factor: {excerpt(loss_scale)} is dropped: the half "
                      f"format is bfloat16{why}, which has float32's range, so Model Zoo trains "
                      "without loss scaling", UserWarning, stacklevel=6)
    # DLSConfig names its own fields; messages name the YAML keys the user wrote instead
    key_paths = {field_name: dls + key for key, field_name in _DLS_KEYS.items()}
    return ModelZooSettings({**kwargs, "extras": extras}, src, key_paths)


def _warn_family_unknown(src: str, rules: ModelZooRules, fp16_type: str, loss_scale: Any) -> None:
    """One warning naming every setting whose default depends on the model family, which the file
    does not say (1.7-2.2: GPT-style models default the half format to bfloat16 in their
    ``set_defaults``, 2.2 also every model with a config class (`BFLOAT16_DEFAULTS`), and the
    runners then drop a dynamic scale: "No need to use DLS for loss when ``use_bfloat16`` is
    set", R_1.7 ``pytorch_base_runner.py``, 1.8-1.9 ``PyTorchBaseModel.py`` /
    ``run_cstorch_flow.py``, 2.0-2.2 ``run_cstorch_flow.py``)."""
    models = ", ".join(sorted(BFLOAT16_DEFAULTS[rules.release]))
    settings = [f"the half format is not named, read as {fp16_type} (bfloat16 for {models})"]
    if loss_scale == "dynamic":
        settings.append("optimizer.loss_scaling_factor: dynamic is kept (with those models' "
                        "bfloat16 Model Zoo drops it and trains without loss scaling)")
    warnings.warn(f"{src}the model family is not named and Model Zoo {_name(rules)} defaults "
                  f"{len(settings)} setting{'s' if len(settings) > 1 else ''} per model: "
                  f"{'; '.join(settings)}. Pass modelzoo_model (CLI: --modelzoo-model) or name "
                  "model.fp16_type", UserWarning, stacklevel=7)


def _cstorch_dynamic_rules(kwargs: dict[str, Any], values: dict[str, Any], src: str, dls: str) -> None:
    """cstorch GradScaler: init = min(max, init); a dynamic min below 2**-14 is refused."""
    low = values.get("min_loss_scale")
    if low is not None and low < _CSTORCH_MIN_LOSS_SCALE:
        raise InputValueError(f"{src}{dls}min_loss_scale: {excerpt(low)} is below 2**-14; cstorch's "
                              "GradScaler refuses it (min_loss_scale too small)")
    init = values.get("initial_loss_scale")
    if init is None:
        return
    high = values.get("max_loss_scale")
    if high is None:
        high = preset_defaults("cerebras", kwargs["fp16_type"]).max_loss_scale
    if init > high and init <= FLOAT32_MAX:
        kwargs["initial_loss_scale"] = float(high)


def _read_flat(data: Mapping, src: str, names: Collection[str]) -> ModelZooSettings:
    for key, value in data.items():
        if key not in names:
            raise InputValueError(
                f"{src}{_key(key)}: "
                f"unknown DLSConfig field{_hint(key, dict.fromkeys(names))} "
                "(Model Zoo files put precision settings under trainer.init.precision)"
            )
        if key in ("mixed_precision", "log_loss_scale", "consecutive_hysteresis"):
            _bool(value, f"{src}{key}")
        if key == "extras":
            _mapping(value, f"{src}extras")
    kwargs = dict(data)
    if "extras" in kwargs:
        kwargs["extras"] = dict(kwargs["extras"])
    return ModelZooSettings(kwargs, src)


def _detect_rules(legacy: dict[str, Any]) -> ModelZooRules:
    """Without a release: the newest, unless the file uses keys only releases <= 2.0 read."""
    if "csconfig.use_cbfloat16" in legacy:
        return ModelZooRules((1, 9))
    if {"model.use_bfloat16", "model.precision_opt_level"} & legacy.keys():
        return ModelZooRules((2, 0))
    return ModelZooRules(LATEST_RELEASE)


def settings_from_params(data: dict[str, Any], *, fields: Collection[str], source: str = "<dict>",
                         modelzoo_release: str | tuple[int, int] | None = None,
                         modelzoo_model: str | None = None) -> ModelZooSettings:
    """The DLSConfig arguments of a parsed Model Zoo params dict (current, legacy or flat layout).

    ``fields``: the DLSConfig field names a flat dict may use; ``source`` names the origin in
    error messages (usually the YAML file's path); ``modelzoo_release`` / ``modelzoo_model``
    select the release's defaults (module docstring). `DLSConfig.from_dict` is the entry point.
    """
    src = f"{source}: "
    if not isinstance(data, Mapping):
        got = "nothing (empty document)" if data is None else excerpt(data)
        raise InputValueError(f"{source}: the top level must be a mapping of settings, got {got}")
    # the family: as named, else as the file says it (its GPT data processor), else unknown
    if modelzoo_model is None and "trainer" not in data:
        modelzoo_model = model_from_params(data)
    rules = None if modelzoo_release is None else modelzoo_rules(modelzoo_release, modelzoo_model)
    _refuse_near_misses(data, _TOP_SECTIONS, src)
    legacy_present = any(
        isinstance(data.get(s), Mapping) and any(k in data[s] for k in keys)
        for s, keys in _LEGACY_SECTIONS.items()
    )
    if "trainer" in data:
        if legacy_present:
            raise InputValueError(
                f"{source}: precision settings found both under trainer.init.precision (current "
                "layout) and under optimizer/model/runconfig (legacy layout); keep one layout"
            )
        rules = rules or modelzoo_rules(None, modelzoo_model)
        if not rules.has_trainer:
            raise InputValueError(f"{source}: the trainer layout needs Model Zoo 2.3 or later "
                                  f"(modelzoo_release is {_name(rules)})")
        values = _read_current(data, src)
        return _build(values, src, "trainer.init.precision.", rules, _current_log_steps(data, src))
    if any(s in data for s in _LEGACY_SECTIONS):
        raw = _read_legacy(data, src)
        if rules is None:
            rules = _detect_rules(raw)
            rules = ModelZooRules(rules.release, modelzoo_model)
        extras = {}
        if raw.get("runconfig.load_checkpoint_states") is not None:
            extras["load_checkpoint_states"] = raw["runconfig.load_checkpoint_states"]
        if raw.get("optimizer.log_summaries") is not None:
            extras["log_summaries"] = raw["optimizer.log_summaries"]
        if raw.get("runconfig.log_steps") is not None:
            extras["log_steps"] = raw["runconfig.log_steps"]
        precision_keys = {k for k in raw if k not in ("runconfig.load_checkpoint_states", "runconfig.log_steps")}
        values = _legacy_to_current(raw, src, rules) if precision_keys else None
        return _build(values, src, "optimizer.", rules, extras)
    return _read_flat(data, src, fields)


def settings_from_yaml(path: str | Path, *, fields: Collection[str],
                       modelzoo_release: str | tuple[int, int] | None = None,
                       modelzoo_model: str | None = None) -> ModelZooSettings:
    """The DLSConfig arguments of a Model Zoo ``params.yaml`` (see `settings_from_params`);
    `DLSConfig.from_yaml` is the entry point."""
    return settings_from_params(load_yaml(path), fields=fields, source=str(path),
                                modelzoo_release=modelzoo_release,
                                modelzoo_model=modelzoo_model or model_from_path(path))
