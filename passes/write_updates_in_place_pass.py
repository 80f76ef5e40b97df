"""WriteUpdatesInPlacePass: each parameter, optimizer-state and scaler-state output becomes `copy_(its placeholder, new value)`, so the step writes its updates into its inputs' storage."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.graph import roles
from dlspass.passes.base import set_outputs

# the placeholder role an update output writes back to (buffers are not written in place:
# a compiled step's graph has no BUFFER placeholders)
SOURCE_OF = {upd: src for upd, src in roles.SOURCE_OF_UPDATE.items() if upd != roles.BUFFER_UPDATE}


class WriteUpdatesInPlacePass(PassBase):
    """End the graph with ``copy_(placeholder, new)`` for every updated parameter and state.

    AOTAutograd returns a training graph's input mutations as outputs and copies each one back
    outside the graph, one eager ``copy_`` per parameter and state tensor per step. Written in
    the graph, the updates land in the inputs' own storage (inside the fused update kernels
    under inductor); the outputs become those inputs, so AOT's copy back is a copy of a tensor
    onto itself, which does nothing. Run after ``apply_dls``: the passes read the functional
    form. ``moved`` is the number of updates the last call moved.
    """

    def __init__(self) -> None:
        self.moved = 0

    def call(self, gm: fx.GraphModule) -> PassResult:
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
            with graph.inserting_before(out):
                moved[i] = graph.call_function(torch.ops.aten.copy_.default, (ph, v))
            # copy_ returns its destination: the placeholder's value
            moved[i].meta["val"] = ph.meta.get("val")
        set_outputs(graph, moved)
        graph.lint()
        gm.recompile()
        self.moved = len(moved)
        return PassResult(gm, bool(moved))


def _writes(node: fx.Node, ph: fx.Node) -> bool:
    return node.target is torch.ops.aten.copy_.default and node.args[0] is ph
