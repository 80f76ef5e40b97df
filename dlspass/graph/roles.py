"""Node roles: how a captured training step says what each node is, so passes need not guess.

A role lives in ``node.meta["custom"]`` (the one node-metadata dict that ``torch.export``
save/load keeps) under ``"dlspass_role"``; the parameter, buffer or state entry it belongs to
under ``"dlspass_target"``; and, for nodes a pass inserted, the pass under ``"dlspass_pass"``.

The captured step graph (``dlspass.capture_step``) is a pure function

    (params, buffers, optimizer_state, scaler_state, hyperparameters, batch)
        -> (new_params, new_buffers, new_optimizer_state, new_scaler_state, loss)

with placeholders in exactly that order and one flat output tuple in exactly that order.
Placeholders carry PARAM, BUFFER, OPT_STATE, SCALER_STATE, HYPER or INPUT. Outputs are described
positionally on the output node (``output.meta["custom"]["dlspass_outputs"]``: one
``[role, target]`` per output, roles PARAM_UPDATE, BUFFER_UPDATE, OPT_STATE_UPDATE,
SCALER_STATE_UPDATE, LOSS), because one node may be returned twice or be a placeholder passed
through unchanged; output values that are computed nodes also carry their role themselves.
The backward seed (``ones_like(loss)``) carries SEED and the gradient of each parameter, as
the optimizer reads it, carries GRAD with the parameter's name as target; where the step's own
code changed that gradient after backward, the gradient as backward produced it carries
BACKWARD_GRAD.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from dlspass.config import DLSConfig
from dlspass.errors import GraphContractError

ROLE_KEY = "dlspass_role"
TARGET_KEY = "dlspass_target"
PASS_KEY = "dlspass_pass"

# placeholders
PARAM = "param"
BUFFER = "buffer"
OPT_STATE = "opt_state"
SCALER_STATE = "scaler_state"
HYPER = "hyper"
INPUT = "input"
# captured computation
LOSS = "loss"
SEED = "backward_seed"
# the ops autograd seeds a backward with (``loss.backward()``: ``ones_like(loss)``; torch.export's
# joint graph: ``full_like(loss, 1)``), by which the SEED node is found
SEED_OPS = (torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default)
GRAD = "grad"
# what ``loss.backward()`` stored in a parameter's ``.grad``, tagged only where the step's own
# code changed it before the optimizer read it (a ``clip_grad_norm_`` inside ``dlspass.compile``):
# the GRAD node is then that code's result. DLS unscales the gradient here, so every read after
# backward sees unscaled values, as after torch.amp's ``scaler.unscale_(optimizer)``.
BACKWARD_GRAD = "backward_grad"
PARAM_UPDATE = "param_update"
BUFFER_UPDATE = "buffer_update"
OPT_STATE_UPDATE = "opt_state_update"
SCALER_STATE_UPDATE = "scaler_state_update"
# inserted by the passes
CAST = "cast"
SCALED_SEED = "scaled_seed"
UNSCALE = "unscale"
GRAD_NORM = "grad_norm"
ISFINITE = "isfinite"
CLIP = "clip"
GUARD = "guard"
SCALE_UPDATE = "scale_update"
# the all-reduce passes (data parallelism): a rank's own gradient before the in-graph all-reduce,
# the nodes of the two reductions, and their ``dlspass_pass`` (PASS_NAME)
LOCAL_GRAD = "local_grad"
GRAD_ALLREDUCE = "grad_allreduce"
FLAG_ALLREDUCE = "flag_allreduce"
PASS_NAME = "distributed"
# fault injection: the nodes InjectFaultsPass inserts, and a gradient as backward made it
# (before its fault) once the faulted value has taken over the GRAD role
FAULT = "fault"
PRE_FAULT_GRAD = "pre_fault_grad"
# numerics telemetry (InsertTelemetryPass): reads values and changes none, so the gradients it
# reads stay the ones backward produced (the unscale pass reroutes only the optimizer's reads)
TELEMETRY = "telemetry"

# targets (``dlspass_target``) with a fixed meaning
GLOBAL = "global"  # the one overflow flag and the one gradient norm of a step
LOCAL = "local"  # the rank-local overflow flag, once the all-reduced one is GLOBAL
FAULT_STEP = "fault_step"  # the step-counter placeholder InjectFaultsPass adds

PLACEHOLDER_ROLES = (PARAM, BUFFER, OPT_STATE, SCALER_STATE, HYPER, INPUT)
OUTPUT_ROLES = (PARAM_UPDATE, BUFFER_UPDATE, OPT_STATE_UPDATE, SCALER_STATE_UPDATE, LOSS)
# each update output role -> the placeholder role it is the next value of, and back
SOURCE_OF_UPDATE = {PARAM_UPDATE: PARAM, BUFFER_UPDATE: BUFFER, OPT_STATE_UPDATE: OPT_STATE,
                    SCALER_STATE_UPDATE: SCALER_STATE}
UPDATE_OF_SOURCE = {src: upd for upd, src in SOURCE_OF_UPDATE.items()}
# BatchNorm statistics (BUFFER_UPDATE) advance on a skipped step and the scaler state is the
# update pass's business: only parameters and optimizer state are rolled back on overflow.
GUARDED_UPDATES = {PARAM_UPDATE: PARAM, OPT_STATE_UPDATE: OPT_STATE}

# metadata keys beside the node roles: on the output node (and the seed, whose meta survives
# torch.export) ``apply_dls`` records its config (with its precision mode written out) and
# applied passes; ONNX
# models carry the roles of their values as JSON in ``metadata_props[ONNX_ROLES_KEY]``.
# They are JSON strings or lists of names, which .pt2 files keep.
OUTPUTS_KEY = "dlspass_outputs"  # [role, target] per output position, on the output node
CONFIG_KEY = "dlspass_config"
# written by dlspass before the recorded config carried the mode; no longer written, still read
# (`recorded_config`) so a graph or file written then reads as it ran
MODE_KEY = "dlspass_precision_mode"
APPLIED_KEY = "dlspass_applied"
SKIPPED_KEY = "dlspass_skipped"  # {pass name: why it did nothing}
ONNX_ROLES_KEY = "dlspass_roles"
# on the last node of a decomposed ``dlspass::round_to_format``: the format it rounds to, so the
# rounding stays recognisable after ``torch.export.save`` (DecomposeRoundingPass writes it)
ROUNDED_KEY = "dlspass_rounded"


def set_role(node: fx.Node, role: str, target: str | None = None, by_pass: str | None = None) -> fx.Node:
    """Tag ``node`` with ``role`` (and the entry it belongs to, and the pass that made it)."""
    custom = node.meta.setdefault("custom", {})
    custom[ROLE_KEY] = role
    if target is not None:
        custom[TARGET_KEY] = target
    if by_pass is not None:
        custom[PASS_KEY] = by_pass
    return node


def role_of(node: fx.Node) -> str | None:
    return node.meta.get("custom", {}).get(ROLE_KEY)


def target_of(node: fx.Node) -> str | None:
    return node.meta.get("custom", {}).get(TARGET_KEY)


def pass_of(node: fx.Node) -> str | None:
    return node.meta.get("custom", {}).get(PASS_KEY)


def nodes_with_role(graph: fx.Graph, role: str | Iterable[str]) -> list[fx.Node]:
    roles = {role} if isinstance(role, str) else set(role)
    return [n for n in graph.nodes if role_of(n) in roles]


def the_node(graph: fx.Graph, role: str) -> fx.Node:
    """The single node with ``role``; a clear error when there is none or several."""
    found = nodes_with_role(graph, role)
    if len(found) != 1:
        raise GraphContractError(f"expected exactly one node with role {role!r}, found {len(found)}")
    return found[0]



def set_output_roles(graph: fx.Graph, roles: list[tuple[str, str | None]]) -> None:
    """Record the role and target of each output position of ``graph``."""
    out = graph.output_node()
    if len(roles) != len(output_values(graph)):
        raise GraphContractError(f"{len(roles)} output roles for {len(output_values(graph))} outputs")
    out.meta.setdefault("custom", {})[OUTPUTS_KEY] = [[r, t] for r, t in roles]


def output_roles(graph: fx.Graph) -> list[tuple[str, str | None]]:
    """``[(role, target)]`` per output position; empty when the graph has none recorded."""
    spec = graph.output_node().meta.get("custom", {}).get(OUTPUTS_KEY, [])
    return [(r, t) for r, t in spec]


def output_value(graph: fx.Graph, role: str, target: str | None = None) -> tuple[int, fx.Node]:
    """The output position and value with ``role`` (and ``target``)."""
    vals = output_values(graph)
    for i, (r, t) in enumerate(output_roles(graph)):
        if r == role and (target is None or t == target):
            return i, vals[i]
    raise GraphContractError(f"no output with role {role!r} and target {target!r}")


def recorded(graph: fx.Graph, key: str) -> Any:
    """The value apply_dls recorded under ``key``: on the output node, else on the seed node.

    Recorded twice because ``torch.export`` rebuilds the output node (losing its meta) but keeps
    the seed node's ``meta["custom"]``.
    """
    for node in (graph.output_node(), *nodes_with_role(graph, SEED)):
        value = node.meta.get("custom", {}).get(key)
        if value is not None:
            return value
    return None


def config_from_record(data: dict[str, Any]) -> DLSConfig:
    """A config as ``apply_dls`` records it (`DLSConfig.to_dict`'s JSON object), read back; file
    readers pass it as the check of a file's recorded config."""
    return DLSConfig(**data)


def config_record(config: DLSConfig | None) -> dict[str, Any] | None:
    """``config`` as ``apply_dls`` and step files record it: `DLSConfig.to_dict` with the
    precision mode in effect written out (`DLSConfig.lowering_mode`), so the record says what
    ran whatever a later release's default mode is; None for no config."""
    return None if config is None else {**config.to_dict(), "precision_mode": config.lowering_mode}


def recorded_config_data(graph: fx.Graph) -> dict[str, Any] | None:
    """The JSON object of the config recorded on ``graph`` (None when none, or no config, was
    recorded). A graph recorded before the config carried its mode (the mode under ``MODE_KEY``,
    the config's ``precision_mode`` null) reads with that mode written in, as it ran."""
    raw = recorded(graph, CONFIG_KEY)
    data = None if raw is None else json.loads(raw)
    if isinstance(data, dict) and data.get("precision_mode") is None:
        mode = recorded(graph, MODE_KEY)
        if mode is not None:
            data = {**data, "precision_mode": mode}
    return data


def recorded_config(gm: fx.GraphModule | fx.Graph) -> DLSConfig | None:
    """The config ``apply_dls`` recorded on ``gm`` (None when none, or no config, was given),
    its ``precision_mode`` the mode it ran with."""
    data = recorded_config_data(gm.graph if isinstance(gm, fx.GraphModule) else gm)
    return None if data is None else config_from_record(data)


def output_values(graph: fx.Graph) -> list[fx.Node]:
    """The flat list of values the graph returns (the captured step returns one flat tuple)."""
    out = graph.output_node()
    vals = out.args[0]
    if isinstance(vals, fx.Node):
        return [vals]
    return list(vals)


def ancestors(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node that ``nodes`` depend on, ``nodes`` included (an iterative walk: deep graphs
    must not reach Python's recursion limit)."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def descendants(nodes: Iterable[fx.Node]) -> dict[fx.Node, None]:
    """``nodes`` and every node that reads one of them, directly or not, in graph order (one
    pass over the graph: a node's inputs come before it)."""
    seen = set(nodes)
    graph = next(iter(seen)).graph if seen else None
    if graph is None:
        return {}
    for n in graph.nodes:
        if n not in seen and any(a in seen for a in n.all_input_nodes):
            seen.add(n)
    return {n: None for n in graph.nodes if n in seen}
