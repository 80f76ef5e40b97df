"""Assemble an ``ExportedProgram`` from a graph module and its signature: the one place dlspass
builds ``ExportGraphSignature`` + ``ModuleCallSignature`` + ``ExportedProgram`` by hand.

Used to package a rewritten step (``dlspass.capture.joint_step.package_step``) and to relabel a
step or joint program for the ONNX exporter (``dlspass.onnx.convert``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.utils._pytree import TreeSpec, tree_flatten

from dlspass.graph import roles


def flat_tuple_spec(n: int) -> TreeSpec:
    """The pytree spec of a flat tuple of ``n`` values."""
    return tree_flatten(tuple(range(n)))[1]


def user_outputs(graph: fx.Graph) -> list[OutputSpec]:
    """Every value ``graph`` returns as a USER_OUTPUT (the ONNX exporter drops the other kinds)."""
    return [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(v.name), None)
            for v in roles.output_values(graph)]


def make_program(gm: fx.GraphModule, input_specs: Sequence[InputSpec],
                 output_specs: Sequence[OutputSpec], *, state_dict: dict[str, torch.Tensor],
                 constants: dict[str, Any], in_spec: TreeSpec | None, out_spec: TreeSpec,
                 forward_arg_names: list[str] | None) -> ExportedProgram:
    """An ``ExportedProgram`` running ``gm`` with this signature, as one root module call
    (no range constraints, no example inputs)."""
    sig = ExportGraphSignature(input_specs=list(input_specs), output_specs=list(output_specs))
    call = ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec,
                               forward_arg_names=forward_arg_names)
    return ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=sig, state_dict=state_dict, range_constraints={},
        module_call_graph=[ModuleCallEntry(fqn="", signature=call)], example_inputs=None,
        constants=constants)
