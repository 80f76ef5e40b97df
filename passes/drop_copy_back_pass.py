"""DropCopyBackPass: each ``copy_(dst, src)`` functionalize left in the graph becomes ``src`` (later readers of ``dst`` read ``src``)."""

from __future__ import annotations

import torch
import torch.fx as fx

from dlspass.passes.base import GraphPass, GraphPassResult, PassContractError


class DropCopyBackPass(GraphPass):
    """Make a traced step free of mutation: ``torch.func.functionalize`` leaves a trailing
    ``copy_(clone, new)`` for the buffers the capture clones inside the vjp (BatchNorm updates
    its running statistics in place); ``new`` itself is the value every later reader wants.

    A copy between values of different shape or dtype cannot be replaced by its source:
    ``PassContractError`` names it. ``stats["dropped"]``: the copies removed.
    """

    name = "drop_copy_back"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        dropped = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
                continue
            dst, src = node.args[:2]
            dv, sv = dst.meta.get("val"), src.meta.get("val")
            if dv is None or sv is None or dv.shape != sv.shape or dv.dtype != sv.dtype:
                raise PassContractError(f"cannot functionalize the in-place copy {node.name}")
            for user in list(dst.users):
                if user is not node and order[user] > order[node]:
                    user.replace_input_with(dst, src)
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            dropped += 1
        dead = graph.eliminate_dead_code()
        return GraphPassResult(gm, bool(dropped) or dead, {"dropped": dropped})
