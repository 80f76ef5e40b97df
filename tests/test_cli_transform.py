"""``dlspass transform --to onnx``: onnxruntime trains the step with the state fed back."""

from __future__ import annotations

import json

import cli_factories as cf
import onnx
import pytest
import torch
from tolerance import assert_close_reordered, mlp_grad_sums

from dlspass.capture.pt2_io import load_program
from dlspass.onnx.files import load_onnx, onnx_meta

# cli_factories.mlp: MLP(8 -> 16 -> 16 -> 4) + MSE on batches of 4 rows
MLP_SUMS = mlp_grad_sums([8, 16, 16, 4], batch=4)

FLAGS = {
    "mlp": ("--no-mixed-precision", "--optimizer", "adam", "--lr", "0.01"),
    "gpt": ("--no-mixed-precision", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"),
}


def _pair(name: str, *extra: str):
    flags = (*FLAGS[name], "--config", str(cf.dls_yaml()), *extra)
    return cf.step_file(name, ".pt2", *flags), cf.step_file(name, ".onnx", *flags, "--to", "onnx")


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_onnxruntime_trains_like_pytorch(name):
    pt2, onnx_path = _pair(name)
    data = cf.batches(name, 20)
    ref = cf.train_pt2(pt2, data)
    ep, _ = load_program(pt2)
    got = cf.train_onnx(onnx_path, dict(ep.state_dict), data)
    assert got["skipped"] == ref["skipped"] and ref["skipped"][-1] == 1
    assert got["scales"] == ref["scales"]
    assert max(ref["scales"]) > 1024
    params = {k: v for k, v in ref["params"].items()}
    assert cf.max_rel(got["params"], params) < 1e-5
    finite = [i for i in range(20) if i != cf.OVERFLOW_STEP]
    assert [got["losses"][i] for i in finite] == pytest.approx([ref["losses"][i] for i in finite], rel=1e-5)


def test_onnx_model_is_valid_and_carries_roles():
    _, onnx_path = _pair("mlp")
    onnx.checker.check_model(onnx.load(str(onnx_path)))
    model = load_onnx(onnx_path)
    meta = onnx_meta(model)
    assert meta["kind"] == "step" and meta["user_inputs"] == ["x", "y"]
    assert meta["outputs"][-1] == "loss"
    roles_map = json.loads(model.metadata_props["dlspass_roles"])
    assert roles_map["net.fc1.weight.new"] == ["param_update", "net.fc1.weight"]
    # parameters and state are graph inputs (overridable), not frozen initializers
    inputs = {v.name for v in model.graph.inputs}
    assert {"net.fc1.weight", "dlspass_scaler_loss_scale", "x", "y"} <= inputs
    ops = {n.op_type for n in model.graph}
    assert "Where" in ops and "Sqrt" in ops  # the guard and the global norm are in the graph


def test_cbfloat16_onnx_matches_pytorch_rounding():
    pt2 = cf.step_file("mlp", ".pt2", "--fp16-type", "cbfloat16")
    onnx_path = cf.step_file("mlp", ".onnx", "--fp16-type", "cbfloat16", "--to", "onnx")
    data = cf.batches("mlp", 10)
    ref = cf.train_pt2(pt2, data)
    ep, _ = load_program(pt2)
    got = cf.train_onnx(onnx_path, dict(ep.state_dict), data)
    assert got["scales"] == ref["scales"] and got["scales"][0] == 2.0**31
    assert got["skipped"] == ref["skipped"]
    assert cf.max_rel(got["params"], ref["params"]) < 1e-5


def test_config_yaml_supplies_dls_settings(tmp_path):
    spec = cf.tmp_dir().parent  # noqa: F841 - keep the fixture dir alive
    out = tmp_path / "zoo.pt2"
    yaml = __import__("pathlib").Path(__file__).parent / "data" / "modelzoo_current_spec.yaml"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", out, "--config", yaml) == 0
    _, meta = load_program(out)
    assert meta["config"]["fp16_type"] == "cbfloat16"
    assert meta["config"]["max_gradient_norm"] == 1.0
    assert "clip_grad_norm" in meta["applied_passes"]
    got = cf.train_pt2(out, cf.batches("mlp", 3))
    assert got["scales"] == [2.0**31] * 3 and all(torch.isfinite(torch.tensor(got["losses"])))


def test_static_loss_scale_has_no_scaler_mutation(tmp_path):
    out = tmp_path / "static.pt2"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", out, "--loss-scale", "128",
                  "--no-mixed-precision") == 0
    ep, meta = load_program(out)
    assert meta["config"]["loss_scale"] == 128.0
    mutated = {s.target for s in ep.graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION"}
    assert not any("scaler" in t for t in mutated)
    # a static scale does not skip: the inf step corrupts the parameters (no guard)
    got = cf.train_pt2(out, cf.batches("mlp", cf.OVERFLOW_STEP + 1))
    assert not torch.isfinite(torch.cat([p.flatten() for p in got["params"].values()])).all()


def test_onnx_training_graph_input_gets_dls(tmp_path):
    """``export -o joint.onnx`` -> ``transform joint.onnx``; ORT + a numpy SGD loop that skips
    when ``dlspass_isfinite`` is False must follow the .pt2 step (SGD, same DLS config)."""
    import numpy as np
    import onnxruntime as ort

    joint, dls = tmp_path / "joint.onnx", tmp_path / "dls.onnx"
    assert cf.cli("export", "cli_factories:mlp", "-o", joint) == 0
    # fp32 matmuls: the gradients are compared with torch autograd's (precision: test_onnx_precision)
    assert cf.cli("transform", joint, "-o", dls, "--config", cf.dls_yaml(), "--no-mixed-precision") == 0
    onnx.checker.check_model(onnx.load(str(dls)))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(dls), sess_options=so, providers=["CPUExecutionProvider"])
    meta = json.loads(sess.get_modelmeta().custom_metadata_map["dlspass.json"])
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name for i in sess.get_inputs()} | set(meta["state_inputs"])
    model, _ = cf.mlp()
    params = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
    assert set(meta["state_inputs"]) == set(params)
    from dlspass.config import DLSConfig
    from dlspass.scale_policy import STATE_FIELDS, init_state

    state = {f"dlspass_scaler_{f}": v.numpy() for f, v in
             zip(STATE_FIELDS, init_state(DLSConfig.from_yaml(str(cf.dls_yaml()))), strict=True)}
    data = cf.batches("mlp", 12)
    lr, scales, skipped = 0.01, [], []
    for i, (x, y) in enumerate(data):
        feeds = {**params, **state, "x": x.numpy(), "y": y.numpy(),
                 "loss_seed": np.array(1.0, dtype=np.float32)}
        feeds = {k: v for k, v in feeds.items() if k in inputs}  # ORT rejects unused inputs
        outs = dict(zip(names, sess.run(None, feeds), strict=True))
        if outs["dlspass_isfinite"]:
            # unscaled gradients equal torch autograd's at the same parameters
            m, _ = cf.mlp()
            with torch.no_grad():
                for k, p in m.named_parameters():
                    p.copy_(torch.from_numpy(params[k]))
            m(x, y).backward()
            for k, p in m.named_parameters():
                # onnxruntime's matmuls against torch's: the forward's and the backward's sums in
                # other orders, bounded by the MLP's longest chain of them (tests/tolerance.py);
                # the scale is a power of two, exact
                assert_close_reordered(torch.from_numpy(outs[f"grad.{k}.unscaled"]), p.grad,
                                       n=MLP_SUMS)
                params[k] = params[k] - lr * outs[f"grad.{k}.unscaled"]
        else:
            assert i == cf.OVERFLOW_STEP
        for k in state:
            if f"{k}.new" in outs:
                state[k] = outs[f"{k}.new"]
        scales.append(float(state["dlspass_scaler_loss_scale"]))
        skipped.append(int(state["dlspass_scaler_num_skipped_steps"]))
    ref = cf.train_pt2(cf.step_file("mlp", ".pt2", "--no-mixed-precision", "--config", str(cf.dls_yaml())), data)
    assert scales == ref["scales"] and skipped == ref["skipped"] and skipped[-1] == 1
    assert cf.max_rel({k: torch.from_numpy(v) for k, v in params.items()}, ref["params"]) < 1e-5


def test_onnx_input_without_seed_input_is_refused(tmp_path, capsys):
    import onnx_ir as ir

    joint, out = tmp_path / "joint.onnx", tmp_path / "dls.onnx"
    assert cf.cli("export", "cli_factories:mlp", "-o", joint) == 0
    model = ir.load(str(joint))
    roles_map = json.loads(model.metadata_props["dlspass_roles"])
    del roles_map["loss_seed"]
    model.metadata_props["dlspass_roles"] = json.dumps(roles_map)
    ir.save(model, str(joint))
    capsys.readouterr()
    assert cf.cli("transform", joint, "-o", out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no backward-seed graph input" in err and not out.exists()


# ---- --rounding: a cbfloat16 step that runs where torch runs ----------------------------------

_FRESH = r"""
import sys, torch
path, data_path, out_path = sys.argv[1:]
data = torch.load(data_path)
m = torch.export.load(path).module()
losses, scales, skipped = [], [], []
with torch.no_grad():
    for batch in data:
        losses.append(m(*batch))
        bufs = dict(m.named_buffers())
        scales.append(bufs["dlspass_scaler_loss_scale"].clone())
        skipped.append(bufs["dlspass_scaler_num_skipped_steps"].clone())
assert "dlspass" not in sys.modules, "dlspass was imported"
assert not [k for k in sys.modules if k.startswith("dlspass.")]
torch.save({"losses": losses, "scales": scales, "skipped": skipped,
            "params": {k: v.detach() for k, v in m.named_parameters()}}, out_path)
"""


_CB16 = ("--fp16-type", "cbfloat16", "--optimizer", "sgd", "--lr", "0.05")


def _run_fresh(step, data, tmp_path):
    """Train ``step`` in a new interpreter that never imports dlspass; its results, or None
    when it failed (with its stderr)."""
    import subprocess
    import sys

    data_path, out_path = tmp_path / "data.pt", tmp_path / "out.pt"
    torch.save(data, data_path)
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(step), str(data_path), str(out_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    return (torch.load(out_path) if proc.returncode == 0 else None), proc.stderr


def test_cbfloat16_step_trains_in_a_process_without_dlspass(tmp_path):
    aten = cf.step_file("mlp", ".pt2", *_CB16)  # default --rounding aten
    op = cf.step_file("mlp", ".pt2", *_CB16, "--rounding", "op")
    ep_aten, meta = load_program(aten)
    assert meta["rounding"] == "aten"
    assert not any("dlspass" in str(n.target) for n in ep_aten.graph.nodes)
    assert any("round_to_format" in str(n.target) for n in load_program(op)[0].graph.nodes)
    data = cf.batches("mlp", 10)  # step 7 overflows (an inf input)
    got, err = _run_fresh(aten, data, tmp_path)
    assert got is not None, err
    ref = cf.train_pt2(op, data)  # the custom op, in this process (dlspass imported)
    assert [int(s) for s in got["skipped"]] == ref["skipped"] and ref["skipped"][-1] == 1
    assert [float(s) for s in got["scales"]] == ref["scales"]
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        if i != cf.OVERFLOW_STEP:
            assert float(a) == b, f"step {i}"  # the bit form is the op, bit for bit
    for k, v in ref["params"].items():
        assert torch.equal(got["params"][k], v), k
    # the custom-op file is what cannot load there
    failed, err = _run_fresh(op, data[:1], tmp_path)
    assert failed is None and "round_to_format" in err


def test_inspect_counts_the_same_casts_for_both_roundings(capsys):
    reports = []
    for extra in ((), ("--rounding", "op")):
        capsys.readouterr()
        assert cf.cli("inspect", cf.step_file("mlp", ".pt2", *_CB16, *extra), "--format", "json") == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["casts"] == reports[1]["casts"] and reports[0]["casts"]["cbfloat16"] > 0


def test_unknown_rounding_is_a_usage_error(tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "x.pt2"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", out, "--rounding", "bits") == 2
    assert "--rounding" in capsys.readouterr().err and not out.exists()


def test_modelzoo_model_flag_names_the_family_of_a_legacy_config(tmp_path, capsys):
    # A 2.0 file (model.precision_opt_level is read up to 2.0) that names no half format: GPT-2's
    # run.py defaults use_bfloat16 to true (Release_2.0.3 gpt2/utils.py set_defaults), and
    # nothing in this file says it is GPT-2
    cfg_file = tmp_path / "params.yaml"
    cfg_file.write_text("model:\n  mixed_precision: true\n  precision_opt_level: 1\n"
                        "optimizer:\n  loss_scaling_factor: 1.0\n")
    out = tmp_path / "gpt2.pt2"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", out, "--config", cfg_file,
                  "--modelzoo-model", "gpt2") == 0
    _, meta = load_program(out)
    assert meta["config"]["fp16_type"] == "bfloat16"
    capsys.readouterr()
    lone = tmp_path / "lone.pt2"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", lone, "--modelzoo-model", "gpt2") == 2
    err = capsys.readouterr().err
    assert "--modelzoo-model" in err and "--config" in err and not lone.exists()
