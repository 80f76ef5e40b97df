"""DropUnchangedOutputsPass: every update output that returns its own placeholder unchanged is removed, with its output role."""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.graph import roles


class DropUnchangedOutputsPass(PassBase):
    """An output that is the placeholder it updates declares no mutation (an ``ExportedProgram``
    mutation output must be a computed value); the input keeps its value without it."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        source = {(roles.role_of(n), roles.target_of(n)): n for n in graph.find_nodes(op="placeholder")}
        vals, out_roles = roles.output_values(graph), roles.output_roles(graph)
        kept = [(v, (role, target)) for v, (role, target) in zip(vals, out_roles, strict=True)
                if source.get((roles.SOURCE_OF_UPDATE.get(role), target)) is not v]
        if len(kept) == len(vals):
            return PassResult(gm, False)
        graph.output_node().args = (tuple(v for v, _ in kept),)
        roles.set_output_roles(graph, [r for _, r in kept])
        graph.lint()
        gm.recompile()
        return PassResult(gm, True)
