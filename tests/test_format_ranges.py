"""format_ranges: the threshold counts equal rounding every value (native casts for float16,
bfloat16 and float8; dlspass's cbfloat16 rounding), on random and boundary values."""

from __future__ import annotations

import math

import pytest
import torch
from numerics_reference import reference_counts

from dlspass.format_ranges import RANGES, get_range, value_counts
from dlspass.formats import FormatError


def boundary_values(name: str) -> torch.Tensor:
    """Each threshold and its float32 neighbours, both signs, plus zeros, inf and NaN."""
    r = RANGES[name]
    edges = torch.tensor([r.flush_below, r.subnormal_below, r.overflow_at, r.max, r.min_normal,
                          r.min_subnormal], dtype=torch.float32)
    up = torch.nextafter(edges, torch.full_like(edges, math.inf))
    down = torch.nextafter(edges, torch.zeros_like(edges))
    vals = torch.cat([edges, up, down])
    return torch.cat([vals, -vals, torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])])


@pytest.mark.parametrize("name", list(RANGES))
def test_counts_equal_rounding_every_value(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    # magnitudes log-uniform over float32's whole normal range, random signs
    expo = torch.rand(200_000, generator=g) * 250 - 125
    sign = torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([sign * torch.exp2(expo), boundary_values(name)])
    finite = x[~torch.isnan(x)]
    want = reference_counts(finite, name)
    got = value_counts(finite, RANGES[name]).tolist()
    assert got == want
    # each class is exercised at every format
    assert all(c > 0 for c in got[1:])
    # NaN counts in no class and makes amax NaN
    with_nan = value_counts(x, RANGES[name]).tolist()
    assert math.isnan(with_nan[0]) and with_nan[1:] == want[1:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_counts_of_a_narrow_tensor(dtype: torch.dtype) -> None:
    x = torch.tensor([1e-8, 1e-6, 1.0, 7e4], dtype=torch.float32).to(dtype)
    got = value_counts(x, RANGES["float16"]).tolist()
    assert got == reference_counts(x.float(), "float16")


def test_unknown_format_is_one_clear_error() -> None:
    with pytest.raises(FormatError, match="format: expected one of float16, .*got 'fp12'"):
        get_range("fp12")
