"""LiftConstantsPass: each tensor ``get_attr`` node becomes a placeholder ``c_<name>`` before the first INPUT placeholder."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch.fx as fx
from torch import Tensor

from dlspass.graph import roles
from dlspass.graph.splice import add_input
from dlspass.graph.step_io import safe_name
from dlspass.passes.base import GraphPass, GraphPassResult, PassContractError


class LiftedConstants(GraphPassResult):
    """What `LiftConstantsPass` returns: the pass result plus ``constants``, each new
    placeholder's name mapped to a copy of its value (``stats["constants"]`` counts them)."""

    constants: dict[str, Tensor]

    def __new__(cls, graph_module: fx.GraphModule, constants: Mapping[str, Tensor]) -> LiftedConstants:
        self = super().__new__(cls, graph_module, bool(constants), {"constants": len(constants)})
        self.constants = dict(constants)
        return self


class LiftConstantsPass(GraphPass):
    """Make the constants the passes created graph inputs, as an ``ExportedProgram`` declares
    them (CONSTANT_TENSOR inputs). A ``get_attr`` of anything but a tensor cannot be lifted:
    ``PassContractError``. Calling it returns `LiftedConstants`.
    """

    name = "lift_constants"

    def __call__(self, graph_module: fx.GraphModule) -> LiftedConstants:
        return cast(LiftedConstants, super().__call__(graph_module))

    def run(self, gm: fx.GraphModule) -> LiftedConstants:
        graph = gm.graph
        placeholders = graph.find_nodes(op="placeholder")
        first_input = next((n for n in placeholders if roles.role_of(n) == roles.INPUT), None)
        # after the parameters and state, or at the end of the inputs when there is no batch
        anchor = first_input if first_input is not None else _after_placeholders(graph)
        constants: dict[str, Tensor] = {}
        for node in list(graph.nodes):
            if node.op != "get_attr":
                continue
            value = getattr(gm, node.target)
            if not isinstance(value, Tensor):
                raise PassContractError(f"cannot package get_attr {node.target!r} of type "
                                        f"{type(value).__name__}")
            ph = add_input(graph, f"c_{safe_name(node.target)}", node.meta.get("val", value),
                           before=anchor)
            ph.meta.update(node.meta)
            node.replace_all_uses_with(ph)
            graph.erase_node(node)
            constants[ph.name] = value.detach().clone()
        return LiftedConstants(gm, constants)


def _after_placeholders(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op != "placeholder")
