"""ExpandBoolWherePass: ``where(c, a, b)`` on bool tensors becomes ``(c & a) | (~c & b)`` (onnxruntime's CPU Where has no bool kernel)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.graph.splice import set_fake_val

_aten = torch.ops.aten


class ExpandBoolWherePass(PassBase):
    """Replace every bool-valued ``aten.where.self`` by logic ops; its ``custom`` meta (roles)
    moves to the final ``logical_or``. Needs fake values (``meta["val"]``) on the graph."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        wheres = [n for n in graph.find_nodes(op="call_function", target=_aten.where.self)
                  if getattr(n.meta.get("val"), "dtype", None) == torch.bool]
        for node in wheres:
            c, a, b = node.args
            with graph.inserting_before(node):
                c_and_a = _logic(graph, _aten.logical_and.default, c, a)
                not_c_and_b = _logic(graph, _aten.logical_and.default,
                                     _logic(graph, _aten.logical_not.default, c), b)
                out = _logic(graph, _aten.logical_or.default, c_and_a, not_c_and_b)
            out.meta["custom"] = dict(node.meta.get("custom", {}))
            node.replace_all_uses_with(out)
            graph.erase_node(node)
        if wheres:
            graph.lint()
            gm.recompile()
        return PassResult(gm, bool(wheres))


def _logic(graph: fx.Graph, target: torch._ops.OpOverload, *args: fx.Node) -> fx.Node:
    """``target(*args)`` at the graph's insertion point, with its fake value."""
    node = graph.call_function(target, args)
    set_fake_val(node)
    return node
