"""DropNoneGetitemsPass: every unused ``getitem`` node whose value is None (no ``meta["val"]``) is erased."""

from __future__ import annotations

import operator

import torch.fx as fx

from dlspass.passes.base import GraphPass, GraphPassResult


class DropNoneGetitemsPass(GraphPass):
    """``make_fx`` keeps ``convolution_backward(...)[0]`` for an input that needs no gradient
    (the op returns None there); the ExportedProgram verifier refuses a node without a value.
    ``stats["dropped"]``: the nodes erased."""

    name = "drop_none_getitems"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        dropped = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.getitem
                   and not n.users and n.meta.get("val") is None]
        for node in dropped:
            graph.erase_node(node)
        return GraphPassResult(gm, bool(dropped), {"dropped": len(dropped)})
