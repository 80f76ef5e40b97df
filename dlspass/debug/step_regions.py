"""An inspect report's step drawn by region: what each DLS pass inserted, open, with its
neighbours; the forward, backward, optimizer, casts, other rewrites and inputs/outputs folded
into labelled ``<details>`` blocks (no JavaScript)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from dlspass.debug.step_svg import esc, render_svg
from dlspass.graph import roles


def reach(starts: list[str], nxt: dict[str, list[str]]) -> set[str]:
    seen = set(starts)
    stack = list(starts)
    while stack:
        for m in nxt.get(stack.pop(), ()):
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


REGIONS = ("dls", "forward", "backward", "optimizer", "casts", "rewrites", "io", "graph")
_REGION_TITLES = {"dls": "DLS (inserted by dlspass)", "forward": "forward", "backward": "backward",
                  "optimizer": "optimizer", "casts": "16-bit casts (lower_precision)",
                  "rewrites": "other dlspass rewrites", "io": "inputs and outputs",
                  "graph": "graph (no backward seed: not a training step)"}
# apply_dls's passes after the precision pass, in pipeline order
DLS_PASSES = ("scale_seed", "unscale_grads", "clip_grad_norm", "guard_updates", "update_scale")
_CAST_PASSES = ("lower_precision",)
_SHOWN_TARGETS = 3  # a per-parameter pass is drawn for this many parameters


def step_regions(r: dict[str, Any]) -> dict[str, list[str]]:
    """Node ids per region of a step graph: ``dls`` (inserted by a DLS pass), ``forward`` (what
    the backward seed is computed from), ``backward`` (from the seed to the gradients),
    ``optimizer`` (the rest of the computation), ``casts`` (the precision pass's),
    ``rewrites`` (other passes', e.g. the in-place updates), ``io`` (inputs and outputs). A
    graph without a backward seed is one ``graph`` region. Empty regions are left out."""
    nodes = r["graph"]["nodes"]
    succ: dict[str, list[str]] = {}
    pred: dict[str, list[str]] = {}
    for a, b in r["graph"]["edges"]:
        succ.setdefault(a, []).append(b)
        pred.setdefault(b, []).append(a)
    seeds = [n["id"] for n in nodes if n["role"] == roles.SEED]
    grads = [n["id"] for n in nodes if n["role"] == roles.GRAD]
    forward = reach(seeds, pred) - set(seeds)
    backward = reach(seeds, succ) & reach(grads, pred)
    out: dict[str, list[str]] = {k: [] for k in REGIONS}
    for n in nodes:
        nid = n["id"]
        if n["op"] in ("placeholder", "output", "input"):
            region = "io"
        elif n["pass"] in DLS_PASSES:
            region = "dls"
        elif n["pass"] in _CAST_PASSES:
            region = "casts"
        elif n["pass"]:
            region = "rewrites"
        elif not seeds:
            region = "graph"
        elif nid in forward:
            region = "forward"
        elif nid in backward:
            region = "backward"
        else:
            region = "optimizer"
        out[region].append(nid)
    return {k: v for k, v in out.items() if v}


def _sub_report(r: dict[str, Any], ids: set[str], title: str) -> dict[str, Any]:
    """``r`` with its graph cut to ``ids`` (edges inside it only), for `render_svg`."""
    nodes = [n for n in r["graph"]["nodes"] if n["id"] in ids]
    edges = [e for e in r["graph"]["edges"] if e[0] in ids and e[1] in ids]
    return {**r, "file": title, "graph": {"nodes": nodes, "edges": edges}, "node_count": len(nodes)}


def _op_summary(nodes: list[dict[str, Any]]) -> str:
    ops = Counter(n["target"] for n in nodes if n["op"] == "call_function")
    top = ", ".join(f"{op} {k}" for op, k in ops.most_common(4))
    return f" ({top}{', ...' if len(ops) > 4 else ''})" if top else ""


def _dls_blocks(r: dict[str, Any], ids: list[str]) -> list[str]:
    """One open block per DLS pass: its inserted ops drawn with the ops they read and feed. A
    pass that inserts per target (a gradient, a parameter, an optimizer state: unscale, guard)
    is drawn for the first few targets; its step-wide ops (the overflow flag, the norm) always."""
    node = {n["id"]: n for n in r["graph"]["nodes"]}
    target = _inherited_targets(r)
    blocks = []
    for name in DLS_PASSES:
        mine = [node[i] for i in ids if node[i]["pass"] == name]
        if not mine:
            continue
        targets = list(dict.fromkeys(target[n["id"]] for n in mine if target[n["id"]]))
        keep = set(targets if len(targets) <= 2 * _SHOWN_TARGETS else targets[:_SHOWN_TARGETS])
        drawn = {n["id"] for n in mine if target[n["id"]] in keep or target[n["id"]] is None}
        # neighbours: what the drawn ops read and feed, except what belongs to a target not drawn
        shown = set(drawn)
        for a, b in r["graph"]["edges"]:
            for near, far in ((a, b), (b, a)):
                if far in drawn and (target[near] is None or target[near] in keep):
                    shown.add(near)
        label = f"{name}: {len(mine)} ops inserted{_op_summary(mine)}"
        if len(targets) > len(keep):
            label += (f"; drawn for {len(keep)} of its {len(targets)} targets ({', '.join(sorted(keep))}; "
                      f"the others alike)")
        label += f", with the {len(shown - drawn)} ops they read or feed"
        sub = _sub_report(r, shown, f"{Path(r['file']).name} [{name}]")
        blocks.append(f'<details class="region dls-pass" data-region="dls" data-pass="{esc(name)}" open>'
                      f'<summary>{esc(label)}</summary><div class="graph">{render_svg(sub)}</div></details>')
    return blocks


def _inherited_targets(r: dict[str, Any]) -> dict[str, str | None]:
    """Each node's target (a parameter, gradient or state name), or, for an untargeted op, the
    one target its computed inputs share (a per-gradient sum reads that gradient); None for
    step-wide nodes (``global``, reading several targets, or only inputs such as the scale).
    Graph order is topological, so one pass carries a target down a chain."""
    inputs: dict[str, list[str]] = {}
    for a, b in r["graph"]["edges"]:
        inputs.setdefault(b, []).append(a)
    computed = {n["id"] for n in r["graph"]["nodes"] if n["op"] == "call_function"}
    out: dict[str, str | None] = {}
    for n in r["graph"]["nodes"]:
        own = n["target_entry"]
        if own is None and n["id"] in computed:
            found = {out[i] for i in inputs.get(n["id"], ()) if i in computed and out.get(i)}
            own = found.pop() if len(found) == 1 else None
        out[n["id"]] = None if own == roles.GLOBAL else own
    return out


def regions_html(r: dict[str, Any]) -> str:
    """The graph by region: each DLS pass's inserted ops drawn with their neighbourhood (open),
    every other region a folded block, labelled with its op count and commonest ops, whose
    drawing shows when it is opened (``<details>``: no script)."""
    node = {n["id"]: n for n in r["graph"]["nodes"]}
    parts = []
    for name, ids in step_regions(r).items():
        if name == "dls":
            parts += _dls_blocks(r, ids)
            continue
        label = f"{_REGION_TITLES[name]}: {len(ids)} ops{_op_summary([node[i] for i in ids])}"
        sub = _sub_report(r, set(ids), f"{Path(r['file']).name} [{name}]")
        parts.append(f'<details class="region" data-region="{name}"><summary>{esc(label)}</summary>'
                     f'<div class="graph">{render_svg(sub)}</div></details>')
    return "\n".join(parts)
