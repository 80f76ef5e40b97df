"""``dlspass transform joint.onnx``: MatMul/Gemm/Conv read and write 16-bit values (fp32 containers).

The reference is written out by hand in torch: the MLP's forward and backward with every input
and output of its matmuls rounded by ``dlspass.formats.round_to_format`` (the custom op, not the
ONNX rounding under test). onnxruntime's gemm kernels (MLAS) and torch's accumulate in float32
in their own orders, so a float32 product can differ by a few float32 ulps; after rounding to a
16-bit format those differences vanish unless the product lies within a few float32 ulps of a
16-bit rounding boundary, where the two land one 16-bit ulp apart. Values outside the matmuls
(the loss, the bias gradients' sums) are float32 reductions whose order differs too. Hence: at
most one 16-bit ulp anywhere, at most a few float32 ulps for float32 values, and (what the tiny
shapes here give) almost everything bit-exact.
"""

from __future__ import annotations

import json

import cli_factories as cf
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from tolerance import assert_close_reordered, mlp_grad_sums

from dlspass.config import DLSConfig
from dlspass.formats import get_format, round_to_format
from dlspass.passes.lower_precision_onnx_pass import (
    CAST_ROLE_KEY,
    LOWERED_OPS,
    lower_precision_onnx,
)
from dlspass.scale_policy import STATE_FIELDS, init_state

FORMATS = ("float16", "cbfloat16", "bfloat16")
# views and ops whose output holds only values of their first input: rounded stays rounded
PRESERVING = {"Identity", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand",
              "Slice", "Gather", "Split", "Relu", "Neg", "MaxPool"}
SCALE = {"float16": 2.0**8, "cbfloat16": 2.0**20, "bfloat16": 1.0}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """joint.onnx of the MLP and its transforms: one per format, and float16 without mixed precision."""
    d = tmp_path_factory.mktemp("onnx_precision")
    paths = {"joint": d / "joint.onnx"}
    assert cf.cli("export", "cli_factories:mlp", "-o", paths["joint"]) == 0
    for fmt in FORMATS:
        paths[fmt] = d / f"{fmt}.onnx"
        assert cf.cli("transform", paths["joint"], "-o", paths[fmt], "--fp16-type", fmt) == 0
    paths["fp32"] = d / "fp32.onnx"
    assert cf.cli("transform", paths["joint"], "-o", paths["fp32"], "--no-mixed-precision") == 0
    return paths


def _is_cast(node: onnx.NodeProto) -> bool:
    return any(p.key == CAST_ROLE_KEY and p.value == "cast" for p in node.metadata_props)


def _walk(model: onnx.ModelProto) -> dict:
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for v in n.input:
            consumers.setdefault(v, []).append(n)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.value_info, *g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    return {"producer": producer, "consumers": consumers, "types": types,
            "outputs": {o.name for o in g.output}}


def _rounded(name: str, w: dict) -> bool:
    n = w["producer"].get(name)
    if n is None:
        return False
    if _is_cast(n):
        return True
    return n.op_type in PRESERVING and name == n.output[0] and _rounded(n.input[0], w)


def _root(name: str, w: dict) -> str:
    """The value ``name`` is a view of (through Transpose, Reshape, ... chains)."""
    n = w["producer"].get(name)
    if n is not None and n.op_type in {"Identity", "Transpose", "Reshape", "Flatten", "Squeeze",
                                       "Unsqueeze"} and name == n.output[0]:
        return _root(n.input[0], w)
    return name


def _check_lowered(model: onnx.ModelProto) -> int:
    """Every lowered op reads rounded float inputs and only rounding nodes read its outputs."""
    w = _walk(model)
    ops = [n for n in model.graph.node if n.op_type in LOWERED_OPS and not _is_cast(n)]
    for op in ops:
        for x in op.input:
            if x and w["types"].get(x, TensorProto.FLOAT) == TensorProto.FLOAT:
                assert _rounded(x, w), f"{op.op_type} {op.name} reads unrounded {x!r}"
        for y in op.output:
            assert y not in w["outputs"], f"{op.name} writes the graph output {y!r} unrounded"
            users = w["consumers"].get(y, [])
            assert users and all(_is_cast(u) for u in users), f"{y!r} is read before its rounding"
    return len(ops)


def _rounding_inputs(model: onnx.ModelProto, fmt: str) -> list[str]:
    """The value each rounding reads (its subgraph's external float input)."""
    g = model.graph
    casts = [n for n in g.node if _is_cast(n)]
    inside = {o for n in casts for o in n.output}
    consts = {t.name for t in g.initializer if t.name.startswith(f"dlspass_round_{fmt}/")}
    return sorted({v for n in casts for v in n.input if v and v not in inside and v not in consts})


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_matmul_reads_and_writes_rounded_values(models, fmt):
    model = onnx.load(str(models[fmt]))
    onnx.checker.check_model(model)
    # the MLP's training graph: 3 forward Gemms, 5 backward MatMuls (no gradient for x)
    assert _check_lowered(model) == 8
    casts = [n for n in model.graph.node if _is_cast(n)]
    meta = json.loads({p.key: p.value for p in model.metadata_props}["dlspass.json"])
    n_rounded = meta["precision"]["rounded_values"]
    assert meta["precision"]["fp16_type"] == fmt and "lower_precision" in meta["applied_passes"]
    if fmt == "cbfloat16":
        assert not any(n.op_type == "Cast" for n in casts)  # the arithmetic form, no 16-bit dtype
        assert {"Round", "Log", "Pow", "Reciprocal"} <= {n.op_type for n in casts}
    else:
        to = TensorProto.FLOAT16 if fmt == "float16" else TensorProto.BFLOAT16
        assert [n.op_type for n in casts] == ["Cast"] * len(casts) and len(casts) == 2 * n_rounded
        assert sorted(helper.get_attribute_value(n.attribute[0]) for n in casts) == \
            sorted([to, TensorProto.FLOAT] * n_rounded)
    # no value is rounded twice and no rounding reads an already rounded value
    reads = _rounding_inputs(model, fmt)
    w = _walk(model)
    assert len(reads) == n_rounded and not any(_rounded(v, w) for v in reads)
    # ... not even through a view: the backward's transposed weights and activations are
    # Transposes of the forward's rounded values, so every rounding has its own root value
    roots = [_root(v, w) for v in reads]
    assert len(set(roots)) == len(roots), sorted(roots)
    # x feeds the first Gemm and the last backward MatMul: one rounding serves both
    assert reads.count("x") == 1 and len(w["consumers"][f"x.{fmt}"]) == 2
    roles_map = json.loads({p.key: p.value for p in model.metadata_props}["dlspass_roles"])
    assert sum(r == ["cast", fmt] for r in roles_map.values()) == n_rounded


def test_unlowered_graph_fails_the_walk(models):
    """The walk above detects missing roundings (so it is not vacuous)."""
    with pytest.raises(AssertionError, match="reads unrounded"):
        _check_lowered(onnx.load(str(models["fp32"])))


def _run(path, fmt: str, params: dict, x, y) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    feeds = {k: v.numpy() for k, v in params.items()}
    feeds.update(x=x.numpy(), y=y.numpy(), loss_seed=np.array(1.0, dtype=np.float32))
    state = init_state(DLSConfig(fp16_type=fmt))
    feeds.update({f"dlspass_scaler_{f}": v.numpy() for f, v in zip(STATE_FIELDS, state, strict=True)})
    feeds["dlspass_scaler_loss_scale"] = np.array(SCALE[fmt], dtype=np.float32)
    names = {i.name for i in sess.get_inputs()}
    outs = sess.run(None, {k: v for k, v in feeds.items() if k in names})
    return {o.name: torch.from_numpy(np.asarray(v)) for o, v in zip(sess.get_outputs(), outs, strict=True)}


def _reference(params: dict, x, y, fmt: str | None, scale: float) -> dict:
    """The MLP's loss and gradients in torch; with ``fmt``, every matmul input/output rounded."""
    def r(t):
        return round_to_format(t, fmt) if fmt else t

    w1, b1, w2, b2, w3, b3 = (params[f"net.fc{i}.{n}"] for i in (1, 2, 3) for n in ("weight", "bias"))
    h1 = torch.relu(r(torch.addmm(r(b1), r(x), r(w1.t()))))
    h2 = torch.relu(r(torch.addmm(r(b2), h1, r(w2.t()))))
    out = r(torch.addmm(r(b3), h2, r(w3.t())))
    g3 = (out - y) * (2.0 / out.numel()) * scale  # d mse / d out, times the scaled seed
    g2 = torch.where(h2 <= 0, 0.0, r(r(g3) @ r(w3)))
    g1 = torch.where(h1 <= 0, 0.0, r(g2 @ r(w2)))
    grads = {"net.fc3.weight": r(r(g3.t()) @ h2), "net.fc3.bias": g3.sum(0),
             "net.fc2.weight": r(g2.t() @ h1), "net.fc2.bias": g2.sum(0),
             "net.fc1.weight": r(g1.t() @ r(x)), "net.fc1.bias": g1.sum(0)}
    return {"loss": ((out - y) ** 2).mean(), **{k: v / scale for k, v in grads.items()}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_onnxruntime_matches_rounded_torch_reference(models, fmt):
    model, _ = cf.mlp()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ulp = 2.0 ** -get_format(fmt).mantissa_bits
    exact = total = 0
    for step in (1, 2):
        x, y = cf.mlp_batch(step)
        got = _run(models[fmt], fmt, params, x, y)
        ref = _reference(params, x, y, fmt, SCALE[fmt])
        fp32 = _reference(params, x, y, None, 1.0)
        if fmt != "bfloat16":  # DLS inserted: unscaled gradients and the finite flag
            assert bool(got["dlspass_isfinite"])
        else:  # bfloat16 needs no scaling: the gradients are the graph's own outputs
            assert "dlspass_isfinite" not in got
        suffix = "" if fmt == "bfloat16" else ".unscaled"
        for k, want in ref.items():
            have = got["loss" if k == "loss" else f"grad.{k}{suffix}"]
            # float32 reductions (loss, bias sums): a few fp32 ulps; rounded values: one 16-bit ulp
            rtol = ulp if k.endswith("weight") else 4 * 2.0**-23
            torch.testing.assert_close(have, want, rtol=rtol, atol=1e-12)
            exact += int((have == want).sum())
            total += have.numel()
            if k.endswith("weight"):
                # matmul results hold format values (unscaling by a power of two keeps that)
                scaled = have * SCALE[fmt]
                assert torch.equal(round_to_format(scaled, fmt), scaled)
                assert not torch.equal(have, fp32[k])  # the rounding changed the numbers
    assert exact >= 0.95 * total


def test_no_mixed_precision_inserts_no_casts(models):
    model, mixed = onnx.load(str(models["fp32"])), onnx.load(str(models["float16"]))
    assert not any(_is_cast(n) for n in model.graph.node)
    # the same DLS graph as with mixed precision, minus exactly the tagged Cast pairs
    count = sum(n.op_type == "Cast" for n in model.graph.node)
    assert count == sum(n.op_type == "Cast" and not _is_cast(n) for n in mixed.graph.node) > 0
    lowering = [n for n in mixed.graph.node
                if any(p.key == "dlspass_pass" and p.value == "lower_precision" for p in n.metadata_props)]
    assert len(model.graph.node) == len(mixed.graph.node) - len(lowering)
    # what the lowering added besides the roundings: copies of Transposes on rounded values
    assert {n.op_type for n in lowering if not _is_cast(n)} == {"Transpose"}
    meta = json.loads({p.key: p.value for p in model.metadata_props}["dlspass.json"])
    assert "precision" not in meta and "dlspass_isfinite" in meta["outputs"]
    # fp32 gradients: bit-for-bit the unrounded torch reference up to float32 accumulation order
    m, _ = cf.mlp()
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    x, y = cf.mlp_batch(1)
    got = _run(models["fp32"], "float16", params, x, y)
    ref = _reference(params, x, y, None, 1.0)
    for k in params:
        # onnxruntime's float32 matmuls against torch's: the forward's and the backward's sums in
        # other orders, bounded by the MLP's longest chain of them (cli_factories.mlp: MLP(8 ->
        # 16 -> 16 -> 4) on 4 rows; tests/tolerance.py)
        assert_close_reordered(got[f"grad.{k}.unscaled"], ref[k], n=mlp_grad_sums([8, 16, 16, 4], batch=4))


def test_bfloat16_inserts_casts_and_no_scaling(models):
    model = onnx.load(str(models["bfloat16"]))
    names = {i.name for i in model.graph.input}
    assert not any(n.startswith("dlspass_scaler_") for n in names) and "loss_seed" in names
    assert not any(n.op_type == "Mul" and n.name == "dlspass_scale_seed" for n in model.graph.node)
    outs = [o.name for o in model.graph.output]
    assert "dlspass_isfinite" not in outs and "grad.net.fc1.weight" in outs
    assert sum(_is_cast(n) for n in model.graph.node) > 0


def test_bfloat16_without_mixed_precision_is_refused(models, tmp_path, capsys):
    out = tmp_path / "x.onnx"
    capsys.readouterr()
    assert cf.cli("transform", models["joint"], "-o", out, "--fp16-type", "bfloat16",
                  "--no-mixed-precision") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing to insert" in err and not out.exists()


def test_lowering_twice_is_refused(models):
    from dlspass.errors import InputValueError

    with pytest.raises(InputValueError, match="already has dlspass precision casts"):
        lower_precision_onnx(onnx.load(str(models["float16"])), "float16")


def test_gpt_attention_matmuls_are_lowered(tmp_path):
    """TinyGPT: batched attention MatMuls behind Reshape/Transpose chains, in both directions."""
    import onnxruntime as ort

    joint, out = tmp_path / "gpt.onnx", tmp_path / "gpt_cb16.onnx"
    assert cf.cli("export", "cli_factories:gpt", "-o", joint) == 0
    assert cf.cli("transform", joint, "-o", out, "--fp16-type", "cbfloat16") == 0
    model = onnx.load(str(out))
    assert _check_lowered(model) == 21  # 3 Gemm + 18 MatMul (forward and backward)
    reads, w = _rounding_inputs(model, "cbfloat16"), _walk(model)
    roots = [_root(v, w) for v in reads]
    assert len(set(roots)) == len(roots), sorted(roots)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(out), sess_options=so, providers=["CPUExecutionProvider"])
    m, _ = cf.gpt()
    feeds = {k: v.detach().numpy() for k, v in m.named_parameters()}
    feeds.update({f"dlspass_scaler_{f}": v.numpy() for f, v in
                  zip(STATE_FIELDS, init_state(DLSConfig(fp16_type="cbfloat16")), strict=True)})
    feeds["loss_seed"] = np.array(1.0, dtype=np.float32)
    feeds.update(zip(("idx", "targets", "mult"), (t.numpy() for t in cf.gpt_batch(1)), strict=True))
    names = [i.name for i in sess.get_inputs()]
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: feeds[k] for k in names}),
                    strict=True))
    assert bool(outs["dlspass_isfinite"]) and np.isfinite(outs["loss"])
    # a linear layer's weight gradient is a rounded MatMul result, unscaled by a power of two
    g = torch.from_numpy(outs["grad.gpt.blocks.0.fc.weight.unscaled"]) * 2.0**31
    assert torch.equal(round_to_format(g, "cbfloat16"), g)


# ---- Conv and ConvTranspose (the exporter cannot write a conv backward: a hand-built graph) ----

def _conv_graph() -> onnx.ModelProto:
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["h"]),
             helper.make_node("ConvTranspose", ["h", "wt"], ["out"], strides=[2, 2]),
             helper.make_node("Conv", ["x", "w"], ["c2"], pads=[1, 1, 1, 1])]
    g = helper.make_graph(
        nodes, "conv",
        [helper.make_tensor_value_info("x", f, [2, 1, 5, 5]), helper.make_tensor_value_info("w", f, [3, 1, 3, 3]),
         helper.make_tensor_value_info("b", f, [3]), helper.make_tensor_value_info("wt", f, [3, 2, 2, 2])],
        [helper.make_tensor_value_info("out", f, [2, 2, 10, 10]),
         helper.make_tensor_value_info("c2", f, [2, 3, 5, 5])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("fmt", ["float16", "cbfloat16"])
def test_conv_and_conv_transpose_are_lowered(fmt):
    import onnxruntime as ort
    import torch.nn.functional as F

    model = _conv_graph()
    n = lower_precision_onnx(model, fmt)
    onnx.checker.check_model(model)
    assert _check_lowered(model) == 3
    assert n == 7  # x (shared by both Convs), w, b, c, wt, out, c2; h = Relu(rounded c) is not
    g = torch.Generator().manual_seed(0)
    feeds = {"x": torch.randn(2, 1, 5, 5, generator=g), "w": torch.randn(3, 1, 3, 3, generator=g),
             "b": torch.randn(3, generator=g), "wt": torch.randn(3, 2, 2, 2, generator=g)}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), sess_options=so,
                                providers=["CPUExecutionProvider"])
    out, c2 = (torch.from_numpy(v) for v in sess.run(None, {k: v.numpy() for k, v in feeds.items()}))

    def r(t):
        return round_to_format(t, fmt)

    x, w, b, wt = (r(feeds[k]) for k in ("x", "w", "b", "wt"))
    h = torch.relu(r(F.conv2d(x, w, b, padding=1)))
    want_out = r(F.conv_transpose2d(h, wt, stride=2))
    want_c2 = r(F.conv2d(x, w, padding=1))
    ulp = 2.0 ** -get_format(fmt).mantissa_bits
    for have, want in ((out, want_out), (c2, want_c2)):
        torch.testing.assert_close(have, want, rtol=ulp, atol=1e-12)
        assert (have == want).float().mean() >= 0.95
        assert torch.equal(r(have), have)
