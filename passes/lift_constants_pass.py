"""LiftConstantsPass: each tensor ``get_attr`` node becomes a placeholder ``c_<name>`` before the first INPUT placeholder."""

from __future__ import annotations

import torch.fx as fx
from torch import Tensor
from torch._guards import detect_fake_mode
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.graph import roles
from dlspass.graph.splice import _first_non_placeholder
from dlspass.graph.step_io import safe_name
from dlspass.passes.base import PassContractError


class LiftConstantsPass(PassBase):
    """Make the constants the passes created graph inputs, as an ``ExportedProgram`` declares
    them (CONSTANT_TENSOR inputs); ``constants`` maps each new placeholder's name to a copy of
    its value. A ``get_attr`` of anything but a tensor cannot be lifted: ``PassContractError``.
    """

    def __init__(self) -> None:
        self.constants: dict[str, Tensor] = {}

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        first_input = next((n for n in graph.find_nodes(op="placeholder")
                            if roles.role_of(n) == roles.INPUT), None)
        for node in list(graph.nodes):
            if node.op != "get_attr":
                continue
            value = getattr(gm, node.target)
            if not isinstance(value, Tensor):
                raise PassContractError(f"cannot package get_attr {node.target!r} of type "
                                        f"{type(value).__name__}")
            anchor = first_input if first_input is not None else _first_non_placeholder(graph)
            with graph.inserting_before(anchor):
                ph = graph.placeholder(f"c_{safe_name(node.target)}")
            ph.meta.update(node.meta)
            if "val" not in ph.meta:
                mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")
                                         if isinstance(n.meta.get("val"), Tensor)])
                ph.meta["val"] = mode.from_tensor(value) if mode is not None else value
            node.replace_all_uses_with(ph)
            graph.erase_node(node)
            self.constants[ph.name] = value.detach().clone()
        return PassResult(gm, bool(self.constants))
