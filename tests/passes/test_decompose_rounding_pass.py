"""DecomposeRoundingPass: the rounding op becomes plain aten ops that round bit-identically to it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.errors import DLSInputError
from dlspass.formats import FORMATS, FormatError, is_round_node, round_to_format, split_form_ok
from dlspass.passes.decompose_rounding_pass import DecomposeRoundingPass, rounded_format

SWITCHES = [(False, False), (True, False), (False, True), (True, True)]
STACK = {"L__self___fc1": ("fc1", "torch.nn.modules.linear.Linear")}


def inputs(n: int = 4096, seed: int = 0) -> Tensor:
    """Values across the whole float32 range (subnormals, overflow, ties), plus 0, -0, ±inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 120, (n,), generator=g).float())
    return torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65520.0, -65504.0])])


def same_bits(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def rounds(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_round_node(n)]


def _scaled_round(fmt: str, saturate: bool, ftz: bool):
    def fn(t: Tensor) -> Tensor:
        return round_to_format(t * 3.0, fmt, saturate=saturate, flush_to_zero=ftz)

    return fn


@pytest.mark.parametrize("form", ["bits", "arith", "split", "cast"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decomposed_graph_rounds_like_the_eager_op(form: str, fmt: str) -> None:
    x = inputs()
    for saturate, ftz in SWITCHES:
        fn = _scaled_round(fmt, saturate, ftz)
        gm = make_fx(fn, tracing_mode="fake")(x)
        if form == "split" and not split_form_ok(fmt):  # bfloat16: round_split cannot, and says so
            with pytest.raises(FormatError, match=fmt):
                DecomposeRoundingPass(form)(gm)
            continue
        result = DecomposeRoundingPass(form)(gm)
        assert result is not None and result.modified
        assert not rounds(gm) and "round_to_format" not in gm.code
        assert same_bits(gm(x), fn(x)), (fmt, form, saturate, ftz)


def test_every_new_node_has_a_fake_value_and_the_op_provenance() -> None:
    def fn(t: Tensor) -> Tensor:
        return round_to_format(torch.sin(t), "cbfloat16") + 1.0

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 5))
    (op,) = rounds(gm)
    op.meta["nn_module_stack"] = dict(STACK)
    op.meta["stack_trace"] = "model.py:7"
    op.meta["custom"] = {"dlspass_role": "cast"}
    before = set(gm.graph.nodes)
    result = DecomposeRoundingPass()(gm)
    assert result.stats["replaced"] == 1
    new = [n for n in gm.graph.nodes if n not in before]
    assert new and all(isinstance(n.meta.get("val"), Tensor) for n in new)
    assert all(n.meta["nn_module_stack"] == STACK and n.meta["stack_trace"] == "model.py:7" for n in new)
    # the last node stands for the op: its custom meta, plus the format it rounds to
    add = gm.graph.output_node().args[0]
    assert add.target is torch.ops.aten.add.Tensor and add not in new
    last = add.args[0]
    assert last.meta["custom"] == {"dlspass_role": "cast", "dlspass_rounded": "cbfloat16"}
    assert rounded_format(last) == "cbfloat16"
    assert last.meta["val"].shape == (3, 5)
    x = torch.randn(3, 5)
    assert same_bits(gm(x), fn(x))


def test_symbolic_shapes_and_several_ops() -> None:
    def fn(t: Tensor) -> Tensor:
        a = round_to_format(t, "float16", saturate=True)
        b = round_to_format(t.t() * 7.0, "bfloat16", flush_to_zero=True)
        return a + round_to_format(b.t(), "float16", saturate=True)

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(4, 6))
    result = DecomposeRoundingPass()(gm)
    assert result.stats["replaced"] == 3 and not rounds(gm)
    for shape in ((4, 6), (9, 2)):
        x = inputs(shape[0] * shape[1] - 6, seed=1)[: shape[0] * shape[1]].reshape(shape)
        assert same_bits(gm(x), fn(x)), shape


def test_graph_without_fake_values_runs_and_claims_no_values() -> None:
    def fn(t: Tensor) -> Tensor:
        return torch.ops.dlspass.round_to_format(t, "bfloat16", False, False)

    gm = fx.symbolic_trace(fn)
    assert rounds(gm)
    before = set(gm.graph.nodes)
    DecomposeRoundingPass()(gm)
    new = [n for n in gm.graph.nodes if n not in before]
    assert new and not any("val" in n.meta for n in new)
    x = inputs()
    assert same_bits(gm(x), fn(x))


def test_nothing_to_do_and_bad_form() -> None:
    gm = make_fx(lambda t: t * 2.0)(torch.randn(3))
    code = gm.code
    result = DecomposeRoundingPass("arith")(gm)
    assert result is not None and not result.modified and result.stats["replaced"] == 0 and gm.code == code
    with pytest.raises(DLSInputError, match="form"):
        DecomposeRoundingPass("bytes")
    with pytest.raises(ValueError, match="form"):  # still the builtin it always was
        DecomposeRoundingPass("bytes")
