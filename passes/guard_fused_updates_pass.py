"""GuardFusedUpdatesPass: a fused optimizer kernel's guarded outputs skip through the kernel's own ``found_inf`` instead of ``where(isfinite, new, old)``."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dlspass.graph import roles
from dlspass.graph.splice import insert_op
from dlspass.passes.base import GraphPass, GraphPassResult, global_node, set_outputs

aten = torch.ops.aten
_getitem = operator.getitem

# torch's fused multi-tensor optimizer kernels, functional form (what AOTAutograd leaves of the
# in-place ones): each returns its tensor-list inputs unchanged when ``found_inf`` is 1
FUSED_KERNELS = (aten._fused_adam.default, aten._fused_adam.tensor_lr,
                 aten._fused_adamw.default, aten._fused_adamw.tensor_lr)
# the kernel's outputs that are updates (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs), at the
# index of the input list each one updates; output 1 (the gradients) is no update
UPDATED_LISTS = (0, 2, 3, 4)


class GuardFusedUpdatesPass(GraphPass):
    """Give each fused optimizer kernel the step's overflow flag as its ``found_inf`` and drop
    the ``where(isfinite, new, old)`` guards on its outputs.

    torch's fused Adam/AdamW kernels leave every parameter and state tensor as it was when
    ``found_inf`` is 1 (torch.amp's fused path relies on it), so the kernel's output is then its
    input, the guard's ``old``: the guard selects what the kernel already returns. Without it the
    compiler has one elementwise select per parameter and state tensor fewer to schedule and
    generate code for. A guard is dropped only where its ``old`` is the very input the kernel
    updates into its ``new``; the step counts, computed outside the kernel, keep theirs.

    Runs after ``verify`` (whose contract is the ``where`` form), on a step graph with a dynamic
    scale; a graph without an overflow flag or without a fused kernel is left alone.
    ``stats["kernels"]`` counts the kernels given the flag, ``stats["guards"]`` the guards dropped.
    """

    name = "guard_fused_updates"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        isfinite = global_node(graph, roles.ISFINITE)
        kernels = [n for n in graph.nodes if n.op == "call_function" and n.target in FUSED_KERNELS
                   and n.kwargs.get("found_inf") is None]
        if isfinite is None or not kernels:
            return GraphPassResult(gm, False, {"kernels": 0, "guards": 0})
        values = roles.output_values(graph)
        dropped: dict[int, fx.Node] = {}
        flagged = 0
        found_inf: fx.Node | None = None
        for kernel in kernels:
            updates = _updates_of(kernel)
            mine = {}
            for i, v in enumerate(values):
                new = _guarded_update(v, isfinite, updates, kernel)
                if new is not None:
                    mine[i] = new
            if not mine:
                continue
            if found_inf is None:
                found_inf = _found_inf(graph, isfinite, self.name)
            _move_after(kernel, found_inf)
            kernel.kwargs = {**kernel.kwargs, "found_inf": found_inf}
            dropped.update(mine)
            flagged += 1
        if not dropped:
            return GraphPassResult(gm, False, {"kernels": 0, "guards": 0})
        guards = [values[i] for i in dropped]
        set_outputs(graph, dropped)
        for guard in guards:
            if not guard.users:
                graph.erase_node(guard)
        return GraphPassResult(gm, True, {"kernels": flagged, "guards": len(dropped)})


def _updates_of(kernel: fx.Node) -> dict[fx.Node, tuple[int, int]]:
    """``{node: (list, position)}`` for the kernel's update outputs (``out[list][position]``)."""
    found: dict[fx.Node, tuple[int, int]] = {}
    for outer in kernel.users:
        if outer.target is not _getitem or outer.args[1] not in UPDATED_LISTS:
            continue
        for inner in outer.users:
            if inner.target is _getitem:
                found[inner] = (outer.args[1], inner.args[1])
    return found


def _guarded_update(v: object, isfinite: fx.Node, updates: dict[fx.Node, tuple[int, int]],
                    kernel: fx.Node) -> fx.Node | None:
    """The guard's ``new`` when ``v`` is ``where(isfinite, new, old)`` with ``new`` the kernel's
    update of the very input ``old``; else None."""
    if not (isinstance(v, fx.Node) and v.target is aten.where.self and roles.role_of(v) == roles.GUARD):
        return None
    cond, new, old = v.args
    src = peel(new)
    if cond is not isfinite or src not in updates:
        return None
    lst, pos = updates[src]
    inputs = kernel.args[lst] if lst < len(kernel.args) else None
    if not isinstance(inputs, (list, tuple)) or pos >= len(inputs) or peel(inputs[pos]) is not peel(old):
        return None
    return new


def peel(node: object) -> object:
    """``node`` without the identities tracing leaves around a value: ``alias``, and the
    functional ``copy(dst, src)`` of an in-place update (its value is ``src``)."""
    while isinstance(node, fx.Node):
        if node.target is aten.alias.default:
            node = node.args[0]
        elif node.target is aten.copy.default:
            node = node.args[1]
        else:
            break
    return node


def _found_inf(graph: fx.Graph, isfinite: fx.Node, by_pass: str) -> fx.Node:
    """``float32(not isfinite)`` right after the flag: the kernels' ``found_inf``."""
    after = isfinite.next
    bad = insert_op(graph, aten.bitwise_not.default, (isfinite,), before=after, role=None, by_pass=by_pass)
    return insert_op(graph, aten._to_copy.default, (bad,), {"dtype": torch.float32}, before=after,
                     role=None, by_pass=by_pass)


def _move_after(kernel: fx.Node, anchor: fx.Node) -> None:
    """Place ``kernel``, and whatever between it and ``anchor`` reads it, after ``anchor`` when
    it came before: the kernel then reads the flag. What moves keeps its order, and read only
    nodes before it or moved with it; ``anchor`` does not read the kernel (the flag is computed
    from the gradients the kernel reads)."""
    moved: list[fx.Node] = []
    reads_kernel = {kernel}
    node = kernel
    while node is not anchor:
        if node is kernel or any(a in reads_kernel for a in node.all_input_nodes):
            reads_kernel.add(node)
            moved.append(node)
        node = node.next
        if node.op == "output":
            return  # the anchor came first: nothing to move
    tail = anchor
    for node in moved:
        tail.append(node)
        tail = node
