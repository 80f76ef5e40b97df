"""CloneSharedOutputsPass: an output that is a placeholder, or a value an earlier position already returns, becomes ``clone(value)``."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.graph import roles
from dlspass.graph.splice import set_fake_val


class CloneSharedOutputsPass(PassBase):
    """Give every output position a node of its own: an ``ExportedProgram`` signature names
    its outputs by node, so one node cannot stand for two outputs nor for an input. The clone
    takes the position's role and target."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        out = graph.output_node()
        vals, seen, modified = roles.output_values(graph), set(), False
        for i, (role, target) in enumerate(roles.output_roles(graph)):
            v = vals[i]
            if v in seen or v.op == "placeholder":
                with graph.inserting_before(out):
                    vals[i] = graph.call_function(torch.ops.aten.clone.default, (v,))
                set_fake_val(vals[i])
                roles.set_role(vals[i], role, target)
                modified = True
            seen.add(vals[i])
        if modified:
            out.args = (tuple(vals),)
            graph.lint()
            gm.recompile()
        return PassResult(gm, modified)
