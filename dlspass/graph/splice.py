"""Splice traced Python helpers (and single ops) into an FX graph, keeping fake values valid.

Passes express their math once, in ``dlspass.scale_policy``; ``splice`` traces such a helper
with ``make_fx`` on the fake values of existing nodes and copies the resulting graph in before
an anchor node, tagging every copied node with its role and the pass that inserted it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.errors import DLSInternalError
from dlspass.graph import roles


class SpliceError(DLSInternalError, RuntimeError):
    """A helper could not be spliced into the graph; the message names the node."""


def _val(node: fx.Node) -> Any:
    if "val" not in node.meta:
        raise SpliceError(f"node {node.name!r} has no fake value (meta['val']); run FakeTensorProp first")
    return node.meta["val"]


def insertion_point(graph: fx.Graph, args: Sequence[fx.Node]) -> fx.Node:
    """The node right after the last of ``args`` in graph order (where new users can go)."""
    last = None
    wanted = set(args)
    for node in graph.nodes:
        if node in wanted:
            last = node
    if last is None:
        raise SpliceError("no argument node of the helper is in the graph")
    nxt = last.next
    # placeholders must stay together at the top of the graph
    while nxt.op == "placeholder":
        nxt = nxt.next
    return nxt


def splice(
    graph: fx.Graph,
    fn: Callable[..., Any],
    args: Sequence[fx.Node],
    *,
    role: str,
    by_pass: str,
    before: fx.Node | None = None,
    output_roles: Sequence[tuple[str, str | None] | None] | None = None,
    decomposition_table: dict | None = None,
) -> list[fx.Node]:
    """Trace ``fn(*fake values of args)`` and copy its graph in; returns the flat output nodes.

    Every copied node gets ``role`` (``output_roles[i]`` = ``(role, target)`` overrides it for the
    i-th flat output) and ``by_pass``. Outputs that are one of ``args`` are returned as they are
    and keep their own role. The copy goes before ``before`` (default: right after the last
    argument), under ``inserting_before`` so the nodes keep their traced order.
    """
    vals = [_val(a) for a in args]
    fake_mode = detect_fake_mode(vals)
    if fake_mode is None:
        raise SpliceError(f"the arguments of {getattr(fn, '__name__', fn)!r} carry no fake tensors")

    def flat_fn(*xs: Any) -> list[Any]:
        return pytree.tree_leaves(fn(*xs))

    with fake_mode:
        sub = make_fx(flat_fn, decomposition_table=decomposition_table, tracing_mode="fake")(*vals)
    anchor = before if before is not None else insertion_point(graph, args)
    sub_placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    val_map: dict[fx.Node, fx.Node] = dict(zip(sub_placeholders, args, strict=True))
    owner = graph.owning_module
    for node in sub.graph.nodes:
        if node.op == "get_attr":
            # constants created inside the helper (e.g. torch.tensor) move onto the host module
            if owner is None:
                raise SpliceError(f"helper {fn!r} creates a constant but the graph has no module")
            name = f"_dls_const_{by_pass}_{len(list(owner.named_buffers()))}_{node.target}"
            owner.register_buffer(name, getattr(sub, node.target), persistent=False)
            with graph.inserting_before(_first_non_placeholder(graph)):
                new = graph.get_attr(name)
            new.meta = dict(node.meta)
            val_map[node] = new
    with graph.inserting_before(anchor):
        out = graph.graph_copy(sub.graph, val_map)
    arg_set = set(args)
    new_nodes = [val_map[n] for n in sub.graph.nodes if n.op in ("call_function", "get_attr")]
    for node in new_nodes:
        roles.set_role(node, role, by_pass=by_pass)
    flat_out = list(out) if isinstance(out, (list, tuple)) else [out]
    for i, node in enumerate(flat_out):
        if output_roles is None or output_roles[i] is None or node in arg_set:
            continue
        r, t = output_roles[i]
        roles.set_role(node, r, t, by_pass=by_pass)
    return flat_out


def _first_non_placeholder(graph: fx.Graph) -> fx.Node:
    for node in graph.nodes:
        if node.op != "placeholder":
            return node
    raise SpliceError("graph has no output node")


def insert_op(
    graph: fx.Graph,
    target: Any,
    args: tuple,
    kwargs: dict | None = None,
    *,
    before: fx.Node,
    role: str,
    by_pass: str,
    target_name: str | None = None,
) -> fx.Node:
    """Insert one ``call_function`` node before ``before``, with its fake value computed."""
    kwargs = kwargs or {}
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    set_fake_val(node)
    roles.set_role(node, role, target_name, by_pass=by_pass)
    return node


def set_fake_val(node: fx.Node) -> None:
    """Recompute ``node.meta['val']`` by running its op on the fake values of its inputs."""
    fargs, fkwargs = fx.node.map_arg((node.args, node.kwargs), _val)
    fake_mode = detect_fake_mode(pytree.tree_leaves((fargs, fkwargs)))
    if fake_mode is None:
        raise SpliceError(f"node {node.name!r}: its inputs carry no fake tensors")
    with fake_mode:
        node.meta["val"] = node.target(*fargs, **fkwargs)
    v = node.meta["val"]
    if isinstance(v, torch.Tensor):
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        node.meta["tensor_meta"] = _extract_tensor_metadata(v)
