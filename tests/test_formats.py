"""Tests for dlspass.formats against float64/numpy references written here and native casts."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass import formats as F
from dlspass.errors import DLSInputError
from dlspass.passes.decompose_rounding_pass import DecomposeRoundingPass

IMPLS = {
    "op": lambda x, f, s=False, z=False: F.round_to_format(x, f, saturate=s, flush_to_zero=z),
    "bits": F.round_bits,
    "arith": F.round_arith,
    "split": F.round_split,  # cbfloat16 and float16 only (F.split_form_ok); tests/test_round_split.py
}
SWITCHES = [(False, False), (True, False), (False, True), (True, True)]
FORMAT_PARAMS = {"float16": (5, 10), "bfloat16": (8, 7), "cbfloat16": (6, 9)}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy()


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equal, except that any NaN matches any NaN."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    g, w = got.reshape(-1), want.reshape(-1)
    gn, wn = torch.isnan(g), torch.isnan(w)
    assert torch.equal(gn, wn), "NaN positions differ"
    diff = (bits(g) != bits(w)) & ~gn.numpy()
    if diff.any():
        i = int(np.flatnonzero(diff)[0])
        pytest.fail(f"{int(diff.sum())} mismatches; first at {i}: got {g[i].item()!r}, want {w[i].item()!r}")


def reference(x: torch.Tensor, name: str, saturate: bool = False, ftz: bool = False) -> torch.Tensor:
    """float64 round-to-nearest-even reference built from frexp/ldexp and np.round."""
    e_bits, m_bits = FORMAT_PARAMS[name]
    bias = 2 ** (e_bits - 1) - 1
    emin, emax = 1 - bias, 2**e_bits - 2 - bias
    fmax = math.ldexp(2.0 - 2.0**-m_bits, emax)
    xd = x.double().numpy().reshape(-1)
    ax = np.abs(xd)
    normal = np.isfinite(xd) & (ax > 0)
    safe = np.where(normal, ax, 1.0)
    _, ex = np.frexp(safe)  # safe = m * 2**ex, m in [0.5, 1)
    e = np.maximum(ex - 1, emin)
    q = np.ldexp(1.0, e - m_bits)
    r = np.round(safe / q) * q  # np.round: ties to even
    r = np.where(r > fmax, fmax if saturate else np.inf, r)
    if ftz:
        r = np.where(r < math.ldexp(1.0, emin), 0.0, r)
    r = np.where(normal, r, ax)
    r = np.copysign(r, xd)
    return torch.from_numpy(r.astype(np.float32)).reshape(x.shape)


def decode_cbfloat16() -> np.ndarray:
    """All 65536 cbfloat16 encodings in float64: 1 sign, 6 exponent (bias 31), 9 mantissa bits."""
    code = np.arange(65536)
    sign = (code >> 15) & 1
    exp = (code >> 9) & 63
    man = code & 511
    normal = (1.0 + man / 512.0) * np.ldexp(1.0, np.clip(exp, 1, 62) - 31)
    sub = man * 2.0**-39
    val = np.where(exp == 0, sub, normal)
    val = np.where(exp == 63, np.where(man == 0, np.inf, np.nan), val)
    return np.where(sign == 1, -val, val)


@pytest.fixture(scope="module")
def random_f32() -> torch.Tensor:
    """Random float32 bit patterns (every exponent, subnormals, inf, NaN) plus tame values."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(-(2**31), 2**31, (30000,), generator=g, dtype=torch.int64)
    wide = raw.to(torch.int32).view(torch.float32)
    tame = torch.randn(10000, generator=g) * torch.exp2(torch.randint(-45, 40, (10000,), generator=g).float())
    return torch.cat([wide, tame])


def test_format_constants():
    cb = F.CBFLOAT16
    assert (cb.exponent_bits, cb.mantissa_bits, cb.bias) == (6, 9, 31)
    assert cb.max == 2.0**32 - 2.0**22 == 4290772992.0
    assert (cb.min_normal, cb.min_subnormal, cb.eps) == (2.0**-30, 2.0**-39, 2.0**-9)
    assert cb.torch_dtype is None
    for fmt in (F.FLOAT16, F.BFLOAT16):
        fi = torch.finfo(fmt.torch_dtype)
        assert (fmt.max, fmt.min_normal, fmt.eps) == (fi.max, fi.tiny, fi.eps)
        assert fmt.min_subnormal == fi.smallest_normal * fi.eps
        assert fmt.bias == 2 ** (fmt.exponent_bits - 1) - 1


def test_get_format():
    assert F.get_format("cbfloat16") is F.CBFLOAT16
    assert F.get_format("BF16") is F.BFLOAT16
    assert F.get_format(torch.float16) is F.FLOAT16
    assert F.get_format(F.CBFLOAT16) is F.CBFLOAT16
    # FormatError: an input error (DLSInputError) that is still a ValueError
    assert issubclass(F.FormatError, DLSInputError) and issubclass(F.FormatError, ValueError)
    with pytest.raises(F.FormatError, match="unknown float format 'fp8'"):
        F.get_format("fp8")
    with pytest.raises(F.FormatError, match="float32"):
        F.get_format(torch.float32)
    with pytest.raises(F.FormatError, match="unknown float format"):
        F.round_to_format(torch.ones(2), "fp8")
    with pytest.raises(F.FormatTypeError, match="must be a name or Format"):
        F.get_format(3)


def test_rejects_non_float32():
    for impl in IMPLS.values():
        with pytest.raises(F.FormatTypeError, match="float32 tensor, got torch.float16"):
            impl(torch.ones(2, dtype=torch.float16), "cbfloat16")


@pytest.mark.parametrize("impl", IMPLS)
def test_all_cbfloat16_encodings_round_trip(impl):
    vals = decode_cbfloat16()
    x = torch.from_numpy(vals.astype(np.float32))
    finite = np.isfinite(vals)
    assert (x.double().numpy()[finite] == vals[finite]).all()  # all exactly representable in fp32
    for s, z in SWITCHES:
        y = IMPLS[impl](x, "cbfloat16", s, z)
        if not z:
            assert_same(y, x)
        else:  # flush_to_zero: exactly the subnormal encodings become signed zeros
            sub = np.abs(vals) < 2.0**-30
            want = torch.where(torch.from_numpy(sub), x * 0.0, x)
            assert_same(y, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_cbfloat16_midpoints_round_to_even(impl):
    """Midpoints between neighbouring cbfloat16 values go to the even one; 1 fp32 ulp off, not."""
    vals = decode_cbfloat16()[:63 * 512]  # positive finite, ascending
    lo, hi = vals[:-1], vals[1:]
    mid = (lo + hi) / 2
    even = np.where((np.arange(len(lo)) % 2) == 0, lo, hi)
    mid32 = torch.from_numpy(mid.astype(np.float32))
    assert (mid32.double().numpy() == mid).all()
    up = torch.nextafter(mid32, torch.tensor(np.inf, dtype=torch.float32))
    down = torch.nextafter(mid32, torch.tensor(0.0))
    f = IMPLS[impl]
    assert_same(f(mid32, "cbfloat16"), torch.from_numpy(even.astype(np.float32)))
    assert_same(f(up, "cbfloat16"), torch.from_numpy(hi.astype(np.float32)))
    assert_same(f(down, "cbfloat16"), torch.from_numpy(lo.astype(np.float32)))
    assert_same(f(-mid32, "cbfloat16"), torch.from_numpy(-even.astype(np.float32)))


SPEC_CASES = [
    (65504.0, 65536.0),
    (1 + 2**-10, 1.0),
    (1 + 3 * 2**-10, 1 + 2**-8),
    (2.0**32 - 2.0**21, math.inf),
    (float(np.nextafter(np.float32(2**32 - 2**21), np.float32(0))), 4290772992.0),
    (2.0**-40, 0.0),
    (0.75 * 2**-39, 2.0**-39),
    (-0.0, -0.0),
    (math.inf, math.inf),
    (-math.inf, -math.inf),
    (math.nan, math.nan),
]


@pytest.mark.parametrize("impl", IMPLS)
def test_spec_corner_cases(impl):
    x = torch.tensor([c[0] for c in SPEC_CASES], dtype=torch.float32)
    want = torch.tensor([c[1] for c in SPEC_CASES], dtype=torch.float32)
    y = IMPLS[impl](x, "cbfloat16")
    assert_same(y, want)
    assert math.copysign(1.0, y[7].item()) == -1.0
    assert_same(IMPLS[impl](-x, "cbfloat16"), -want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(FORMAT_PARAMS))
def test_random_against_float64_reference(impl, name, random_f32):
    if impl == "split" and not F.split_form_ok(name):
        with pytest.raises(F.FormatError, match=name):
            F.round_split(random_f32, name)
        return
    for s, z in SWITCHES:
        assert_same(IMPLS[impl](random_f32, name, s, z), reference(random_f32, name, s, z))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_native_formats_match_casts(impl, name, random_f32):
    if impl == "split" and not F.split_form_ok(name):
        pytest.skip(f"round_split does not round to {name} (test_random_against_float64_reference)")
    dtype = F.get_format(name).torch_dtype
    assert_same(IMPLS[impl](random_f32, name), random_f32.to(dtype).float())
    # and every native encoding is a fixed point
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    assert_same(IMPLS[impl](codes, name), codes)


@pytest.mark.parametrize("impl", IMPLS)
def test_saturate_and_flush(impl):
    f = IMPLS[impl]
    big = torch.tensor([2.0**33, -(2.0**32 - 2.0**21), 3e38, math.inf, -math.inf, math.nan])
    assert_same(f(big, "cbfloat16", True), torch.tensor([4290772992.0, -4290772992.0, 4290772992.0,
                                                         math.inf, -math.inf, math.nan]))
    assert_same(f(big, "cbfloat16"), torch.tensor([math.inf, -math.inf, math.inf, math.inf,
                                                   -math.inf, math.nan]))
    assert_same(f(torch.tensor([70000.0, -1e6]), "float16", True), torch.tensor([65504.0, -65504.0]))
    small = torch.tensor([2.0**-35, -(2.0**-35), 2.0**-30 * (1 - 2**-11), 2.0**-31, 2.0**-30])
    assert_same(f(small, "cbfloat16", False, True), torch.tensor([0.0, -0.0, 2.0**-30, 0.0, 2.0**-30]))
    assert math.copysign(1.0, f(small, "cbfloat16", False, True)[1].item()) == -1.0
    assert_same(f(small, "cbfloat16"), torch.tensor([2.0**-35, -(2.0**-35), 2.0**-30, 2.0**-31, 2.0**-30]))
    tiny16 = torch.tensor([2.0**-20, -(2.0**-24)])
    assert_same(f(tiny16, "float16", False, True), torch.tensor([0.0, -0.0]))
    # bfloat16 flush: fp32 subnormals are below its min normal too
    if impl != "split":  # round_split does not round to bfloat16
        assert_same(f(torch.tensor([1e-40, 2.0**-126]), "bfloat16", False, True), torch.tensor([0.0, 2.0**-126]))


@pytest.mark.parametrize("impl", IMPLS)
def test_shapes(impl):
    f = IMPLS[impl]
    zero_d = torch.tensor(1 + 3 * 2**-10)
    y = f(zero_d, "cbfloat16")
    assert y.shape == () and y.item() == 1 + 2**-8
    empty = torch.empty(0, 3)
    assert f(empty, "cbfloat16").shape == (0, 3)
    x = torch.randn(4, 5, 6).transpose(0, 2)  # non-contiguous
    assert_same(f(x, "cbfloat16"), reference(x, "cbfloat16"))
    assert_same(x, x.clone())  # input untouched (sanity of the aliasing-free contract)


def test_eager_chunked_path_matches_reference():
    n = 3 * F._CHUNK + 7
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-45, 35, (n,), generator=g).float())
    x = x.reshape(n, 1)
    for s, z in SWITCHES:
        assert_same(F.round_to_format(x, "cbfloat16", saturate=s, flush_to_zero=z),
                    reference(x, "cbfloat16", s, z))


def test_compiled_kernel_falls_back(monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(F, "COMPILE_MIN_NUMEL", 8)
    monkeypatch.setattr(F, "_COMPILED", {})
    monkeypatch.setattr(F, "_compile_failed", False)
    monkeypatch.setattr(torch, "compile", broken)
    x = torch.randn(100) * 1e3
    # never compiled while a trace runs the kernel (make_fx real mode) nor when switched off
    gm = make_fx(lambda t: F.round_to_format(t, "cbfloat16"))(x)
    assert calls == []
    monkeypatch.setenv("DLSPASS_ROUNDING_COMPILE", "0")
    assert_same(gm(x), reference(x, "cbfloat16"))
    assert_same(F.round_to_format(x, "cbfloat16"), reference(x, "cbfloat16"))
    assert calls == [] and not F._compile_failed
    monkeypatch.delenv("DLSPASS_ROUNDING_COMPILE")
    with pytest.warns(RuntimeWarning, match="compiled rounding kernel unavailable"):
        y = F.round_to_format(x, "cbfloat16")
    assert_same(y, reference(x, "cbfloat16"))
    assert F._compile_failed and len(calls) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, then silent
        assert_same(F.round_to_format(x, "cbfloat16"), reference(x, "cbfloat16"))


def test_exp2_is_exact_on_integers():
    """round_arith relies on exp2 of integral floats being exact powers of two."""
    k = torch.arange(-149, 128, dtype=torch.float32)
    want = torch.tensor([math.ldexp(1.0, int(i)) for i in k], dtype=torch.float32)
    assert_same(torch.exp2(k), want)


def test_straight_through_gradient():
    x = torch.tensor([1 + 2**-10, 3.3e9, 5e9, -2.0**-41], requires_grad=True)
    w = torch.tensor([2.0, 3.0, 5.0, 7.0])
    (F.round_to_format(x, "cbfloat16") * w).sum().backward()
    assert torch.equal(x.grad, w)
    torch.library.opcheck(torch.ops.dlspass.round_to_format.default, (torch.randn(3), "cbfloat16", False, True))


def _step(x: torch.Tensor) -> torch.Tensor:
    a = F.round_to_format(x * 3.0, "cbfloat16")
    b = F.round_to_format(a + 1.0, "float16", saturate=True, flush_to_zero=True)
    return a - b


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_make_fx_traces_op_and_decompose(mode):
    x = torch.randn(64) * torch.exp2(torch.randint(-40, 30, (64,)).float())
    gm = make_fx(_step, tracing_mode=mode)(x)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.dlspass.round_to_format.default) == 2
    assert "dlspass.round_to_format" in gm.code
    want = _step(x)
    assert_same(gm(x), want)
    assert DecomposeRoundingPass()(gm).stats["replaced"] == 2
    assert "round_to_format" not in gm.code
    assert any(n.target == torch.ops.aten.view.dtype for n in gm.graph.nodes)
    assert_same(gm(x), want)
    if mode != "real":
        for n in gm.graph.nodes:
            if n.op == "call_function":
                val = n.meta.get("val")
                assert isinstance(val, torch.Tensor), n
    assert DecomposeRoundingPass()(gm).stats["replaced"] == 0


@pytest.mark.slow
def test_inductor_compiles_bit_form_bitwise():
    vals = torch.from_numpy(decode_cbfloat16().astype(np.float32))
    g = torch.Generator().manual_seed(2)
    x = torch.cat([vals, torch.randint(-(2**31), 2**31, (5000,), generator=g).to(torch.int32).view(torch.float32)])
    compiled = torch.compile(F.round_bits, dynamic=True)
    for s, z in SWITCHES:
        assert_same(compiled(x, "cbfloat16", s, z), reference(x, "cbfloat16", s, z))


def test_round_arith_exports_to_onnx_bitwise():
    """round_arith is the ONNX path: exported and run in onnxruntime it must still be exact."""
    ort = pytest.importorskip("onnxruntime")

    class Round(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.round_arith(x, "cbfloat16", False, True)

    g = torch.Generator().manual_seed(3)
    vals = decode_cbfloat16()
    mids = (vals[:63 * 512 - 1] + vals[1:63 * 512]) / 2
    x = torch.cat([
        torch.from_numpy(vals.astype(np.float32)),
        torch.from_numpy(np.concatenate([mids, -mids]).astype(np.float32)),
        torch.randint(-(2**31), 2**31, (20000,), generator=g).to(torch.int32).view(torch.float32),
    ])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(Round(), (x,), dynamo=True, verbose=False).model_proto
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    assert_same(torch.from_numpy(y), reference(x, "cbfloat16", False, True))


@pytest.mark.slow
def test_eager_op_compiled_kernel_bitwise(monkeypatch):
    monkeypatch.setattr(F, "COMPILE_MIN_NUMEL", 1000)
    monkeypatch.setattr(F, "_COMPILED", {})
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-(2**31), 2**31, (6000,), generator=g).to(torch.int32).view(torch.float32)
    for s, z in SWITCHES:
        assert_same(F.round_to_format(x, "cbfloat16", saturate=s, flush_to_zero=z),
                    reference(x, "cbfloat16", s, z))
    assert len(F._COMPILED) == 4 and not F._compile_failed


def _layouts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 1000.0

    return {
        "transposed": r(3, 4).t(),
        "permuted_3d": r(2, 3, 4).transpose(0, 1),
        "permuted_4d": r(2, 3, 4, 5).permute(0, 2, 1, 3),
        "sliced_step": r(4, 6)[:, ::2],
        "sliced_window": r(4, 6)[1:3, 1:5],
        "expanded": r(3, 1).expand(3, 4),
        "channels_last": r(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "offset_transposed": r(5, 3, 4)[1:].transpose(1, 2),
    }


@pytest.mark.parametrize("switches", [(False, False), (True, True)])
@pytest.mark.parametrize("name", list(FORMAT_PARAMS))
@pytest.mark.parametrize("layout", list(_layouts()))
def test_op_fake_and_decomposition_agree_on_strides(layout, name, switches):
    """Eager kernel, fake kernel and decomposition give the same strides (and the eager values
    are the reference's): a traced graph plans later views on the fake kernel's strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    s, z = switches
    x = _layouts()[layout]

    def fn(t: torch.Tensor) -> torch.Tensor:
        return F.round_to_format(t, name, saturate=s, flush_to_zero=z)

    eager = fn(x)
    assert_same(eager.contiguous(), reference(x.contiguous(), name, s, z))
    with FakeTensorMode() as mode:
        fake = fn(mode.from_tensor(x))
    gm = make_fx(fn, tracing_mode="fake")(x)
    assert DecomposeRoundingPass()(gm).stats["replaced"] == 1
    out_val = gm.graph.output_node().args[0].meta["val"]
    decomposed = gm(x)
    assert_same(decomposed.contiguous(), eager.contiguous())
    assert eager.stride() == fake.stride() == out_val.stride() == decomposed.stride(), (
        eager.stride(), fake.stride(), out_val.stride(), decomposed.stride())
    assert eager.stride() == torch.empty_like(x).stride()


_ISA_SCRIPT = """
import sys, torch
from dlspass import formats as F
x = torch.tensor([5e9, 4.3e9, 4.2e9, 1e38, 3e38, float("inf"), 1.0, -5e9, 2.0**-40, 0.0] * 8)
bad = []
for s in (False, True):
    for z in (False, True):
        got = torch.compile(F.round_bits, dynamic=False)(x, "cbfloat16", s, z)
        want = F.round_bits(x, "cbfloat16", s, z)
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            bad.append((s, z, got[:10].tolist(), want[:10].tolist()))
print(torch.backends.cpu.get_cpu_capability(), bad)
"""


def run_under_isa(script: str, isa: str, cache_dir: Path, **env: str) -> str:
    """Run ``script`` in a new process under ``ATEN_CPU_CAPABILITY=isa``, one thread, its own
    inductor cache (a kernel compiled under one ISA is not a test of another) and ``env``; the
    text after the capability on its last line. Skips when the CPU does not run ``isa``."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
           "OMP_NUM_THREADS": "1", **env}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    capability, rest = out.stdout.strip().splitlines()[-1].split(" ", 1)
    if capability.lower() != isa:
        pytest.skip(f"this CPU runs {capability}, not {isa}")
    return rest


# the default run compiles under the machine's own ISA already (avx512 where it has it): the
# avx512 subprocess is behind `slow` (tools/run_slow.sh), avx2 (its own kernels) runs by default
@pytest.mark.parametrize("isa", ["avx2", pytest.param("avx512", marks=pytest.mark.slow)])
def test_compiled_round_bits_equals_eager_under_each_vector_isa(isa, tmp_path):
    """round_bits compiled by inductor under a vector ISA equals its eager run bit for bit (the
    same int32 ops). Under AVX2, inductor's vectorised integer `>=` inside a `where` picked the
    wrong branch, so every saturated value came back inf."""
    bad = run_under_isa(_ISA_SCRIPT, isa, tmp_path / "inductor")
    assert bad == "[]", bad
