"""CloneSharedOutputsPass: an output that is a placeholder, or a value an earlier position already returns, becomes ``clone(value)``."""

from __future__ import annotations

import torch
import torch.fx as fx

from dlspass.graph import roles
from dlspass.graph.splice import insert_op
from dlspass.passes.base import GraphPass, GraphPassResult, set_outputs


class CloneSharedOutputsPass(GraphPass):
    """Give every output position a node of its own: an ``ExportedProgram`` signature names
    its outputs by node, so one node cannot stand for two outputs nor for an input. The clone
    takes the position's role and target. ``stats["cloned"]``: the clones added."""

    name = "clone_shared_outputs"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        out = graph.output_node()
        vals, seen = roles.output_values(graph), set()
        clones: dict[int, fx.Node] = {}
        for i, (role, target) in enumerate(roles.output_roles(graph)):
            v = vals[i]
            if v in seen or v.op == "placeholder":
                clones[i] = insert_op(graph, torch.ops.aten.clone.default, (v,), before=out,
                                      role=role, by_pass=self.name, target_name=target)
            seen.add(clones.get(i, v))
        set_outputs(graph, clones)
        return GraphPassResult(gm, bool(clones), {"cloned": len(clones)})
