"""WriteUpdatesInPlacePass: each parameter, optimizer-state and scaler-state output becomes `copy_(its placeholder, new value)`, so the step writes its updates into its inputs' storage."""

from __future__ import annotations

import torch
import torch.fx as fx

from dlspass.graph import roles
from dlspass.graph.splice import insert_op
from dlspass.passes.base import GraphPass, GraphPassResult, set_outputs

# the placeholder role an update output writes back to (buffers are not written in place:
# a compiled step's graph has no BUFFER placeholders)
SOURCE_OF = {upd: src for upd, src in roles.SOURCE_OF_UPDATE.items() if upd != roles.BUFFER_UPDATE}


class WriteUpdatesInPlacePass(GraphPass):
    """End the graph with ``copy_(placeholder, new)`` for every updated parameter and state.

    AOTAutograd returns a training graph's input mutations as outputs and copies each one back
    outside the graph, one eager ``copy_`` per parameter and state tensor per step. Written in
    the graph, the updates land in the inputs' own storage (inside the fused update kernels
    under inductor); the outputs become those inputs, so AOT's copy back is a copy of a tensor
    onto itself, which does nothing. Run after ``apply_dls``: the passes read the functional
    form. Each ``copy_`` carries its output's role and target; ``stats["moved"]`` is the number
    of updates moved.
    """

    name = "write_updates_in_place"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        source = {(roles.role_of(n), roles.target_of(n)): n for n in graph.find_nodes(op="placeholder")}
        out = graph.output_node()
        vals = roles.output_values(graph)
        moved: dict[int, fx.Node] = {}
        for i, (role, target) in enumerate(roles.output_roles(graph)):
            ph = source.get((SOURCE_OF.get(role), target))
            v = vals[i]
            if ph is None or v is ph or not isinstance(v, fx.Node) or _writes(v, ph):
                continue  # nothing to write, or written already (a second run changes nothing)
            # copy_ returns its destination: its fake value is the placeholder's
            moved[i] = insert_op(graph, torch.ops.aten.copy_.default, (ph, v), before=out,
                                 role=role, by_pass=self.name, target_name=target)
        set_outputs(graph, moved)
        return GraphPassResult(gm, bool(moved), {"moved": len(moved)})


def _writes(node: fx.Node, ph: fx.Node) -> bool:
    return node.target is torch.ops.aten.copy_.default and node.args[0] is ph
