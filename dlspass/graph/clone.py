"""``clone_step_graph``: a copy of a role-tagged step graph that shares no role metadata with it."""

from __future__ import annotations

import copy

import torch.fx as fx


def clone_step_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm`` that a pass may rewrite without touching ``gm``.

    ``copy.deepcopy`` of a GraphModule copies each node's ``meta`` dict but not the dicts in
    it, so the copy would share ``meta["custom"]`` (roles, targets, the recorded config) with
    the original: a pass re-tagging a node of the copy, or ``apply_dls`` recording its config
    there, would change the original too (which then reads as already rewritten).
    """
    clone = copy.deepcopy(gm)
    for node in clone.graph.nodes:
        if "custom" in node.meta:
            node.meta["custom"] = copy.deepcopy(node.meta["custom"])
    return clone
