"""LowerPrecisionPass: every mm/bmm/addmm/convolution (forward and backward) reads and writes 16 bits."""

from __future__ import annotations

import operator

import pytest
import torch
from stepgraph import cnn_step, gpt_step, mlp_step, run, trace_step

import dlspass.formats  # noqa: F401 - registers dlspass::round_to_format (ROUND below)
from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.models import MLP, mse_loss
from dlspass.passes import LowerPrecisionPass, apply_dls
from dlspass.precision_policy import DEFAULT_LOWER_OPS, VALUE_PRESERVING_OPS, WHOLE_VIEW_OPS

aten = torch.ops.aten
ROUND = torch.ops.dlspass.round_to_format.default


def _rounded(n: torch.fx.Node) -> bool:
    """Produced by a round node, or a pure view/copy chain of one."""
    while n.target is not ROUND:
        if n.op != "call_function" or not (n.target in VALUE_PRESERVING_OPS or n.target is operator.getitem):
            return False
        n = n.args[0]
    return True


def _view_root(n: torch.fx.Node) -> torch.fx.Node:
    while n.op == "call_function" and n.target in WHOLE_VIEW_OPS:
        n = n.args[0]
    return n


def _check_lowered(gm: torch.fx.GraphModule, fmt: str) -> set:
    seen = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in DEFAULT_LOWER_OPS:
            continue
        seen.add(node.target)
        for a in node.all_input_nodes:
            if a.meta["val"].is_floating_point():
                assert _rounded(a), f"{node.name} reads unrounded {a.name}"
        outs = [node] if isinstance(node.meta["val"], torch.Tensor) else [
            u for u in node.users if u.target is operator.getitem and u.users]
        assert outs, node.name
        for y in outs:
            (r,) = y.users
            assert r.target is ROUND and r.args[1] == fmt and roles.role_of(r) == roles.CAST, y.name
            assert roles.pass_of(r) == "lower_precision"
    rounds = [n for n in gm.graph.nodes if n.target is ROUND]
    assert len({r.args[0] for r in rounds}) == len(rounds), "a value is rounded twice"
    # nor twice through different whole views (a weight read as t(w) and as w): round the source
    roots = [_view_root(r.args[0]) for r in rounds]
    assert len(set(roots)) == len(roots), "a tensor is rounded twice through different views"
    assert not any(r.args[0].target is ROUND for r in rounds), "a rounded value is rounded again"
    return seen


def test_cnn_convolutions_forward_and_backward_are_rounded() -> None:
    gm = cnn_step().gm
    LowerPrecisionPass("float16")(gm)
    seen = _check_lowered(gm, "float16")
    assert {aten.convolution.default, aten.convolution_backward.default, aten.addmm.default,
            aten.mm.default} <= seen


def test_gpt_bmm_and_mm_are_rounded_cbfloat16() -> None:
    gm = gpt_step().gm
    LowerPrecisionPass("cbfloat16")(gm)
    seen = _check_lowered(gm, "cbfloat16")
    assert {aten.bmm.default, aten.mm.default} <= seen


def test_rounding_only_around_listed_ops_everything_else_fp32() -> None:
    gm = gpt_step().gm
    LowerPrecisionPass("float16")(gm)

    def lowered(n: torch.fx.Node) -> bool:
        if n.target is operator.getitem:
            n = n.args[0]
        return n.target in DEFAULT_LOWER_OPS

    def feeds_lowered(n: torch.fx.Node) -> bool:
        return any(lowered(u) or (u.target in VALUE_PRESERVING_OPS and feeds_lowered(u)) for u in n.users)

    rounds = [n for n in gm.graph.nodes if n.target is ROUND]
    assert rounds
    for r in rounds:
        assert lowered(r.args[0]) or feeds_lowered(r), r.name  # softmax, norms, loss, SGD untouched
    for n in gm.graph.nodes:  # no dtype changes in emulation: master weights and math stay fp32
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert v.dtype == torch.float32, n.name


def _tiny_loss_step(cfg):
    torch.manual_seed(0)
    model = MLP(d_in=4, d_hidden=8, d_out=3)
    return trace_step(model, lambda m, b: mse_loss(m, b) * 1e-9,
                      (torch.randn(5, 4), torch.randn(5, 3)), cfg)


def test_gradients_live_in_16_bits_and_underflow_without_scaling() -> None:
    # SGD's first momentum buffer is exactly the gradient the optimizer received
    key = "fc1.weight.momentum_buffer"
    fp32 = DLSConfig(loss_scale=None, mixed_precision=False)
    step32 = _tiny_loss_step(fp32)
    want = run(step32, apply_dls(step32.gm, fp32))[roles.OPT_STATE_UPDATE][key]
    assert float(want.abs().max()) < 1e-8 and bool((want != 0).any())  # below fp16's range
    unscaled = DLSConfig(loss_scale=None)  # fp16 arithmetic, no loss scaling
    step = _tiny_loss_step(unscaled)
    got = run(step, apply_dls(step.gm, unscaled))[roles.OPT_STATE_UPDATE][key]
    assert not bool((got != 0).any())  # the 16-bit gradient flushed to zero
    scaled = DLSConfig(loss_scale=2.0**24)  # static scaling brings it back into range
    steps = _tiny_loss_step(scaled)
    got_s = run(steps, apply_dls(steps.gm, scaled))[roles.OPT_STATE_UPDATE][key]
    torch.testing.assert_close(got_s, want, rtol=2e-2, atol=1e-12)


def test_native_float16_runs_the_ops_and_the_activations_between_them_in_16_bits() -> None:
    cfg = DLSConfig(loss_scale=None)
    step = mlp_step(cfg)
    gm = step.gm
    LowerPrecisionPass("float16", "native")(gm)
    gm.recompile()
    cet = torch.ops.prims.convert_element_type.default
    mms = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    assert mms
    for n in mms:  # in and out in float16: a cast, or a value computed in float16 (relu of an mm)
        assert n.meta["val"].dtype == torch.float16
        assert all(a.meta["val"].dtype == torch.float16 for a in n.all_input_nodes), n.name
    # the relu between two linears, and its backward, run in float16 (what the backward reads)
    relus = [n for n in gm.graph.nodes if n.target in (aten.relu.default, aten.threshold_backward.default)]
    assert relus and all(n.meta["val"].dtype == torch.float16 for n in relus)
    casts = [n for n in gm.graph.nodes if n.target is cet and n.args[1] == torch.float16]
    assert len({_view_root(c.args[0]) for c in casts}) == len(casts), "a tensor is cast twice"
    ups = [n for n in gm.graph.nodes if n.target is cet and n.args[1] == torch.float32]
    assert not [u for u in ups if u.args[0].target is cet], "a cast of a cast"
    for g in roles.nodes_with_role(gm.graph, roles.GRAD):  # the optimizer reads float32 gradients
        assert g.meta["val"].dtype == torch.float32, g.name
    native = run(step, gm)
    emul = mlp_step(cfg)
    emulated = run(emul, apply_dls(emul.gm, cfg))
    for k in step.params:
        torch.testing.assert_close(native[roles.PARAM_UPDATE][k], emulated[roles.PARAM_UPDATE][k],
                                   rtol=1e-2, atol=1e-3)


def test_bad_modes_are_clear_errors_and_pass_is_idempotent() -> None:
    with pytest.raises(ValueError, match="'native' supports.*cbfloat16"):
        LowerPrecisionPass("cbfloat16", "native")
    with pytest.raises(ValueError, match="precision mode"):
        LowerPrecisionPass("float16", "fast")
    gm = mlp_step().gm
    LowerPrecisionPass("bfloat16")(gm)
    gm.recompile()
    code = gm.code
    assert not LowerPrecisionPass("bfloat16")(gm).modified
    gm.recompile()
    assert gm.code == code


@pytest.mark.parametrize("make", [cnn_step, gpt_step], ids=["cnn", "gpt"])
def test_native_pipeline_runs_conv_and_bmm_in_float16_close_to_emulation(make) -> None:
    cfg = DLSConfig()
    native_step, emul_step = make(cfg), make(cfg)
    native = apply_dls(native_step.gm, cfg.with_overrides(precision_mode="native"))
    lowered = [n for n in native.graph.nodes if n.target in DEFAULT_LOWER_OPS]
    assert lowered
    for n in lowered:
        v = n.meta["val"]
        vals = [v] if isinstance(v, torch.Tensor) else [x for x in v if isinstance(x, torch.Tensor)]
        assert all(x.dtype == torch.float16 for x in vals), n.name
    got = run(native_step, native)
    want = run(emul_step, apply_dls(emul_step.gm, cfg))
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-2, atol=1e-3)
    for k in want[roles.PARAM_UPDATE]:
        torch.testing.assert_close(got[roles.PARAM_UPDATE][k], want[roles.PARAM_UPDATE][k],
                                   rtol=1e-2, atol=1e-3)


def _mm_pow_exp(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A matmul, then the pointwise math of a tanh GELU (pow) and an exp, then a matmul: every
    intermediate returned, so eager autocast shows the dtype it runs each one in."""
    h = x @ w
    p = h + 0.044715 * torch.pow(h, 3.0)
    e = torch.exp(p)
    return h, p, e, e @ w


def _lowered_mm_pow_exp(device: str) -> dict[object, torch.dtype]:
    """Native bfloat16 lowering of ``_mm_pow_exp`` traced on ``device`` (fake tensors): the
    dtype each of its mm, pow and exp nodes runs in."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        gm = make_fx(_mm_pow_exp)(torch.empty(4, 8, device=device), torch.empty(8, 8, device=device))
    LowerPrecisionPass("bfloat16", "native")(gm)
    want = (aten.mm.default, aten.pow.Tensor_Scalar, aten.exp.default)
    return {n.target: n.meta["val"].dtype for n in gm.graph.nodes if n.target in want}


def test_native_follows_each_devices_autocast_for_pointwise_math() -> None:
    """pow and exp (a tanh GELU's math) run as the device's autocast runs them: on CPU in their
    16-bit inputs' dtype (checked against torch.autocast("cpu") on the same function), so the
    values a backward reads stay 16-bit; on CUDA in float32 (CUDA autocast's float32 list; not
    checkable against torch here: a CPU-only torch disables CUDA autocast, so the fake-CUDA
    graph is checked against the list)."""
    x, w = torch.randn(4, 8), torch.randn(8, 8) * 0.1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, p, e, _ = _mm_pow_exp(x, w)
    cpu = _lowered_mm_pow_exp("cpu")
    assert cpu == {aten.mm.default: h.dtype, aten.pow.Tensor_Scalar: p.dtype, aten.exp.default: e.dtype}
    assert cpu[aten.pow.Tensor_Scalar] == torch.bfloat16  # the reference does not widen on CPU
    cuda = _lowered_mm_pow_exp("cuda")
    assert cuda == {aten.mm.default: torch.bfloat16, aten.pow.Tensor_Scalar: torch.float32,
                    aten.exp.default: torch.float32}


def test_policy_for_keeps_norms_softmax_and_losses_float32_on_every_device() -> None:
    from dlspass.precision_policy import FP32_OPS, FP32_POINTWISE_OPS, policy_for

    cpu, cuda = policy_for("bfloat16", "cpu"), policy_for("bfloat16", "cuda")
    assert cuda.fp32_ops == FP32_OPS and cpu.fp32_ops == FP32_OPS - FP32_POINTWISE_OPS
    for op in (aten.native_layer_norm.default, aten._log_softmax.default, aten._softmax.default,
               aten.nll_loss_forward.default, aten.sum.dim_IntList):
        assert cpu.keeps_fp32(op) and cuda.keeps_fp32(op), op
    for op in (aten.pow.Tensor_Scalar, aten.exp.default, aten.rsqrt.default):
        assert cuda.keeps_fp32(op) and not cpu.keeps_fp32(op), op
    assert cpu.lower_ops == cuda.lower_ops
