"""MarkSeedPass: the joint graph's backward seed ``full_like(loss, 1)`` is read through ``dlspass::mark(seed, "backward_seed")``."""

from __future__ import annotations

import torch.fx as fx

from dlspass.errors import InputValueError
from dlspass.graph import roles
from dlspass.graph.marks import MARK_OP
from dlspass.graph.splice import insert_op
from dlspass.passes.base import GraphPass, GraphPassResult


def joint_seeds(graph: fx.Graph, loss_name: str) -> list[fx.Node]:
    """The ``full_like``/``ones_like`` nodes of the loss named ``loss_name`` (one in a joint
    graph from ``torch.export``: the backward seed)."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in roles.SEED_OPS
            and n.args and getattr(n.args[0], "name", None) == loss_name]


class MarkSeedPass(GraphPass):
    """Mark the seed of a joint forward-backward graph, so that tracing the graph into a step
    (``make_fx`` + ``resolve_marks``) gives it the SEED role: torch.export's joint graph makes
    the seed a constant-like node nothing else names. A program without exactly one seed of
    its loss is the user's input (a joint program that is no training step): an input error.
    """

    name = "mark_seed"

    def __init__(self, loss_name: str) -> None:
        self.loss_name = loss_name

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        seeds = joint_seeds(graph, self.loss_name)
        if len(seeds) != 1:
            raise InputValueError(f"cannot find the backward seed full_like({self.loss_name}, 1) "
                                  f"(found {len(seeds)})")
        seed = seeds[0]
        # the marker carries the role until resolve_marks moves it onto the seed
        marked = insert_op(graph, MARK_OP, (seed, roles.SEED, ""), before=seed.next, role=None,
                           by_pass=self.name, source=seed)
        seed.replace_all_uses_with(marked, delete_user_cb=lambda u: u is not marked)
        return GraphPassResult(gm, True)
