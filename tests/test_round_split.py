"""round_split (dlspass.formats): the short rounding inductor compiles for cbfloat16 and float16
with switches, checked bit for bit against round_bits (the reference form, itself tested against
float64 references in tests/test_formats.py) in eager and compiled by inductor.

The default tests cover every float32 exponent and sign with mantissas that put a tie, and its
neighbours, at every dropped-bit position (so every tie of the format's normals and subnormals),
plus every midpoint between neighbouring cbfloat16 values. The slow test covers all 2**32
float32 bit patterns (tools/bench/RESULTS.md records its run).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_formats import run_under_isa
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass import formats as F

SWITCHES = [(False, False), (True, False), (False, True), (True, True)]
SPLIT_FORMATS = ["float16", "cbfloat16"]  # in FORMATS order


def mantissa_patterns(seed: int = 0) -> np.ndarray:
    """23-bit mantissas with a tie, one below, one above, all-zero and all-one dropped bits at
    every position k (bits below k dropped), under kept bits 0, 1, all ones and random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(1, 24):
        half = 1 << (k - 1)
        low = np.array([0, half - 1, half, half + 1, (1 << k) - 1], dtype=np.int64)
        top = (1 << (23 - k)) - 1
        high = np.unique(np.array([0, 1, top, *rng.integers(0, top + 1, 3)], dtype=np.int64) & top)
        out.append(((high[:, None] << k) | low[None, :]).reshape(-1))
    return np.unique(np.concatenate(out))


def every_exponent_sample() -> torch.Tensor:
    """Every sign and exponent (zeros, subnormals, inf and NaN payloads included) times
    ``mantissa_patterns``: about 200k float32 values."""
    m = mantissa_patterns()
    e = np.arange(256, dtype=np.int64)
    s = np.array([0, 1], dtype=np.int64)
    bits = (s[:, None, None] << 31) | (e[None, :, None] << 23) | m[None, None, :]
    return torch.from_numpy(bits.reshape(-1).astype(np.uint32).view(np.int32)).view(torch.float32)


def cbfloat16_midpoints() -> torch.Tensor:
    """Every midpoint between neighbouring positive cbfloat16 values (the one past max too) and
    the float32 values either side of it, both signs."""
    code = np.arange(63 * 512)  # positive finite encodings, ascending
    exp, man = code >> 9, code & 511
    vals = np.where(exp == 0, man * 2.0**-39, (1 + man / 512) * np.ldexp(1.0, np.maximum(exp, 1) - 31))
    vals = np.append(vals, 2.0**32)  # the first value past max: its midpoint is the overflow tie
    mid = torch.from_numpy(((vals[:-1] + vals[1:]) / 2).astype(np.float32))
    near = [mid, torch.nextafter(mid, torch.tensor(np.inf, dtype=torch.float32)),
            torch.nextafter(mid, torch.tensor(0.0))]
    return torch.cat([*near, *(-t for t in near)])


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical, NaN payloads included (round_split keeps a NaN's bits, as round_bits does)."""
    g, w = got.view(torch.int32), want.view(torch.int32)
    bad = (g != w).nonzero()
    if len(bad):
        i = int(bad[0])
        pytest.fail(f"{len(bad)} mismatches; first bits {int(g[i]):#010x}, want {int(w[i]):#010x}")


@pytest.fixture(scope="module")
def sample() -> torch.Tensor:
    return torch.cat([every_exponent_sample(), cbfloat16_midpoints()])


def test_sample_has_every_tie_of_cbfloat16(sample):
    """The sample is what the docstrings say: each cbfloat16 normal tie pattern (dropped bits
    exactly 0x2000) at each exponent, both parities of the kept bits, and NaNs of both kinds."""
    b = sample.view(torch.int32)
    ties = b[(b & 0x3FFF) == 0x2000]
    kinds = {(int(e), int(p)) for e, p in zip((ties >> 23) & 0xFF, (ties >> 14) & 1, strict=True)}
    assert kinds == {(e, p) for e in range(256) for p in (0, 1)}
    signalling = ((b & 0x7FC00000) == 0x7F800000) & ((b & 0x003FFFFF) != 0)
    assert signalling.sum() > 0 and (torch.isnan(sample) & ~signalling).sum() > 0


def test_split_form_covers_cbfloat16_and_float16_not_bfloat16():
    assert [name for name in F.FORMATS if F.split_form_ok(name)] == SPLIT_FORMATS
    x = torch.ones(3)
    with pytest.raises(F.FormatError, match="bfloat16"):
        F.round_split(x, "bfloat16")
    with pytest.raises(F.FormatError, match="bfloat16"):
        F.round_fn("bfloat16", True, False, "split")
    with pytest.raises(F.FormatTypeError, match="float32 tensor"):
        F.round_split(x.double(), "cbfloat16")


@pytest.mark.parametrize("name", SPLIT_FORMATS)
def test_eager_bit_identical_to_round_bits(sample, name):
    for s, z in SWITCHES:
        same_bits(F.round_split(sample, name, s, z), F.round_bits(sample, name, s, z))


def test_cast_form_rounds_cbfloat16_with_round_split():
    """What inductor compiles for cbfloat16 (the "cast" form) is round_split: at most half of
    round_bits' ops after inductor's decompositions (15 to 21 against 41 to 45) and no dtype
    view (a bitcast, a dozen lines of C++ per use in inductor's vectorised code), for each
    switch; bfloat16 with switches keeps round_bits (round_split cannot)."""
    x = torch.randn(8)
    table = select_decomp_table()

    def ops(fmt: str, s: bool, z: bool, form: str) -> list[str]:
        gm = make_fx(F.round_fn(fmt, s, z, form), decomposition_table=table)(x)
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    for s, z in SWITCHES:
        cast, split, bits = (ops("cbfloat16", s, z, form) for form in ("cast", "split", "bits"))
        assert cast == split and len(split) <= 0.5 * len(bits), (len(split), len(bits))
        assert "aten.view.dtype" not in split and "aten.view.dtype" in bits
    assert ops("bfloat16", True, False, "cast") == ops("bfloat16", True, False, "bits")
    assert ops("float16", False, True, "cast") == ops("float16", False, True, "split")


_COMPILED_SCRIPT = """
import torch
from torch._inductor import config as inductor_config
from dlspass import formats as F
from test_round_split import SWITCHES, SPLIT_FORMATS, cbfloat16_midpoints, every_exponent_sample

x = torch.cat([every_exponent_sample(), cbfloat16_midpoints()])

def all_variants(t):
    return torch.stack([F.round_split(t, n, s, z) for n in SPLIT_FORMATS for s, z in SWITCHES])

with inductor_config.patch(F.INDUCTOR_CONFIG):
    got = torch.compile(all_variants, dynamic=False, fullgraph=True)(x)
want = torch.stack([F.round_bits(x, n, s, z) for n in SPLIT_FORMATS for s, z in SWITCHES])
bad = (got.view(torch.int32) != want.view(torch.int32)).sum(dim=1).tolist()
print(torch.backends.cpu.get_cpu_capability(), bad)
"""


# the default run compiles under the machine's own ISA already (avx512 where it has it): the
# avx512 subprocess is behind `slow` (tools/run_slow.sh), avx2 (its own kernels) runs by default
@pytest.mark.parametrize("isa", ["avx2", pytest.param("avx512", marks=pytest.mark.slow)])
def test_compiled_bit_identical_to_round_bits_under_each_vector_isa(isa, tmp_path):
    """Inductor's C++ for round_split, under each vector ISA, rounds the sample bit-identically to
    eager round_bits for both formats and every switch. The run enables g++'s unsafe math
    optimizations by the environment, as a user could: INDUCTOR_CONFIG, which dlspass's compile
    paths apply, must switch them back off (with them, c - (c - a) may fold to a)."""
    path = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    bad = run_under_isa(_COMPILED_SCRIPT, isa, tmp_path / "inductor", PYTHONPATH=path,
                        TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG="1")
    assert bad == "[0, 0, 0, 0, 0, 0, 0, 0]", bad


def _mismatches_in_chunk(base: torch.Tensor, n: int) -> torch.Tensor:
    """Per (format, switches), how many of the float32 bit patterns base .. base + n - 1 round
    differently by round_split and round_bits (both in the same compiled graph)."""
    x = (torch.arange(n, dtype=torch.int32) + base).view(torch.float32)
    return torch.stack([(F.round_split(x, name, s, z).view(torch.int32)
                         != F.round_bits(x, name, s, z).view(torch.int32)).sum()
                        for name in SPLIT_FORMATS for s, z in SWITCHES])


@pytest.mark.slow
def test_every_float32_compiled():
    """All 2**32 bit patterns, in chunks of 2**24, compiled by inductor (eager would take hours
    on a small CPU): round_split and round_bits agree on every one, for both formats and every
    switch (tools/bench/RESULTS.md, "cbfloat16 first call (issue 31)")."""
    n = 1 << 24
    from torch._inductor import config as inductor_config

    with inductor_config.patch(F.INDUCTOR_CONFIG):
        check = torch.compile(_mismatches_in_chunk, dynamic=False, fullgraph=True)
        total = torch.zeros(2 * len(SWITCHES), dtype=torch.int64)
        for start in range(-(2**31), 2**31, n):  # the last chunk ends at 2**31 - 1: no overflow
            total += check(torch.tensor(start, dtype=torch.int32), n)
    assert total.tolist() == [0] * (2 * len(SWITCHES))
