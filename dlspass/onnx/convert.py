"""ONNX output (and the input check) for the CLI: a dlspass training step that onnxruntime runs.

``save_step_onnx(step, meta, path)`` exports the ``ExportedProgram`` of a dlspass step:

1. emulated rounding (``dlspass::round_to_format``) becomes its float-only form
   (``dlspass.formats.round_arith``: ``log2``/``exp2``/``round``), which ONNX can express, and
   ``where`` on bool tensors (the guard of SGD's momentum marker) becomes logic ops, which
   onnxruntime's CPU kernels cover;
2. every output is relabelled USER_OUTPUT and the module's ``out_spec`` made a flat tuple (the
   dynamo exporter drops LOSS/MUTATION outputs and silently emits an empty model otherwise);
3. ``torch.onnx.export(..., dynamo=True)``; then every initializer (parameters, optimizer state,
   scaler state, lr) is promoted to a graph input with onnx_ir, so a caller feeds the state in and
   the updated state back: output ``<name>.new`` is the next value of input ``<name>``, and the
   last output ``loss`` is the loss;
4. roles, the DLS config and the tied parameter names (``"tied"``) go to the model's
   ``metadata_props`` (``dlspass.json``).

ONNX *input*: ``joint_to_onnx`` writes a joint program as an ONNX training graph (outputs
``loss`` and ``grad.<param>``, the backward seed as the input ``loss_seed``, roles in
``metadata_props``); ``transform_onnx`` lowers its precision and adds DLS with two onnx_ir
passes: ``LowerPrecisionOnnxPass`` (``passes/lower_precision_onnx_pass.py``) rounds every float
input and output of MatMul/Gemm/Conv/ConvTranspose (forward and backward) to the 16-bit format
in fp32 containers, like the FX ``LowerPrecisionPass``: ``Cast`` down and up for
float16/bfloat16, the exact float-only ``round_arith`` (exported by torch, copied per value)
for cbfloat16. ``InsertDLSOnnxPass`` (``passes/insert_dls_onnx_pass.py``) adds DLS to such a
graph: seed × scale, then the gradients are unscaled, checked and clipped and the scaler state
updated by ``dls_tail`` and ``update_state`` exported from torch (the same code the FX passes
splice in) and grafted onto the graph. A constant seed inside a foreign graph cannot be
identified post hoc, so the seed must be a tagged input; there is no optimizer in such a graph,
so skipping is the caller's: apply the update only when the output ``dlspass_isfinite`` is True.
Loading and checking a user's ONNX file is ``dlspass.onnx.files``'s.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import torch
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, TensorArgument
from torch.utils._pytree import tree_flatten

from dlspass.capture.joint_step import joint_graph
from dlspass.capture.program import flat_tuple_spec, make_program, user_outputs
from dlspass.config import DLSConfig
from dlspass.errors import GraphContractError, InputValueError
from dlspass.files.atomic_write import write_atomic
from dlspass.files.file_meta import META_FILE
from dlspass.files.quiet import quiet_torch
from dlspass.graph import roles
from dlspass.onnx.files import (
    check_onnx,
    gradient_outputs,
    inline_external_data,
    load_onnx,
    onnx_meta,
)
from dlspass.passes.decompose_rounding_pass import DecomposeRoundingPass
from dlspass.passes.expand_bool_where_pass import ExpandBoolWherePass
from dlspass.passes.expose_seed_pass import ExposeSeedPass
from dlspass.passes.insert_dls_onnx_pass import InsertDLSOnnxPass
from dlspass.passes.lower_precision_onnx_pass import LowerPrecisionOnnxPass


def _relabelled(step: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of ``step`` whose outputs are all USER_OUTPUT with a flat-tuple out_spec."""
    gm = copy.deepcopy(step.graph_module)
    constants = sum(n.op == "get_attr" for n in gm.graph.nodes)
    DecomposeRoundingPass("arith")(gm)
    if sum(n.op == "get_attr" for n in gm.graph.nodes) != constants:
        raise GraphContractError("round_arith traced a tensor constant; cannot splice it into the program")
    ExpandBoolWherePass()(gm)  # onnxruntime's CPU Where has no bool kernel
    # by the output node's values: the rewrites above may have replaced an output node
    outs = user_outputs(gm.graph)
    old = step.module_call_graph[0].signature
    return make_program(gm, step.graph_signature.input_specs, outs, state_dict=dict(step.state_dict),
                        constants=dict(step.constants), in_spec=old.in_spec,
                        out_spec=flat_tuple_spec(len(outs)), forward_arg_names=old.forward_arg_names)


def _promote_initializers(graph: Any) -> list[str]:
    """Make every initializer of the ``onnx_ir`` graph that is not an input yet a graph input
    (in front of the user inputs, in initializer order), so a caller feeds the state in;
    returns their names."""
    state: list[str] = []
    for name, init in list(graph.initializers.items()):
        if init not in graph.inputs:
            graph.inputs.insert(len(state), init)
            state.append(name)
    return state


def step_to_onnx(step: torch.export.ExportedProgram, meta: dict[str, Any]) -> Any:
    """The dlspass step as an ``onnx_ir.Model`` with state as inputs and ``.new`` outputs."""
    kinds = [(s.kind, s.target) for s in step.graph_signature.output_specs]
    prog = _relabelled(step)
    example = _example_inputs(step)
    with quiet_torch():
        onnx_prog = torch.onnx.export(prog, example, dynamo=True, verbose=False,
                                      optimize=False, verify=False)
    model = onnx_prog.model
    graph = model.graph
    if len(graph.outputs) != len(kinds):
        raise GraphContractError(f"the ONNX exporter produced {len(graph.outputs)} outputs for "
                           f"{len(kinds)} step outputs")
    state_names = _promote_initializers(graph)
    for value, (kind, target) in zip(graph.outputs, kinds, strict=True):
        value.name = "loss" if kind == OutputKind.LOSS_OUTPUT else f"{target}.new"
    onnx_meta = dict(meta)
    onnx_meta["state_inputs"] = state_names
    onnx_meta["user_inputs"] = [v.name for v in graph.inputs if v.name not in set(state_names)]
    onnx_meta["outputs"] = [v.name for v in graph.outputs]
    model.metadata_props[META_FILE] = json.dumps(onnx_meta, sort_keys=True)
    model.metadata_props[roles.ONNX_ROLES_KEY] = json.dumps(
        {v.name: list(r) for v, r in zip(graph.outputs, meta["output_roles"], strict=True)})
    return model


def _example_inputs(step: torch.export.ExportedProgram) -> tuple[torch.Tensor, ...]:
    """Zero tensors shaped like the step's user inputs (the exporter only needs their specs)."""
    names = {s.arg.name for s in step.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    out = []
    for node in step.graph.find_nodes(op="placeholder"):
        if node.name in names:
            v = node.meta["val"]
            out.append(torch.zeros(v.shape, dtype=v.dtype))
    return tuple(out)


def save_step_onnx(step: torch.export.ExportedProgram, meta: dict[str, Any], path: Path) -> None:
    """Write the step as ONNX to ``path`` atomically (see the module docstring)."""
    import onnx_ir as ir

    model = step_to_onnx(step, meta)
    write_atomic(path, lambda tmp: ir.save(model, tmp))


# ---- joint program -> ONNX training graph (gradients as outputs, seed as an input) ------------

SEED_INPUT = "loss_seed"


def joint_to_onnx(joint: torch.export.ExportedProgram, *, tied: dict[str, str] | None = None) -> Any:
    """The joint program as ONNX: outputs ``loss`` and ``grad.<param>``, the backward seed as
    the scalar input ``loss_seed`` (feed 1.0), parameters as overridable inputs.

    ``tied`` (``{dropped_name: kept_name}`` from ``merge_tied_parameters``) goes to the metadata
    as ``"tied"``; None (not known: the joint's metadata does not say) leaves the key out.
    """
    j = joint_graph(joint, "joint program")
    gm = j.gm
    ExposeSeedPass(SEED_INPUT)(gm)
    in_specs = [*joint.graph_signature.input_specs,
                InputSpec(InputKind.USER_INPUT, TensorArgument(SEED_INPUT), None)]
    outs = user_outputs(gm.graph)
    n_user = len(j.inputs) + 1
    old = joint.module_call_graph[0].signature
    prog = make_program(gm, in_specs, outs, state_dict=dict(joint.state_dict),
                        constants=dict(joint.constants),
                        in_spec=tree_flatten((tuple(range(n_user)), {}))[1],
                        out_spec=flat_tuple_spec(len(outs)),
                        forward_arg_names=[*(old.forward_arg_names or j.inputs), SEED_INPUT])
    example = [torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
               for n in gm.graph.find_nodes(op="placeholder") if n.name in (*j.inputs, SEED_INPUT)]
    with quiet_torch():
        model = torch.onnx.export(prog, tuple(example), dynamo=True, verbose=False, optimize=False,
                                  verify=False).model
    graph = model.graph
    state = _promote_initializers(graph)
    role_map: dict[str, list[Any]] = {SEED_INPUT: [roles.SEED, None]}
    for value, (kind, target) in zip(graph.outputs, j.out_kinds, strict=True):
        value.name = {"loss": "loss", "grad": f"grad.{target}", "buffer": f"{target}.new"}.get(
            kind, value.name)
        role_map[value.name] = {"loss": [roles.LOSS, None], "grad": [roles.GRAD, target],
                                "buffer": [roles.BUFFER_UPDATE, target]}.get(kind, ["other", None])
    meta: dict[str, Any] = {"format": "dlspass-joint", "kind": "joint", "state_inputs": state,
                            "user_inputs": [*j.inputs, SEED_INPUT]}
    if tied is not None:
        meta["tied"] = dict(tied)
    model.metadata_props[META_FILE] = json.dumps(meta, sort_keys=True)
    model.metadata_props[roles.ONNX_ROLES_KEY] = json.dumps(role_map, sort_keys=True)
    return model


def save_joint_onnx(joint: torch.export.ExportedProgram, path: Path, *,
                    tied: dict[str, str] | None = None) -> None:
    """Write ``joint_to_onnx(joint, tied=tied)`` atomically to ``path``."""
    import onnx_ir as ir

    model = joint_to_onnx(joint, tied=tied)
    write_atomic(path, lambda tmp: ir.save(model, tmp))


# ---- ONNX training graph -> DLS (seed scaling, unscale, check, scale update) ------------------

def transform_onnx(src: Path, out: Path, config: DLSConfig) -> None:
    """Lower the precision of an ONNX training graph (``LowerPrecisionOnnxPass``, when
    ``config.mixed_precision``) and insert DLS (``InsertDLSOnnxPass``, when ``config.enabled``;
    bfloat16 gets the casts only), then check and save it atomically."""
    model = load_onnx(src)
    meta = onnx_meta(model)
    if meta is not None and meta.get("kind") == "step":
        raise InputValueError(f"{src}: already a dlspass training step; transform the original .pt2 instead")
    if not gradient_outputs(model):
        raise InputValueError(f"{src}: the ONNX model has no gradient outputs (not a training graph)")
    if not config.mixed_precision and not config.enabled:
        raise InputValueError(f"{src}: mixed precision and loss scaling are both off for this config; "
                              "nothing to insert")
    passes: list[ir.passes.PassBase] = []
    if config.mixed_precision:
        # before the DLS tail is grafted: the tail's math stays fp32, like the FX pipeline's
        passes.append(LowerPrecisionOnnxPass(config.fp16_type, str(src)))
    if config.enabled:
        passes.append(InsertDLSOnnxPass(config, str(src)))
    for p in passes:  # not ir.passes.Sequential: it would wrap our InputValueErrors in a PassError
        p(model)
    # the output is one self-contained file: external tensors (checked by load_onnx) move in
    inline_external_data(model)
    proto = ir.serde.serialize_model(model)
    check_onnx(proto, str(src))
    write_atomic(out, lambda tmp: onnx.save(proto, tmp))
