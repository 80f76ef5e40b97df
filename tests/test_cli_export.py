"""``dlspass export`` -> ``transform`` -> ``torch.export.load`` -> train, against ``capture_step``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import cli_factories as cf
import pytest
import torch

from dlspass.capture.joint_step import step_graph
from dlspass.capture.optim import OptimizerSpec
from dlspass.capture.pt2_io import load_program, save_program
from dlspass.config import DLSConfig
from dlspass.graph import roles

ROOT = Path(__file__).resolve().parents[1]
# the optimizer each model trains with, as CLI flags and as the reference's spec
OPTIMIZERS = {
    "mlp": (("--optimizer", "adam", "--lr", "0.01"), OptimizerSpec(kind="adam", lr=0.01)),
    "gpt": (("--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"),
            OptimizerSpec(kind="sgd", lr=0.05, momentum=0.9)),
}


def _fp32_step(name: str) -> Path:
    flags, _ = OPTIMIZERS[name]
    return cf.step_file(name, ".pt2", "--no-mixed-precision", "--config", str(cf.dls_yaml()), *flags)


def _reference_config() -> DLSConfig:
    return dataclasses.replace(DLSConfig.from_yaml(str(cf.dls_yaml())), mixed_precision=False)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_exported_step_trains_like_capture_step(name):
    data = cf.batches(name, 20)
    got = cf.train_pt2(_fp32_step(name), data)
    ref = cf.train_reference(name, _reference_config(), OPTIMIZERS[name][1], data)
    # the forced overflow is skipped, and the scale follows the same trajectory
    assert got["skipped"] == ref["skipped"]
    assert got["skipped"][-1] == 1 and got["skipped"][cf.OVERFLOW_STEP] == 1
    assert got["scales"] == ref["scales"]
    assert got["scales"][cf.OVERFLOW_STEP] == got["scales"][cf.OVERFLOW_STEP - 1] / 2
    assert max(got["scales"]) > 1024  # it grew as well (steps_per_increase 4)
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        if i == cf.OVERFLOW_STEP:
            assert not torch.isfinite(torch.tensor([a, b])).any()
        else:
            assert a == pytest.approx(b, rel=1e-6), f"step {i}"
    assert cf.max_rel(got["params"], ref["params"]) < 1e-6


def test_overflow_step_leaves_params_and_state_unchanged():
    path = _fp32_step("mlp")
    data = cf.batches("mlp", cf.OVERFLOW_STEP + 1)
    before = cf.train_pt2(path, data[: cf.OVERFLOW_STEP])
    after = cf.train_pt2(path, data)
    for k, v in before["state"].items():
        if "scaler" in k:
            continue
        assert torch.equal(v, after["state"][k]), k  # params and Adam moments bit-identical


def test_roles_and_config_survive_save_and_load():
    path = _fp32_step("gpt")
    with zipfile.ZipFile(path) as z:
        assert any(n.endswith("extra/dlspass.json") for n in z.namelist())
    ep, meta = load_program(path)
    assert meta["kind"] == "step" and meta["config"]["steps_per_increase"] == 4
    assert meta["optimizer"]["momentum"] == 0.9
    # computed nodes keep node.meta["custom"] through torch.export.save/load
    loaded = [n for n in ep.graph.nodes if roles.role_of(n) is not None]
    assert {roles.role_of(n) for n in loaded} >= {roles.SEED, roles.GRAD, roles.SCALED_SEED,
                                                 roles.UNSCALE, roles.GUARD}
    gm = step_graph(ep, meta)
    n_params = sum(1 for n in gm.graph.find_nodes(op="placeholder") if roles.role_of(n) == roles.PARAM)
    assert n_params == len(ep.graph_signature.parameters) == 16
    assert [s.kind.name for s in ep.graph_signature.output_specs][-1] == "LOSS_OUTPUT"
    kinds = {s.kind.name for s in ep.graph_signature.input_specs}
    assert kinds == {"PARAMETER", "BUFFER", "USER_INPUT"}
    assert [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"] == \
        ["idx", "targets", "mult"]


def test_retransform_same_settings_is_idempotent_and_different_is_refused(tmp_path, capsys):
    src = _fp32_step("mlp")
    flags, _ = OPTIMIZERS["mlp"]
    again = tmp_path / "again.pt2"
    assert cf.cli("transform", src, "-o", again, "--no-mixed-precision", "--config",
                  cf.dls_yaml(), *flags) == 0
    a, _ = load_program(src)
    b, meta_b = load_program(again)
    assert [n.name for n in a.graph.nodes] == [n.name for n in b.graph.nodes]
    assert meta_b["config"]["steps_per_increase"] == 4
    capsys.readouterr()
    other = tmp_path / "other.pt2"
    assert cf.cli("transform", src, "-o", other, "--fp16-type", "cbfloat16") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already a dlspass training step" in err
    assert not other.exists()


def test_a_step_written_before_a_config_setting_existed_is_still_the_same_step(tmp_path, capsys):
    """A step file whose recorded config lacks a setting added later (telemetry) is the step
    the same settings build today: re-transforming it is a no-op, not a refusal."""
    src = _fp32_step("mlp")
    ep, meta = load_program(src)
    assert meta["config"].pop("telemetry") is False
    old = tmp_path / "old.pt2"
    save_program(ep, old, meta)
    again = tmp_path / "again.pt2"
    flags, _ = OPTIMIZERS["mlp"]
    assert cf.cli("transform", old, "-o", again, "--no-mixed-precision", "--config",
                  cf.dls_yaml(), *flags) == 0, capsys.readouterr().err
    assert [n.name for n in load_program(again)[0].graph.nodes] == [n.name for n in ep.graph.nodes]


def test_cbfloat16_step_trains_and_verifies(tmp_path):
    path = cf.step_file("mlp", ".pt2", "--fp16-type", "cbfloat16")
    assert cf.cli("verify", path) == 0
    got = cf.train_pt2(path, cf.batches("mlp", 10))
    assert got["scales"][0] == 2.0**31 and got["skipped"][-1] == 1
    assert all(torch.isfinite(torch.tensor(got["losses"][cf.OVERFLOW_STEP + 1:])))


def test_export_and_transform_as_subprocesses(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop("DLSPASS_DEBUG", None)
    joint = tmp_path / "mlp.pt2"
    res = subprocess.run([sys.executable, "-m", "dlspass", "export", "cli_factories:mlp", "-o", str(joint)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr.strip() == f"wrote {joint}"
    ep, meta = load_program(joint)
    assert meta["kind"] == "joint" and ep.graph_signature.backward_signature.loss_output
    res = subprocess.run([sys.executable, "-m", "dlspass", "verify", str(_fp32_step("mlp"))],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("OK "), res.stderr
    assert json.loads(res.stdout.split("config ", 1)[1].rstrip(")\n"))["loss_scale"] == "dynamic"


# ---- outside-model failures, reproduced on minimal models (tests/repro_factories.py) ----------

def _cli_vs_eager(name: str, tmp_path: Path, n: int = 4, overflow_at: int | None = 2):
    """export -> transform (fp32, DLS, SGD) -> torch.export.load -> train, and the eager
    GradScaler run of the same model, batches and settings."""
    import hf_factories as hf
    import repro_factories as rf

    joint, step = tmp_path / f"{name}.pt2", tmp_path / f"{name}_step.pt2"
    assert cf.cli("export", f"repro_factories:{name}", "-o", joint) == 0
    assert cf.cli("transform", joint, "-o", step, "--no-mixed-precision", "--optimizer", "sgd",
                  "--lr", "0.05") == 0
    data = hf.batches(rf.BATCHES[name], n, overflow_at)
    got = hf.train_step_file(step, data)
    ref = hf.train_eager(rf.FACTORIES[name], DLSConfig(mixed_precision=False),
                         OptimizerSpec(kind="sgd", lr=0.05), data)
    return got, ref


def test_attention_transpose_view_exports_and_trains_like_eager(tmp_path):
    # torch's joint trace of the CPU flash-attention op laid the output out differently from the
    # op, so the model's view failed in export (pytorch#136543), and differentiated the flash op
    # against its math decomposition, giving wrong query/key/value gradients
    got, ref = _cli_vs_eager("attention", tmp_path)
    import hf_factories as hf

    hf.assert_same_training(got, ref, 2, rel=1e-5)


def test_tied_weights_are_one_parameter_trained_like_torch_optim(tmp_path):
    import hf_factories as hf

    got, ref = _cli_vs_eager("tied", tmp_path)
    # one parameter for the embedding and the head, as model.parameters() has it
    assert set(got["params"]) == {"emb.weight", "mid.weight", "mid.bias"}
    hf.assert_same_training(got, ref, 2, rel=1e-5)
    assert not torch.equal(got["params"]["emb.weight"], _initial_params("tied")["emb.weight"])
    # the files say which name the head's weight is trained under: the programs no longer list it
    tied = _tied_names_of_the_model()
    assert tied == {"head.weight": "emb.weight"}
    for path in (tmp_path / "tied.pt2", tmp_path / "tied_step.pt2"):
        ep, meta = load_program(path)
        assert meta["tied"] == tied, path
        assert "head.weight" not in ep.state_dict and "emb.weight" in ep.state_dict


def _tied_names_of_the_model() -> dict[str, str]:
    """``{name: first name}`` of every parameter the model holds under a second name."""
    import repro_factories as rf

    model, _ = rf.FACTORIES["tied"]()
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        first.setdefault(id(p), name)
    return out


def test_tied_names_travel_through_onnx_outputs(tmp_path):
    from dlspass.onnx.files import load_onnx, onnx_meta

    tied = {"head.weight": "emb.weight"}
    joint_pt2, joint_onnx = tmp_path / "tied.pt2", tmp_path / "tied.onnx"
    step_onnx, dls_onnx = tmp_path / "step.onnx", tmp_path / "dls.onnx"
    assert cf.cli("export", "repro_factories:tied", "-o", joint_pt2) == 0
    assert cf.cli("export", "repro_factories:tied", "-o", joint_onnx) == 0
    assert cf.cli("transform", joint_pt2, "-o", step_onnx, "--to", "onnx") == 0
    assert cf.cli("transform", joint_onnx, "-o", dls_onnx, "--no-mixed-precision") == 0
    # the ONNX DLS pass updates the joint's record in place (kind onnx_dls), keeping "tied"
    for path, kind in ((joint_onnx, "joint"), (step_onnx, "step"), (dls_onnx, "onnx_dls")):
        model = load_onnx(path)
        meta = onnx_meta(model)
        assert meta["kind"] == kind and meta["tied"] == tied, path
        inputs = {v.name for v in model.graph.inputs}
        assert "emb.weight" in inputs and "head.weight" not in inputs, path


def test_a_model_without_tied_weights_records_none(tmp_path):
    joint = cf.joint_file("mlp")
    assert load_program(joint)[1]["tied"] == {}
    assert load_program(_fp32_step("mlp"))[1]["tied"] == {}
    out = tmp_path / "mlp.onnx"
    assert cf.cli("export", "cli_factories:mlp", "-o", out) == 0
    from dlspass.onnx.files import load_onnx, onnx_meta

    assert onnx_meta(load_onnx(out))["tied"] == {}


def test_a_joint_without_the_record_gives_a_step_without_it(tmp_path):
    """A joint written before dlspass recorded ties: its step says nothing rather than "none"."""
    from dlspass.capture.pt2_io import save_program

    ep, meta = load_program(cf.joint_file("mlp"))
    old = tmp_path / "old.pt2"
    save_program(ep, old, {k: v for k, v in meta.items() if k != "tied"})
    step = tmp_path / "old_step.pt2"
    assert cf.cli("transform", old, "-o", step, "--no-mixed-precision") == 0
    assert "tied" not in load_program(step)[1]


def _initial_params(name: str) -> dict[str, torch.Tensor]:
    import repro_factories as rf

    model, _ = rf.FACTORIES[name]()
    return {k: v.detach() for k, v in model.named_parameters()}


def test_convolution_of_the_input_transforms_and_trains_like_eager(tmp_path):
    import hf_factories as hf

    got, ref = _cli_vs_eager("conv_input", tmp_path)
    hf.assert_same_training(got, ref, 2, rel=1e-5)


def test_batchnorm_bias_gradient_used_by_the_backward_trains_like_eager(tmp_path):
    import hf_factories as hf

    got, ref = _cli_vs_eager("conv_bn_linear", tmp_path)
    assert {"bn.running_mean", "bn.running_var"} <= set(got["buffers"])
    hf.assert_same_training(got, ref, 2, rel=1e-5)


def test_a_torch_export_failure_is_bad_input_exit_2_one_line(tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "dd.pt2"
    assert cf.cli("export", "repro_factories:data_dependent", "-o", out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("dlspass: error: repro_factories:data_dependent: torch.export.export "
                          "failed on the model (")
    assert "(GuardOnDataDependentSymNode: " in err and not out.exists()  # torch's error, named


def test_a_torch_failure_in_the_backward_trace_is_also_exit_2(tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "na.pt2"
    assert cf.cli("export", "repro_factories:no_autograd", "-o", out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    assert err.startswith("dlspass: error: repro_factories:no_autograd: torch could not trace the "
                          "model's backward (RuntimeError: Trying to backward through "
                          "repro_factories.no_autograd")
