"""Hostile ``.pt2`` archives: nothing in them runs, memory and time stay bounded, exit 2, one line.

Each vector is a crafted but well-formed archive (a valid zip of a valid program with one
member changed) whose payload writes the sentinel ``PWNED`` into the working folder. The
control test shows the payloads are live: plain ``torch.export.load`` (and ``.module()``) runs
them. dlspass must refuse every one from ``inspect``, ``verify`` and ``transform`` before torch
reads the archive.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hostile_files import (
    PAYLOAD,
    SENTINEL,
    deflate_bomb,
    edit_json,
    evil_pickle,
    evil_torch_save,
    live_under_plain_torch,
    members,
    rewrite,
    run_cli,
    save_tiny,
)

from dlspass.cli import run
from dlspass.files.pt2_archive import UnsafeArchiveError, check_pt2_archive

pytestmark = pytest.mark.timeout(300)

WEIGHTS = "data/weights/model_weights_config.json"
CONSTANTS = "data/constants/model_constants_config.json"
MODEL = "models/model.json"
EVIL_EXPR = f"exec({PAYLOAD!r})"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pt2")
    return {"static": save_tiny(d / "tiny.pt2"), "dynamic": save_tiny(d / "dyn.pt2", dynamic=True)}


def _weight_pickled(src: Path, dst: Path) -> Path:
    _, files = members(src)
    cfg = json.loads(files[WEIGHTS])
    entry = next(iter(cfg["config"].values()))
    entry["use_pickle"] = True
    return rewrite(src, dst, {WEIGHTS: json.dumps(cfg).encode(),
                              f"data/weights/{entry['path_name']}": evil_torch_save()})


def _constant(path_name: str, payload: bytes, use_pickle: bool):
    def build(src: Path, dst: Path) -> Path:
        _, files = members(src)
        cfg = json.loads(files[CONSTANTS])
        cfg["config"]["evil"] = {"path_name": path_name, "is_param": False,
                                 "use_pickle": use_pickle, "tensor_meta": None}
        return rewrite(src, dst, {CONSTANTS: json.dumps(cfg).encode(),
                                  f"data/constants/{path_name}": payload})
    return build


def _first_node(edit):
    def build(src: Path, dst: Path) -> Path:
        return edit_json(src, dst, MODEL, lambda p: edit(p["graph_module"]["graph"]["nodes"][0]))
    return build


def _set_target(target: str):
    return _first_node(lambda node: node.__setitem__("target", target))


def _set_every_expr(expr: str):
    """An edit for `edit_json` that writes ``expr`` into every ``expr_str`` of the program."""
    def edit(prog: dict) -> None:
        stack = [prog]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                if "expr_str" in item:
                    item["expr_str"] = expr
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return edit


def _evil_expr(src: Path, dst: Path) -> Path:
    return edit_json(src, dst, MODEL, _set_every_expr(EVIL_EXPR))


def _evil_guard(src: Path, dst: Path) -> Path:
    # no quotes: torch pastes the guard into a string literal too, which a quote would break
    guard = f"exec(bytes({list(PAYLOAD.encode())}).decode()) is None"
    return edit_json(src, dst, MODEL, lambda p: p.__setitem__("guards_code", [guard]))


# name: (base program, builder, words of the error, live under plain torch.export.load)
VECTORS = {
    "sample_inputs_pickle": ("static", lambda s, d: rewrite(s, d, {"data/sample_inputs/model.pt": evil_torch_save()}),
                             "data/sample_inputs/model.pt cannot be loaded without pickle", True),
    "weight_use_pickle": ("static", _weight_pickled, "stored with pickle", True),
    "constant_use_pickle": ("static", _constant("tensor_0", evil_torch_save(), True), "stored with pickle", True),
    "opaque_object": ("static", _constant("opaque_obj_0", evil_pickle(), True), "stored with pickle", True),
    "opaque_object_unflagged": ("static", _constant("opaque_obj_0", evil_pickle(), False), "object payload", False),
    "custom_object": ("static", _constant("custom_obj_0", evil_pickle(), False), "object payload", False),
    "aotinductor": ("static", lambda s, d: rewrite(s, d, {"data/aotinductor/model/model.so": b"\x7fELF"}),
                    "AOTInductor", False),
    "legacy_weights": ("static", lambda s, d: rewrite(s, d, {"data/weights/model.pt": evil_torch_save()}),
                       "legacy pickled layout", True),
    "legacy_constants": ("static", lambda s, d: rewrite(s, d, {"data/constants/model.pt": evil_torch_save()}),
                         "legacy pickled layout", True),
    "legacy_zip": ("static", lambda s, d: _legacy_zip(d), "outside the archive's root folder", False),
    "old_archive_version": ("static", lambda s, d: rewrite(s, d, {"archive_version": b"-1"}), "archive version", False),
    "second_program": ("static", lambda s, d: rewrite(s, d, {"models/other.json": b"{}"}), "unexpected program", False),
    "target_os_system": ("static", _set_target("torch.os.system"), "is not an operator", False),
    "target_load_library": ("static", _set_target("torch.ops.load_library"), "is not an operator", False),
    "target_methodcaller": ("static", _set_target("_operator.methodcaller"), "is not an operator", False),
    "target_torch_load": ("static", _set_target("torch.load"), "is not an operator", False),
    "target_leaf_function_hop": ("static", _set_target("torch.ops.higher_order.invoke_leaf_function"),
                                 "is not an operator", False),
    "sympy_expression": ("dynamic", _evil_expr, "sympify would evaluate it", True),
    "guards_code": ("dynamic", _evil_guard, "guards_code", True),
    "duplicate_member": ("static", lambda s, d: _duplicate(s, d), "appears twice", False),
    "outside_root": ("static", lambda s, d: rewrite(s, d, {}, extra_raw=[("elsewhere/x", b"")]),
                     "outside the archive's root folder", False),
    "deep_json": ("static", lambda s, d: rewrite(s, d, {MODEL: b"[" * 200_000 + b"]" * 200_000}),
                  "nests too deeply", False),
}


def _legacy_zip(dst: Path) -> Path:
    """The pre-2.8 layout ``torch.export.load`` falls back to (top-level ``version``)."""
    import zipfile

    with zipfile.ZipFile(dst, "w") as z:
        z.writestr("version", b"8.0")
        z.writestr("serialized_exported_program.json", b"{}")
        z.writestr("serialized_state_dict.pt", evil_torch_save())
    return dst


def _duplicate(src: Path, dst: Path) -> Path:
    root, _ = members(src)
    return rewrite(src, dst, {}, extra_raw=[(f"{root}/{MODEL}", b"{}")])


def _build(base: dict[str, Path], name: str, folder: Path) -> Path:
    which, build, _, _ = VECTORS[name]
    folder.mkdir(parents=True, exist_ok=True)
    return build(base[which], folder / f"{name}.pt2")


def _cli(args: list[str], capsys) -> tuple[int, str, float]:
    capsys.readouterr()
    t = time.monotonic()
    rc = run([str(a) for a in args])
    return rc, capsys.readouterr().err, time.monotonic() - t


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_crafted_archive_is_refused_before_torch_reads_it(base, tmp_path, monkeypatch, capsys, name):
    evil = _build(base, name, tmp_path / "in")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(UnsafeArchiveError):
        check_pt2_archive(evil)
    words = VECTORS[name][2]
    for args in (["inspect", evil], ["verify", evil], ["transform", evil, "-o", work / "out.pt2"]):
        rc, err, seconds = _cli(args, capsys)
        assert rc == 2, err
        assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
        assert words in err, err
        assert len(err) < 500, err
        assert seconds < 60
        assert not (work / SENTINEL).exists(), f"{name}: the payload ran under {args[0]}"
        assert sorted(p.name for p in work.iterdir()) == [], "no output and no temporary file"


def test_the_payloads_are_live_under_plain_torch(base, tmp_path):
    """Control: the vectors marked live run their payload under ``torch.export.load`` itself
    (``.module()`` and one call for the guard), so the refusals above are not vacuous."""
    live = [n for n, v in VECTORS.items() if v[3]]
    files = {n: _build(base, n, tmp_path / n) for n in live}
    ran, stderr = live_under_plain_torch(files, run_module=True)
    assert ran == {n: True for n in live}, stderr


def test_valid_archives_still_load(base, tmp_path, capsys):
    for which in ("static", "dynamic"):
        check_pt2_archive(base[which])
        rc, err, _ = _cli(["inspect", base[which]], capsys)
        assert rc == 0, err


def test_zip_bomb_model_json_fails_fast_in_bounded_memory(base, tmp_path):
    """A ~2 MB archive whose models/model.json inflates to 2 GiB: refused from the zip
    directory, in a subprocess whose peak RSS stays far below the 2 GiB."""
    bomb = deflate_bomb(base["static"], tmp_path / "bomb.pt2", MODEL, 2 * 2**30)
    assert bomb.stat().st_size < 4 * 2**20
    work = tmp_path / "work"
    work.mkdir()
    res = run_cli(["inspect", bomb], work)
    assert res.rc == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "zip bomb" in res.stderr, res.stderr
    assert res.seconds < 60
    assert res.peak_rss_mb < 1024, res.peak_rss_mb


def test_member_larger_than_it_declares_is_refused(base, tmp_path, capsys):
    """The same 2 GiB stream declared as 64 KiB: the reader stops at the declared size."""
    bomb = deflate_bomb(base["static"], tmp_path / "liar.pt2", MODEL, 256 * 2**20, declared=65536)
    t = time.monotonic()
    with pytest.raises(UnsafeArchiveError, match="damaged|not valid JSON"):
        check_pt2_archive(bomb)
    assert time.monotonic() - t < 30


def test_canonical_exec_payload_through_the_real_entry_point(base, tmp_path):
    """The issue's reproduction, in a subprocess: sample inputs replaced by a pickle whose
    ``__reduce__`` is ``exec``; exit 2, one stderr line, no sentinel, < 60 s, < 1 GB."""
    evil = _build(base, "sample_inputs_pickle", tmp_path / "in")
    work = tmp_path / "work"
    work.mkdir()
    res = run_cli(["inspect", evil], work)
    assert res.rc == 2, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("dlspass: error:"), res.stderr
    assert not (work / SENTINEL).exists()
    assert res.seconds < 60 and res.peak_rss_mb < 1024


def test_nested_zip_bomb_in_sample_inputs_is_refused(base, tmp_path):
    """``data/sample_inputs/model.pt`` is itself a torch.save zip: one whose storage record
    declares 1 GiB of deflated zeros is refused before ``torch.load`` would allocate it."""
    import resource

    import torch

    inner = tmp_path / "inputs.pt"
    torch.save((torch.zeros(4),), inner)
    _, files = members(inner)
    storage = next(r for r in files if r.startswith("data/") and r[5:].isdigit())
    bomb_inputs = deflate_bomb(inner, tmp_path / "bomb_inputs.pt", storage, 2**30)
    evil = rewrite(base["static"], tmp_path / "nested.pt2",
                   {"data/sample_inputs/model.pt": bomb_inputs.read_bytes()})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    with pytest.raises(UnsafeArchiveError, match="zip bomb"):
        check_pt2_archive(evil)
    assert time.monotonic() - t < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024  # KiB


def test_sample_inputs_in_the_legacy_stream_format_are_refused(base, tmp_path):
    import io

    import torch

    buf = io.BytesIO()
    torch.save((torch.zeros(4),), buf, _use_new_zipfile_serialization=False)
    evil = rewrite(base["static"], tmp_path / "legacy_inputs.pt2", {"data/sample_inputs/model.pt": buf.getvalue()})
    with pytest.raises(UnsafeArchiveError, match="zip format"):
        check_pt2_archive(evil)


@pytest.mark.parametrize("expr", [
    "Pow(Integer(9), Integer(999999999))", "LShift(Integer(1), Integer(10000000000000))",
    "Float('1.0', precision=1000000000000)", "Symbol('s0').__class__", "Integer(2)**Integer(99999999)",
    "RoundDecimal(Float('1.5'), Integer(999999999999))",
])
def test_expressions_that_compute_without_bound_are_refused(base, tmp_path, expr):
    """Not code execution but unbounded time or memory inside sympify: refused by the grammar."""
    evil = edit_json(base["dynamic"], tmp_path / "dos.pt2", MODEL, _set_every_expr(expr))
    t = time.monotonic()
    with pytest.raises(UnsafeArchiveError, match="sympify"):
        check_pt2_archive(evil)
    assert time.monotonic() - t < 30
