"""DecomposeForInductorPass: no op of inductor's decomposition table is left, and the graph computes what eager torch does."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.formats import round_to_format
from dlspass.passes.decompose_for_inductor_pass import DecomposeForInductorPass

ROUND = torch.ops.dlspass.round_to_format.default
aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def _dls_tail(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = round_to_format(x, "float16")
    ok = torch.stack([torch.isfinite(r).all(), (r.abs() < 1e4).all()]).all()  # scale_policy.all_finite's form
    return torch.clamp(r, -2.0, 2.0) * 3, ok


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_table_ops_and_rounding_are_decomposed_and_values_kept(tracing_mode: str) -> None:
    table = select_decomp_table()
    x = torch.tensor([0.1, -3.0, 70000.0, 1e-9, 1.5, -0.3333])
    gm = make_fx(_dls_tail, tracing_mode=tracing_mode)(x)
    # ops inductor's table decomposes (some decompose into themselves, e.g. add: those stay)
    decomposed = {ROUND, aten.clamp.default, aten.stack.default, aten.all.default}
    assert decomposed - {ROUND} <= set(table)
    assert decomposed <= _targets(gm)

    result = DecomposeForInductorPass()(gm)
    assert result.modified and result.stats["replaced"] >= 5
    assert not decomposed & _targets(gm)
    for inp in (x, torch.tensor([float("inf"), 0.5, float("nan")]), torch.randn(9) * 100):
        if tracing_mode == "fake" and inp.shape != x.shape:
            continue  # a fake-mode trace is for its one shape
        got, want = gm(inp), _dls_tail(inp)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "cbfloat16"])
def test_rounding_through_inductor_is_bitwise_the_eager_op(fmt: str) -> None:
    """float16/bfloat16 round by a cast there and back (two ops, not the ~20 of the bit form);
    inductor keeps that round trip only under dlspass.formats.INDUCTOR_CONFIG, so the compiled
    rounding equals the eager op bit for bit, inside a fused kernel (the multiplies around it)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    from dlspass.formats import INDUCTOR_CONFIG, round_bits

    def f(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (round_to_format(x * 2, fmt) * 3,)

    x = torch.cat([torch.randn(4096) * s for s in (1e-9, 1e-6, 1e-3, 1.0, 1e3, 5e4)]
                  + [torch.tensor([65519.0, 65520.0, 2.0**-25, 3 * 2.0**-26, -0.0])])
    gm = make_fx(f, tracing_mode="fake")(x)
    DecomposeForInductorPass()(gm)
    n_ops = len([n for n in gm.graph.nodes if n.op == "call_function"])
    assert n_ops <= 4 if fmt != "cbfloat16" else n_ops > 10  # mul, cast, cast, mul
    want = (round_bits(x * 2, fmt) * 3).view(torch.int32)
    with inductor_config.patch(INDUCTOR_CONFIG):
        got = compile_fx_inner(gm, [x])([x])[0]
    assert torch.equal(got.view(torch.int32), want)
    if fmt != "cbfloat16":
        # without the setting inductor drops the round trip: the values are x * 6, unrounded
        assert not torch.equal(compile_fx_inner(gm, [x])([x])[0].view(torch.int32), want)
