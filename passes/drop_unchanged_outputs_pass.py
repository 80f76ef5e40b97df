"""DropUnchangedOutputsPass: every update output that returns its own placeholder unchanged is removed, with its output role."""

from __future__ import annotations

import torch.fx as fx

from dlspass.graph import roles
from dlspass.passes.base import GraphPass, GraphPassResult


class DropUnchangedOutputsPass(GraphPass):
    """An output that is the placeholder it updates declares no mutation (an ``ExportedProgram``
    mutation output must be a computed value); the input keeps its value without it.
    ``stats["dropped"]``: the outputs removed."""

    name = "drop_unchanged_outputs"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        source = {(roles.role_of(n), roles.target_of(n)): n for n in graph.find_nodes(op="placeholder")}
        vals, out_roles = roles.output_values(graph), roles.output_roles(graph)
        kept = [(v, (role, target)) for v, (role, target) in zip(vals, out_roles, strict=True)
                if source.get((roles.SOURCE_OF_UPDATE.get(role), target)) is not v]
        dropped = len(vals) - len(kept)
        if dropped:
            # fewer outputs: a change of the output node itself, which splice does not make
            graph.output_node().args = (tuple(v for v, _ in kept),)
            roles.set_output_roles(graph, [r for _, r in kept])
        return GraphPassResult(gm, bool(dropped), {"dropped": dropped})
