"""Bad input: one line on stderr naming the problem, exit 2, no output created, old output kept."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import cli_factories as cf
import onnx
import pytest
import torch
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
KEEP = b"an existing output that must survive"


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    good = cf.joint_file("mlp").read_bytes()
    files = {
        "missing": d / "missing.pt2",
        "empty": d / "empty.pt2",
        "truncated": d / "truncated.pt2",
        "random": d / "random.pt2",
        "suffix": d / "model.txt",
        "inference": d / "inference.pt2",
        "no_grad_onnx": d / "nograd.onnx",
        "random_onnx": d / "random.onnx",
        "zip": d / "notexport.pt2",
    }
    with zipfile.ZipFile(files["zip"], "w") as z:
        z.writestr("archive/data.pkl", b"not a program")
    files["empty"].write_bytes(b"")
    files["truncated"].write_bytes(good[: len(good) // 2])
    files["random"].write_bytes(os.urandom(4096))
    files["suffix"].write_bytes(good)
    model, example = cf.inference()
    torch.export.save(torch.export.export(model, example), str(files["inference"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph), str(files["no_grad_onnx"]))
    files["random_onnx"].write_bytes(os.urandom(2048))
    return files


def _check(capsys, tmp_path, args, must_mention, out_name="out.pt2", existing=False):
    """Run the CLI with ``args`` (``OUT`` replaced by an output path) and check the contract."""
    out = tmp_path / out_name
    if existing:
        out.write_bytes(KEEP)
    argv = [str(out) if a == "OUT" else str(a) for a in args]
    capsys.readouterr()
    rc = cf.cli(*argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
    assert must_mention.lower() in err.lower(), err
    if existing:
        assert out.read_bytes() == KEEP
    else:
        assert not out.exists()
    # no temp file left behind either
    assert [p.name for p in tmp_path.iterdir()] == ([out_name] if existing else [])


FILE_CASES = [
    ("missing", "no such file"),
    ("empty", "empty"),
    ("truncated", "not a .pt2 archive"),
    ("random", "not a .pt2 archive"),
    ("suffix", "unsupported file type '.txt'"),
    ("zip", "cannot load the .pt2 archive"),
    ("inference", "not a training"),
]


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize(("case", "message"), FILE_CASES)
def test_transform_bad_file(bad_files, tmp_path, capsys, case, message, existing):
    _check(capsys, tmp_path, ["transform", bad_files[case], "-o", "OUT"], message, existing=existing)


@pytest.mark.parametrize(("case", "message"), FILE_CASES[:6])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_bad_file(bad_files, tmp_path, capsys, case, message, command):
    extra = ["-o", "OUT"] if command == "inspect" else []
    _check(capsys, tmp_path, [command, bad_files[case], *extra], message, out_name="out.txt")


def test_onnx_without_gradients(bad_files, tmp_path, capsys):
    _check(capsys, tmp_path, ["transform", bad_files["no_grad_onnx"], "-o", "OUT"],
           "no gradient outputs", out_name="out.onnx", existing=True)


def test_random_bytes_onnx(bad_files, tmp_path, capsys):
    _check(capsys, tmp_path, ["transform", bad_files["random_onnx"], "-o", "OUT"],
           "cannot read the ONNX model", out_name="out.onnx")
    _check(capsys, tmp_path, ["inspect", bad_files["random_onnx"]], "cannot read the ONNX model",
           out_name="unused.txt")


@pytest.mark.parametrize(("flags", "message"), [
    (["--fp16-type", "float8"], "--fp16-type"),
    (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["--loss-scale", "huge"], "--loss-scale"),
    (["--to", "tflite"], "--to"),
    (["--betas", "0.9"], "--betas"),
    (["--lr", "-1"], "--lr"),
    (["--precision-mode", "fast"], "--precision-mode"),
    (["--bogus-flag"], "no such option"),
])
def test_unknown_option_values(tmp_path, capsys, flags, message):
    _check(capsys, tmp_path, ["transform", cf.joint_file("mlp"), "-o", "OUT", *flags], message,
           existing=True)


def test_inspect_unknown_format(tmp_path, capsys):
    _check(capsys, tmp_path, ["inspect", cf.joint_file("mlp"), "--format", "pdf", "-o", "OUT"],
           "--format", out_name="out.txt")


@pytest.mark.parametrize("where", ["no_dir", "file_parent", "bad_suffix"])
def test_unwritable_output(tmp_path, capsys, where):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = {"no_dir": tmp_path / "nope" / "out.pt2", "file_parent": blocker / "out.pt2",
           "bad_suffix": tmp_path / "out.zip"}[where]
    capsys.readouterr()
    rc = cf.cli("transform", cf.joint_file("mlp"), "-o", out)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and str(out) in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only folders")
def test_read_only_output_folder(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        capsys.readouterr()
        assert cf.cli("transform", cf.joint_file("mlp"), "-o", ro / "out.pt2") == 2
        assert "not writable" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize(("spec", "message"), [
    ("nocolon", "expected MODULE:FACTORY"),
    ("no_such_module_xyz:make", "cannot import module"),
    ("cli_factories:missing", "has no callable 'missing'"),
    ("cli_factories:not_a_pair", "must return (model, example_inputs)"),
    ("cli_factories:inference", "not a training model"),
])
def test_export_bad_factory(tmp_path, capsys, spec, message):
    _check(capsys, tmp_path, ["export", spec, "-o", "OUT"], message, existing=True)


def test_corrupt_archive_subprocess_prints_one_line(bad_files, tmp_path):
    # torch.export.load logs a traceback on corrupt archives; the real entry point must not show it
    env = {**os.environ}
    env.pop("DLSPASS_DEBUG", None)
    for case in ("truncated", "zip"):
        out = tmp_path / "out.pt2"
        res = subprocess.run([sys.executable, "-m", "dlspass", "inspect", str(bad_files[case])],
                             capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
        assert res.returncode == 2
        assert res.stderr.count("\n") == 1 and res.stdout == "", res.stderr
        assert not out.exists()
