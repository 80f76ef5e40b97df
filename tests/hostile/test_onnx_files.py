"""Hostile ONNX files: deep chains, external-data references, wrong-shaped dlspass metadata.

Every file is a valid protobuf built with ``onnx.helper``; each command must end in exit 0
or exit 2 with one bounded line, within 60 s, without reading outside the model's folder.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_files import chain_onnx
from onnx import TensorProto, helper

from dlspass.cli import run

pytestmark = pytest.mark.timeout(180)


def _cli(capsys, *args) -> tuple[int, str, float]:
    capsys.readouterr()
    t = time.monotonic()
    rc = run([str(a) for a in args])
    return rc, capsys.readouterr().err, time.monotonic() - t


@pytest.mark.parametrize("op", ["Identity", "Relu"])
def test_3000_node_chain_before_a_matmul(tmp_path, capsys, op):
    """The rounding walks follow the chain iteratively: no RecursionError (exit 3)."""
    assert sys.getrecursionlimit() < 3000 * 2
    src = tmp_path / "chain.onnx"
    onnx.save(chain_onnx(3000, op), src)
    out = tmp_path / "out.onnx"
    rc, err, seconds = _cli(capsys, "transform", src, "-o", out, "--loss-scale", "none")
    assert rc == 0, err
    assert seconds < 60
    model = onnx.load(out)
    mm = next(n for n in model.graph.node if n.name == "mm")
    # the MatMul reads rounded values (float16 casts) and its output is rounded too
    producers = {o: n for n in model.graph.node for o in n.output}
    assert all(producers[i].op_type in ("Cast", "Identity") for i in mm.input if i in producers)
    assert producers["grad.w"].op_type == "Cast"
    if op == "Identity":  # the chain was rebuilt on the rounded input, not rounded 3000 times
        casts = [n for n in model.graph.node if n.op_type == "Cast"]
        assert len(casts) == 6  # x, w and the output: down and up each
    rc, err, _ = _cli(capsys, "inspect", src)
    assert rc == 0, err


def _external(tmp_path: Path, location: str, *, offset: str | None = None, length: str | None = None) -> Path:
    model = chain_onnx(1)
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.ClearField("float_data")
    w.data_location = TensorProto.EXTERNAL
    entries = [("location", location)]
    if offset is not None:
        entries.append(("offset", offset))
    if length is not None:
        entries.append(("length", length))
    for k, v in entries:
        e = w.external_data.add()
        e.key, e.value = k, v
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    p = d / "ext.onnx"
    p.write_bytes(model.SerializeToString())
    return p


def _secret(tmp_path: Path) -> Path:
    s = tmp_path / "secret.bin"
    s.write_bytes(np.ones(16, np.float32).tobytes())
    return s


EXTERNAL = {
    "parent_folder": (lambda t: _external(t, "../secret.bin"), "not a short relative path"),
    "absolute": (lambda t: _external(t, str(_secret(t))), "not a short relative path"),
    "symlink_out": (lambda t: _symlinked(t), "leads outside"),
    "over_long": (lambda t: _external(t, "a" * 5000), "not a short relative path"),
    "long_component": (lambda t: _external(t, "b" * 300 + ".bin"), "not a short relative path"),
    "missing": (lambda t: _external(t, "nothing.bin"), "cannot be read"),
    "fifo": (lambda t: _fifo(t), "not a regular file"),
    "beyond_end": (lambda t: _with_data(t, offset="32", length="64"), "outside the"),
    "bad_number": (lambda t: _with_data(t, offset="ten"), "not a number|cannot read the ONNX model"),
    "nul_byte": (lambda t: _external(t, "w\0.bin"), "not a short relative path"),
}


def _symlinked(t: Path) -> Path:
    p = _external(t, "link.bin")
    os.symlink(_secret(t), p.parent / "link.bin")
    return p


def _fifo(t: Path) -> Path:
    p = _external(t, "pipe.bin")
    os.mkfifo(p.parent / "pipe.bin")
    return p


def _with_data(t: Path, **kw: str) -> Path:
    p = _external(t, "w.bin", **kw)
    (p.parent / "w.bin").write_bytes(np.ones(16, np.float32).tobytes())
    return p


@pytest.mark.parametrize("case", sorted(EXTERNAL))
def test_external_data_reference_is_refused(tmp_path, capsys, case):
    build, words = EXTERNAL[case]
    src = build(tmp_path)
    for args in (["inspect", src], ["transform", src, "-o", tmp_path / "out.onnx", "--loss-scale", "none"]):
        rc, err, seconds = _cli(capsys, *args)
        assert rc == 2, err
        assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
        assert re.search(words, err), err
        assert len(err) < 700 and seconds < 60
    assert not (tmp_path / "out.onnx").exists()


def test_valid_external_data_still_loads(tmp_path, capsys):
    src = _with_data(tmp_path)
    rc, err, _ = _cli(capsys, "transform", src, "-o", tmp_path / "out.onnx", "--loss-scale", "none")
    assert rc == 0, err


def test_over_long_input_path_is_an_input_error(tmp_path, capsys):
    rc, err, _ = _cli(capsys, "inspect", tmp_path / ("x" * 5000 + ".onnx"))
    assert rc == 2, err
    assert err.count("\n") == 1 and len(err) < 700, err


# ---- wrong-shaped dlspass metadata in metadata_props -------------------------------------------

def _with_props(tmp_path: Path, name: str, props: dict[str, str]) -> Path:
    model = chain_onnx(2)
    helper.set_model_props(model, props)
    p = tmp_path / f"{name}.onnx"
    onnx.save(model, p)
    return p


ONNX_META = {
    "roles_list": {"dlspass_roles": "[]"},
    "roles_string_pair": {"dlspass_roles": json.dumps({"grad.w": "grad"})},
    "roles_short_pair": {"dlspass_roles": json.dumps({"grad.w": ["grad"]})},
    "roles_nested": {"dlspass_roles": json.dumps({"grad.w": [["grad", "w"]]})},
    "roles_not_json": {"dlspass_roles": "{"},
    "roles_number_target": {"dlspass_roles": json.dumps({"grad.w": ["grad", 3]})},
    "meta_list": {"dlspass.json": "[1]"},
    "meta_kind_number": {"dlspass.json": json.dumps({"kind": 3})},
    "meta_state_inputs": {"dlspass.json": json.dumps({"state_inputs": "x"})},
    "meta_passes_object": {"dlspass.json": json.dumps({"applied_passes": {"a": 1}})},
    "meta_config_unknown": {"dlspass.json": json.dumps({"config": {"bogus": 1}})},
    "meta_config_list": {"dlspass.json": json.dumps({"config": [1, 2]})},
    "meta_tied_list": {"dlspass.json": json.dumps({"tied": ["head.weight", "emb.weight"]})},
    "meta_tied_number": {"dlspass.json": json.dumps({"tied": {"head.weight": 1}})},
    "meta_tied_long_name": {"dlspass.json": json.dumps({"tied": {"emb.weight": "e" * 5000}})},
}


@pytest.mark.parametrize("case", sorted(ONNX_META))
def test_wrong_shaped_onnx_metadata_is_exit_2(tmp_path, capsys, case):
    src = _with_props(tmp_path, case, ONNX_META[case])
    for args in (["inspect", src], ["transform", src, "-o", tmp_path / "out.onnx"]):
        rc, err, seconds = _cli(capsys, *args)
        assert rc == 2, err
        assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
        assert len(err) < 700 and seconds < 60
