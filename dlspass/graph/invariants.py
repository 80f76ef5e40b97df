"""Check a step graph's contract between passes (`check`) and prove a rewritten step graph's DLS
invariants with DAG reachability (networkx), not path lists (`verify`).

For a graph with dynamic loss scaling:

- the backward seed is read only through the SCALED_SEED, which multiplies by the ``loss_scale``
  placeholder;
- every UNSCALE node reads that same placeholder (directly or through other UNSCALE nodes);
- every path from the seed to a parameter or optimizer-state output crosses exactly one UNSCALE
  node (checked by propagating the min and max UNSCALE count over a topological order, which is
  linear in the graph size however many paths there are);
- every parameter and optimizer-state output is a GUARD ``where(isfinite, new, old)`` whose
  ``old`` is the matching placeholder and whose condition depends on the gradients
  (or is that placeholder passed through unchanged). Buffer and scaler-state outputs are exempt.

- no DLS node (scaled seed, unscale, overflow check, norm, clip, guard, scale update) and no
  gradient the optimizer reads holds a 16-bit value: native mixed precision
  (``LowerPrecisionPass(mode="native")``) keeps them, like the master weights, in float32.

A static scale checks the first three and the last; a graph without scaling only gets linted.
"""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from dlspass.errors import DLSInternalError, GraphContractError
from dlspass.graph import roles
from dlspass.precision_policy import NATIVE_DTYPES


class VerificationError(DLSInternalError):
    """A DLS invariant does not hold; the message names the offending node.

    Internal: after ``apply_dls`` it means a pass broke its contract. ``dlspass verify FILE``
    reports it as the command's result (exit 1).
    """


def check(gm: fx.GraphModule | fx.Graph) -> None:
    """The contract every pass takes and leaves (``GraphContractError`` naming what is wrong):
    the graph lints, has exactly one backward seed, records one role per output, and every
    placeholder and computed node that something reads has a fake value (``meta["val"]``)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    graph.lint()
    if len(roles.nodes_with_role(graph, roles.SEED)) != 1:
        raise GraphContractError("the graph needs exactly one backward_seed node")
    out_roles = roles.output_roles(graph)
    if not out_roles:
        raise GraphContractError("the output node records no output roles (dlspass_outputs)")
    if len(out_roles) != len(roles.output_values(graph)):
        raise GraphContractError(f"{len(out_roles)} output roles for "
                                 f"{len(roles.output_values(graph))} outputs")
    for node in graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta and node.users:
            raise GraphContractError(f"node {node.name!r} has no fake value (meta['val'])")


def _config_of(graph: fx.Graph) -> tuple[bool, bool]:
    """``(enabled, dynamic)`` from the recorded config, else from the nodes present."""
    if roles.recorded(graph, roles.CONFIG_KEY) is not None:
        cfg = roles.recorded_config(graph)
        return (False, False) if cfg is None else (cfg.enabled, cfg.dynamic)
    enabled = bool(roles.nodes_with_role(graph, roles.SCALED_SEED))
    dynamic = enabled and bool(roles.nodes_with_role(graph, roles.GUARD))
    return enabled, dynamic


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """The data-flow DAG of ``graph``: an edge from each input node to each user."""
    dag = nx.DiGraph()
    for node in graph.nodes:
        dag.add_node(node)
        for inp in node.all_input_nodes:
            dag.add_edge(inp, node)
    return dag


def verify(gm: fx.GraphModule | fx.Graph) -> bool:
    """True when the DLS invariants hold; otherwise ``VerificationError`` naming the node."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    try:
        graph.lint()
    except Exception as e:  # lint raises RuntimeError with the node name
        raise VerificationError(f"graph lint failed: {e}") from e
    enabled, dynamic = _config_of(graph)
    if not enabled:
        return True
    dag = to_networkx(graph)
    _check_float32(graph)
    seed, scale = _check_seed(graph)
    _check_unscale_inputs(graph, dag, seed, scale)
    lo, hi = _unscale_counts(dag, seed)
    vals = roles.output_values(graph)
    out_roles = roles.output_roles(graph)
    for i, (role, target) in enumerate(out_roles):
        if role not in roles.GUARDED_UPDATES:
            continue
        v = vals[i]
        if v in lo and not lo[v] == hi[v] == 1:
            raise VerificationError(_count_message(dag, lo, hi, v, i, target))
        if dynamic:
            _check_guard(graph, v, i, role, target, lo)
    return True


_DLS_ROLES = (roles.SCALED_SEED, roles.UNSCALE, roles.ISFINITE, roles.GRAD_NORM, roles.CLIP,
              roles.GUARD, roles.SCALE_UPDATE)


def _check_float32(graph: fx.Graph) -> None:
    for node in roles.nodes_with_role(graph, (*_DLS_ROLES, roles.GRAD)):
        # a gradient may be the float32 cast of a 16-bit op's output: only its value counts
        seen = (node,) if roles.role_of(node) == roles.GRAD else (*node.all_input_nodes, node)
        for x in seen:
            v = x.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype in NATIVE_DTYPES.values():
                raise VerificationError(f"{roles.role_of(node)} node {node.name!r} reads or writes "
                                        f"{x.name!r} in {v.dtype}: DLS math must run in float32")


def _check_seed(graph: fx.Graph) -> tuple[fx.Node, fx.Node]:
    seeds = roles.nodes_with_role(graph, roles.SEED)
    if len(seeds) != 1:
        raise VerificationError(f"expected one backward_seed node, found {len(seeds)}")
    seed = seeds[0]
    scaled = [u for u in seed.users if roles.role_of(u) == roles.SCALED_SEED]
    unscaled_users = [u for u in seed.users if roles.role_of(u) != roles.SCALED_SEED]
    if len(scaled) != 1 or unscaled_users:
        names = [u.name for u in unscaled_users] or [seed.name]
        raise VerificationError(f"the backward seed {seed.name!r} is not read through exactly one "
                                f"scaled_seed node (read by {names})")
    scale = [a for a in scaled[0].all_input_nodes if a is not seed]
    if (len(scale) != 1 or scale[0].op != "placeholder"
            or roles.role_of(scale[0]) != roles.SCALER_STATE or roles.target_of(scale[0]) != "loss_scale"):
        raise VerificationError(f"scaled_seed {scaled[0].name!r} does not multiply by the loss_scale "
                                "placeholder")
    return seed, scale[0]


def _check_unscale_inputs(graph: fx.Graph, dag: nx.DiGraph, seed: fx.Node, scale: fx.Node) -> None:
    from_seed = nx.descendants(dag, seed)
    unscales = roles.nodes_with_role(graph, roles.UNSCALE)
    if not unscales:
        raise VerificationError("the graph scales the seed but has no unscale node")
    for node in unscales:
        for inp in node.all_input_nodes:
            if inp is scale or roles.role_of(inp) == roles.UNSCALE or inp in from_seed:
                continue
            raise VerificationError(
                f"unscale node {node.name!r} reads {inp.name!r}, not the loss_scale placeholder "
                f"{scale.name!r} that the scaled seed uses")


def _unscale_counts(dag: nx.DiGraph, seed: fx.Node) -> tuple[dict, dict]:
    """Min and max number of UNSCALE nodes (capped at 2) on paths from ``seed`` to each node."""
    reach = nx.descendants(dag, seed) | {seed}
    lo: dict[fx.Node, int] = {seed: 0}
    hi: dict[fx.Node, int] = {seed: 0}
    for node in nx.topological_sort(dag.subgraph(reach)):
        if node is seed:
            continue
        preds = [p for p in dag.predecessors(node) if p in lo]
        add = 1 if roles.role_of(node) == roles.UNSCALE else 0
        lo[node] = min(2, min(lo[p] for p in preds) + add)
        hi[node] = min(2, max(hi[p] for p in preds) + add)
    return lo, hi


def _count_message(dag: nx.DiGraph, lo: dict, hi: dict, v: fx.Node, i: int, target: str | None) -> str:
    if hi[v] >= 2:
        # the first UNSCALE reached by a path that already crossed one
        for node in nx.topological_sort(dag.subgraph(lo)):
            if roles.role_of(node) == roles.UNSCALE and any(
                    hi.get(p, 0) >= 1 for p in dag.predecessors(node)):
                return (f"unscale node {node.name!r} unscales a gradient a second time on the way "
                        f"to output {i} ({target!r})")
        return f"output {i} ({target!r}) is reached through more than one unscale node"
    return (f"output {i} ({target!r}) node {v.name!r} is reachable from the backward seed "
            "without an unscale node")


def _check_guard(graph: fx.Graph, v: fx.Node, i: int, role: str, target: str | None,
                 lo: dict) -> None:
    want = roles.GUARDED_UPDATES[role]
    if v.op == "placeholder" and roles.role_of(v) == want and roles.target_of(v) == target:
        return  # passed through unchanged
    if (roles.role_of(v) != roles.GUARD or v.op != "call_function"
            or v.target is not torch.ops.aten.where.self or len(v.args) != 3):
        raise VerificationError(f"output {i} ({role} {target!r}) node {v.name!r} is not guarded by "
                                "where(isfinite, new, old)")
    cond, _new, old = v.args
    if not (isinstance(old, fx.Node) and old.op == "placeholder" and roles.role_of(old) == want
            and roles.target_of(old) == target):
        name = old.name if isinstance(old, fx.Node) else repr(old)
        raise VerificationError(f"guard {v.name!r} of output {i} ({target!r}) falls back to {name!r}, "
                                f"not the {want} placeholder of {target!r}")
    if not isinstance(cond, fx.Node) or cond not in lo:
        raise VerificationError(f"guard {v.name!r} of output {i} ({target!r}) has a condition that "
                                "does not depend on the gradients")
