"""ExpandBoolWherePass: ``where(c, a, b)`` on bool tensors becomes ``(c & a) | (~c & b)`` (onnxruntime's CPU Where has no bool kernel)."""

from __future__ import annotations

import torch
import torch.fx as fx

from dlspass.graph.splice import insert_op
from dlspass.passes.base import GraphPass, GraphPassResult

_aten = torch.ops.aten


class ExpandBoolWherePass(GraphPass):
    """Replace every bool-valued ``aten.where.self`` by logic ops; its ``custom`` meta (roles)
    moves to the final ``logical_or``. Needs fake values (``meta["val"]``) on the graph.
    ``stats["expanded"]``: the ``where`` nodes replaced."""

    name = "expand_bool_where"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        wheres = [n for n in graph.find_nodes(op="call_function", target=_aten.where.self)
                  if getattr(n.meta.get("val"), "dtype", None) == torch.bool]
        for node in wheres:
            c, a, b = node.args

            def op(target: torch._ops.OpOverload, *args: fx.Node, where: fx.Node = node) -> fx.Node:
                return insert_op(graph, target, args, before=where, role=None, by_pass=self.name,
                                 source=where)

            c_and_a = op(_aten.logical_and.default, c, a)
            not_c_and_b = op(_aten.logical_and.default, op(_aten.logical_not.default, c), b)
            out = op(_aten.logical_or.default, c_and_a, not_c_and_b)
            out.meta["custom"] = dict(node.meta.get("custom", {}))
            node.replace_all_uses_with(out)
            graph.erase_node(node)
        return GraphPassResult(gm, bool(wheres), {"expanded": len(wheres)})
