"""``dlspass inspect`` (text, JSON against its schema, SVG, HTML, chromium) and ``dlspass verify``."""

from __future__ import annotations

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import cli_factories as cf
import jsonschema
import pytest

from dlspass.capture.pt2_io import load_program, save_program
from dlspass.debug.inspect_report import REPORT_SCHEMA
from dlspass.graph import roles

SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def files():
    joint = cf.joint_file("mlp")
    # the custom op, so the graph names each rounding (aten steps: test_cli_transform.py)
    step = cf.step_file("mlp", ".pt2", "--fp16-type", "cbfloat16", "--max-gradient-norm", "1.0",
                        "--rounding", "op")
    return joint, step


def _inspect(capsys, *args):
    capsys.readouterr()
    rc = cf.cli("inspect", *args)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_json_report_validates_and_counts_what_the_passes_inserted(files, capsys):
    joint, step = files
    report = json.loads(_inspect(capsys, step, "--diff", joint, "--format", "json"))
    jsonschema.validate(report, REPORT_SCHEMA)
    ep, _ = load_program(step)
    # independent count straight from the loaded graph
    by_pass = {}
    for n in ep.graph.nodes:
        if roles.pass_of(n):
            by_pass[roles.pass_of(n)] = by_pass.get(roles.pass_of(n), 0) + 1
    assert report["inserted_by_pass"] == by_pass
    assert set(by_pass) >= {"lower_precision", "scale_seed", "unscale_grads", "clip_grad_norm",
                            "guard_updates", "update_scale"}
    n_round = sum(1 for n in ep.graph.nodes if "round_to_format" in str(n.target))
    assert report["casts"] == {"cbfloat16": n_round} and n_round > 0
    assert report["config"]["fp16_type"] == "cbfloat16" and report["kind"] == "step"
    assert 0 < report["scaled_region"]["size"] < report["node_count"]
    assert report["diff"]["node_delta"] == report["node_count"] - len(
        [n for n in load_program(joint)[0].graph.nodes if n.op == "call_function"])
    assert report["diff"]["added_roles"]["guard"] == 6
    params = [r for r in report["roles"] if r["role"] == "param"]
    assert len(params) == 6 and {r["target"] for r in params} >= {"net.fc1.weight"}


def test_json_of_joint_program_and_schema_rejects_garbage(files, capsys):
    joint, _ = files
    report = json.loads(_inspect(capsys, joint, "--format", "json"))
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["kind"] == "joint" and report["inserted_by_pass"] == {} and report["config"] is None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**report, "kind": "weird"}, REPORT_SCHEMA)


def test_text_report(files, capsys):
    joint, step = files
    text = _inspect(capsys, step, "--diff", joint)
    assert "inserted by pass:" in text and "cbfloat16" in text and "diff against" in text


def test_svg_marks_inserted_nodes(files, tmp_path, capsys):
    _, step = files
    out = tmp_path / "g.svg"
    _inspect(capsys, step, "--format", "svg", "-o", out)
    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG_NS}svg"
    circles = root.findall(f".//{SVG_NS}circle")
    inserted = [c for c in circles if c.get("class") == "dls-inserted"]
    ep, _ = load_program(step)
    assert len(circles) == len(list(ep.graph.nodes))
    assert len(inserted) == sum(1 for n in ep.graph.nodes if roles.pass_of(n))
    assert {c.get("data-pass") for c in inserted} >= {"scale_seed", "guard_updates"}


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.classes, self.text = [], set(), [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if "id" in a:
            self.ids.add(a["id"])
        if "class" in a:
            self.classes.append(a["class"])
        for k in ("src", "href"):
            assert k not in a or not a[k].startswith("http"), f"external resource {a[k]}"

    def handle_data(self, data):
        self.text.append(data)


def _html(files, tmp_path, capsys) -> Path:
    joint, step = files
    out = tmp_path / "report.html"
    _inspect(capsys, step, "--diff", joint, "--format", "html", "-o", out)
    return out


def test_html_is_self_contained_with_svg_roles_and_diff(files, tmp_path, capsys):
    p = _Collect()
    p.feed(_html(files, tmp_path, capsys).read_text())
    assert "svg" in p.tags and "script" not in p.tags
    assert {"summary", "graph", "roles", "diff"} <= p.ids
    assert "dls-inserted" in p.classes and "roles" in p.classes and "diff" in p.classes
    text = " ".join(p.text)
    assert "scaled_seed" in text and "Diff against" in text and "aten.where.self" in text


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_html_opens_in_headless_chromium(files, tmp_path, capsys):
    html_path = _html(files, tmp_path, capsys)
    res = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", html_path.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-500:]
    assert "<svg" in res.stdout and 'class="dls-inserted"' in res.stdout and 'id="roles"' in res.stdout


def test_verify_ok_and_fails_naming_the_node(files, tmp_path, capsys):
    _, step = files
    capsys.readouterr()
    assert cf.cli("verify", step) == 0
    assert capsys.readouterr().out.startswith("OK ")
    # break one guard: where(isfinite, new, old) -> where(isfinite, new, new)
    ep, meta = load_program(step)
    guard = next(n for n in ep.graph.nodes if roles.role_of(n) == roles.GUARD
                 and roles.target_of(n) == "net.fc2.bias")
    guard.args = (guard.args[0], guard.args[1], guard.args[1])
    bad = tmp_path / "bad.pt2"
    save_program(ep, bad, meta)
    assert cf.cli("verify", bad) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "verification failed" in err and guard.name in err


def test_verify_refuses_a_joint_program(files, capsys):
    joint, _ = files
    capsys.readouterr()
    assert cf.cli("verify", joint) == 2
    assert "not a dlspass training step" in capsys.readouterr().err


def test_inspect_onnx(tmp_path, capsys):
    path = cf.step_file("mlp", ".onnx", "--no-mixed-precision", "--to", "onnx")
    report = json.loads(_inspect(capsys, path, "--format", "json"))
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["file_format"] == "onnx" and report["config"]["mixed_precision"] is False
    assert any(r["role"] == "param_update" for r in report["roles"])
    assert report["op_histogram"]["Where"] >= 6
    assert report["tied"] == {}  # the mlp ties nothing, and the ONNX step says so



def test_inspect_names_the_tied_parameters(tmp_path, capsys):
    joint, step = tmp_path / "tied.pt2", tmp_path / "tied_step.pt2"
    assert cf.cli("export", "repro_factories:tied", "-o", joint) == 0
    assert cf.cli("transform", joint, "-o", step, "--no-mixed-precision") == 0
    for path in (joint, step):
        text = _inspect(capsys, path)
        assert "tied parameters: head.weight -> emb.weight\n" in text, text
        report = json.loads(_inspect(capsys, path, "--format", "json"))
        jsonschema.validate(report, REPORT_SCHEMA)
        assert report["tied"] == {"head.weight": "emb.weight"}
    html_out = tmp_path / "tied.html"
    _inspect(capsys, step, "--format", "html", "-o", html_out)
    p = _Collect()
    p.feed(html_out.read_text())
    assert "head.weight -> emb.weight" in " ".join(p.text)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**report, "tied": {"head.weight": 3}}, REPORT_SCHEMA)


def test_inspect_says_none_or_not_recorded(files, tmp_path, capsys):
    joint, _ = files
    assert "tied parameters: none\n" in _inspect(capsys, joint)
    assert json.loads(_inspect(capsys, joint, "--format", "json"))["tied"] == {}
    ep, meta = load_program(joint)
    old = tmp_path / "old.pt2"  # written before dlspass recorded ties
    save_program(ep, old, {k: v for k, v in meta.items() if k != "tied"})
    assert "tied parameters: not recorded\n" in _inspect(capsys, old)
    report = json.loads(_inspect(capsys, old, "--format", "json"))
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["tied"] is None
