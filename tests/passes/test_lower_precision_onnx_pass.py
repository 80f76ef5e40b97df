"""LowerPrecisionOnnxPass on a model written in ONNX text: the exact nodes it inserts, onnxruntime
against torch with every MatMul input and output rounded by ``round_to_format``, onnx.checker."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from dlspass.errors import DLSInputError
from dlspass.formats import round_to_format
from dlspass.passes.lower_precision_onnx_pass import CAST_ROLE_KEY, LowerPrecisionOnnxPass

# h = x @ w (a graph output behind Relu and Add); gx = g @ w^T, whose Transpose reads the
# rounded w only once the pass has run; wt is untyped (the pass infers it with ONNX shape inference)
TEXT = """
<ir_version: 10, opset_import: ["" : 18]>
agraph (float[2,3] x, float[3,4] w, float[2,4] g) => (float[2,4] y, float[2,3] gx)
{
    h = MatMul(x, w)
    r = Relu(h)
    y = Add(r, g)
    wt = Transpose<perm=[1,0]>(w)
    gx = MatMul(g, wt)
}
"""

CAST_OPS = ["Cast", "Cast", "Cast", "Cast", "MatMul", "Cast", "Cast", "Relu", "Add", "Transpose",
            "Cast", "Cast", "Transpose", "MatMul", "Cast", "Cast"]


def _feeds() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(2, 3, generator=g), "w": torch.randn(3, 4, generator=g),
            "g": torch.randn(2, 4, generator=g)}


def _reference(fmt: str) -> dict[str, torch.Tensor]:
    def r(t: torch.Tensor) -> torch.Tensor:
        return round_to_format(t, fmt)

    f = _feeds()
    x, w, g = r(f["x"]), r(f["w"]), r(f["g"])
    return {"y": torch.relu(r(x @ w)) + f["g"], "gx": r(g @ w.t())}


def _ort(model: ir.Model) -> dict[str, torch.Tensor]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), sess_options=so,
                                providers=["CPUExecutionProvider"])
    outs = sess.run(None, {k: v.numpy() for k, v in _feeds().items()})
    return {o.name: torch.from_numpy(np.asarray(v)) for o, v in zip(sess.get_outputs(), outs, strict=True)}


def _rounding(node: ir.Node) -> bool:
    return node.metadata_props.get(CAST_ROLE_KEY) == "cast"


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "cbfloat16"])
def test_matmul_inputs_and_outputs_are_rounded(fmt):
    model = ir.from_onnx_text(TEXT)
    assert LowerPrecisionOnnxPass(fmt)(model).modified
    ops = [n.op_type for n in model.graph]
    if fmt == "cbfloat16":  # the arithmetic rounding, no 16-bit dtype: same places, more nodes
        assert "Cast" not in ops and {"Round", "Log", "Pow"} <= set(ops)
        assert [n.op_type for n in model.graph if not _rounding(n)] == \
            [op for op in CAST_OPS if op != "Cast"]
    else:
        assert ops == CAST_OPS
        to = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}[fmt]
        assert [n.attributes["to"].value for n in model.graph if n.op_type == "Cast"] == \
            [to, ir.DataType.FLOAT] * 5
    # w is rounded once: the backward's Transpose is rebuilt on the rounded w
    view = next(n for n in model.graph if n.metadata_props.get("dlspass_pass") == "lower_precision"
                and not _rounding(n))
    assert view.op_type == "Transpose" and view.inputs[0].name == f"w.{fmt}"
    # outputs keep their names on the rounded values
    assert [v.name for v in model.graph.outputs] == ["y", "gx"]
    assert _rounding(model.graph.outputs[1].producer())
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    got, want = _ort(model), _reference(fmt)
    for k in ("y", "gx"):
        torch.testing.assert_close(got[k], want[k], rtol=2.0**-7, atol=1e-6)
    assert torch.equal(round_to_format(got["gx"], fmt), got["gx"])
    meta = json.loads(model.metadata_props["dlspass.json"])
    assert meta == {"applied_passes": ["lower_precision"],
                    "precision": {"fp16_type": fmt, "lowered_ops": ["MatMul"], "rounded_values": 5}}
    tagged = json.loads(model.metadata_props["dlspass_roles"])
    assert tagged == {v: ["cast", fmt] for v in ("gx", "h", f"g.{fmt}", f"w.{fmt}", f"x.{fmt}")}


def test_float16_matches_torch_bit_for_bit():
    """Products of float16 values are exact in float32 and the sums here are short: no
    accumulation-order slack is needed."""
    model = ir.from_onnx_text(TEXT)
    LowerPrecisionOnnxPass("float16")(model)
    got, want = _ort(model), _reference("float16")
    assert torch.equal(got["gx"], want["gx"]) and torch.equal(got["y"], want["y"])


def test_unlowered_model_differs_from_the_rounded_reference():
    """The comparison above is not vacuous: without the pass the numbers are float32's."""
    got, want = _ort(ir.from_onnx_text(TEXT)), _reference("float16")
    assert not torch.equal(got["gx"], want["gx"])


def test_twice_and_unknown_format_are_input_errors():
    model = ir.from_onnx_text(TEXT)
    LowerPrecisionOnnxPass("float16")(model)
    with pytest.raises(DLSInputError, match="already has dlspass precision casts"):
        LowerPrecisionOnnxPass("float16")(model)
    with pytest.raises(DLSInputError, match="cannot lower ONNX precision to 'float8'"):
        LowerPrecisionOnnxPass("float8")(ir.from_onnx_text(TEXT))
