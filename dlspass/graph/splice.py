"""Splice traced Python helpers (and single ops) into an FX graph, keeping fake values valid.

Passes express their math once, in ``dlspass.scale_policy``; ``splice`` traces such a helper
with ``make_fx`` on the fake values of existing nodes and `graft` copies the resulting graph in
before an anchor node, tagging every copied node with its role and the pass that inserted it.
Inserted nodes inherit the provenance (``stack_trace``, ``nn_module_stack``) of the node they
stand for, so a non-finite value found in them is still attributed to a module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from dlspass.errors import InternalRuntimeError
from dlspass.graph import roles

# node meta that says where a node came from in the user's program (debug/localize reads them)
PROVENANCE_KEYS = ("stack_trace", "nn_module_stack")


# a helper could not be spliced into the graph; the message names the node
SpliceError = InternalRuntimeError


class Spliced(list[fx.Node]):
    """What `splice` returns: the flat output nodes (a list), plus ``inserted``, every node it added.

    ``inserted`` lets a pass re-route uses of an old value to a new one while the inserted nodes,
    which read the old value, keep reading it.
    """

    def __init__(self, outputs: Sequence[fx.Node], inserted: Sequence[fx.Node]) -> None:
        super().__init__(outputs)
        self.inserted: list[fx.Node] = list(inserted)


def _val(node: fx.Node) -> Any:
    if "val" not in node.meta:
        raise SpliceError(f"node {node.name!r} has no fake value (meta['val']); run FakeTensorProp first")
    return node.meta["val"]


def insertion_point(graph: fx.Graph, args: Sequence[fx.Node]) -> fx.Node:
    """The node right after the last of ``args`` in graph order (where new users can go)."""
    last = _last_in_graph(graph, args)
    if last is None:
        raise SpliceError("no argument node of the helper is in the graph")
    nxt = last.next
    # placeholders must stay together at the top of the graph
    while nxt.op == "placeholder":
        nxt = nxt.next
    return nxt


def _last_in_graph(graph: fx.Graph, nodes: Sequence[fx.Node]) -> fx.Node | None:
    last = None
    wanted = set(nodes)
    for node in graph.nodes:
        if node in wanted:
            last = node
    return last


def provenance_source(graph: fx.Graph, args: Sequence[Any], before: fx.Node | None) -> fx.Node | None:
    """The node whose provenance new nodes reading ``args`` before ``before`` inherit.

    The anchor when it is an op that reads one of ``args`` (the new nodes prepare an input of
    it, e.g. a cast of a layer's input belongs to that layer); otherwise the last of ``args``
    in graph order (the new nodes transform a value that node produced).
    """
    nodes = [a for a in pytree.tree_leaves(list(args)) if isinstance(a, fx.Node)]
    if (before is not None and before.op == "call_function"
            and any(a in before.all_input_nodes for a in nodes)):
        return before
    last = _last_in_graph(graph, nodes)
    return last if last is not None else before


def port_provenance(source: fx.Node | None, nodes: Sequence[fx.Node]) -> None:
    """Copy ``source``'s provenance meta onto each of ``nodes`` that has none of its own."""
    if source is None:
        return
    for key in PROVENANCE_KEYS:
        if key not in source.meta:
            continue
        for node in nodes:
            if key not in node.meta:
                # a copy: one shared dict would let a later edit on one node change all of them
                node.meta[key] = copy.copy(source.meta[key])


def graft(
    graph: fx.Graph,
    sub: fx.GraphModule,
    args: Sequence[fx.Node],
    before: fx.Node,
    *,
    const_prefix: str = "_dls_const",
    source: fx.Node | None = None,
) -> tuple[list[fx.Node], list[fx.Node]]:
    """Copy ``sub``'s graph into ``graph`` before ``before``; returns ``(flat outputs, inserted)``.

    ``sub``'s placeholders become ``args`` (in order). Its ``get_attr`` constants move onto the
    module owning ``graph`` as non-persistent buffers (``const_prefix`` + a fresh index), read
    at the top of the graph, so they follow the module across devices; `dlspass.capture.joint_step`
    lifts them back into inputs when it packages a step. The copies keep ``sub``'s node meta
    (fake values included) and, where they have none, get ``source``'s provenance. Outputs of
    ``sub`` that are one of its inputs come back as the matching node of ``args``; ``inserted``
    lists every node added, in graph order.
    """
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise SpliceError(f"the traced graph takes {len(placeholders)} inputs, {len(args)} given")
    val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, args, strict=True))
    inserted: list[fx.Node] = []
    owner = graph.owning_module
    top = None  # constants are read right after the placeholders, in their traced order
    for node in sub.graph.nodes:
        if node.op != "get_attr":
            continue
        top = top or _first_non_placeholder(graph)
        # constants created inside the helper (e.g. torch.tensor) move onto the host module
        if owner is None:
            raise SpliceError(f"the traced graph reads constant {node.target!r} but the graph "
                              "has no module to hold it")
        name = _fresh_name(owner, f"{const_prefix}_{len(list(owner.named_buffers()))}_{node.target}")
        owner.register_buffer(name, getattr(sub, node.target), persistent=False)
        with graph.inserting_before(top):
            new = graph.get_attr(name)
        new.meta = dict(node.meta)
        val_map[node] = new
        inserted.append(new)
    with graph.inserting_before(before):
        out = graph.graph_copy(sub.graph, val_map)
    inserted += [val_map[n] for n in sub.graph.nodes
                 if n.op not in ("placeholder", "get_attr", "output")]
    port_provenance(source, inserted)
    flat_out = list(out) if isinstance(out, (list, tuple)) else [out]
    return flat_out, inserted


def _fresh_name(owner: torch.nn.Module, name: str) -> str:
    base, k = name, 1
    while hasattr(owner, name):
        name, k = f"{base}_{k}", k + 1
    return name


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
    source: fx.Node | None = None,
) -> Spliced:
    """Trace ``fn(*fake values of args)`` and `graft` its graph in; returns the flat output nodes.

    Every inserted node gets ``role`` (``output_roles[i]`` = ``(role, target)`` overrides it for
    the i-th flat output) and ``by_pass``. Outputs that are one of ``args`` are returned as they
    are and keep their own role. The copy goes before ``before`` (default: right after the last
    argument, past the placeholders) and keeps the traced order. The inserted nodes take the
    provenance of ``source`` (default: `provenance_source`). The result is a list of the
    outputs whose ``inserted`` attribute lists every node added.
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
    if source is None:
        source = provenance_source(graph, args, before)
    flat_out, inserted = graft(graph, sub, args, anchor, const_prefix=f"_dls_const_{by_pass}",
                               source=source)
    for node in inserted:
        roles.set_role(node, role, by_pass=by_pass)
    arg_set = set(args)
    for i, node in enumerate(flat_out):
        if output_roles is None or output_roles[i] is None or node in arg_set:
            continue
        r, t = output_roles[i]
        roles.set_role(node, r, t, by_pass=by_pass)
    return Spliced(flat_out, inserted)


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
    role: str | None,
    by_pass: str,
    target_name: str | None = None,
    source: fx.Node | None = None,
    fake: bool = True,
) -> fx.Node:
    """Insert one ``call_function`` node before ``before``, with its fake value computed.

    The node gets ``role`` (and ``target_name``) and ``by_pass``; ``role=None`` is for a step
    inside a rewrite that stands for no value of the contract (only ``by_pass`` is recorded).
    It takes the provenance of ``source`` (default: `provenance_source` of its arguments).
    ``fake=False`` is for a graph that carries no fake values at all (``symbolic_trace``): the
    node gets none either.
    """
    kwargs = kwargs or {}
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    if fake:
        set_fake_val(node)
    if role is not None:
        roles.set_role(node, role, target_name, by_pass=by_pass)
    else:
        node.meta.setdefault("custom", {})[roles.PASS_KEY] = by_pass
    port_provenance(source if source is not None else provenance_source(graph, [args, kwargs], before),
                    [node])
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
        node.meta["tensor_meta"] = _extract_tensor_metadata(v)


def add_input(graph: fx.Graph, name: str, value: torch.Tensor, *, role: str | None = None,
              target: str | None = None, before: fx.Node | None = None) -> fx.Node:
    """A new graph input (placeholder) named ``name``, after the last one (or ``before``).

    ``splice`` and ``insert_op`` make computed nodes only; a pass that needs a new input (a
    buffer the step feeds, the loss scale, a lifted constant) makes it here. Its ``val`` is
    ``value`` in the fake mode of the graph's inputs (``value`` itself when it is already a
    fake tensor, or when the graph has no fake values), so rule 1 of the contract (every node
    has a fake value) holds for it; with ``role`` it gets that role and ``target``.
    """
    placeholders = list(graph.find_nodes(op="placeholder"))
    anchor = graph.inserting_before(before) if before is not None else graph.inserting_after(placeholders[-1])
    with anchor:
        node = graph.placeholder(name)
    if not isinstance(value, FakeTensor):
        mode = detect_fake_mode([p.meta.get("val") for p in placeholders])
        value = mode.from_tensor(value) if mode is not None else value
    node.meta["val"] = value
    if role is not None:
        roles.set_role(node, role, target)
    return node
