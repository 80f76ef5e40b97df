"""Policy as data: the scale-policy presets, the formats and policies a config may name, and how
config messages quote a value.

Below `dlspass.config` (which checks a `DLSConfig` against these) and `dlspass.modelzoo` (which
reads Model Zoo files into `DLSConfig` arguments), so that neither imports the other's layer.
Defaults follow the presets table of docs/SEMANTICS.md §2 (cstorch's and the other tools'
defaults, with their sources).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from dlspass.errors import InputValueError
from dlspass.files.bounded_text import excerpt as bounded_excerpt

# The choices are written once, as the types of DLSConfig's fields; the tuples are their values.
FP16Type = Literal["float16", "bfloat16", "cbfloat16"]
Policy = Literal["cerebras", "torch", "deepspeed", "deepspeed-0.17.0", "deepspeed-fp16-optimizer",
                 "megatron", "keras"]
FP16_TYPES: tuple[str, ...] = get_args(FP16Type)
POLICIES: tuple[str, ...] = get_args(Policy)
FLOAT32_MAX = 3.4028234663852886e38
LARGEST_POW2_SCALE = 2.0**127
"""The largest power of two float32 holds: the presets' cap, so every scale they reach keeps
scaling and unscaling exact (float32's largest value, 3.4028235e38, is not a power of two)."""
FLOAT32_SMALLEST_NORMAL = 2.0**-126
"""Below this a float32 scale is subnormal and its float32 reciprocal may be inf: a config whose
floor lies there unscales by dividing (`dlspass.scale_policy.divides`)."""
DEEPSPEED_POLICIES: tuple[str, ...] = ("deepspeed", "deepspeed-0.17.0", "deepspeed-fp16-optimizer")
"""DeepSpeed's rules: ``deepspeed`` is ZeRO's `DynamicLossScaler` as released since 0.17.1,
``deepspeed-0.17.0`` the same class up to 0.17.0 (growth one clean step earlier), and
``deepspeed-fp16-optimizer`` the fp16 optimizer without ZeRO (`FP16_Optimizer._update_scale`:
no hysteresis), docs/SEMANTICS.md §3.2."""
_EXCERPT = 60


@dataclass(frozen=True)
class PresetDefaults:
    """The numbers a policy uses when the user leaves a key at ``None``."""

    initial_loss_scale: float
    max_loss_scale: float
    min_loss_scale: float
    steps_per_increase: int
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 1
    overflow_check: Literal["global_norm", "all_finite"] = "all_finite"


def preset_defaults(policy: str, fp16_type: str) -> PresetDefaults:
    """Defaults of ``policy`` for ``fp16_type`` (docs/SEMANTICS.md §2)."""
    if policy == "cerebras":
        init = 2.0**31 if fp16_type == "cbfloat16" else 2.0**15
        return PresetDefaults(init, init, 2.0**-14, 2000, overflow_check="global_norm")
    # The other tools have no cap: torch stops at the last finite power of two (it refuses a
    # growth to inf), the others grow to inf (or, DeepSpeed, past float32 in a Python float).
    # dlspass caps at 2**127, the largest power of two float32 holds (docs/SEMANTICS.md §2).
    if policy == "torch":
        # torch has no floor: the floor keeps 1/scale finite (docs/SEMANTICS.md §3.1)
        return PresetDefaults(2.0**16, LARGEST_POW2_SCALE, 2.0**-14, 2000)
    if policy in ("deepspeed", "deepspeed-0.17.0"):
        return PresetDefaults(2.0**16, LARGEST_POW2_SCALE, 1.0, 1000, hysteresis=2)
    if policy == "deepspeed-fp16-optimizer":
        return PresetDefaults(2.0**16, LARGEST_POW2_SCALE, 1.0, 1000)
    if policy == "megatron":
        return PresetDefaults(2.0**32, LARGEST_POW2_SCALE, 1.0, 1000, hysteresis=2)
    if policy == "keras":
        return PresetDefaults(2.0**15, LARGEST_POW2_SCALE, 2.0**-14, 2000)
    raise InputValueError(f"policy: unknown preset {policy!r}; choose one of {', '.join(POLICIES)}")


def parse_release_name(release: str | tuple, pattern: str, *, key: str, example: str,
                       shape: str) -> tuple[int, ...]:
    """A release given as a tuple, or as a name whose numbers ``pattern``'s groups capture, as
    a tuple of ints with as many parts as ``shape`` names (``"(major, minor)"``); anything else is
    an `InputValueError` naming ``key`` (Model Zoo and DeepSpeed releases)."""
    if isinstance(release, tuple):
        parsed: tuple = release
    else:
        m = re.fullmatch(pattern, str(release).strip())
        if m is None:
            raise InputValueError(f"{key}: expected a release such as {example}, got {excerpt(release)}")
        parsed = tuple(int(g) for g in m.groups())
    if not (len(parsed) == shape.count(",") + 1 and all(type(x) is int for x in parsed)):
        raise InputValueError(f"{key}: expected {shape}, got {excerpt(release)}")
    return parsed


def excerpt(value: object) -> str:
    """A bounded, one-line rendering of ``value`` for error messages (never a full ``repr``):
    `dlspass.files.bounded_text.excerpt` in the wording of configuration errors."""
    return bounded_excerpt(value, _EXCERPT, plain=True)
