"""The SVG drawing of an inspect report's graph (networkx computes the layout; no Graphviz)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import networkx as nx

from dlspass.files.bounded_text import printable


def esc(text: str) -> str:
    """Text from the file for HTML/SVG: control characters (invalid in XML) written out."""
    return html.escape(printable(text))


_COLORS = {"inserted": "#f28e2b", "role": "#4e79a7", "io": "#59a14f", "plain": "#bab0ac"}


def _layout(r: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Layered layout: topological generation -> column; rows ordered by the mean row of each
    node's inputs (one barycenter sweep), which keeps chains straight and crossings few.
    Linear in nodes plus edges (sort aside): each node is bucketed into its column once."""
    dag = nx.DiGraph()
    order = {n["id"]: i for i, n in enumerate(r["graph"]["nodes"])}
    dag.add_nodes_from(order)
    dag.add_edges_from(tuple(e) for e in r["graph"]["edges"])
    gens = [list(g) for g in nx.topological_generations(dag)]
    col = {nid: x for x, gen in enumerate(gens) for nid in gen}
    # sources (inputs, state) sit just left of their first user, not all in column 0
    for nid in gens[0] if gens else []:
        users = [col[u] for u in dag.successors(nid)]
        col[nid] = max(min(users) - 1, 0) if users else 0
    columns: list[list[str]] = [[] for _ in range(max(col.values(), default=-1) + 1)]
    for nid in order:  # in file order within each column
        columns[col[nid]].append(nid)
    pos: dict[str, tuple[float, float]] = {}
    for x, gen in enumerate(columns):
        def key(nid: str) -> tuple[float, int]:
            ys = [pos[p][1] for p in dag.predecessors(nid) if p in pos]
            return (sum(ys) / len(ys) if ys else float(order[nid]), order[nid])

        for y, nid in enumerate(sorted(gen, key=key)):
            pos[nid] = (float(x), float(y))
    return pos


_LABELLED_UP_TO = 250  # nodes: a drawing this small names each op beside its circle


def _short(op: str) -> str:
    """``aten.where.self`` -> ``where``: the op's name without namespace and overload."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "dlspass", "prims") else parts[0]


def render_svg(r: dict[str, Any]) -> str:
    """The graph as a standalone SVG: inserted nodes orange (class ``dls-inserted``); a small
    graph also names each op (its short name, or the node's target for inputs and outputs)."""
    pos = _layout(r)
    labelled = len(r["graph"]["nodes"]) <= _LABELLED_UP_TO
    dx, dy, pad, rad = (96.0, 26.0, 20.0, 6.0) if labelled else (34.0, 22.0, 20.0, 7.0)
    # at least wide enough for the title line
    width = max(pad * 2 + dx * (max((p[0] for p in pos.values()), default=0) + 1), 640.0)
    height = pad * 2 + dy * (max((p[1] for p in pos.values()), default=0) + 1) + 20

    def xy(nid: str) -> tuple[float, float]:
        x, y = pos[nid]
        return pad + x * dx, pad + 20 + y * dy

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="dlspass-graph" width="{width:.0f}" '
             f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" '
             'font-size="10">',
             f'<text x="{pad}" y="14">{esc(Path(r["file"]).name)}: {r["node_count"]} ops; '
             'orange = inserted by dlspass, blue = tagged role, green = input/output</text>',
             '<g class="edges" stroke="#999" stroke-width="0.6" fill="none">']
    for a, b in r["graph"]["edges"]:
        (x1, y1), (x2, y2) = xy(a), xy(b)
        parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}"/>')
    parts.append('</g><g class="nodes">')
    for n in r["graph"]["nodes"]:
        x, y = xy(n["id"])
        if n["pass"]:
            cls, color = "dls-inserted", _COLORS["inserted"]
        elif n["op"] in ("placeholder", "output", "input"):
            cls, color = "io", _COLORS["io"]
        elif n["role"]:
            cls, color = "role", _COLORS["role"]
        else:
            cls, color = "plain", _COLORS["plain"]
        title = f"{n['id']}: {n['target']}"
        if n["role"]:
            title += f" [{n['role']}{' ' + n['target_entry'] if n['target_entry'] else ''}]"
        if n["pass"]:
            title += f" (inserted by {n['pass']})"
        extra = f' data-pass="{esc(n["pass"])}"' if n["pass"] else ""
        parts.append(f'<circle class="{cls}" cx="{x:.1f}" cy="{y:.1f}" r="{rad}" fill="{color}"'
                     f'{extra}><title>{esc(title)}</title></circle>')
        if labelled:
            name = n["target_entry"] if n["op"] in ("placeholder", "input") and n["target_entry"] else (
                n["id"] if n["op"] in ("placeholder", "output", "input") else _short(n["target"]))
            parts.append(f'<text class="label" x="{x + rad + 2:.1f}" y="{y - rad + 1:.1f}" '
                         f'font-size="9" fill="#333">{esc(name if len(name) <= 18 else name[:17] + "~")}</text>')
    parts.append("</g></svg>")
    return "\n".join(parts)


# the regions of a step graph, in the order the HTML shows them; DLS is open, the rest fold
