"""ExposeSeedPass: the marked backward seed of a joint graph (``full_like(loss, 1)``) becomes a placeholder input, so the caller feeds the seed."""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.graph import roles
from dlspass.graph.marks import MARK_OP
from dlspass.passes.base import PassContractError


class ExposeSeedPass(PassBase):
    """Replace the ``dlspass::mark(seed, "backward_seed")`` node and the seed it marks by a
    placeholder ``name`` after the last placeholder (with the seed's fake value). A graph
    that already has that placeholder and no marked seed is left as it is."""

    def __init__(self, name: str) -> None:
        self.name = name

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        marks = [n for n in graph.find_nodes(op="call_function", target=MARK_OP) if n.args[1] == roles.SEED]
        placeholders = graph.find_nodes(op="placeholder")
        if not marks and any(p.name == self.name for p in placeholders):
            return PassResult(gm, False)
        if len(marks) != 1:
            raise PassContractError(f"expose_seed: {len(marks)} marked backward seeds (expected one)")
        mark = marks[0]
        seed = mark.args[0]
        with graph.inserting_after(placeholders[-1]):
            ph = graph.placeholder(self.name)
        ph.meta["val"] = seed.meta["val"]
        mark.replace_all_uses_with(ph)
        graph.erase_node(mark)
        graph.erase_node(seed)
        graph.lint()
        gm.recompile()
        return PassResult(gm, True)
