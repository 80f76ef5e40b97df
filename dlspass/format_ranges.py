"""Where a float32 value lands in a narrow format: flushed to zero, subnormal, normal or overflowed.

One table of ranges (`RANGES`: float16, bfloat16, cbfloat16 from ``dlspass.formats``; float8
e4m3fn and e5m2 from ``torch.finfo``) and the thresholds that round-to-nearest-even gives:

- a non-zero ``|x| <= min_subnormal / 2`` rounds to zero (the tie goes to the even zero);
- ``min_subnormal / 2 < |x| < min_normal - min_subnormal / 2`` rounds to a subnormal (at the
  upper tie the largest subnormal, whose last mantissa bit is 1, loses to ``min_normal``);
- ``|x| >= max + ulp(max) / 2`` overflows where ``max`` ends in a 1 bit (IEEE formats: the tie
  rounds up to inf), ``|x| > max + ulp(max) / 2`` where it ends in a 0 bit (float8 e4m3fn, whose
  ``max`` 448 is 1.75 * 2^8 and which has no inf: such values saturate or become NaN).

Every threshold is exact in float32, so `value_counts` compares float32 values with them and
agrees with rounding the values one by one (tests/test_format_ranges.py checks it against the
casts and ``dlspass.formats.round_to_format``). `value_counts` is plain tensor ops: a graph pass
traces it into a step graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dlspass.formats import FORMATS, FormatError

__all__ = ["COUNT_FIELDS", "RANGES", "FormatRange", "get_range", "value_counts"]

# the columns of value_counts, in order
COUNT_FIELDS = ("amax", "flushed", "subnormal", "overflow")


@dataclass(frozen=True)
class FormatRange:
    """The range of a binary float format with subnormals (see the module docstring)."""

    name: str
    max: float
    min_normal: float
    min_subnormal: float
    mantissa_bits: int
    max_is_odd: bool  # the last mantissa bit of ``max``: decides the overflow tie
    torch_dtype: torch.dtype | None = None

    @property
    def flush_below(self) -> float:
        """Non-zero magnitudes up to and including this round to zero."""
        return self.min_subnormal / 2

    @property
    def subnormal_below(self) -> float:
        """Magnitudes above `flush_below` and below this round to a subnormal."""
        return self.min_normal - self.min_subnormal / 2

    @property
    def overflow_at(self) -> float:
        """The rounding boundary above ``max`` (inclusive when `max_is_odd`)."""
        return self.max + math.ldexp(1.0, math.frexp(self.max)[1] - 1 - self.mantissa_bits - 1)

    def overflows(self, a: Tensor) -> Tensor:
        """Which magnitudes ``a`` (float32, ``>= 0`` or NaN) overflow the format."""
        return a >= self.overflow_at if self.max_is_odd else a > self.overflow_at


def _from_format(name: str) -> FormatRange:
    f = FORMATS[name]
    return FormatRange(name, f.max, f.min_normal, f.min_subnormal, f.mantissa_bits, True,
                       f.torch_dtype)


def _from_float8(name: str, dtype: torch.dtype, mantissa_bits: int) -> FormatRange:
    fi = torch.finfo(dtype)
    # max = (1 + m / 2^mantissa_bits) * 2^e: its last mantissa bit is m's lowest bit
    mant = round((math.frexp(fi.max)[0] * 2 - 1) * 2**mantissa_bits)
    return FormatRange(name, fi.max, fi.smallest_normal, fi.smallest_normal * 2.0**-mantissa_bits,
                       mantissa_bits, bool(mant & 1), dtype)


RANGES: dict[str, FormatRange] = {
    **{n: _from_format(n) for n in ("float16", "bfloat16", "cbfloat16")},
    "float8_e4m3fn": _from_float8("float8_e4m3fn", torch.float8_e4m3fn, 3),
    "float8_e5m2": _from_float8("float8_e5m2", torch.float8_e5m2, 2),
}


def get_range(name: str) -> FormatRange:
    """The `FormatRange` called ``name`` (one of `RANGES`); `FormatError` otherwise."""
    try:
        return RANGES[name]
    except KeyError:
        raise FormatError(f"format: expected one of {', '.join(RANGES)}, got {name!r}") from None


def value_counts(x: Tensor, r: FormatRange) -> Tensor:
    """``[amax, flushed, subnormal, overflow]`` of ``x`` in format ``r``, as a float64 tensor.

    ``amax`` is ``max |x|`` (NaN when ``x`` holds one; 0 for an empty tensor); the counts are
    of the non-zero values that round to zero, the values that round to a subnormal and the
    values that overflow (infinite inputs included; NaN in none). Exact up to 2^53 values.
    """
    a = x.detach().abs().to(torch.float32).flatten()
    amax = a.amax() if a.numel() else a.new_zeros(())
    nonzero = a > 0
    flushed = nonzero & (a <= r.flush_below)
    subnormal = (a > r.flush_below) & (a < r.subnormal_below)
    over = r.overflows(a)
    counts = torch.stack([m.sum(dtype=torch.int64) for m in (flushed, subnormal, over)])
    return torch.cat([amax.to(torch.float64).reshape(1), counts.to(torch.float64)])
