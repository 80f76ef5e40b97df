"""ExposeSeedPass: the marked backward seed of a joint graph (``full_like(loss, 1)``) becomes a placeholder input, so the caller feeds the seed."""

from __future__ import annotations

import torch.fx as fx

from dlspass.graph import roles
from dlspass.graph.marks import MARK_OP
from dlspass.graph.splice import add_input
from dlspass.passes.base import GraphPass, GraphPassResult, PassContractError


class ExposeSeedPass(GraphPass):
    """Replace the ``dlspass::mark(seed, "backward_seed")`` node and the seed it marks by a
    placeholder ``input_name`` after the last placeholder (with the seed's fake value). A graph
    that already has that placeholder and no marked seed is left as it is."""

    name = "expose_seed"

    def __init__(self, input_name: str) -> None:
        self.input_name = input_name

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        marks = [n for n in graph.find_nodes(op="call_function", target=MARK_OP) if n.args[1] == roles.SEED]
        placeholders = graph.find_nodes(op="placeholder")
        if not marks and any(p.name == self.input_name for p in placeholders):
            return GraphPassResult(gm, False, {"exposed": 0})
        if len(marks) != 1:
            raise PassContractError(f"{self.name}: {len(marks)} marked backward seeds (expected one)")
        mark = marks[0]
        seed = mark.args[0]
        ph = add_input(graph, self.input_name, seed.meta["val"])
        mark.replace_all_uses_with(ph)
        graph.erase_node(mark)
        graph.erase_node(seed)
        return GraphPassResult(gm, True, {"exposed": 1})
