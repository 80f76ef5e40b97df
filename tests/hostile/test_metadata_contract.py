"""``.pt2`` files whose ``dlspass.json`` has the wrong shape: exit 2 with one line, never exit 3.

The cases are generated from a real dlspass step: each top-level key gets a value of the wrong
type, is dropped, or gets an extra level of nesting, and the whole object is replaced by other
JSON values. Every case goes through ``inspect``, ``verify`` and ``transform`` (about 60 calls).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import cli_factories as cf
import pytest
from hostile_files import members, rewrite

from dlspass.cli import run

pytestmark = pytest.mark.timeout(600)
META = "extra/dlspass.json"


@pytest.fixture(scope="module")
def step() -> tuple[Path, dict]:
    path = cf.step_file("mlp", ".pt2")
    _, files = members(path)
    return path, json.loads(files[META])


def _cases(meta: dict) -> dict[str, object]:
    wrong = {"kind": 7, "output_roles": "param_update", "config": "dynamic", "optimizer": "sgd",
             "precision_mode": ["emulate"], "placeholder_roles": [["param", "w"]],
             "buffer_names": [1, 2], "inputs": {"x": 1}, "applied_passes": "all", "version": "1",
             "format": None, "tied": [["head.weight", "emb.weight"]]}
    out: dict[str, object] = {}
    for key, value in wrong.items():
        out[f"{key}_wrong_type"] = {**meta, key: value}
    for key in ("output_roles", "config", "optimizer", "precision_mode"):
        out[f"{key}_missing"] = {k: v for k, v in meta.items() if k != key}
    roles = meta["output_roles"]
    out["output_roles_nested"] = {**meta, "output_roles": [[r] for r in roles]}
    out["output_roles_short_pair"] = {**meta, "output_roles": [r[:1] for r in roles]}
    out["output_roles_one_fewer"] = {**meta, "output_roles": roles[:-1]}
    out["output_roles_number_target"] = {**meta, "output_roles": [[r[0], 5] for r in roles]}
    ph = meta["placeholder_roles"]
    out["placeholder_roles_nested"] = {**meta, "placeholder_roles": {k: [v] for k, v in ph.items()}}
    # "tied" is {dropped: kept}: bounded, one merge per name
    out["tied_number_target"] = {**meta, "tied": {"head.weight": 3}}
    out["tied_nested"] = {**meta, "tied": {"head.weight": ["emb.weight"]}}
    out["tied_empty_name"] = {**meta, "tied": {"": "emb.weight"}}
    out["tied_long_name"] = {**meta, "tied": {"h" * 5000: "emb.weight"}}
    out["tied_to_itself"] = {**meta, "tied": {"emb.weight": "emb.weight"}}
    out["tied_chain"] = {**meta, "tied": {"a.weight": "b.weight", "b.weight": "c.weight"}}
    out["tied_too_many"] = {**meta, "tied": {f"l{i}.weight": "emb.weight" for i in range(10_001)}}
    out["config_unknown_key"] = {**meta, "config": {**meta["config"], "bogus": 1}}
    out["config_nested"] = {**meta, "config": {"config": meta["config"]}}
    out["whole_nested"] = {"dlspass": meta}
    out["list"] = [meta]
    out["string"] = "step"
    out["number"] = 3
    return out


def test_wrong_shaped_pt2_metadata_is_exit_2(step, tmp_path, capsys):
    path, meta = step
    cases = _cases(meta)
    assert len(cases) >= 20
    outcomes = {}
    for name, value in cases.items():
        bad = rewrite(path, tmp_path / f"{name}.pt2", {META: json.dumps(value).encode()})
        for command in ("inspect", "verify", "transform"):
            args = [command, bad] + (["-o", tmp_path / "out.pt2"] if command == "transform" else [])
            capsys.readouterr()
            t = time.monotonic()
            rc = run([str(a) for a in args])
            err = capsys.readouterr().err
            outcomes[(name, command)] = rc
            assert rc == 2, f"{name} {command}: exit {rc}\n{err[-3000:]}"
            assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
            assert len(err) < 700 and time.monotonic() - t < 60
            assert not (tmp_path / "out.pt2").exists()
    assert len(outcomes) >= 60


def test_the_unchanged_step_still_works(step, tmp_path, capsys):
    path, meta = step
    assert meta["tied"] == {}  # the check below is on a value dlspass writes
    # a well-formed "tied" at the bounds is read, not refused
    fine = {**{f"l{i}.weight": "emb.weight" for i in range(9_999)}, "w" * 1024: "emb.weight"}
    ok = rewrite(path, tmp_path / "tied_ok.pt2", {META: json.dumps({**meta, "tied": fine}).encode()})
    for args in (["inspect", path], ["verify", path], ["inspect", ok]):
        capsys.readouterr()
        assert run([str(a) for a in args]) == 0, capsys.readouterr().err


def test_error_line_quotes_a_bounded_excerpt(step, tmp_path, capsys):
    """A 5 MB value in the metadata (or on the command line) is quoted, not echoed."""
    path, meta = step
    bad = rewrite(path, tmp_path / "huge.pt2", {META: json.dumps({**meta, "kind": ["x" * 5_000_000]}).encode()})
    for args in (["inspect", bad], ["transform", path, "-o", tmp_path / "o.pt2", "--fp16-type", "y" * 5_000_000]):
        capsys.readouterr()
        assert run([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and len(err) < 700, len(err)
