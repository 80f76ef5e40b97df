"""Read a DeepSpeed config's loss-scaling settings as `DLSConfig` arguments.

`DLSConfig.from_deepspeed` is the entry point; like `dlspass.modelzoo`, this module sits below
`dlspass.config` and returns keyword arguments, which the config checks.

What is read (every other top-level key, the optimizer, batch sizes and so on, is ignored):

- ``fp16``: ``enabled``, ``loss_scale`` (0 is dynamic), ``initial_scale_power``,
  ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``,
  ``auto_cast`` (kept in ``extras``: it casts inputs, not the scale);
- ``bf16`` (or the older ``bfloat16``): ``enabled`` (bfloat16: no loss scaling);
- ``zero_optimization.stage``: 1-3 run ZeRO's ``DynamicLossScaler`` (policy ``deepspeed``, or
  ``deepspeed-0.17.0`` up to that release); 0 or absent, the fp16 optimizer without ZeRO
  (``FP16_Optimizer`` / ``FP16_UnfusedOptimizer._update_scale``: no hysteresis, policy
  ``deepspeed-fp16-optimizer``);
- ``gradient_clipping``: global-norm clipping (0: none).

What an absent key means depends on the release (docs/SEMANTICS.md §3.2): from 0.17.1 on the
engine always passes the ``fp16`` section's defaults (``DeepSpeedFP16Config``: power 16, window
1000, hysteresis 2, floor 1). Up to 0.17.0 (``get_dynamic_loss_scale_args``) it passes them only
when the section names one of the five dynamic keys; otherwise ZeRO builds
``DynamicLossScaler()`` with its own defaults (2**32, window 1000, floor 1, hysteresis 1) and the
optimizer without ZeRO takes its floor from the optimizer class (1 for FusedAdam, 0.25 for the
others), which the config file does not say: such a file is refused unless it sets a
static ``loss_scale`` (no dynamic default is read then).

Anything dlspass cannot map is refused with one line (``ConfigError`` from `DLSConfig`):
an unknown key in ``fp16``, ``"auto"`` (which the Hugging Face integration fills in),
``fp16_master_weights_and_grads`` (fp16 master weights), fp16 and bf16 both enabled.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dlspass.errors import InputValueError
from dlspass.modelzoo import ModelZooSettings
from dlspass.presets import excerpt, parse_release_name

FIRST_RELEASE = (0, 10, 0)
LATEST_RELEASE = (0, 19, 8)
GROWTH_RULE_CHANGED = (0, 17, 1)
"""DeepSpeed PR #6976: the growth test moved one clean step later, and the engine started
passing the fp16 section's defaults whatever keys the section names."""
MAX_CONFIG_BYTES = 1 << 20

_DYNAMIC_KEYS = ("initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis",
                 "consecutive_hysteresis")
_FP16_KEYS = ("enabled", "auto_cast", "loss_scale", *_DYNAMIC_KEYS, "fp16_master_weights_and_grads")
# DeepSpeedFP16Config's defaults (precision_config.py since 0.17.1, constants.py before)
_FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "min_loss_scale": 1,
                  "hysteresis": 2, "consecutive_hysteresis": False}
# DynamicLossScaler() up to 0.17.0, what ZeRO builds when no dynamic key is named
_SCALER_DEFAULTS_UP_TO_0_17_0 = {"initial_scale_power": 32, "loss_scale_window": 1000,
                                 "min_loss_scale": 1, "hysteresis": 1,
                                 "consecutive_hysteresis": False}


def parse_release(release: str | tuple[int, int, int] | None) -> tuple[int, int, int]:
    """``"0.19.8"``, ``"v0.17.0"`` or a tuple; ``None`` is the newest release dlspass knows."""
    if release is None:
        return LATEST_RELEASE
    parsed = parse_release_name(release, r"v?(\d{1,3})\.(\d{1,3})\.(\d{1,3})", key="release",
                                example="'0.19.8'", shape="(major, minor, patch)")
    if not FIRST_RELEASE <= parsed <= LATEST_RELEASE:
        raise InputValueError(f"release: DeepSpeed {'.'.join(map(str, parsed))} is outside the "
                              f"releases dlspass has read (0.10.0 to 0.19.8)")
    return parsed


def _load(path_or_dict: str | Path | Mapping) -> tuple[Mapping, str]:
    if isinstance(path_or_dict, Mapping):
        return path_or_dict, "<dict>"
    if not isinstance(path_or_dict, (str, Path)):
        raise InputValueError(f"expected a DeepSpeed config path or dict, got {excerpt(path_or_dict)}")
    path = Path(path_or_dict)
    if not path.is_file():
        raise InputValueError(f"{path}: not a regular file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise InputValueError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a DeepSpeed config")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputValueError(f"{path}: not JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, Mapping):
        raise InputValueError(f"{path}: the top level must be an object, got {excerpt(data)}")
    return data, str(path)


def _enabled(section: Any, where: str) -> bool:
    if section is None:
        return False
    if not isinstance(section, Mapping):
        raise InputValueError(f"{where}: expected an object, got {excerpt(section)}")
    value = section.get("enabled", False)
    _no_auto(value, f"{where}.enabled")
    if not isinstance(value, bool):
        raise InputValueError(f"{where}.enabled: expected true or false, got {excerpt(value)}")
    return value


def _no_auto(value: Any, where: str) -> None:
    if value == "auto":
        raise InputValueError(f"{where}: 'auto' is filled in by the Hugging Face integration; "
                              "write the value it resolves to")


def _int(value: Any, where: str, low: int | None = None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        need = f"an integer >= {low}" if low is not None else "an integer"
        raise InputValueError(f"{where}: expected {need}, got {excerpt(value)}")
    return value


def _zero_stage(data: Mapping, src: str) -> int:
    zero = data.get("zero_optimization")
    if zero is None:
        return 0
    if not isinstance(zero, Mapping):
        raise InputValueError(f"{src}zero_optimization: expected an object, got {excerpt(zero)}")
    stage = zero.get("stage", 0)
    _no_auto(stage, f"{src}zero_optimization.stage")
    stage = _int(stage, f"{src}zero_optimization.stage", 0)
    if stage > 3:
        raise InputValueError(f"{src}zero_optimization.stage: expected 0, 1, 2 or 3, got {stage}")
    return stage


def _clipping(data: Mapping, src: str) -> dict[str, Any]:
    value = data.get("gradient_clipping", 0.0)
    _no_auto(value, f"{src}gradient_clipping")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InputValueError(f"{src}gradient_clipping: expected a number >= 0, got {excerpt(value)}")
    return {"max_gradient_norm": float(value)} if value > 0 else {}


def settings_from_deepspeed(path_or_dict: str | Path | Mapping,
                            release: str | tuple[int, int, int] | None = None) -> ModelZooSettings:
    """The `DLSConfig` arguments of a DeepSpeed config (module docstring);
    `DLSConfig.from_deepspeed` is the entry point."""
    data, source = _load(path_or_dict)
    rel = parse_release(release)
    src = f"{source}: "
    fp16 = data.get("fp16")
    fp16_on = _enabled(fp16, f"{src}fp16")
    bf16_key = "bf16" if "bf16" in data else "bfloat16"
    bf16_on = _enabled(data.get(bf16_key), f"{src}{bf16_key}")
    clipping = _clipping(data, src)
    if fp16_on and bf16_on:
        raise InputValueError(f"{src}fp16.enabled and {bf16_key}.enabled: DeepSpeed refuses both "
                              "(bfloat16 and fp16 modes cannot be simultaneously enabled)")
    if bf16_on:
        return ModelZooSettings({"fp16_type": "bfloat16", "loss_scale": None, **clipping}, src)
    if not fp16_on:
        return ModelZooSettings({"mixed_precision": False, "loss_scale": None, **clipping}, src)
    assert isinstance(fp16, Mapping)
    for key, value in fp16.items():
        if key not in _FP16_KEYS:
            close = difflib.get_close_matches(str(key)[:200], _FP16_KEYS, 1, 0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(_FP16_KEYS)}"
            raise InputValueError(f"{src}fp16.{excerpt(key) if not isinstance(key, str) else key[:60]}: "
                                  f"unknown key{hint}")
        _no_auto(value, f"{src}fp16.{key}")
    if fp16.get("fp16_master_weights_and_grads", False) is not False:
        raise InputValueError(f"{src}fp16.fp16_master_weights_and_grads: fp16 master weights are "
                              "not supported (dlspass keeps float32 master weights)")
    stage = _zero_stage(data, src)
    current = rel >= GROWTH_RULE_CHANGED
    loss_scale = fp16.get("loss_scale", 0)
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not loss_scale >= 0:
        raise InputValueError(f"{src}fp16.loss_scale: expected 0 (dynamic) or a positive number, "
                              f"got {excerpt(loss_scale)}")
    kwargs: dict[str, Any] = {"fp16_type": "float16", **clipping}
    if fp16.get("auto_cast") is not None:
        if not isinstance(fp16["auto_cast"], bool):
            raise InputValueError(f"{src}fp16.auto_cast: expected true or false, got "
                                  f"{excerpt(fp16['auto_cast'])}")
        kwargs["extras"] = {"auto_cast": fp16["auto_cast"]}
    if loss_scale > 0:  # a static scale: no dynamic default is read, whatever the release
        kwargs["loss_scale"] = float(loss_scale)
        return ModelZooSettings(kwargs, src, _KEY_PATHS)
    named = [k for k in _DYNAMIC_KEYS if k in fp16]
    if current or named:
        values = {**_FP16_DEFAULTS, **{k: fp16[k] for k in named}}
    elif stage > 0:
        values = dict(_SCALER_DEFAULTS_UP_TO_0_17_0)
    else:
        raise InputValueError(
            f"{src}fp16: DeepSpeed {'.'.join(map(str, rel))} without ZeRO and without any of "
            f"{', '.join(_DYNAMIC_KEYS)} takes the scale's floor from the optimizer class (1 for "
            "FusedAdam, 0.25 for the others); name fp16.min_loss_scale")
    power = _int(values["initial_scale_power"], f"{src}fp16.initial_scale_power")
    window = _int(values["loss_scale_window"], f"{src}fp16.loss_scale_window", 1)
    hysteresis = _int(values["hysteresis"], f"{src}fp16.hysteresis", 1)
    consecutive = values["consecutive_hysteresis"]
    if not isinstance(consecutive, bool):
        raise InputValueError(f"{src}fp16.consecutive_hysteresis: expected true or false, got "
                              f"{excerpt(consecutive)}")
    floor = values["min_loss_scale"]
    if current:  # DeepSpeedFP16Config declares it an int (pydantic refuses 0.5)
        floor = _int(floor, f"{src}fp16.min_loss_scale", 1)
    elif isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0:
        raise InputValueError(f"{src}fp16.min_loss_scale: expected a number > 0, got {excerpt(floor)}")
    if not -149 <= power <= 127:
        raise InputValueError(f"{src}fp16.initial_scale_power: 2**{power} is outside float32's range "
                              "for a loss scale; the scale is held in float32")
    if stage == 0:
        policy = "deepspeed-fp16-optimizer"
    else:
        policy = "deepspeed" if current else "deepspeed-0.17.0"
    kwargs.update(loss_scale="dynamic", policy=policy, initial_loss_scale=2.0**power,
                  steps_per_increase=window, min_loss_scale=float(floor),
                  consecutive_hysteresis=consecutive)
    if policy != "deepspeed-fp16-optimizer":  # FP16_Optimizer never reads them
        kwargs["hysteresis"] = hysteresis
    return ModelZooSettings(kwargs, src, _KEY_PATHS)


_KEY_PATHS = {"initial_loss_scale": "fp16.initial_scale_power (as 2**power)",
              "steps_per_increase": "fp16.loss_scale_window", "min_loss_scale": "fp16.min_loss_scale",
              "hysteresis": "fp16.hysteresis", "max_gradient_norm": "gradient_clipping"}
