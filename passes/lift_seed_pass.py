"""LiftSeedPass: the marked backward seed becomes a graph input (a placeholder after the last one) that every reader of the seed reads."""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.graph.marks import MARK_OP
from dlspass.passes.base import PassContractError


class LiftSeedPass(PassBase):
    """Turn a joint graph's seed (marked by ``MarkSeedPass``) into the input ``name``: a graph
    exported without its optimizer (ONNX) leaves scaling the seed to whoever runs it, and a
    constant inside the graph could not be found again. The marker and the seed are erased."""

    def __init__(self, name: str) -> None:
        self.name = name

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        marks = [n for n in graph.nodes if n.op == "call_function" and n.target is MARK_OP]
        if not marks:
            raise PassContractError("lift_seed: the graph has no marked backward seed")
        mark = marks[0]
        seed = mark.args[0]
        with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
            ph = graph.placeholder(self.name)
        ph.meta["val"] = seed.meta["val"]
        mark.replace_all_uses_with(ph)
        graph.erase_node(mark)
        graph.erase_node(seed)
        graph.lint()
        gm.recompile()
        return PassResult(gm, True)
