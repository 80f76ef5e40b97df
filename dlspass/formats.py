"""Reduced-precision float formats (float16, bfloat16, cbfloat16) emulated in float32.

Every value of a format here is exactly representable in float32, so a tensor "in" a format is a
float32 tensor whose values were rounded, once, from float32 with round-to-nearest-even
(cbfloat16 is never produced through float16: double rounding would be wrong at ties).

Semantics of ``round_to_format(x, fmt, saturate=False, flush_to_zero=False)``:

- finite values round to nearest, ties to even, with the format's subnormals kept;
- a finite value that rounds past the largest finite value becomes ±inf, or ±max with
  ``saturate=True``; ±inf inputs stay ±inf and NaN stays NaN in both modes (saturation is about
  finite values that the narrow format cannot hold, not about values that were already infinite);
- with ``flush_to_zero=True`` a result whose magnitude is below the minimum normal becomes a zero
  of the input's sign (rounding happens first, as if subnormals existed, so a value just below
  the minimum normal that rounds up to it is kept);
- -0.0 stays -0.0; NaN payloads are not specified (the bit form keeps the input's bits).

There are four implementations that agree bitwise (NaN payloads aside):

1. ``round_to_format``: the ``dlspass::round_to_format`` custom op (traceable, shows by name in
   FX graphs, straight-through gradient). Its eager kernel uses native casts for float16 and
   bfloat16 without switches. Otherwise, for tensors of at least ``COMPILE_MIN_NUMEL`` elements
   (4M) outside any trace, it runs ``round_bits`` compiled by inductor (compiled lazily on first
   use, one kernel per format and switch combination, dynamic shapes; any compile failure
   warns once and falls back for the rest of the process; ``DLSPASS_ROUNDING_COMPILE=0`` turns
   it off). Smaller tensors, and the fallback, run the bit form in place on chunks that stay in
   L2 and below ATen's parallel grain size.
2. ``round_bits``: int32 bit arithmetic made of plain aten ops, so inductor fuses it into one
   loop; `dlspass.passes.decompose_rounding_pass.DecomposeRoundingPass` swaps the custom op
   for it inside an FX graph.
3. ``round_arith``: float arithmetic only (log2, exp2, round, where) for exporters that have no
   bitcast (ONNX).
4. ``round_split``: 15 float ops, no bitcast (41 ops with 4 for ``round_bits``); what inductor
   compiles for cbfloat16 and float16 with switches (``split_form_ok``), whose first call grows
   with the ops per rounding (docs/COMPILE_TIME.md, "Emulated cbfloat16", has the proof).
"""

from __future__ import annotations

import math
import os
import types
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _get_current_dispatch_mode

from dlspass.errors import InputTypeError, InputValueError
from dlspass.precision_policy import NATIVE_DTYPES

__all__ = ["BFLOAT16", "CBFLOAT16", "FLOAT16", "FORMATS", "Format", "FormatError", "FormatTypeError",
           "get_format", "round_arith", "round_bits", "round_to_format"]

_F32_MANT = 23
_F32_BIAS = 127
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_SIGN_MASK = -(2**31)  # 0x80000000 as a signed int32
_CHUNK = 32000  # eager chunk: < ATen's 32768 parallel grain, ~500 KiB of buffers fit in L2
# Tensors at least this large use a lazily compiled (inductor, one fused loop) bit kernel in
# eager mode; tests and tiny models never reach it. DLSPASS_ROUNDING_COMPILE=0 turns it off.
COMPILE_MIN_NUMEL = 1 << 22
# the rounding op's plain-op forms: round_bits, round_arith, round_split, and "cast" for inductor
# (round_fn: a cast round trip for float16/bfloat16 without switches, else round_split or bits)
FORMS = ("bits", "arith", "cast", "split")
_F32_MAX = math.ldexp(2.0 - 2.0**-_F32_MANT, _F32_BIAS)


# a float format (or rounding form) name that dlspass does not know
FormatError = InputValueError
# a value of the wrong type for a format argument or the rounding op
FormatTypeError = InputTypeError


@dataclass(frozen=True)
class Format:
    """An IEEE-like binary float format with subnormals and an all-ones exponent for inf/NaN.

    ``max`` is the largest finite value, ``min_normal``/``min_subnormal`` the smallest positive
    normal/subnormal values and ``eps`` the gap between 1 and the next value. ``torch_dtype`` is
    the native dtype when PyTorch has one.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float
    eps: float
    torch_dtype: torch.dtype | None = None

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the minimum normal value."""
        return 1 - self.bias


def _make_format(name: str, exponent_bits: int, mantissa_bits: int) -> Format:
    dtype = NATIVE_DTYPES.get(name)  # the formats with a hardware dtype: dlspass.config
    bias = 2 ** (exponent_bits - 1) - 1
    emax = 2**exponent_bits - 2 - bias
    emin = 1 - bias
    return Format(
        name=name,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        bias=bias,
        max=math.ldexp(2.0 - 2.0**-mantissa_bits, emax),
        min_normal=math.ldexp(1.0, emin),
        min_subnormal=math.ldexp(1.0, emin - mantissa_bits),
        eps=2.0**-mantissa_bits,
        torch_dtype=dtype,
    )


FLOAT16 = _make_format("float16", 5, 10)
BFLOAT16 = _make_format("bfloat16", 8, 7)
CBFLOAT16 = _make_format("cbfloat16", 6, 9)
FORMATS: dict[str, Format] = {f.name: f for f in (FLOAT16, BFLOAT16, CBFLOAT16)}
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "cb16": "cbfloat16"}


def get_format(fmt: str | Format | torch.dtype) -> Format:
    """Return the ``Format`` named by ``fmt`` (a Format, a name or alias, or a torch dtype)."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.torch_dtype == fmt:
                return f
        raise FormatError(f"no dlspass format for dtype {fmt}; known: {', '.join(FORMATS)}")
    if isinstance(fmt, str):
        key = _ALIASES.get(fmt.lower(), fmt.lower())
        if key in FORMATS:
            return FORMATS[key]
        raise FormatError(f"unknown float format {fmt!r}; known: {', '.join(FORMATS)}")
    raise FormatTypeError(f"float format must be a name or Format, got {type(fmt).__name__}")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise FormatTypeError(f"round_to_format expects a tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise FormatTypeError(f"round_to_format expects a float32 tensor, got {x.dtype}")


def _f32_bits(value: float) -> int:
    """Bits of a positive float32-normal ``value`` (plain arithmetic: dynamo traces through it)."""
    m, e = math.frexp(value)  # value = m * 2**e, 0.5 <= m < 1
    return ((e - 1 + _F32_BIAS) << _F32_MANT) | int((2 * m - 1) * 2**_F32_MANT)


@dataclass(frozen=True)
class _Consts:
    shift: int  # mantissa bits dropped from float32
    round_bias: int  # half an ulp minus one, in the dropped bits
    keep_mask: int  # clears the dropped bits
    max_bits: int
    min_normal_bits: int
    min_normal: float
    has_subnormal_path: bool  # format subnormals are float32 normals: need a wider shift


_CONSTS: dict[str, _Consts] = {}


def _consts(fmt: Format) -> _Consts:
    c = _CONSTS.get(fmt.name)
    if c is None:
        if fmt.exponent_bits > 8 or fmt.mantissa_bits > _F32_MANT:
            raise FormatError(f"format {fmt.name!r} does not fit in float32")
        shift = _F32_MANT - fmt.mantissa_bits
        c = _Consts(
            shift=shift,
            round_bias=(1 << (shift - 1)) - 1 if shift else 0,
            keep_mask=~((1 << shift) - 1),
            max_bits=_f32_bits(fmt.max),
            min_normal_bits=_f32_bits(fmt.min_normal),
            min_normal=fmt.min_normal,
            has_subnormal_path=fmt.min_exponent > 1 - _F32_BIAS,
        )
        _CONSTS[fmt.name] = c
    return c


for _f in FORMATS.values():  # precomputed so traced code only does a dict lookup
    _consts(_f)


def round_bits(x: torch.Tensor, fmt: str | Format, saturate: bool = False,
               flush_to_zero: bool = False) -> torch.Tensor:
    """Round float32 ``x`` to ``fmt`` with int32 bit arithmetic (plain aten ops, fusable).

    Same semantics as ``round_to_format``; NaN inputs come back with their bits unchanged.
    """
    _check_input(x)
    c = _consts(get_format(fmt))
    u = x.view(torch.int32)
    a = u & _ABS_MASK
    # clamping NaNs to inf keeps the rounding add below int32 overflow; NaNs are restored last
    ac = torch.clamp(a, max=_INF_BITS)
    r = (ac + (c.round_bias + ((ac >> c.shift) & 1))) & c.keep_mask
    if c.has_subnormal_path:
        # below the format's min normal the quantum is fixed: shift the full significand right by
        # (shift + exponent deficit), round half to even, and rebuild min_normal + q*quantum so a
        # float subtraction of min_normal (exact) normalises the result
        s = torch.clamp((c.shift + (c.min_normal_bits >> 23)) - (ac >> 23), 1, 31)
        m = (ac & 0x007FFFFF) | 0x00800000
        half = torch.bitwise_left_shift(1, s - 1)
        q = (m + (half - 1 + ((m >> s) & 1))) >> s
        sub = ((q << c.shift) + c.min_normal_bits).view(torch.float32) - c.min_normal
        r = torch.where(ac < c.min_normal_bits, sub.view(torch.int32), r)
    if saturate:
        # `>` and not `>=`: inductor's AVX2 code for an integer `>=`, `<=` or `!=` mask inside
        # a `where` selects the wrong branch (torch 2.13, vectorised loops only), which made
        # every saturated value inf; `>` and `<` compile correctly on every ISA
        r = torch.where(ac > _INF_BITS - 1, _INF_BITS, torch.clamp(r, max=c.max_bits))
    else:
        r = torch.where(r > c.max_bits, _INF_BITS, r)
    if flush_to_zero:
        r = torch.where(r < c.min_normal_bits, 0, r)
    out = torch.where(a > _INF_BITS, u, r | (u & _SIGN_MASK))
    return out.view(torch.float32)


def _split_consts(f: Format) -> tuple[float, float, float] | None:
    """``round_split``'s 2**s, 2**(emin + s) and largest non-overflowing float32; None where
    x * (2**s + 1) can overflow below max or a float32 subnormal would not round to zero."""
    s, emax = _F32_MANT - f.mantissa_bits, 2**f.exponent_bits - 2 - f.bias
    if emax + s + 2 > _F32_BIAS or f.min_exponent - f.mantissa_bits - 1 < 1 - _F32_BIAS:
        return None
    # overflow from max + half its quantum on (max ends in a 1 bit: that tie rounds up)
    last = f.max + math.ldexp(1.0, emax - f.mantissa_bits - 1) - math.ldexp(1.0, emax - _F32_MANT)
    return 2.0**s, math.ldexp(1.0, f.min_exponent + s), last


def split_form_ok(fmt: str | Format) -> bool:
    """True when ``round_split`` can round to ``fmt``: cbfloat16, float16; not bfloat16."""
    return _split_consts(get_format(fmt)) is not None


def round_split(x: torch.Tensor, fmt: str | Format, saturate: bool = False,
                flush_to_zero: bool = False) -> torch.Tensor:
    """Round float32 ``x`` to ``fmt`` with float ops only: Veltkamp's split ``c = a * 2**s + a``,
    ``c - (c - a)`` for the format's normals (``a = |x|``, ``s = 23 - mantissa_bits``), ``(a + C)
    - C`` with ``C = 2**(emin + s)`` for its subnormals. Bit-identical to ``round_bits`` on every
    float32 (tests/test_round_split.py; why: docs/COMPILE_TIME.md, "Emulated cbfloat16"). g++'s
    unsafe math would fold ``c - (c - a)`` to ``a``: compile it under ``INDUCTOR_CONFIG``."""
    _check_input(x)
    f = get_format(fmt)
    if (consts := _split_consts(f)) is None:
        raise FormatError(f"round_split cannot round to {f.name!r}: its top binade overflows")
    factor, sub_adder, last_finite = consts
    a = torch.abs(x)
    c = a * factor + a  # the product is exact: a fused multiply-add gives the same c
    r = torch.where(a < f.min_normal, (a + sub_adder) - sub_adder, c - (c - a))
    if saturate:  # finite values past max become max; inf stays inf
        r = torch.where(a > last_finite, torch.where(a > _F32_MAX, math.inf, f.max), r)
    else:
        r = torch.where(a > last_finite, math.inf, r)
    if flush_to_zero:
        r = torch.where(r < f.min_normal, 0.0, r)
    return torch.where(torch.isnan(x), x, torch.copysign(r, x))


def round_arith(x: torch.Tensor, fmt: str | Format, saturate: bool = False,
                flush_to_zero: bool = False) -> torch.Tensor:
    """Round float32 ``x`` to ``fmt`` with float arithmetic only (no bitcast; ONNX-exportable).

    Exact for every float32 input: the exponent from ``log2`` is corrected against ``exp2`` of
    itself, the quantum is a power of two (so dividing by it is exact) and ``torch.round`` rounds
    half to even.
    """
    _check_input(x)
    f = get_format(fmt)
    ax = torch.abs(x)
    finite_nonzero = torch.isfinite(ax) & (ax > 0)
    safe = torch.where(finite_nonzero, ax, 1.0)
    e = torch.floor(torch.log2(safe))
    # log2 may round across a power of two; one step either way fixes it
    e = torch.where(torch.exp2(e) > safe, e - 1, e)
    e = torch.where(torch.exp2(e + 1) <= safe, e + 1, e)
    e = torch.clamp(e, min=float(f.min_exponent))
    quantum = torch.exp2(e - f.mantissa_bits)
    r = torch.round(safe / quantum) * quantum
    if saturate:
        r = torch.clamp(r, max=f.max)
    else:
        r = torch.where(r > f.max, math.inf, r)
    if flush_to_zero:
        r = torch.where(r < f.min_normal, 0.0, r)
    r = torch.where(finite_nonzero, r, ax)  # zeros, infs, NaNs pass through
    # The sign goes on with a multiply: onnxruntime's Where returns +0.0 when selecting a -0.0
    # input, and negation may be lowered to 0 - r. 1/x < 0 catches x == -0.0.
    negative = (x < 0) | (torch.reciprocal(x) < 0)
    return r * torch.where(negative, -1.0, 1.0)


def _native_ok(f: Format, saturate: bool, flush_to_zero: bool) -> bool:
    return f.torch_dtype is not None and not saturate and not flush_to_zero


# one compiled kernel per (format, saturate, flush_to_zero); each gets its own code object so
# that dynamo's per-code recompile limit (8) is never shared between them
_COMPILED: dict[tuple[str, bool, bool], object] = {}
_compile_failed = False


def _compile_allowed(x: torch.Tensor) -> bool:
    return (
        not _compile_failed
        and x.numel() >= COMPILE_MIN_NUMEL
        and os.environ.get("DLSPASS_ROUNDING_COMPILE", "1") != "0"
        and not torch.compiler.is_compiling()
        and not torch.fx._symbolic_trace.is_fx_tracing()  # make_fx in real mode runs kernels
        and _get_current_dispatch_mode() is None
    )


def _compiled_round(x: torch.Tensor, f: Format, saturate: bool, flush_to_zero: bool) -> torch.Tensor | None:
    """Run the bit form through inductor; None (and never again) if compiling fails."""
    global _compile_failed
    key = (f.name, saturate, flush_to_zero)
    try:
        kernel = _COMPILED.get(key)
        if kernel is None:
            base = round_fn(*key)
            name = f"round_bits_{f.name}_{int(saturate)}{int(flush_to_zero)}"
            code = base.__code__.replace(co_name=name, co_qualname=name)
            fresh = types.FunctionType(code, base.__globals__, name, None, base.__closure__)
            kernel = _COMPILED[key] = torch.compile(fresh, dynamic=True, fullgraph=True)
        # imported here, not at the top: inductor's config loads dynamo (about 0.9 s), which an
        # eager user of the formats (analyze, the eager rounding of small tensors) never needs
        from torch._inductor import config as inductor_config

        from dlspass.cache_facts import inductor_key_config

        # the CPU facts in the cache key: inductor's own key lacks the vector ISA, and a kernel
        # cached under another ISA rounds wrongly here (dlspass.cache_facts)
        with inductor_config.patch(inductor_key_config()):
            return kernel(x)
    except Exception as err:
        _compile_failed = True
        warnings.warn(
            f"dlspass: compiled rounding kernel unavailable, using eager ops ({err!r:.200})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _eager_round(x: torch.Tensor, f: Format, saturate: bool, flush_to_zero: bool) -> torch.Tensor:
    if _native_ok(f, saturate, flush_to_zero):
        return x.to(f.torch_dtype).to(torch.float32)
    # The result has the strides the fake kernel reports (``empty_like``, preserve_format): a
    # contiguous result for a transposed input breaks a later ``view`` that the traced graph
    # planned on the input's layout.
    result = torch.empty_like(x)
    if _compile_allowed(x):
        out = _compiled_round(x, f, saturate, flush_to_zero)
        if out is not None:
            return out if out.stride() == result.stride() else result.copy_(out)
    if result.stride() == x.stride():
        # x is dense (empty_like gave it its own strides): round the flat block of memory that
        # x and the result share in layout; rounding is elementwise, so the order is irrelevant
        _round_flat(_flat_block(x), _flat_block(result), f, saturate, flush_to_zero)
    else:  # sliced or expanded: round a contiguous copy, then lay it out like the fake says
        flat = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        _round_flat(x.contiguous().view(-1), flat, f, saturate, flush_to_zero)
        result.copy_(flat.view(x.shape))
    return result


def _flat_block(t: torch.Tensor) -> torch.Tensor:
    """The memory of a non-overlapping, dense ``t`` as one flat contiguous tensor."""
    return t.as_strided((t.numel(),), (1,))


def _round_flat(x: torch.Tensor, y: torch.Tensor, f: Format, saturate: bool, flush_to_zero: bool) -> None:
    """Round the flat float32 ``x`` into the flat float32 ``y`` (the eager bit form)."""
    # chunks stay in L2 and below ATen's parallel grain size: the ~15 passes below then cost
    # cache bandwidth, not DRAM bandwidth, and no thread-pool barrier per op
    src = x.view(torch.int32)
    n = src.numel()
    out = y.view(torch.int32)
    k = min(n, _CHUNK)
    scratch = (torch.empty(k, dtype=torch.int32), torch.empty(k, dtype=torch.bool),
               torch.empty(k, dtype=torch.bool))
    c = _consts(f)
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        _round_chunk(src[start:stop], out[start:stop], *(t[: stop - start] for t in scratch),
                     c, saturate, flush_to_zero)


def _round_chunk(u: torch.Tensor, o: torch.Tensor, a: torch.Tensor, m: torch.Tensor, nan: torch.Tensor,
                 c: _Consts, saturate: bool, flush_to_zero: bool) -> None:
    """In-place version of ``round_bits`` on int32 views (``u`` in, ``o`` out, rest scratch)."""
    torch.bitwise_and(u, _ABS_MASK, out=a)
    torch.gt(a, _INF_BITS, out=nan)
    has_nan = bool(nan.any())
    if has_nan:  # keeps the rounding add below int32 overflow
        a.clamp_(max=_INF_BITS)
    torch.bitwise_right_shift(a, c.shift, out=o)
    o.bitwise_and_(1).add_(a).add_(c.round_bias).bitwise_and_(c.keep_mask)
    if c.has_subnormal_path:
        torch.lt(a, c.min_normal_bits, out=m)
        if m.any():
            # ulp(magic) is the format's subnormal quantum, so the IEEE float32 add rounds half
            # to even exactly as the shift form of round_bits does; the subtraction is exact
            magic = c.min_normal * 2.0**c.shift
            idx = m.nonzero().squeeze(1)
            fa = a.index_select(0, idx).view(torch.float32)
            o.index_copy_(0, idx, ((fa + magic) - magic).view(torch.int32))
    if saturate:
        torch.ge(a, _INF_BITS, out=m)
        o.clamp_(max=c.max_bits).masked_fill_(m, _INF_BITS)
    else:
        torch.gt(o, c.max_bits, out=m)
        o.masked_fill_(m, _INF_BITS)
    if flush_to_zero:
        torch.lt(o, c.min_normal_bits, out=m)
        o.masked_fill_(m, 0)
    torch.bitwise_and(u, _SIGN_MASK, out=a)
    o.bitwise_or_(a)
    if has_nan:
        torch.where(nan, u, o, out=o)


@torch.library.custom_op("dlspass::round_to_format", mutates_args=())
def _round_to_format_op(x: torch.Tensor, fmt: str, saturate: bool, flush_to_zero: bool) -> torch.Tensor:
    f = get_format(fmt)
    _check_input(x)
    return _eager_round(x, f, saturate, flush_to_zero)


@_round_to_format_op.register_fake
def _round_to_format_fake(x: torch.Tensor, fmt: str, saturate: bool, flush_to_zero: bool) -> torch.Tensor:
    get_format(fmt)
    _check_input(x)
    return torch.empty_like(x)


def _round_backward(ctx, grad: torch.Tensor):
    # straight-through: rounding is treated as identity for the gradient
    return grad, None, None, None


_round_to_format_op.register_autograd(_round_backward)


def round_to_format(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    saturate: bool = False,
    flush_to_zero: bool = False,
) -> torch.Tensor:
    """Round float32 ``x`` to ``fmt`` (returns float32 of ``x``'s shape) via the custom op.

    See the module docstring for overflow, saturation, flush-to-zero, signed-zero and NaN rules.
    The op is ``torch.ops.dlspass.round_to_format.default`` in traced graphs; its gradient passes
    through unchanged.
    """
    _check_input(x)
    f = get_format(fmt)
    return torch.ops.dlspass.round_to_format(x, f.name, bool(saturate), bool(flush_to_zero))


def is_round_node(node: fx.Node) -> bool:
    """True for a ``dlspass::round_to_format`` call in an FX graph."""
    # only call nodes have an op as target (the others name attributes, methods or inputs)
    return node.target in (torch.ops.dlspass.round_to_format.default, torch.ops.dlspass.round_to_format)


def round_node_args(node: fx.Node) -> tuple[fx.Node, str, bool, bool]:
    """``(x, format name, saturate, flush_to_zero)`` of a rounding node, positional or keyword."""
    names = ("x", "fmt", "saturate", "flush_to_zero")
    vals = dict(zip(names, node.args, strict=False))
    vals.update(node.kwargs)
    return vals["x"], vals["fmt"], bool(vals["saturate"]), bool(vals["flush_to_zero"])


# What inductor must be told when it compiles a graph with the "cast" form: without the first,
# its C++ codegen treats a float32 -> float16 -> float32 round trip as a no-op (pytorch#115260's
# cache); the second keeps g++ from folding round_split back to x (an environment can set it).
INDUCTOR_CONFIG = {"emulate_precision_casts": True, "cpp.enable_unsafe_math_opt_flag": False}


def round_fn(fmt: str, saturate: bool, flush_to_zero: bool, form: str = "bits"):
    """``x -> round_bits(x, ...)`` (``round_arith``/``round_split`` for ``form="arith"``/``"split"``)
    with the options bound.

    ``form="cast"``: a format torch has as a dtype (float16, bfloat16) without switches rounds by
    a cast there and back, as the eager kernel does (two ops, bitwise ``round_bits`` but for NaN
    payloads; inductor keeps the round trip only under ``INDUCTOR_CONFIG``); other formats get
    ``round_split`` where ``split_form_ok`` (15 ops, the same bits), else ``round_bits``.
    """
    f = get_format(fmt)
    if form == "cast" and _native_ok(f, saturate, flush_to_zero):
        dtype = f.torch_dtype

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype).to(torch.float32)

        return cast
    split = _split_consts(f) is not None
    if form == "split" and not split:
        raise FormatError(f"round_split cannot round to {f.name!r}: its top binade overflows")
    impl = round_arith if form == "arith" else round_split if split and form != "bits" else round_bits

    # make_fx needs a signature of exactly the traced arguments (no defaults)
    def fn(t: torch.Tensor) -> torch.Tensor:
        return impl(t, fmt, saturate, flush_to_zero)

    return fn
