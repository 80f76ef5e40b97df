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
4. roles and the DLS config go to the model's ``metadata_props`` (``dlspass.json``).

ONNX *input*: ``joint_to_onnx`` writes a joint program as an ONNX training graph (outputs
``loss`` and ``grad.<param>``, the backward seed as the input ``loss_seed``, roles in
``metadata_props``); ``insert_dls_onnx`` adds DLS to such a graph: seed × scale, then the
gradients are unscaled, checked and clipped and the scaler state updated by ``dls_tail`` and
``update_state`` exported from torch (the same code the FX passes splice in) and grafted onto
the graph. A constant seed inside a foreign graph cannot be identified post hoc, so the seed
must be a tagged input; there is no optimizer in such a graph, so skipping is the caller's:
apply the update only when the output ``dlspass_isfinite`` is True.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from . import roles
from .export_io import META_FILE, InputError, quiet_torch, write_atomic


def _arith_rounding(gm: fx.GraphModule) -> int:
    """Replace each ``dlspass::round_to_format`` node by the traced ``round_arith`` ops."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    from .formats import _is_round_node, _node_args, round_arith

    count = 0
    for node in list(gm.graph.nodes):
        if not _is_round_node(node):
            continue
        x, fmt, saturate, ftz = _node_args(node)
        val = x.meta["val"]

        fn = _arith_fn(round_arith, fmt, saturate, ftz)
        with detect_fake_mode([val]):
            sub = make_fx(fn, tracing_mode="fake")(val)
        ph = next(n for n in sub.graph.nodes if n.op == "placeholder")
        val_map: dict[fx.Node, fx.Node] = {ph: x}
        if any(n.op == "get_attr" for n in sub.graph.nodes):
            raise RuntimeError("round_arith traced a tensor constant; cannot splice it into the program")
        with gm.graph.inserting_before(node):
            out = gm.graph.graph_copy(sub.graph, val_map)
        if "custom" in node.meta:
            out.meta["custom"] = dict(node.meta["custom"])
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _bool_where_to_logic(gm: fx.GraphModule) -> int:
    """``where(c, a, b)`` on bool tensors -> ``(c & a) | (~c & b)``: ORT's CPU Where has no bool kernel."""
    from .splice import set_fake_val

    aten = torch.ops.aten
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.where.self:
            continue
        val = node.meta.get("val")
        if val is None or val.dtype != torch.bool:
            continue
        c, a, b = node.args
        with gm.graph.inserting_before(node):
            new = []
            for target, args in ((aten.logical_and.default, (c, a)), (aten.logical_not.default, (c,))):
                new.append(gm.graph.call_function(target, args))
                set_fake_val(new[-1])
            new.append(gm.graph.call_function(aten.logical_and.default, (new[1], b)))
            set_fake_val(new[-1])
            out = gm.graph.call_function(aten.logical_or.default, (new[0], new[2]))
            set_fake_val(out)
        out.meta["custom"] = dict(node.meta.get("custom", {}))
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _arith_fn(round_arith: Any, fmt: str, saturate: bool, ftz: bool) -> Any:
    # make_fx needs a signature of exactly the traced arguments (no defaults)
    def fn(t: torch.Tensor) -> torch.Tensor:
        return round_arith(t, fmt, saturate, ftz)

    return fn


def _relabelled(step: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of ``step`` whose outputs are all USER_OUTPUT with a flat-tuple out_spec."""
    from torch.export import ExportedProgram
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import (
        ExportGraphSignature,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )
    from torch.utils._pytree import tree_flatten

    gm = copy.deepcopy(step.graph_module)
    _arith_rounding(gm)
    _bool_where_to_logic(gm)
    sig = step.graph_signature
    # by the output node's values: the rewrites above may have replaced an output node
    outs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(v.name), None)
            for v in roles.output_values(gm.graph)]
    new_sig = ExportGraphSignature(input_specs=list(sig.input_specs), output_specs=outs)
    old = step.module_call_graph[0].signature
    out_spec = tree_flatten(tuple(range(len(outs))))[1]
    call = ModuleCallSignature(inputs=[], outputs=[], in_spec=old.in_spec, out_spec=out_spec,
                               forward_arg_names=old.forward_arg_names)
    return ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=new_sig, state_dict=dict(step.state_dict),
        range_constraints={}, module_call_graph=[ModuleCallEntry(fqn="", signature=call)],
        example_inputs=None, constants=dict(step.constants))


def step_to_onnx(step: torch.export.ExportedProgram, meta: dict[str, Any]) -> Any:
    """The dlspass step as an ``onnx_ir.Model`` with state as inputs and ``.new`` outputs."""
    from torch.export.graph_signature import OutputKind

    kinds = [(s.kind, s.target) for s in step.graph_signature.output_specs]
    prog = _relabelled(step)
    example = _example_inputs(step)
    with quiet_torch():
        onnx_prog = torch.onnx.export(prog, example, dynamo=True, verbose=False,
                                      optimize=False, verify=False)
    model = onnx_prog.model
    graph = model.graph
    if len(graph.outputs) != len(kinds):
        raise RuntimeError(f"the ONNX exporter produced {len(graph.outputs)} outputs for "
                           f"{len(kinds)} step outputs")
    state_names = []
    for name, init in list(graph.initializers.items()):
        if init not in graph.inputs:
            graph.inputs.insert(len(state_names), init)
            state_names.append(name)
    for value, (kind, target) in zip(graph.outputs, kinds, strict=True):
        value.name = "loss" if kind == OutputKind.LOSS_OUTPUT else f"{target}.new"
    onnx_meta = dict(meta)
    onnx_meta["state_inputs"] = state_names
    onnx_meta["user_inputs"] = [v.name for v in graph.inputs if v.name not in set(state_names)]
    onnx_meta["outputs"] = [v.name for v in graph.outputs]
    model.metadata_props[META_FILE] = json.dumps(onnx_meta, sort_keys=True)
    model.metadata_props["dlspass_roles"] = json.dumps(
        {v.name: list(r) for v, r in zip(graph.outputs, meta["output_roles"], strict=True)})
    return model


def _example_inputs(step: torch.export.ExportedProgram) -> tuple[torch.Tensor, ...]:
    """Zero tensors shaped like the step's user inputs (the exporter only needs their specs)."""
    from torch.export.graph_signature import InputKind

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


def load_onnx(path: str | Path) -> Any:
    """An ``onnx_ir.Model`` from ``path``; ``InputError`` when it is not a readable ONNX model."""
    import onnx_ir as ir

    from .export_io import check_input_file

    p = check_input_file(path, (".onnx",))
    try:
        with quiet_torch():
            model = ir.load(str(p))
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"{p}: cannot read the ONNX model ({type(e).__name__}: {first[:200]})") from None
    if not model.graph.outputs:
        raise InputError(f"{p}: the ONNX model has no outputs")
    _check_wellformed(model, p)
    return model


def _check_wellformed(model: Any, p: Path) -> None:
    """Reject what a damaged file can still parse into: names that are not text (bytes that
    are not UTF-8) and values that no input, initializer or node defines."""
    defined = {v.name for v in model.graph.inputs} | set(model.graph.initializers)
    for node in model.graph:
        for field in (node.name, node.op_type, node.domain):
            if field is not None and not isinstance(field, str):
                raise InputError(f"{p}: invalid ONNX model (a node name or op type is not UTF-8 text)")
        for v in node.inputs:
            if v is None:
                continue
            if not isinstance(v.name, str):
                raise InputError(f"{p}: invalid ONNX model (a value name is not UTF-8 text)")
            if v.producer() is None and v.name not in defined and not v.is_initializer():
                raise InputError(f"{p}: invalid ONNX model (node {node.name!r} reads {v.name!r}, "
                                 "which nothing defines)")
        defined.update(o.name for o in node.outputs)


def onnx_meta(model: Any) -> dict[str, Any] | None:
    """The ``dlspass.json`` a dlspass ONNX export carries (None for foreign models)."""
    raw = model.metadata_props.get(META_FILE)
    return json.loads(raw) if raw else None


def gradient_outputs(model: Any) -> list[str]:
    """Names of outputs tagged as gradients (``metadata_props`` roles or a ``grad`` name)."""
    tagged = json.loads(model.metadata_props.get("dlspass_roles", "{}"))
    found = [name for name, (role, _t) in tagged.items() if role == roles.GRAD]
    found += [v.name for v in model.graph.outputs
              if v.name not in found and ("grad" in v.name.lower())]
    return found


# ---- joint program -> ONNX training graph (gradients as outputs, seed as an input) ------------

SEED_INPUT = "loss_seed"


def joint_to_onnx(joint: torch.export.ExportedProgram) -> Any:
    """The joint program as ONNX: outputs ``loss`` and ``grad.<param>``, the backward seed as
    the scalar input ``loss_seed`` (feed 1.0), parameters as overridable inputs."""
    from torch.export import ExportedProgram
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import (
        ExportGraphSignature,
        InputKind,
        InputSpec,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )
    from torch.utils._pytree import tree_flatten

    from .export_io import _joint

    j = _joint(joint, "joint program")
    gm = j.gm
    from .marks import MARK_OP

    mark = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is MARK_OP)
    seed = mark.args[0]
    last_ph = gm.graph.find_nodes(op="placeholder")[-1]
    with gm.graph.inserting_after(last_ph):
        ph = gm.graph.placeholder(SEED_INPUT)
    ph.meta["val"] = seed.meta["val"]
    mark.replace_all_uses_with(ph)
    gm.graph.erase_node(mark)
    gm.graph.erase_node(seed)
    gm.graph.lint()
    gm.recompile()
    sig = joint.graph_signature
    in_specs = [*sig.input_specs, InputSpec(InputKind.USER_INPUT, TensorArgument(SEED_INPUT), None)]
    outs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(v.name), None)
            for v in roles.output_values(gm.graph)]
    n_user = len(j.inputs) + 1
    old = joint.module_call_graph[0].signature
    call = ModuleCallSignature(inputs=[], outputs=[], in_spec=tree_flatten((tuple(range(n_user)), {}))[1],
                               out_spec=tree_flatten(tuple(range(len(outs))))[1],
                               forward_arg_names=[*(old.forward_arg_names or j.inputs), SEED_INPUT])
    prog = ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=ExportGraphSignature(in_specs, outs),
        state_dict=dict(joint.state_dict), range_constraints={},
        module_call_graph=[ModuleCallEntry(fqn="", signature=call)], example_inputs=None,
        constants=dict(joint.constants))
    example = [torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
               for n in gm.graph.find_nodes(op="placeholder") if n.name in (*j.inputs, SEED_INPUT)]
    with quiet_torch():
        model = torch.onnx.export(prog, tuple(example), dynamo=True, verbose=False, optimize=False,
                                  verify=False).model
    graph = model.graph
    state = []
    for name, init in list(graph.initializers.items()):
        if init not in graph.inputs:
            graph.inputs.insert(len(state), init)
            state.append(name)
    role_map: dict[str, list[Any]] = {SEED_INPUT: [roles.SEED, None]}
    for value, (kind, target) in zip(graph.outputs, j.out_kinds, strict=True):
        value.name = {"loss": "loss", "grad": f"grad.{target}", "buffer": f"{target}.new"}.get(
            kind, value.name)
        role_map[value.name] = {"loss": [roles.LOSS, None], "grad": [roles.GRAD, target],
                                "buffer": [roles.BUFFER_UPDATE, target]}.get(kind, ["other", None])
    model.metadata_props[META_FILE] = json.dumps(
        {"format": "dlspass-joint", "kind": "joint", "state_inputs": state,
         "user_inputs": [*j.inputs, SEED_INPUT]}, sort_keys=True)
    model.metadata_props["dlspass_roles"] = json.dumps(role_map, sort_keys=True)
    return model


def save_joint_onnx(joint: torch.export.ExportedProgram, path: Path) -> None:
    """Write ``joint_to_onnx(joint)`` atomically to ``path``."""
    import onnx_ir as ir

    model = joint_to_onnx(joint)
    write_atomic(path, lambda tmp: ir.save(model, tmp))


# ---- ONNX training graph -> DLS (seed scaling, unscale, check, scale update) ------------------

class _DLSTail(torch.nn.Module):
    """Unscale, check (and clip) gradients and update the scaler state, for ONNX export."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, grads: list[torch.Tensor], state: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        from .scale_policy import ScalerState, dls_tail, update_state

        st = ScalerState(*state)
        out, isfinite, _norm = dls_tail(grads, st.loss_scale, self.config)
        new = update_state(st, isfinite, self.config) if self.config.dynamic else st
        return (*out, isfinite, *(s.clone() for s in new))


def transform_onnx(src: Path, out: Path, config: Any) -> None:
    """Insert DLS into an ONNX training graph (see ``insert_dls_onnx``) and save it atomically."""
    import onnx

    model = load_onnx(src)
    meta = onnx_meta(model)
    if meta is not None and meta.get("kind") == "step":
        raise InputError(f"{src}: already a dlspass training step; transform the original .pt2 instead")
    if not gradient_outputs(model):
        raise InputError(f"{src}: the ONNX model has no gradient outputs (not a training graph)")
    proto = insert_dls_onnx(onnx.load(str(src)), config, str(src))
    write_atomic(out, lambda tmp: onnx.save(proto, tmp))


def insert_dls_onnx(proto: Any, config: Any, source: str = "model") -> Any:
    """DLS in an ONNX training graph whose outputs are gradients (``onnx.ModelProto`` in and out).

    The backward seed must be a graph input tagged ``backward_seed`` in ``metadata_props``
    (``dlspass export -o joint.onnx`` makes it ``loss_seed``): post hoc, a constant seed inside
    the graph cannot be told apart from other constants, so it cannot be scaled. The seed is
    multiplied by the new input ``dlspass_scaler_loss_scale``; the gradients are unscaled,
    checked (and clipped) by the exported ``dls_tail``, and the scaler state is updated:
    outputs ``grad.<param>.unscaled`` (what the optimizer must use), ``dlspass_isfinite`` (skip
    the optimizer update when False) and ``dlspass_scaler_<field>.new``. Precision lowering is
    not applied to ONNX input (the graph keeps its own dtypes).
    """
    import onnx
    from onnx import compose, helper

    from .scale_policy import STATE_FIELDS, init_state

    if not config.enabled:
        raise InputError(f"{source}: loss scaling is off for this config; nothing to insert")
    props = {p.key: p.value for p in proto.metadata_props}
    tagged = json.loads(props.get("dlspass_roles", "{}"))
    seeds = [k for k, (r, _t) in tagged.items() if r == roles.SEED]
    input_names = [i.name for i in proto.graph.input]
    if len(seeds) != 1 or seeds[0] not in input_names:
        raise InputError(f"{source}: no backward-seed graph input (tag one as 'backward_seed' in "
                         "metadata_props['dlspass_roles'], or export with `dlspass export -o x.onnx`)")
    seed = seeds[0]
    grad_names = [o.name for o in proto.graph.output if tagged.get(o.name, [None])[0] == roles.GRAD]
    if not grad_names:
        raise InputError(f"{source}: no output is tagged as a gradient in metadata_props['dlspass_roles']")
    # the tail, exported by torch from the same policy code the FX passes splice in
    types = {vi.name: vi.type.tensor_type for vi in proto.graph.output}
    grads_ex = [torch.zeros([d.dim_value for d in types[n].shape.dim],
                            dtype=_torch_dtype(types[n].elem_type)) for n in grad_names]
    state0 = list(init_state(config))
    with quiet_torch():
        tail = torch.onnx.export(_DLSTail(config), (grads_ex, state0), dynamo=True, verbose=False,
                                 optimize=True, verify=False,
                                 opset_version=_opset(proto)).model_proto
    tail = compose.add_prefix(tail, "dlspass_tail/")
    g = proto.graph
    state_names = [f"dlspass_scaler_{f}" for f in STATE_FIELDS]
    rename = dict(zip([i.name for i in tail.graph.input], [*grad_names, *state_names], strict=True))
    out_names = ([f"{n}.unscaled" for n in grad_names] + ["dlspass_isfinite"]
                 + [f"{n}.new" for n in state_names])
    rename.update(zip([o.name for o in tail.graph.output], out_names, strict=True))
    scaled = "dlspass_scaled_seed"
    for node in g.node:
        for k, name in enumerate(node.input):
            if name == seed:
                node.input[k] = scaled
    g.node.insert(0, helper.make_node("Mul", [seed, state_names[0]], [scaled], name="dlspass_scale_seed"))
    for node in tail.graph.node:
        for k, name in enumerate(node.input):
            node.input[k] = rename.get(name, name)
        for k, name in enumerate(node.output):
            node.output[k] = rename.get(name, name)
    g.node.extend(tail.graph.node)
    g.initializer.extend(tail.graph.initializer)
    for vi, name in zip(tail.graph.input[len(grad_names):], state_names, strict=True):
        vi.name = name
        g.input.append(vi)
    kept = [o for o in g.output if o.name not in grad_names]
    del g.output[:]
    g.output.extend(kept)
    for vi, name in zip(tail.graph.output, out_names, strict=True):
        vi.name = name
        g.output.append(vi)
    have = {(f.domain, f.name) for f in proto.functions}
    proto.functions.extend(f for f in tail.functions if (f.domain, f.name) not in have)
    domains = {o.domain for o in proto.opset_import}
    proto.opset_import.extend(o for o in tail.opset_import if o.domain not in domains)
    meta = json.loads(props.get(META_FILE, "{}") or "{}")
    meta.update({"kind": "onnx_dls", "config": config.to_dict(), "state_inputs_dls": state_names,
                 "outputs": [o.name for o in g.output]})
    tagged.update({n: [roles.UNSCALE, t] for n, t in
                   ((f"{gname}.unscaled", tagged[gname][1]) for gname in grad_names)})
    tagged["dlspass_isfinite"] = [roles.ISFINITE, None]
    tagged.update({f"{n}.new": [roles.SCALER_STATE_UPDATE, f] for n, f in zip(state_names, STATE_FIELDS, strict=True)})
    helper.set_model_props(proto, {**props, META_FILE: json.dumps(meta, sort_keys=True),
                                   "dlspass_roles": json.dumps(tagged, sort_keys=True)})
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:
        raise InputError(f"{source}: the model with DLS inserted does not validate "
                         f"({str(e).splitlines()[0]})") from None
    return proto


def _torch_dtype(elem_type: int) -> torch.dtype:
    from onnx import TensorProto

    table = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
             TensorProto.BFLOAT16: torch.bfloat16, TensorProto.DOUBLE: torch.float64}
    if elem_type not in table:
        raise InputError(f"gradient outputs must be floating point, got ONNX type {elem_type}")
    return table[elem_type]


def _opset(proto: Any) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 18)
