"""Counting where values land in a format by rounding each one (native casts; dlspass's
cbfloat16 rounding): the eager reference of ``format_ranges.value_counts`` and the telemetry."""

from __future__ import annotations

import math

import torch

from dlspass.format_ranges import RANGES
from dlspass.formats import round_to_format


def _rounded(x: torch.Tensor, name: str) -> torch.Tensor:
    r = RANGES[name]
    if r.torch_dtype is not None:
        return x.to(r.torch_dtype).to(torch.float32)
    return round_to_format(x, name)


def reference_counts(x: torch.Tensor, name: str) -> list[float]:
    """Count by rounding each value: the independent reference of ``value_counts``."""
    r = RANGES[name]
    y = _rounded(x, name)
    flushed = (x != 0) & (y == 0)
    subnormal = (y != 0) & (y.abs() < r.min_normal)
    if name == "float8_e4m3fn":
        # torch's cast saturates (no inf): a value the format cannot hold is one whose cast is
        # off by more than half the spacing at max
        half_ulp = math.ldexp(1.0, math.frexp(r.max)[1] - 1 - r.mantissa_bits - 1)
        over = (x.abs() - y.abs()) > half_ulp
    else:
        over = torch.isinf(y)
    amax = x.abs().max().item()
    return [amax, *(float(m.sum()) for m in (flushed, subnormal, over))]
