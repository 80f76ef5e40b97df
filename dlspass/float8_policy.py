"""Float8 training policy as data: the recipes (which float8 format and which scaling axis per
matmul operand) and the filter that decides which matmuls of a step run in float8.

The recipes are torchao 0.18.0's two main ones (``torchao.float8.Float8LinearConfig
.from_recipe_name``), stated for any matmul ``A @ B`` rather than for the three matmuls of an
``nn.Linear``:

- ``tensorwise``: one scale per operand; an operand that is a gradient (it depends on the
  backward seed: ``grad_output`` in torchao's terms) is cast to ``float8_e5m2``, every other
  operand (activations, weights) to ``float8_e4m3fn``;
- ``rowwise``: one scale per row of the contraction, i.e. ``A`` is scaled per row (its amax
  over its last dim) and ``B`` per column (over its first dim); every operand is
  ``float8_e4m3fn``, and each scale is rounded down to a power of two. torchao's rowwise
  ``Float8Linear`` scales each operand of its three matmuls along exactly that axis (input
  along -1 for the output and along 0 for the weight gradient, weight along the output
  features for the output and along the input features for the input gradient,
  grad_output along -1 for the input gradient and along 0 for the weight gradient).

In both, the scale is ``fp8_max / max(amax, 1e-12)`` computed in float64 and stored in
float32, the cast saturates (clamps to ``±fp8_max``), the product accumulates in float32 and
comes out in the matmul's own dtype (the step's 16-bit dtype where it is lowered).

The filter (`Float8Filter`) is the policy apart from the pass that applies it: by default
every matmul with float operands is converted, as torchao's ``convert_to_float8_training``
converts every ``nn.Linear`` unless given a ``module_filter_fn``; ``min_size="auto"`` applies
the thresholds of torchao's auto filter (``_auto_filter_for_recipe``: matmuls too small for
float8 to gain on an H100 stay in 16 bits), ``multiple_of=16`` the float8 GEMM's alignment on
GPUs, ``skip_modules`` skips by module path (torchao's ``filter_fqns``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlspass.config import ConfigError

EPS = 1e-12
"""The floor of an amax before it is inverted (torchao's ``float8_utils.EPS``)."""

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class Float8Recipe:
    """How each operand of a converted matmul is cast: its float8 dtype (``grad_dtype`` for an
    operand that is a gradient), per-tensor or per-row scales, power-of-two scale rounding."""

    name: str
    dtype: torch.dtype
    grad_dtype: torch.dtype
    rowwise: bool
    pow2_scales: bool

    def dtype_for(self, is_grad: bool) -> torch.dtype:
        return self.grad_dtype if is_grad else self.dtype


RECIPES: dict[str, Float8Recipe] = {
    "tensorwise": Float8Recipe("tensorwise", E4M3, E5M2, rowwise=False, pow2_scales=False),
    "rowwise": Float8Recipe("rowwise", E4M3, E4M3, rowwise=True, pow2_scales=True),
}


@dataclass(frozen=True)
class MatmulSite:
    """What the filter sees of one matmul: its module path (``""`` when unknown), its op,
    and ``(M, K, N)`` of its (per-batch) ``[M, K] @ [K, N]``."""

    module: str
    op: str
    m: int
    k: int
    n: int


@dataclass(frozen=True)
class Float8Filter:
    """Which matmuls a float8 step converts (module docstring).

    ``skip_modules``: a matmul whose module path contains one of these strings stays as it is.
    ``min_size``: ``None`` converts any size; ``"auto"`` skips the sizes torchao's auto filter
    skips for the recipe (measured on H100s: below them float8's casts cost more than its
    faster GEMM gains). ``multiple_of``: skip a matmul whose ``K`` or ``N`` is not a multiple
    (16 is what float8 GEMMs on GPUs require; 1 accepts all, as the CPU kernel does).
    """

    skip_modules: tuple[str, ...] = ()
    min_size: str | None = None
    multiple_of: int = 1

    def __post_init__(self) -> None:
        if self.min_size not in (None, "auto"):
            raise ConfigError(f"float8 filter min_size: expected None or 'auto', got {self.min_size!r}")
        if isinstance(self.multiple_of, bool) or not isinstance(self.multiple_of, int) or self.multiple_of < 1:
            raise ConfigError(f"float8 filter multiple_of: expected a positive int, got {self.multiple_of!r}")

    def reason_to_skip(self, site: MatmulSite, recipe: Float8Recipe) -> str | None:
        """Why ``site`` stays in its own precision, or None to convert it."""
        hit = next((s for s in self.skip_modules if s and s in site.module), None)
        if hit is not None:
            return f"module {site.module!r} matches skip_modules entry {hit!r}"
        if self.multiple_of > 1 and (site.k % self.multiple_of or site.n % self.multiple_of):
            return f"K={site.k}, N={site.n} not multiples of {self.multiple_of}"
        if self.min_size == "auto" and _too_small(site, recipe):
            return (f"K={site.k}, N={site.n} below torchao's {recipe.name} size thresholds "
                    "(float8 would not gain)")
        return None


def _too_small(site: MatmulSite, recipe: Float8Recipe) -> bool:
    """torchao 0.18.0's auto-filter thresholds, with its ``N, K = weight.shape``: ``K`` the
    contraction, ``N`` the output features."""
    k, n = site.k, site.n
    if recipe.rowwise:
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    return k <= 4096 and n <= 1024


DEFAULT_FILTER = Float8Filter()
