"""``dlspass inspect``: summarise a graph file and render it as text, JSON, SVG or HTML.

``summarize_file(path)`` reads a ``.pt2`` (joint program or dlspass step) or a ``.onnx`` and
returns one JSON-serialisable report (``REPORT_SCHEMA``): op histogram, nodes each pass inserted,
the passes that skipped and why, casts per dtype/format, the scaled region (nodes between the scaled seed and the unscale),
a roles table, the embedded DLS config, the tied parameter names merged at export and the graph
itself (nodes and edges).
``render(report, fmt, other)`` draws it; ``other`` adds a before/after diff. The SVG is written
here (networkx only computes the layout): no Graphviz, and the HTML is one offline file.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from dlspass.capture.joint_step import step_graph
from dlspass.capture.pt2_io import load_program
from dlspass.debug.step_regions import reach, regions_html
from dlspass.debug.step_svg import esc, render_svg
from dlspass.errors import InputValueError
from dlspass.files.bounded_text import one_line, printable
from dlspass.files.paths import check_input_file
from dlspass.graph import roles
from dlspass.graph.roles import recorded_config
from dlspass.onnx.files import load_onnx, onnx_meta
from dlspass.passes.decompose_rounding_pass import rounded_format
from dlspass.passes.lower_matmuls_to_float8_pass import FLOAT8_KEY

FORMATS = ("text", "json", "svg", "html")
SCHEMA_ID = "dlspass-inspect/1"

_COUNTS = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}
_NODE = {
    "type": "object",
    "required": ["id", "op", "target", "role", "target_entry", "pass"],
    "properties": {
        "id": {"type": "string"}, "op": {"type": "string"}, "target": {"type": "string"},
        "role": {"type": ["string", "null"]}, "target_entry": {"type": ["string", "null"]},
        "pass": {"type": ["string", "null"]},
    },
    "additionalProperties": False,
}
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "title": "dlspass inspect report",
    "type": "object",
    "required": ["schema", "file", "file_format", "kind", "config", "node_count", "op_histogram",
                 "inserted_by_pass", "skipped_passes", "casts", "scaled_region", "roles", "graph"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "file": {"type": "string"},
        "file_format": {"enum": ["pt2", "onnx"]},
        "kind": {"enum": ["step", "joint", "program", "onnx"]},
        "config": {"type": ["object", "null"]},
        "optimizer": {"type": ["object", "null"]},
        "precision_mode": {"type": ["string", "null"]},
        # {dropped_name: kept_name} of tied parameters merged at export; null: not recorded
        # (a foreign file, or dlspass metadata without a "tied" key). Optional in a report.
        "tied": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        "node_count": {"type": "integer", "minimum": 0},
        "op_histogram": _COUNTS,
        "inserted_by_pass": _COUNTS,
        "skipped_passes": {"type": "object", "additionalProperties": {"type": "string"}},
        "casts": _COUNTS,
        # {matmul: {"float8": recipe or null, "why": reason or null, "op", "module"}}, as
        # LowerMatmulsToFloat8Pass recorded it; absent where it did not run. Optional.
        "float8": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["float8", "why", "op", "module"],
            "properties": {"float8": {"type": ["string", "null"]}, "why": {"type": ["string", "null"]},
                           "op": {"type": "string"}, "module": {"type": "string"}}}},
        "scaled_region": {
            "type": "object", "required": ["size", "seed", "unscale"],
            "properties": {"size": {"type": "integer", "minimum": 0},
                           "seed": {"type": ["string", "null"]},
                           "unscale": {"type": "array", "items": {"type": "string"}}},
        },
        "roles": {"type": "array", "items": {
            "type": "object", "required": ["node", "role", "target", "pass"],
            "properties": {"node": {"type": "string"}, "role": {"type": "string"},
                           "target": {"type": ["string", "null"]}, "pass": {"type": ["string", "null"]}},
        }},
        "graph": {
            "type": "object", "required": ["nodes", "edges"],
            "properties": {
                "nodes": {"type": "array", "items": _NODE},
                "edges": {"type": "array", "items": {"type": "array", "items": {"type": "string"},
                                                     "minItems": 2, "maxItems": 2}},
            },
        },
        "diff": {
            "type": "object", "required": ["other", "added_ops", "removed_ops", "node_delta"],
            "properties": {"other": {"type": "string"}, "added_ops": _COUNTS,
                           "removed_ops": _COUNTS, "node_delta": {"type": "integer"},
                           "added_roles": _COUNTS},
        },
    },
}


# ---- reading ---------------------------------------------------------------------------------

def _op_name(node: Any) -> str:
    t = node.target
    if node.op == "call_function":
        name = getattr(t, "__name__", None) or str(t)
        ns = getattr(getattr(t, "namespace", None), "__str__", lambda: "")()
        return f"{ns}.{name}" if ns and not name.startswith(ns) else name
    return node.op


def _converts(node: Any) -> bool:
    return rounded_format(node) is not None or node.target in (
        torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def _cast_key(node: Any) -> str:
    fmt = rounded_format(node)
    if fmt is not None:
        return fmt
    val = node.meta.get("val")
    return str(getattr(val, "dtype", "unknown")).replace("torch.", "")


def _summarize_fx(gm: Any) -> dict[str, Any]:
    graph = gm.graph
    nodes, edges, role_rows = [], [], []
    inserted: Counter[str] = Counter()
    casts: Counter[str] = Counter()
    hist: Counter[str] = Counter()
    for node in graph.nodes:
        role, target, by = roles.role_of(node), roles.target_of(node), roles.pass_of(node)
        op = _op_name(node)
        nodes.append({"id": node.name, "op": node.op, "target": op, "role": role,
                      "target_entry": target, "pass": by})
        if node.op == "call_function":
            hist[op] += 1
        if by is not None:
            inserted[by] += 1
        # not the views replayed on a cast value; a native cast that took a gradient's role
        # (the float32 copy of an mm's output) counts too
        if (role == roles.CAST or by == "lower_precision") and _converts(node):
            casts[_cast_key(node)] += 1
        if role is not None:
            role_rows.append({"node": node.name, "role": role, "target": target, "pass": by})
        edges += [[inp.name, node.name] for inp in node.all_input_nodes]
    return {"nodes": nodes, "edges": edges, "roles": role_rows, "inserted": dict(inserted),
            "skipped": _skipped(graph), "float8": _float8(graph), "casts": dict(casts), "hist": dict(hist),
            "region": _scaled_region(nodes, edges)}


_REASON_CHARS = 200


def _skipped(graph: Any) -> dict[str, str]:
    """``{pass: why it skipped}`` as apply_dls recorded it (on the seed node in a .pt2 file).

    The record comes from the file: only a JSON object of strings is read, each reason cut to
    one short line, and anything else is ignored, so a hand-edited graph cannot stop the report.
    """
    data = _recorded_object(graph, roles.SKIPPED_KEY)
    return {one_line(k, _REASON_CHARS): one_line(v, _REASON_CHARS)
            for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _recorded_object(graph: Any, key: str) -> dict:
    """The JSON object recorded under ``key`` on ``graph``; ``{}`` when absent or malformed."""
    raw = roles.recorded(graph, key)
    try:
        data = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {}


def _float8(graph: Any) -> dict[str, dict[str, Any]]:
    """Per matmul, whether the float8 pass converted it and why not, as it recorded it (on the
    seed node in a .pt2 file); read as defensively as `_skipped`: only well-formed entries."""
    out = {}
    for name, d in _recorded_object(graph, FLOAT8_KEY).items():
        if not (isinstance(name, str) and isinstance(d, dict)):
            continue
        fields = {k: d.get(k) for k in ("float8", "why", "op", "module")}
        if all(isinstance(fields[k], str) for k in ("op", "module")) and all(
                fields[k] is None or isinstance(fields[k], str) for k in ("float8", "why")):
            out[one_line(name, _REASON_CHARS)] = {k: v if v is None else one_line(v, _REASON_CHARS)
                                                  for k, v in fields.items()}
    return out


def _scaled_region(nodes: list[dict], edges: list[list[str]]) -> dict[str, Any]:
    """Nodes on a path from the scaled seed to an unscale node (the values that carry the scale).

    One forward search from the seed and one backward search from all unscale nodes together:
    linear in the graph, however many gradients there are."""
    seeds = [n["id"] for n in nodes if n["role"] == roles.SCALED_SEED]
    unscale = [n["id"] for n in nodes if n["role"] == roles.UNSCALE]
    if not seeds:
        return {"size": 0, "seed": None, "unscale": unscale}
    succ: dict[str, list[str]] = {}
    pred: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        pred.setdefault(b, []).append(a)
    down, up = reach([seeds[0]], succ), reach(unscale, pred)
    return {"size": len(down & up), "seed": seeds[0], "unscale": unscale}


def _summarize_pt2(path: Path) -> dict[str, Any]:
    ep, meta = load_program(path)
    kind = (meta or {}).get("kind") or ("joint" if getattr(ep.graph_signature, "backward_signature", None)
                                        else "program")
    s = _summarize_fx(step_graph(ep, meta))
    return {"file_format": "pt2", "kind": kind, "meta": meta or {}, **s}


def _summarize_onnx(path: Path) -> dict[str, Any]:
    model = load_onnx(path)
    meta = onnx_meta(model) or {}
    out_roles = json.loads(model.metadata_props.get(roles.ONNX_ROLES_KEY, "{}"))
    nodes, edges, hist = [], [], Counter()
    inserted: Counter[str] = Counter()
    producer: dict[str, str] = {}
    for v in model.graph.inputs:
        nodes.append({"id": v.name, "op": "input", "target": "input", "role": None,
                      "target_entry": None, "pass": None})
        producer[v.name] = v.name
    for i, node in enumerate(model.graph):
        nid = node.name or f"{node.op_type}_{i}"
        hist[node.op_type] += 1
        by = node.metadata_props.get(roles.PASS_KEY)
        if by:
            inserted[by] += 1
        role = target = None
        for o in node.outputs:
            producer[o.name] = nid
            if o.name in out_roles:
                role, target = out_roles[o.name]
        nodes.append({"id": nid, "op": "node", "target": node.op_type, "role": role,
                      "target_entry": target, "pass": None})
        edges += [[producer[v.name], nid] for v in node.inputs if v is not None and v.name in producer]
    rows = [{"node": n["id"], "role": n["role"], "target": n["target_entry"], "pass": None}
            for n in nodes if n["role"]]
    return {"file_format": "onnx", "kind": "onnx", "meta": meta, "nodes": nodes, "edges": edges,
            # one entry per rounded value, by format (a cbfloat16 rounding is ~35 arithmetic
            # nodes and a float16 one a Cast pair, so node counts would mislead)
            "roles": rows, "inserted": dict(inserted), "skipped": {},
            "casts": dict(Counter(t for r, t in out_roles.values() if r == roles.CAST)),
            "hist": dict(hist), "region": {"size": 0, "seed": None, "unscale": []}}


def summarize_file(path: str | Path) -> dict[str, Any]:
    """The inspect report of a ``.pt2`` or ``.onnx`` file (see ``REPORT_SCHEMA``)."""
    p = check_input_file(path)
    return _report(_summarize_pt2(p) if p.suffix == ".pt2" else _summarize_onnx(p), str(p))


def summarize_graph(gm: Any, *, name: str = "graph") -> dict[str, Any]:
    """The inspect report of an in-memory rewritten FX GraphModule (``file`` is ``name``)."""
    cfg = recorded_config(gm)
    meta = {"config": cfg.to_dict() if cfg is not None else None}
    return _report({"file_format": "pt2", "kind": "step", "meta": meta, **_summarize_fx(gm)}, name)


def _report(s: dict[str, Any], file: str) -> dict[str, Any]:
    meta = s["meta"]
    return {
        "schema": SCHEMA_ID, "file": file, "file_format": s["file_format"], "kind": s["kind"],
        "config": meta.get("config"), "optimizer": meta.get("optimizer"),
        "precision_mode": meta.get("precision_mode"), "tied": meta.get("tied"),
        "node_count": sum(1 for n in s["nodes"] if n["op"] in ("call_function", "node")),
        "op_histogram": dict(sorted(s["hist"].items())),
        "inserted_by_pass": s["inserted"], "skipped_passes": s["skipped"], "casts": s["casts"],
        **({"float8": s["float8"]} if s.get("float8") else {}),
        "scaled_region": s["region"],
        "roles": s["roles"], "graph": {"nodes": s["nodes"], "edges": s["edges"]},
    }


def diff_reports(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What ``after`` has that ``before`` lacks (ops and roles), and the node-count change."""
    a, b = Counter(after["op_histogram"]), Counter(before["op_histogram"])
    ra = Counter(r["role"] for r in after["roles"])
    rb = Counter(r["role"] for r in before["roles"])
    return {"other": before["file"], "added_ops": dict(sorted((a - b).items())),
            "removed_ops": dict(sorted((b - a).items())),
            "node_delta": after["node_count"] - before["node_count"],
            "added_roles": dict(sorted((ra - rb).items()))}


# ---- rendering -------------------------------------------------------------------------------

def render(report: dict[str, Any], fmt: str, other: dict[str, Any] | None = None) -> str:
    """``report`` (with a diff against ``other``) as text, json, svg or html."""
    if other is not None:
        report = {**report, "diff": diff_reports(report, other)}
    if fmt == "json":
        return json.dumps(report, indent=1, sort_keys=True)
    if fmt == "svg":
        return render_svg(report)
    if fmt == "html":
        return render_html(report)
    if fmt == "text":
        return render_text(report)
    raise InputValueError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")


def render_text(r: dict[str, Any]) -> str:
    lines = [f"{r['file']}: {r['kind']} ({r['file_format']}), {r['node_count']} ops"]
    if r["config"] is not None:
        lines.append("DLS config: " + json.dumps(r["config"], sort_keys=True))
    if r.get("optimizer"):
        lines.append("optimizer: " + json.dumps(r["optimizer"], sort_keys=True))
    lines.append("tied parameters: " + _tied_text(r.get("tied")))
    lines.append("inserted by pass: " + (", ".join(f"{k} {v}" for k, v in r["inserted_by_pass"].items()) or "none"))
    lines += [f"skipped: {k} ({v})" for k, v in sorted(r["skipped_passes"].items())]
    lines.append("casts: " + (", ".join(f"{k} {v}" for k, v in sorted(r["casts"].items())) or "none"))
    lines += _float8_text(r.get("float8") or {})
    reg = r["scaled_region"]
    lines.append(f"scaled region: {reg['size']} nodes from {reg['seed']} to {len(reg['unscale'])} unscale nodes")
    counts = Counter(row["role"] for row in r["roles"])
    lines.append("roles: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if "diff" in r:
        d = r["diff"]
        lines.append(f"diff against {d['other']}: {d['node_delta']:+d} ops")
        lines += [f"  + {k} x{v}" for k, v in d["added_ops"].items()]
        lines += [f"  - {k} x{v}" for k, v in d["removed_ops"].items()]
    # names come from the file: an ESC in one must not reach the terminal
    return "\n".join(printable(line) for line in lines)


def _float8_text(f8: dict[str, dict[str, Any]]) -> list[str]:
    """One line with the float8 count per recipe, then one per matmul: its recipe, or why it
    stays in its own precision (the filter's reason)."""
    if not f8:
        return []
    done = Counter(d["float8"] for d in f8.values() if d["float8"])
    lines = [f"float8: {sum(done.values())} of {len(f8)} matmuls converted ("
             + (", ".join(f"{k} {v}" for k, v in sorted(done.items())) or "none") + ")"]

    def where(name: str, d: dict[str, Any]) -> str:
        return f"{name} ({d['op']}{', ' + d['module'] if d['module'] else ''})"

    lines += [f"  float8 {d['float8']}: {where(name, d)}" for name, d in sorted(f8.items()) if d["float8"]]
    lines += [f"  not float8: {where(name, d)}: {d['why']}" for name, d in sorted(f8.items()) if not d["float8"]]
    return lines


def _tied_text(tied: dict[str, str] | None) -> str:
    """``lm_head.weight -> wte.weight, ...``: the names merged into the parameter trained as
    the kept one, which the program itself no longer lists."""
    if tied is None:
        return "not recorded"
    return ", ".join(f"{d} -> {k}" for d, k in sorted(tied.items())) or "none"


def _table(headers: list[str], rows: list[list[Any]], cls: str) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc('' if c is None else str(c))}</td>" for c in row)
                   + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def render_html(r: dict[str, Any]) -> str:
    """One self-contained offline HTML page: summary, inline SVG graph, roles table, diff."""
    summary = _table(["item", "value"], [
        ["file", r["file"]], ["kind", r["kind"]], ["ops", r["node_count"]],
        ["DLS config", json.dumps(r["config"], sort_keys=True) if r["config"] else "none"],
        ["optimizer", json.dumps(r.get("optimizer"), sort_keys=True) if r.get("optimizer") else "none"],
        ["tied parameters", _tied_text(r.get("tied"))],
        ["inserted by pass", ", ".join(f"{k}: {v}" for k, v in r["inserted_by_pass"].items()) or "none"],
        ["skipped passes", "; ".join(f"{k}: {v}" for k, v in sorted(r["skipped_passes"].items())) or "none"],
        ["casts", ", ".join(f"{k}: {v}" for k, v in sorted(r["casts"].items())) or "none"],
        ["scaled region", f"{r['scaled_region']['size']} nodes from {r['scaled_region']['seed']}"],
    ], "summary")
    role_rows = [[x["node"], x["role"], x["target"], x["pass"]] for x in r["roles"]]
    roles_html = _table(["node", "role", "target", "inserted by"], role_rows, "roles")
    if "diff" in r:
        d = r["diff"]
        rows = ([["+", k, v] for k, v in d["added_ops"].items()]
                + [["-", k, v] for k, v in d["removed_ops"].items()])
        diff_html = (f'<section id="diff"><h2>Diff against {esc(d["other"])} '
                     f'({d["node_delta"]:+d} ops)</h2>{_table(["", "op", "count"], rows, "diff")}</section>')
    else:
        diff_html = '<section id="diff"><h2>Diff</h2><p>No --diff file given.</p></section>'
    style = ("body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;"
             "margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;"
             "text-align:left}th{background:#eee}.graph{overflow:auto;border:1px solid #ccc;"
             "max-height:70vh}.diff td:first-child{font-weight:bold}details.region{margin:.3em 0;"
             "border:1px solid #ddd;padding:.2em .5em}details.region>summary{cursor:pointer;"
             "font-size:14px}details.region[data-region=dls]>summary{font-weight:bold}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>dlspass inspect: {esc(Path(r['file']).name)}</title>"
            f"<style>{style}</style></head><body>"
            f"<h1>dlspass inspect: {esc(Path(r['file']).name)}</h1>"
            f'<section id="summary"><h2>Summary</h2>{summary}</section>'
            f'<section id="graph"><h2>Graph</h2>{regions_html(r)}</section>'
            f"{diff_html}"
            f'<section id="roles"><h2>Roles</h2>{roles_html}</section>'
            "</body></html>\n")
