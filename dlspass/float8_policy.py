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

The filter (`Float8Filter`) is the policy apart from the pass that applies it. By default
every matmul with float operands is converted, as torchao 0.18.0's ``convert_to_float8_training``
converts every ``nn.Linear`` when given no ``module_filter_fn`` (its default: no size check).
``min_size="auto"`` decides as torchao's auto filter (``_auto_filter_for_recipe``, opt-in there
too) decides for an ``nn.Linear`` of weight ``N x K``: skip it unless ``N`` and ``K`` are
multiples of 16, and skip the sizes below its thresholds (measured on H100s: there float8's
casts cost more than its faster GEMM gains). The decision is per weight, so the three matmuls
of a linear (output, input gradient, weight gradient) convert or stay together, as torchao's
module swap has them; a matmul that multiplies no parameter (attention's batched products,
``x @ y`` of activations) is judged by its own ``[M, K] @ [K, N]``. ``multiple_of=16`` is the
float8 GEMM's alignment on GPUs, checked on each matmul's own ``K`` and ``N``; ``skip_modules``
skips by module path (torchao's ``filter_fqns``). ``DLSConfig.float8_filter`` is its spec
(`Float8Filter.from_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlspass.config import ConfigError, parse_float8_filter

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
    ``(M, K, N)`` of its (per-batch) ``[M, K] @ [K, N]``, and ``weight``: ``(N, K)`` of the 2-D
    parameter it multiplies or whose gradient it computes (as torchao reads an ``nn.Linear``:
    ``N, K = weight.shape``, output by input features), None when it has none."""

    module: str
    op: str
    m: int
    k: int
    n: int
    weight: tuple[int, int] | None = None

    @property
    def size(self) -> tuple[int, int]:
        """``(N, K)`` the size rule judges: the weight's, else the matmul's own."""
        return self.weight if self.weight is not None else (self.n, self.k)


@dataclass(frozen=True)
class Float8Filter:
    """Which matmuls a float8 step converts (module docstring).

    ``skip_modules``: a matmul whose module path contains one of these strings stays as it is.
    ``min_size``: ``None`` converts any size; ``"auto"`` skips what torchao's auto filter skips
    for the recipe, judged on `MatmulSite.size`: ``N`` or ``K`` not a multiple of 16, or below
    the recipe's thresholds (measured on H100s: below them float8's casts cost more than its
    faster GEMM gains). ``multiple_of``: skip a matmul whose own ``K`` or ``N`` is not a
    multiple (16 is what float8 GEMMs on GPUs require; 1 accepts all, as the CPU kernel does).
    """

    skip_modules: tuple[str, ...] = ()
    min_size: str | None = None
    multiple_of: int = 1

    def __post_init__(self) -> None:
        if self.min_size not in (None, "auto"):
            raise ConfigError(f"float8 filter min_size: expected None or 'auto', got {self.min_size!r}")
        if isinstance(self.multiple_of, bool) or not isinstance(self.multiple_of, int) or self.multiple_of < 1:
            raise ConfigError(f"float8 filter multiple_of: expected a positive int, got {self.multiple_of!r}")

    @classmethod
    def from_spec(cls, spec: str) -> Float8Filter:
        """The filter of a ``DLSConfig.float8_filter`` spec (``dlspass.config.parse_float8_filter``):
        ``"all"`` converts any size, ``"auto"`` is ``min_size="auto"``, each ``skip:PATH`` a
        ``skip_modules`` entry."""
        rule, skips = parse_float8_filter(spec)
        return cls(skip_modules=skips, min_size="auto" if rule == "auto" else None)

    def reason_to_skip(self, site: MatmulSite, recipe: Float8Recipe) -> str | None:
        """Why ``site`` stays in its own precision, or None to convert it."""
        hit = next((s for s in self.skip_modules if s and s in site.module), None)
        if hit is not None:
            return f"module {site.module!r} matches skip_modules entry {hit!r}"
        if self.multiple_of > 1 and (site.k % self.multiple_of or site.n % self.multiple_of):
            return f"K={site.k}, N={site.n} not multiples of {self.multiple_of}"
        if self.min_size == "auto":
            n, k = site.size
            what = "weight" if site.weight is not None else "matmul"
            if n % 16 or k % 16:
                return f"{what} N={n}, K={k} not multiples of 16 (torchao's auto filter)"
            if _too_small(n, k, recipe):
                return (f"{what} N={n}, K={k} below torchao's {recipe.name} size thresholds "
                        "(float8 would not gain)")
        return None


def _too_small(n: int, k: int, recipe: Float8Recipe) -> bool:
    """torchao 0.18.0's auto-filter thresholds (``_auto_filter_for_tensorwise`` and
    ``_auto_filter_for_rowwise``) for a weight ``N, K = weight.shape``: ``K`` the input
    features (the contraction of the output matmul), ``N`` the output features."""
    if recipe.rowwise:
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    return k <= 4096 and n <= 1024


DEFAULT_FILTER = Float8Filter()
