"""DropNoneGetitemsPass: every unused ``getitem`` node whose value is None (no ``meta["val"]``) is erased."""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult


class DropNoneGetitemsPass(PassBase):
    """``make_fx`` keeps ``convolution_backward(...)[0]`` for an input that needs no gradient
    (the op returns None there); the ExportedProgram verifier refuses a node without a value."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        dropped = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.getitem
                   and not n.users and n.meta.get("val") is None]
        for node in dropped:
            graph.erase_node(node)
        return PassResult(gm, bool(dropped))
