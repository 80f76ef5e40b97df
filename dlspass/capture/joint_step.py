"""A joint ``.pt2`` program -> a whole DLS training step, re-packaged as a ``.pt2`` program.

``transform_program(joint, meta, config, optimizer)`` turns a joint program (from
``dlspass.capture.export``) into a whole training step:

1. ``joint_graph`` copies the joint graph module and puts a ``dlspass::mark`` on its backward
   seed (``full_like(loss, 1)``);
2. ``joint_to_step_graph`` traces ``joint(params, buffers, inputs)`` followed by the functional
   optimizer update with ``make_fx``, marking loss and gradients, which lays the graph out as
   ``dlspass.graph.roles`` describes;
3. ``dlspass.capture.step_pipeline.run_step_pipeline`` rewrites it (the pipeline of every front end);
4. ``package_step`` re-packages the graph as an ``ExportedProgram``: parameters are PARAMETERs,
   optimizer state, scaler state and hyperparameters are BUFFERs, the model's inputs are
   USER_INPUTs; outputs are PARAMETER/BUFFER mutations followed by the LOSS_OUTPUT, so
   ``torch.export.load(f).module()(*inputs)`` under ``torch.no_grad()`` runs one step in place.

What ``torch.export.save`` does not keep (the output node's metadata) travels in the archive's
``dlspass.json`` extra file: config, precision mode, output roles and buffer names, so
``inspect`` and ``verify`` work from the file alone (``step_graph`` puts them back on the graph).
Both a joint and a step record, as ``"tied"``, the parameter names merged into another one
(``{dropped: kept}``; see ``merge_tied_parameters``): the program itself lists only the kept
name, so without it a user could not tell that ``lm_head.weight`` is trained as ``wte.weight``.
A joint whose metadata has no ``"tied"`` key gives a step without one: unknown, not "none".
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch.export.graph_signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten

from dlspass.capture import step_pipeline
from dlspass.capture.export import joint_with_ties
from dlspass.capture.optim import OptimizerSpec, functionalize
from dlspass.capture.program import make_program
from dlspass.config import DLSConfig, PrecisionMode, deprecated_precision_mode
from dlspass.errors import InputValueError
from dlspass.files.file_meta import FORMAT_VERSION
from dlspass.files.quiet import quiet_torch
from dlspass.graph import roles
from dlspass.graph.marks import mark, resolve_marks
from dlspass.graph.step_io import StepIO, mark_grads, safe_name, tag_step_io
from dlspass.passes.base import PassContractError
from dlspass.passes.clone_shared_outputs_pass import CloneSharedOutputsPass
from dlspass.passes.decompose_rounding_pass import DecomposeRoundingPass
from dlspass.passes.drop_none_getitems_pass import DropNoneGetitemsPass
from dlspass.passes.drop_unchanged_outputs_pass import DropUnchangedOutputsPass
from dlspass.passes.lift_constants_pass import LiftConstantsPass
from dlspass.passes.mark_seed_pass import MarkSeedPass, joint_seeds
from dlspass.scale_policy import STATE_FIELDS, init_state

ROUNDINGS = ("aten", "op")
"""How a step writes emulated rounding (``transform_program``'s ``rounding``)."""


# ---- joint program -> training step graph ------------------------------------------------

@dataclass
class JointGraph:
    """A joint program's graph module (its seed marked) and what each input and output is."""

    gm: fx.GraphModule
    params: list[str]          # PARAMETER targets, joint placeholder order
    buffers: list[str]         # BUFFER targets
    inputs: list[str]          # USER_INPUT placeholder names
    consts: list[str]          # CONSTANT_TENSOR targets
    kinds: list[str]           # per joint placeholder: "param" | "buffer" | "input" | "const"
    out_kinds: list[tuple[str, str | None]]  # per joint output: (kind, target)


def joint_graph(ep: torch.export.ExportedProgram, source: str) -> JointGraph:
    """A copy of the joint program ``ep``'s graph module with its backward seed marked, and the
    kind of each input and output; ``InputValueError`` (naming ``source``) when ``ep`` is not a
    joint training program dlspass can take."""
    sig = ep.graph_signature
    bw = getattr(sig, "backward_signature", None)
    if bw is None or not bw.gradients_to_parameters:
        raise InputValueError(f"{source}: not a training graph: no loss output and no parameter "
                              "gradients (export it with `dlspass export MODULE:FACTORY`)")
    gm = copy.deepcopy(ep.graph_module)
    kinds, params, buffers, inputs, consts = [], [], [], [], []
    for spec in sig.input_specs:
        if spec.kind == InputKind.PARAMETER:
            kinds.append("param")
            params.append(spec.target)
        elif spec.kind == InputKind.BUFFER:
            kinds.append("buffer")
            buffers.append(spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            kinds.append("input")
            inputs.append(spec.arg.name)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            # a tensor the model creates in forward (lifted by export): traced in as a constant
            kinds.append("const")
            consts.append(spec.target)
        else:
            raise InputValueError(f"{source}: unsupported graph input kind {spec.kind.name} "
                                  f"({spec.arg.name}); only parameters, buffers and user inputs are supported")
    out_kinds: list[tuple[str, str | None]] = []
    for spec in sig.output_specs:
        kind = {OutputKind.LOSS_OUTPUT: "loss", OutputKind.GRADIENT_TO_PARAMETER: "grad",
                OutputKind.BUFFER_MUTATION: "buffer", OutputKind.USER_OUTPUT: "other",
                OutputKind.GRADIENT_TO_USER_INPUT: "other"}.get(spec.kind)
        if kind is None:
            raise InputValueError(f"{source}: unsupported graph output kind {spec.kind.name}")
        out_kinds.append((kind, spec.target))
    # the seed: full_like(loss, 1) in the joint graph
    loss_name = bw.loss_output
    seeds = joint_seeds(gm.graph, loss_name)
    if len(seeds) != 1:
        raise InputValueError(f"{source}: cannot find the backward seed full_like({loss_name}, 1) "
                              f"(found {len(seeds)})")
    MarkSeedPass(loss_name)(gm)
    return JointGraph(gm, params, buffers, inputs, consts, kinds, out_kinds)



@dataclass
class StepInfo:
    """What ``package_step`` needs besides the graph: names, initial values, output roles."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]       # model buffers, by joint target
    opt_state: dict[str, Tensor]     # by functional-optimizer key
    scaler: dict[str, Tensor]
    hyper: dict[str, Tensor]
    inputs: list[str]
    in_spec: Any
    forward_arg_names: list[str] | None


_NAME_PREFIX = {roles.PARAM: "p_", roles.BUFFER: "b_", roles.OPT_STATE: "opt_",
                roles.SCALER_STATE: "scaler_", roles.HYPER: "hyper_"}


def _placeholder_name(role: str, target: str) -> str:
    """``p_<param>``, ``b_<buffer>``, ...; user inputs keep the name export gave them."""
    return target if role == roles.INPUT else _NAME_PREFIX[role] + safe_name(target)


def joint_to_step_graph(ep: torch.export.ExportedProgram, optimizer: OptimizerSpec,
                        config: DLSConfig | None, source: str) -> tuple[fx.GraphModule, StepInfo]:
    """The role-tagged (not yet rewritten) training step of the joint program ``ep``."""
    j = joint_graph(ep, source)
    sd = ep.state_dict
    consts = ep.constants
    params = {k: torch.nn.Parameter(sd[k].detach().clone()) for k in j.params}
    buffers = {k: (sd[k] if k in sd else consts[k]).detach().clone() for k in j.buffers}
    const_values = [consts[k].detach().clone() for k in j.consts]
    opt = optimizer.make(list(params.values()))
    fopt = functionalize(opt, {id(p): k for k, p in params.items()})
    opt_state = {k: v.detach().clone() for k, v in fopt.state_tensors().items()}
    hyper = {k: v.detach().clone() for k, v in fopt.hyper_tensors().items()}
    scaler = dict(zip(STATE_FIELDS, init_state(config or DLSConfig(loss_scale=None)), strict=True))
    example = list(ep.example_inputs[0]) if ep.example_inputs else None
    if example is None or len(example) != len(j.inputs):
        raise InputValueError(f"{source}: the program carries no example inputs to trace with")
    grad_names = [t for k, t in j.out_kinds if k == "grad"]
    io = StepIO(params=list(params), buffers=list(buffers), opt_state=list(opt_state),
                hyper=list(hyper), batch=j.inputs)

    def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
        p, b, o, s, h, x = io.split(flat)
        sources = {"param": iter(p.values()), "buffer": iter(b.values()), "input": iter(x),
                   "const": iter(const_values)}
        args = [next(sources[k]) for k in j.kinds]
        outs = j.gm(*args)
        new_b, loss, grads = dict(b), None, {}
        for (kind, target), v in zip(j.out_kinds, outs, strict=True):
            if kind == "loss":
                loss = mark(v, roles.LOSS)
            elif kind == "grad":
                grads[target] = v
            elif kind == "buffer":
                new_b[target] = v
        new_p, new_o = fopt.update(p, mark_grads(grads), o, h)
        return (*new_p.values(), *new_b.values(), *new_o.values(), *s, loss)

    flat = [*(v.detach() for v in params.values()), *buffers.values(), *opt_state.values(),
            *scaler.values(), *hyper.values(), *example]
    with quiet_torch():
        # _allow_non_fake_inputs: lifted constants enter as real tensors (get_attr constants)
        gm = make_fx(flat_step, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)
    for node in gm.graph.nodes:
        # make_fx may share one "custom" dict between nodes; roles must stay per node
        if "custom" in node.meta:
            node.meta["custom"] = dict(node.meta["custom"])
    resolve_marks(gm)
    DropNoneGetitemsPass()(gm)
    missing = set(params) - set(grad_names)
    if missing == set(params):
        raise InputValueError(f"{source}: no parameter receives a gradient")
    tag_step_io(gm, io, name=_placeholder_name)
    sig = ep.module_call_graph[0].signature if ep.module_call_graph else None
    info = StepInfo(params, buffers, opt_state, scaler, hyper, j.inputs,
                    sig.in_spec if sig is not None else None,
                    getattr(sig, "forward_arg_names", None) if sig is not None else None)
    return gm, info


# ---- step graph -> ExportedProgram -----------------------------------------------------------

def _buffer_name(role: str, target: str) -> str:
    prefix = {roles.OPT_STATE: "dlspass_opt", roles.SCALER_STATE: "dlspass_scaler",
              roles.HYPER: "dlspass_hyper"}[role]
    return f"{prefix}_{safe_name(target)}"


def package_step(gm: fx.GraphModule, info: StepInfo) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """Re-package the rewritten step graph ``gm`` as an ``ExportedProgram`` (see module doc).

    Outputs that return their placeholder unchanged are dropped (nothing to mutate) and a
    value returned at two positions gets a clone, because the signature names outputs by node.
    Returns the program and the ``dlspass.json`` fields that describe its roles.
    """
    gm = copy.deepcopy(gm)
    graph = gm.graph
    try:
        consts = LiftConstantsPass()(gm).constants
    except PassContractError as e:  # a constant the user's program made that is no tensor
        raise InputValueError(str(e)) from None
    placeholders = graph.find_nodes(op="placeholder")
    values = {roles.PARAM: info.params, roles.BUFFER: info.buffers, roles.OPT_STATE: info.opt_state,
              roles.SCALER_STATE: info.scaler, roles.HYPER: info.hyper}
    state_dict: dict[str, Tensor] = {}
    input_specs, buffer_names = [], {}
    for node in placeholders:
        role, target = roles.role_of(node), roles.target_of(node)
        if node.name in consts:
            input_specs.append(InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), node.name))
        elif role == roles.PARAM:
            state_dict[target] = torch.nn.Parameter(values[role][target].detach().clone())
            input_specs.append(InputSpec(InputKind.PARAMETER, TensorArgument(node.name), target))
        elif role in values:
            name = target if role == roles.BUFFER else _buffer_name(role, target)
            buffer_names[f"{role}:{target}"] = name
            state_dict[name] = values[role][target].detach().clone()
            input_specs.append(InputSpec(InputKind.BUFFER, TensorArgument(node.name), name, persistent=True))
        elif role == roles.INPUT:
            input_specs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(node.name), None))
        else:
            raise InputValueError(f"placeholder {node.name} has no role")
    DropUnchangedOutputsPass()(gm)  # nothing to mutate
    CloneSharedOutputsPass()(gm)  # the signature names outputs by node
    kept_vals, kept_roles = roles.output_values(graph), roles.output_roles(graph)
    output_specs = []
    for v, (role, target) in zip(kept_vals, kept_roles, strict=True):
        src = roles.SOURCE_OF_UPDATE.get(role)
        if role == roles.LOSS:
            spec_kind, spec_target = OutputKind.LOSS_OUTPUT, None
        elif src == roles.PARAM:
            spec_kind, spec_target = OutputKind.PARAMETER_MUTATION, target
        else:
            spec_kind = OutputKind.BUFFER_MUTATION
            spec_target = target if src == roles.BUFFER else _buffer_name(src, target)
        output_specs.append(OutputSpec(spec_kind, TensorArgument(v.name), spec_target))
    gm.recompile()
    ep = make_program(gm, input_specs, output_specs, state_dict=state_dict, constants=consts,
                      in_spec=info.in_spec, out_spec=tree_flatten(kept_vals[-1].meta["val"])[1],
                      forward_arg_names=info.forward_arg_names)
    # torch.export.save keeps node.meta["custom"] of computed nodes only
    meta = {"output_roles": [list(r) for r in kept_roles], "buffer_names": buffer_names,
            "placeholder_roles": {n.name: [roles.role_of(n), roles.target_of(n)]
                                  for n in placeholders if n.name not in consts}}
    return ep, meta


# ---- the whole transform -----------------------------------------------------------------------

def transform_program(ep: torch.export.ExportedProgram, meta: dict[str, Any] | None,
                      config: DLSConfig | None, optimizer: OptimizerSpec, *,
                      precision_mode: PrecisionMode | None = None, source: str = "input",
                      rounding: str = "aten") -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """The DLS training step of the joint (or plain loss) program ``ep`` and its metadata.

    ``rounding="aten"`` writes each emulated rounding as core aten bit operations
    (``dlspass.formats.round_bits``), so the program loads and runs wherever torch does;
    ``"op"`` keeps the ``dlspass::round_to_format`` custom op (loading then needs
    ``import dlspass.formats``). A program that is already a dlspass step is returned unchanged
    when ``config``, optimizer, precision mode and rounding are the ones it was built with, and
    refused otherwise. The precision mode is the config's (`DLSConfig.lowering_mode`; without a
    config nothing is lowered and the file says emulate). ``precision_mode=`` is deprecated: pass
    ``config=DLSConfig(precision_mode=...)`` (it is merged into ``config`` with a
    ``DeprecationWarning``).

    The metadata records the mode in effect under ``"precision_mode"``, and the config with
    that mode written out, so a file says what ran whatever a later default is. A config
    recorded while emulate was the default wrote it out too: an older file reads as emulated.
    """
    if rounding not in ROUNDINGS:
        raise InputValueError(f"rounding: expected one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    config = deprecated_precision_mode(config, precision_mode, "transform_program")
    mode = config.lowering_mode if config is not None else "emulate"
    wanted = {"config": roles.config_record(config),
              "optimizer": optimizer.to_dict(), "precision_mode": mode, "rounding": rounding}
    if meta is not None and meta.get("kind") == "step":
        # a step whose metadata names no rounding calls the custom op
        have = {k: meta.get(k, "op" if k == "rounding" else None) for k in wanted}
        if isinstance(have["config"], dict):  # its mode is the one the file records as run
            # a setting DLSConfig gained after the file was written reads as its default: the
            # behaviour the file was built with (telemetry off, say)
            have["config"] = {**DLSConfig().to_dict(), **have["config"],
                              "precision_mode": have["precision_mode"]}
        if json.dumps(have, sort_keys=True) == json.dumps(wanted, sort_keys=True):
            return ep, meta
        raise InputValueError(f"{source}: already a dlspass training step built with "
                              f"{json.dumps(have, sort_keys=True)}; transform the original joint "
                              "program to change the settings")
    if getattr(ep.graph_signature, "backward_signature", None) is None:
        ep, tied = joint_with_ties(ep, source)
    else:
        # the joint's merge happened at export; None: its metadata does not say (unknown)
        tied = (meta or {}).get("tied")
    gm, info = joint_to_step_graph(ep, optimizer, config, source)
    # graph tagged by joint_to_step_graph; no collectives in a single-file step
    gm, _ = step_pipeline.run_step_pipeline(gm, config)
    if rounding == "aten":
        DecomposeRoundingPass("bits")(gm)
    out, roles_meta = package_step(gm, info)
    full = {"format": "dlspass-step", "version": FORMAT_VERSION, "kind": "step", **wanted,
            **roles_meta, "inputs": info.inputs,
            "applied_passes": gm.graph.output_node().meta.get("custom", {}).get(roles.APPLIED_KEY, [])}
    if tied is not None:  # unknown stays absent rather than claiming nothing was tied
        full["tied"] = dict(tied)
    return out, full


def step_graph(ep: torch.export.ExportedProgram, meta: dict[str, Any] | None) -> fx.GraphModule:
    """The program's graph module with the dlspass output metadata restored (for verify/inspect)."""
    gm = ep.graph_module
    if meta is None or meta.get("kind") != "step":
        return gm
    ph_roles = meta.get("placeholder_roles", {})
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in ph_roles and roles.role_of(node) is None:
            roles.set_role(node, *ph_roles[node.name])
    custom = gm.graph.output_node().meta.setdefault("custom", {})
    custom[roles.OUTPUTS_KEY] = [list(r) for r in meta["output_roles"]]
    config = meta["config"]
    if isinstance(config, dict) and config.get("precision_mode") is None:
        # written before the recorded config carried the mode: the file's mode is what ran
        config = {**config, "precision_mode": meta.get("precision_mode")}
    custom[roles.CONFIG_KEY] = json.dumps(config, sort_keys=True)
    custom[roles.APPLIED_KEY] = list(meta.get("applied_passes", []))
    return gm
