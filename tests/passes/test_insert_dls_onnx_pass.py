"""InsertDLSOnnxPass on a training graph written in ONNX text (a least-squares loss and its
hand-written backward): the nodes it adds, onnxruntime against torch autograd and the torch
scaler policy (``update_state``), onnx.checker."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from tolerance import assert_close_reordered

from dlspass.config import DLSConfig
from dlspass.errors import DLSInputError
from dlspass.passes.insert_dls_onnx_pass import InsertDLSOnnxPass
from dlspass.scale_policy import STATE_FIELDS, ScalerState, init_state, update_state

# loss = sum((x @ w - y)^2); d loss / d w = x^T (2 (x @ w - y) seed)
TEXT = """
<ir_version: 10, opset_import: ["" : 18]>
agraph (float[2,3] x, float[3,1] w, float[2,1] y, float loss_seed) => (float loss, float[3,1] grad_w)
{
    p = MatMul(x, w)
    d = Sub(p, y)
    sq = Mul(d, d)
    loss = ReduceSum<keepdims=0>(sq)
    two = Constant<value=float {2.0}>()
    gd = Mul(d, two)
    gp = Mul(gd, loss_seed)
    xt = Transpose<perm=[1,0]>(x)
    grad_w = MatMul(xt, gp)
}
"""
GRAPH_OPS = ["MatMul", "Sub", "Mul", "ReduceSum", "Constant", "Mul", "Mul", "Transpose", "MatMul"]
CONFIG = DLSConfig(mixed_precision=False, initial_loss_scale=1024.0)
STATE = [f"dlspass_scaler_{f}" for f in STATE_FIELDS]


def _model(seed_role: str = "backward_seed") -> ir.Model:
    model = ir.from_onnx_text(TEXT)
    model.graph.outputs[1].name = "grad.w"  # ONNX text has no dots in names
    model.metadata_props["dlspass_roles"] = json.dumps(
        {"loss_seed": [seed_role, None], "grad.w": ["grad", "w"], "loss": ["loss", None]})
    return model


def _batch(bad: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, generator=g)
    if bad:
        x[0, 0] = float("inf")
    return {"x": x, "w": torch.randn(3, 1, generator=g), "y": torch.randn(2, 1, generator=g)}


def _run(model: ir.Model, batch: dict[str, torch.Tensor], state: ScalerState) -> dict[str, np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), sess_options=so,
                                providers=["CPUExecutionProvider"])
    feeds = {k: v.numpy() for k, v in batch.items()}
    feeds["loss_seed"] = np.array(1.0, dtype=np.float32)
    feeds.update({n: s.numpy() for n, s in zip(STATE, state, strict=True)})
    outs = sess.run(None, feeds)
    return {o.name: np.asarray(v) for o, v in zip(sess.get_outputs(), outs, strict=True)}


def test_seed_is_scaled_and_the_tail_replaces_the_gradient_outputs():
    model = _model()
    assert InsertDLSOnnxPass(CONFIG)(model).modified
    nodes = list(model.graph)
    mul = nodes[0]
    assert (mul.op_type, mul.name, [v.name for v in mul.inputs]) == \
        ("Mul", "dlspass_scale_seed", ["loss_seed", "dlspass_scaler_loss_scale"])
    assert [n.op_type for n in nodes[1:1 + len(GRAPH_OPS)]] == GRAPH_OPS  # the graph, in order
    tail = nodes[1 + len(GRAPH_OPS):]
    assert tail and all(n.name.startswith("dlspass_tail/") for n in tail)
    # the seed's only reader is the scaling; the backward reads the scaled seed
    assert [u.node for u in model.graph.inputs[3].uses()] == [mul]
    gp = next(n for n in nodes if n.op_type == "Mul" and "gd" in [v.name for v in n.inputs])
    assert gp.inputs[1] is mul.outputs[0] and mul.outputs[0].name == "dlspass_scaled_seed"
    assert [v.name for v in model.graph.inputs] == ["x", "w", "y", "loss_seed", *STATE]
    assert [v.name for v in model.graph.outputs] == \
        ["loss", "grad.w.unscaled", "dlspass_isfinite", *(f"{n}.new" for n in STATE)]
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    roles_map = json.loads(model.metadata_props["dlspass_roles"])
    assert roles_map["grad.w.unscaled"] == ["unscale", "w"]
    assert roles_map["dlspass_isfinite"] == ["isfinite", None]
    assert roles_map["dlspass_scaler_loss_scale.new"] == ["scaler_state_update", "loss_scale"]
    meta = json.loads(model.metadata_props["dlspass.json"])
    assert meta["kind"] == "onnx_dls" and meta["config"] == CONFIG.to_dict()
    assert meta["outputs"] == [v.name for v in model.graph.outputs]


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "overflow"])
def test_onnxruntime_matches_autograd_and_the_torch_scaler(bad):
    model = _model()
    InsertDLSOnnxPass(CONFIG)(model)
    batch = _batch(bad)
    state = init_state(CONFIG)
    got = _run(model, batch, state)
    # the reference: torch autograd for the gradient, the torch policy for the scaler state
    w = batch["w"].clone().requires_grad_()
    loss = ((batch["x"] @ w - batch["y"]) ** 2).sum()
    loss.backward()
    assert bool(got["dlspass_isfinite"]) is (not bad)
    if not bad:
        # onnxruntime's MatMul/ReduceSum against torch's kernels: other summation orders. The
        # gradient: x @ w's 3 terms, then x^T @ (2 d)'s 2 rows: n = 3 + 2; the loss: the 3 terms,
        # then the sum of 2 squares: n = 3 + 2 (tests/tolerance.py). The unscaling divides by a
        # power of two: exact.
        assert_close_reordered(torch.from_numpy(got["grad.w.unscaled"]), w.grad, n=3 + 2)
        assert_close_reordered(torch.from_numpy(got["loss"]), loss.detach(), n=3 + 2)
    want = update_state(state, torch.tensor(not bad), CONFIG)
    for name, v in zip(STATE, want, strict=True):
        assert torch.equal(torch.from_numpy(got[f"{name}.new"]), v), name
    if bad:
        assert float(got["dlspass_scaler_loss_scale.new"]) < CONFIG.init_scale


def test_seed_times_scale_before_unscaling():
    """The unscaled gradient does not depend on the scale: the seed really is multiplied."""
    model = _model()
    InsertDLSOnnxPass(CONFIG)(model)
    batch = _batch()
    a = _run(model, batch, init_state(CONFIG))
    b = _run(model, batch, init_state(CONFIG)._replace(loss_scale=torch.tensor(2.0**-4)))
    assert np.array_equal(a["grad.w.unscaled"], b["grad.w.unscaled"])  # powers of two: exact


@pytest.mark.parametrize(("model", "config", "words"), [
    (lambda: _model("loss"), CONFIG, "no backward-seed graph input"),
    (_model, DLSConfig(loss_scale=None), "loss scaling is off"),
], ids=["untagged_seed", "scaling_off"])
def test_missing_seed_or_scaling_off_is_an_input_error(model, config, words):
    with pytest.raises(DLSInputError, match=words):
        InsertDLSOnnxPass(config)(model())


def test_no_tagged_gradient_is_an_input_error():
    model = _model()
    model.metadata_props["dlspass_roles"] = json.dumps({"loss_seed": ["backward_seed", None]})
    with pytest.raises(DLSInputError, match="no output is tagged as a gradient"):
        InsertDLSOnnxPass(CONFIG)(model)


@pytest.mark.parametrize("policy", ["torch", "deepspeed", "deepspeed-fp16-optimizer"])
def test_float64_factor_policies_export_their_update(policy):
    # torch's and DeepSpeed's factors are a float64 product rounded once (docs/SEMANTICS.md §1.3):
    # the exported tail must compute the same float32 scale as update_state
    cfg = DLSConfig(mixed_precision=False, initial_loss_scale=1024.0, policy=policy,
                    backoff_factor=0.3, growth_factor=1.5, steps_per_increase=1)
    state = init_state(cfg)
    for bad in (True, True, True, False):  # three backoffs by 0.3: 27.6480007, not 27.6480026
        model = _model()
        InsertDLSOnnxPass(cfg)(model)
        got = _run(model, _batch(bad), state)
        want = update_state(state, torch.tensor(not bad), cfg)
        for name, v in zip(STATE, want, strict=True):
            assert torch.equal(torch.from_numpy(got[f"{name}.new"]), v), (policy, bad, name)
        state = want
    f32 = np.float32
    float32_chain = f32(f32(f32(f32(1024 * f32(0.3)) * f32(0.3)) * f32(0.3)) * f32(1.5))
    assert float(state.loss_scale) != float(float32_chain)
