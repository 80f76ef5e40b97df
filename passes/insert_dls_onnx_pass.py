"""InsertDLSOnnxPass: the tagged seed input becomes ``seed × loss_scale`` and the gradient outputs go through the exported unscale/check/clip/scale-update tail."""

from __future__ import annotations

import json

import onnx_ir as ir
import torch

from dlspass.config import DLSConfig
from dlspass.errors import InputValueError
from dlspass.files.file_meta import META_FILE
from dlspass.files.quiet import quiet_torch
from dlspass.graph import roles
from dlspass.graph.onnx_opset import default_opset
from dlspass.scale_policy import STATE_FIELDS, ScalerState, dls_tail, init_state, update_state

TAIL_PREFIX = "dlspass_tail/"
SCALED_SEED = "dlspass_scaled_seed"
ISFINITE = "dlspass_isfinite"
STATE_INPUTS = [f"dlspass_scaler_{f}" for f in STATE_FIELDS]

_TORCH_DTYPES = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16,
                 ir.DataType.BFLOAT16: torch.bfloat16, ir.DataType.DOUBLE: torch.float64}


class _DLSTail(torch.nn.Module):
    """Unscale, check (and clip) gradients and update the scaler state, for ONNX export."""

    def __init__(self, config: DLSConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, grads: list[torch.Tensor], state: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        st = ScalerState(*state)
        out, isfinite, _norm = dls_tail(grads, st.loss_scale, self.config)
        new = update_state(st, isfinite, self.config) if self.config.dynamic else st
        return (*out, isfinite, *(s.clone() for s in new))


class InsertDLSOnnxPass(ir.passes.InPlacePass):
    """DLS in an ONNX training graph whose outputs are gradients.

    Rules:

    1. The backward seed must be the one graph input tagged ``backward_seed`` in
       ``metadata_props["dlspass_roles"]`` (``dlspass export -o joint.onnx`` makes it
       ``loss_seed``): post hoc, a constant seed inside the graph cannot be told apart from
       other constants, so it cannot be scaled. Every reader of the seed reads
       ``dlspass_scaled_seed = Mul(seed, dlspass_scaler_loss_scale)`` instead.
    2. The outputs tagged ``grad`` feed a tail exported by torch from the same policy code the
       FX passes splice in (``dls_tail``, ``update_state``), its names prefixed
       ``dlspass_tail/``; the scaler state ``dlspass_scaler_<field>`` becomes graph inputs.
    3. The gradient outputs are replaced, at the end of the outputs, by
       ``grad.<param>.unscaled`` (what the optimizer must use), ``dlspass_isfinite`` (skip the
       optimizer update when False) and ``dlspass_scaler_<field>.new``; their roles go to
       ``dlspass_roles`` and ``dlspass.json`` becomes ``kind: onnx_dls`` with the config.

    Loss scaling off, no tagged seed input or no tagged gradient is an ``InputValueError``.
    Precision lowering is ``LowerPrecisionOnnxPass``'s (run it first: the tail stays fp32).
    """

    def __init__(self, config: DLSConfig, source: str = "model") -> None:
        super().__init__()
        self.config = config
        self.source = source

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        seed, grads = _seed_and_grads(model, self.config, self.source)
        tail = _export_tail(self.config, grads, default_opset(model), self.source)
        _graft(model, tail, seed, grads)
        _record(model, self.config, [g.name for g in grads])
        return ir.passes.PassResult(model, modified=True)


def _seed_and_grads(model: ir.Model, config: DLSConfig, source: str) -> tuple[ir.Value, list[ir.Value]]:
    """The tagged seed input and the tagged gradient outputs (``InputValueError`` when missing)."""
    if not config.enabled:
        raise InputValueError(f"{source}: loss scaling is off for this config; nothing to insert")
    tagged = json.loads(model.metadata_props.get(roles.ONNX_ROLES_KEY, "{}"))
    seeds = [k for k, (r, _t) in tagged.items() if r == roles.SEED]
    inputs = {v.name: v for v in model.graph.inputs}
    if len(seeds) != 1 or seeds[0] not in inputs:
        raise InputValueError(f"{source}: no backward-seed graph input (tag one as 'backward_seed' in "
                              "metadata_props['dlspass_roles'], or export with `dlspass export -o x.onnx`)")
    grads = [v for v in model.graph.outputs if tagged.get(v.name, [None])[0] == roles.GRAD]
    if not grads:
        raise InputValueError(f"{source}: no output is tagged as a gradient in metadata_props['dlspass_roles']")
    return inputs[seeds[0]], grads


def _export_tail(config: DLSConfig, grads: list[ir.Value], opset: int, source: str) -> ir.Model:
    """``_DLSTail`` as ONNX for gradients shaped like ``grads`` (unknown dims as 0)."""
    examples = []
    for g in grads:
        if g.dtype not in _TORCH_DTYPES:
            raise InputValueError(f"{source}: gradient outputs must be floating point, got ONNX type "
                                  f"{int(g.dtype) if g.dtype is not None else 0}")
        dims = [d if isinstance(d, int) else 0 for d in (g.shape or ())]
        examples.append(torch.zeros(dims, dtype=_TORCH_DTYPES[g.dtype]))
    with quiet_torch():
        return torch.onnx.export(_DLSTail(config), (examples, list(init_state(config))), dynamo=True,
                                 verbose=False, optimize=True, verify=False, opset_version=opset).model


def _graft(model: ir.Model, tail: ir.Model, seed: ir.Value, grads: list[ir.Value]) -> None:
    """Move the tail's nodes, constants and state inputs into ``model``, reading ``grads``."""
    g, tg = model.graph, tail.graph
    _prefix_names(tg, TAIL_PREFIX)
    grad_ins, state_ins, outs = list(tg.inputs[:len(grads)]), list(tg.inputs[len(grads):]), list(tg.outputs)
    nodes, consts = list(tg), list(tg.initializers.values())
    tg.inputs.clear()
    tg.outputs.clear()
    tg.initializers.clear()
    tg.remove(nodes)
    out_names = [f"{v.name}.unscaled" for v in grads] + [ISFINITE] + [f"{n}.new" for n in STATE_INPUTS]
    for v, name in (*zip(outs, out_names, strict=True), *zip(state_ins, STATE_INPUTS, strict=True)):
        v.name = name
    _scale_seed(g, seed, state_ins[0])
    ir.convenience.replace_all_uses_with(grad_ins, grads)
    g.extend(nodes)
    for c in consts:
        g.register_initializer(c)
    g.inputs.extend(state_ins)
    kept = [v for v in g.outputs if v not in set(grads)]
    g.outputs.clear()
    g.outputs.extend([*kept, *outs])
    for key, f in tail.functions.items():
        model.functions.setdefault(key, f)
    for domain, version in tail.opset_imports.items():
        model.opset_imports.setdefault(domain, version)


def _prefix_names(graph: ir.Graph, prefix: str) -> None:
    """Prefix every value and node name of ``graph``, so that none can clash with the model's."""
    for v in (*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)):
        if v.name:
            v.name = prefix + v.name
    for n in graph:
        n.name = prefix + (n.name or "")


def _scale_seed(graph: ir.Graph, seed: ir.Value, scale: ir.Value) -> None:
    """Every reader of ``seed`` reads ``Mul(seed, scale)`` instead (the first node of the graph)."""
    scaled = ir.Value(name=SCALED_SEED)
    ir.convenience.replace_all_uses_with(seed, scaled)
    mul = ir.Node("", "Mul", [seed, scale], outputs=[scaled], name="dlspass_scale_seed")
    first = next(iter(graph), None)
    if first is None:
        graph.append(mul)
    else:
        graph.insert_before(first, mul)


def _record(model: ir.Model, config: DLSConfig, grad_names: list[str]) -> None:
    """Roles of the new outputs and the ``onnx_dls`` record in the model's metadata."""
    props = model.metadata_props
    tagged = json.loads(props.get(roles.ONNX_ROLES_KEY, "{}"))
    meta = json.loads(props.get(META_FILE, "{}") or "{}")
    meta.update({"kind": "onnx_dls", "config": config.to_dict(), "state_inputs_dls": STATE_INPUTS,
                 "outputs": [v.name for v in model.graph.outputs]})
    tagged.update({f"{n}.unscaled": [roles.UNSCALE, tagged[n][1]] for n in grad_names})
    tagged[ISFINITE] = [roles.ISFINITE, None]
    tagged.update({f"{n}.new": [roles.SCALER_STATE_UPDATE, f] for n, f in zip(STATE_INPUTS, STATE_FIELDS, strict=True)})
    props[META_FILE] = json.dumps(meta, sort_keys=True)
    props[roles.ONNX_ROLES_KEY] = json.dumps(tagged, sort_keys=True)
