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
``metadata_props``); ``transform_onnx`` lowers its precision and adds DLS.
``lower_precision_onnx`` rounds every float input and output of MatMul/Gemm/Conv/ConvTranspose
(forward and backward) to the 16-bit format in fp32 containers, like the FX
``LowerPrecisionPass``: ``Cast`` down and up for float16/bfloat16, the exact float-only
``round_arith`` (exported by torch, spliced per value) for cbfloat16.
``insert_dls_onnx`` adds DLS to such a graph: seed × scale, then the
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

from dlspass.capture.exported import META_FILE, InputError, quiet_torch, write_atomic
from dlspass.capture.program import flat_tuple_spec, make_program, user_outputs
from dlspass.files.file_meta import check_onnx_meta
from dlspass.graph import roles


def _bool_where_to_logic(gm: fx.GraphModule) -> int:
    """``where(c, a, b)`` on bool tensors -> ``(c & a) | (~c & b)``: ORT's CPU Where has no bool kernel."""
    from dlspass.graph.splice import set_fake_val

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


def _relabelled(step: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of ``step`` whose outputs are all USER_OUTPUT with a flat-tuple out_spec."""
    from dlspass.formats import decompose_rounding

    gm = copy.deepcopy(step.graph_module)
    constants = sum(n.op == "get_attr" for n in gm.graph.nodes)
    decompose_rounding(gm, form="arith")
    if sum(n.op == "get_attr" for n in gm.graph.nodes) != constants:
        raise RuntimeError("round_arith traced a tensor constant; cannot splice it into the program")
    _bool_where_to_logic(gm)
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

    from dlspass.capture.exported import check_input_file

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
    check_onnx_meta(model.metadata_props, str(p))
    _check_external_data(p)
    return model


MAX_LOCATION_CHARS = 1024


def _check_external_data(p: Path) -> None:
    """Every external-data reference must name a regular file inside the model's folder, and
    its offset and length must lie inside that file: ``onnx.load`` would otherwise read any
    file the path reaches, block on a FIFO, or fail with an exception of its own."""
    import os
    import stat

    import onnx
    from onnx import TensorProto

    from dlspass.files.bounded_text import excerpt

    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as e:
        raise InputError(f"{p}: cannot read the ONNX model ({type(e).__name__}: "
                         f"{excerpt(str(e), 120)})") from None
    base = os.path.realpath(p.parent)
    for t in _all_tensors(proto):
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        where = f"{p}: tensor {excerpt(t.name, 80)} stores its data in {excerpt(loc, 80)}"
        parts = loc.replace("\\", "/").split("/")
        if not loc or len(loc) > MAX_LOCATION_CHARS or "\0" in loc or os.path.isabs(loc) \
                or ".." in parts or any(len(c) > 255 for c in parts):
            raise InputError(f"{where}, which is not a short relative path inside the model's folder")
        target = os.path.realpath(os.path.join(base, loc))
        if os.path.commonpath([base, target]) != base:
            raise InputError(f"{where}, which leads outside the model's folder")
        try:
            st = os.stat(target)
        except OSError as e:
            raise InputError(f"{where}, which cannot be read ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{where}, which is not a regular file")
        try:
            offset = int(info.get("offset", "0"))
            length = int(info.get("length", str(st.st_size - offset)))
        except ValueError:
            raise InputError(f"{where} at an offset or length that is not a number") from None
        if offset < 0 or length < 0 or offset + length > st.st_size:
            raise InputError(f"{where} at bytes {offset}..{offset + length}, outside the "
                             f"{st.st_size:,}-byte file")


def _all_tensors(proto: Any) -> Any:
    """Every TensorProto of a model: initializers and node attributes, in every subgraph and
    function (walked with a stack, not recursion)."""
    stack = [proto.graph, *proto.functions]
    while stack:
        g = stack.pop()
        if hasattr(g, "initializer"):
            yield from g.initializer
            for sparse in g.sparse_initializer:
                yield sparse.values
                yield sparse.indices
        for node in g.node:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                if a.HasField("g"):
                    stack.append(a.g)
                stack.extend(a.graphs)


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
    tagged = json.loads(model.metadata_props.get(roles.ONNX_ROLES_KEY, "{}"))
    found = [name for name, (role, _t) in tagged.items() if role == roles.GRAD]
    found += [v.name for v in model.graph.outputs
              if v.name not in found and ("grad" in v.name.lower())]
    return found


# ---- joint program -> ONNX training graph (gradients as outputs, seed as an input) ------------

SEED_INPUT = "loss_seed"


def joint_to_onnx(joint: torch.export.ExportedProgram) -> Any:
    """The joint program as ONNX: outputs ``loss`` and ``grad.<param>``, the backward seed as
    the scalar input ``loss_seed`` (feed 1.0), parameters as overridable inputs."""
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
    from torch.utils._pytree import tree_flatten

    from dlspass.capture.exported import _joint
    from dlspass.passes.lift_seed_pass import LiftSeedPass

    j = _joint(joint, "joint program")
    gm = j.gm
    LiftSeedPass(SEED_INPUT)(gm)
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
    model.metadata_props[META_FILE] = json.dumps(
        {"format": "dlspass-joint", "kind": "joint", "state_inputs": state,
         "user_inputs": [*j.inputs, SEED_INPUT]}, sort_keys=True)
    model.metadata_props[roles.ONNX_ROLES_KEY] = json.dumps(role_map, sort_keys=True)
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
        from dlspass.scale_policy import ScalerState, dls_tail, update_state

        st = ScalerState(*state)
        out, isfinite, _norm = dls_tail(grads, st.loss_scale, self.config)
        new = update_state(st, isfinite, self.config) if self.config.dynamic else st
        return (*out, isfinite, *(s.clone() for s in new))


def transform_onnx(src: Path, out: Path, config: Any) -> None:
    """Lower the precision of an ONNX training graph (``lower_precision_onnx``, when
    ``config.mixed_precision``) and insert DLS (``insert_dls_onnx``, when ``config.enabled``;
    bfloat16 gets the casts only), then save it atomically."""
    import onnx

    model = load_onnx(src)
    meta = onnx_meta(model)
    if meta is not None and meta.get("kind") == "step":
        raise InputError(f"{src}: already a dlspass training step; transform the original .pt2 instead")
    if not gradient_outputs(model):
        raise InputError(f"{src}: the ONNX model has no gradient outputs (not a training graph)")
    if not config.mixed_precision and not config.enabled:
        raise InputError(f"{src}: mixed precision and loss scaling are both off for this config; "
                         "nothing to insert")
    proto = onnx.load(str(src))
    if config.mixed_precision:
        # before the DLS tail is grafted: the tail's math stays fp32, like the FX pipeline's
        lower_precision_onnx(proto, config.fp16_type, str(src))
    if config.enabled:
        proto = insert_dls_onnx(proto, config, str(src))
    _check(proto, str(src))
    write_atomic(out, lambda tmp: onnx.save(proto, tmp))


# ---- ONNX training graph -> 16-bit matmuls and convolutions (fp32 containers) -----------------

LOWERED_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})
"""ONNX ops whose float inputs and outputs are rounded to the 16-bit format (forward and
backward alike: the training graph's backward matmuls are ordinary MatMul/Gemm/Conv nodes)."""

# Ops whose first output holds only values of their first input (or zero, or a sign flip):
# a rounded value stays rounded through them, so it is not rounded again.
_MOVING_OPS = frozenset({"Identity", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
                         "Expand", "Slice", "Gather", "Split"})
_PRESERVING_OPS = _MOVING_OPS | {"Relu", "Neg", "MaxPool"}
# Data movement that keeps every element (a view of the whole value): round its source instead,
# so that other views of the same source reuse that one rounding.
_RESHAPING_OPS = frozenset({"Identity", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze"})

CAST_ROLE_KEY = "dlspass_role"
"""``NodeProto.metadata_props`` key of the nodes dlspass inserted (value: a ``roles`` name)."""

_ONNX_DTYPES = {"float16": 10, "bfloat16": 16}  # TensorProto.FLOAT16 / BFLOAT16


def lower_precision_onnx(proto: Any, fmt: str, source: str = "model") -> int:
    """Round every float32 input and output of MatMul/Gemm/Conv/ConvTranspose in ``proto`` (an
    ``onnx.ModelProto``, edited in place) to ``fmt``, keeping float32 containers; returns the
    number of values rounded.

    float16/bfloat16 round with ``Cast(to=16-bit)`` then ``Cast(to=FLOAT)``; cbfloat16 with
    the float-only ``dlspass.formats.round_arith``, exported once by torch and spliced in. An
    input already rounded (a rounding's output, possibly through views or ``Relu``) is read as
    is, and each value is rounded at most once however many ops read it; a view (Transpose,
    Reshape, ...) of a rounded value is rebuilt from the rounded value, not rounded again. An
    op's output ``y`` keeps its name on the rounded value (the raw result becomes
    ``y.unrounded``), so graph outputs and every reader see the rounded value. Inserted nodes carry
    ``metadata_props[dlspass_role] = "cast"``; the rounded values are tagged ``cast`` in
    ``metadata_props["dlspass_roles"]`` of the model.
    """
    from onnx import helper

    if fmt not in (*_ONNX_DTYPES, "cbfloat16"):
        raise InputError(f"{source}: cannot lower ONNX precision to {fmt!r} "
                         "(expected float16, bfloat16 or cbfloat16)")
    g = proto.graph
    if any(_node_role(n) == roles.CAST for n in g.node):
        raise InputError(f"{source}: the ONNX model already has dlspass precision casts")
    types = _elem_types(proto)
    targets = [n for n in g.node if n.op_type in LOWERED_OPS and n.domain in ("", "ai.onnx")]
    if any(v and v not in types for n in targets for v in (*n.input, *n.output)):
        import onnx

        types = _elem_types(onnx.shape_inference.infer_shapes(proto))
    producer = {o: n for n in g.node for o in n.output}
    taken = {*producer, *(v.name for v in g.input), *(t.name for t in g.initializer)}
    target_ids = {id(n) for n in targets}
    cast_outputs: set[str] = set()
    known: dict[str, bool] = {}

    def is_rounded(name: str) -> bool:
        """Whether ``name`` is a rounding's output, possibly through value-preserving ops.
        Iterative: a chain of thousands of ops before a MatMul must not exhaust the stack
        (and a cycle, which a crafted file can hold, must not loop)."""
        chain: list[str] = []
        on_chain: set[str] = set()
        cur = name
        while cur not in known:
            src = producer.get(cur)
            if cur in cast_outputs:
                known[cur] = True
            elif cur in on_chain or src is None or src.op_type not in _PRESERVING_OPS \
                    or cur != src.output[0] or not src.input:
                known[cur] = False
            else:
                chain.append(cur)
                on_chain.add(cur)
                cur = src.input[0]
        for n in chain:
            known[n] = known[cur]
        return known[name]

    template = _RoundTemplate(fmt, _opset(proto))
    rounded: dict[str, str] = {}
    nodes: list[Any] = []

    def via_view(x: str) -> str | None:
        """``x`` rebuilt from an already rounded value by a copy of the data movement that
        made it (the backward's Transpose of a forward weight, say): no second rounding.
        Walks down the chain of data movement iteratively, then copies it bottom-up."""
        from onnx import NodeProto, StringStringEntryProto

        chain: list[tuple[str, Any]] = []
        on_chain: set[str] = set()
        cur = x
        while cur not in rounded:
            src = producer.get(cur)
            if src is None or src.op_type not in _MOVING_OPS or not src.input \
                    or cur not in src.output or cur in on_chain:
                return None
            chain.append((cur, src))
            on_chain.add(cur)
            if is_rounded(src.input[0]):
                base = src.input[0]
                break
            cur = src.input[0]
        else:
            base = rounded[cur]
        for cur, src in reversed(chain):
            view = NodeProto()
            view.CopyFrom(src)
            del view.metadata_props[:]
            view.metadata_props.append(StringStringEntryProto(key="dlspass_pass", value="lower_precision"))
            view.name = _fresh(f"dlspass_view/{src.name or src.op_type}", taken)
            view.input[0] = base
            for k, o in enumerate(src.output):
                if o:
                    view.output[k] = _fresh(f"{o}.{fmt}", taken)
                    rounded[o] = view.output[k]
                    known[view.output[k]] = True
            nodes.append(view)
            base = rounded[cur]
        return rounded[x]

    for node in list(g.node):
        if id(node) not in target_ids:
            nodes.append(node)
            continue
        for k, x in enumerate(node.input):
            if not x or types.get(x) != 1 or is_rounded(x):  # 1: TensorProto.FLOAT
                continue
            if via_view(x) is None:
                base = x
                while (src := producer.get(base)) is not None and src.op_type in _RESHAPING_OPS \
                        and src.input and types.get(src.input[0]) == 1 and base == src.output[0]:
                    base = src.input[0]
                rounded[base] = _fresh(f"{base}.{fmt}", taken)
                nodes += template.nodes(base, rounded[base])
                cast_outputs.add(rounded[base])
                via_view(x)
            node.input[k] = rounded[x]
        nodes.append(node)
        for k, y in enumerate(node.output):
            if not y or types.get(y) != 1:
                continue
            raw = _fresh(f"{y}.unrounded", taken)
            node.output[k] = raw
            producer[raw] = node
            nodes += template.nodes(raw, y)
            cast_outputs.add(y)
            known[y] = True
            rounded[y] = y
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(template.used_initializers())
    props = {p.key: p.value for p in proto.metadata_props}
    tagged = json.loads(props.get("dlspass_roles", "{}"))
    tagged.update({v: [roles.CAST, fmt] for v in sorted(cast_outputs) if v not in tagged})
    meta = json.loads(props.get(META_FILE, "{}") or "{}")
    meta["precision"] = {"fp16_type": fmt, "rounded_values": len(cast_outputs),
                         "lowered_ops": sorted({n.op_type for n in targets})}
    meta["applied_passes"] = [*meta.get("applied_passes", []), "lower_precision"]
    helper.set_model_props(proto, {**props, META_FILE: json.dumps(meta, sort_keys=True),
                                   "dlspass_roles": json.dumps(tagged, sort_keys=True)})
    return len(cast_outputs)


def _node_role(node: Any) -> str | None:
    return next((p.value for p in node.metadata_props if p.key == CAST_ROLE_KEY), None)


def _elem_types(proto: Any) -> dict[str, int]:
    g = proto.graph
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in (*g.input, *g.value_info, *g.output) if vi.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in g.initializer})
    return {k: v for k, v in types.items() if v}


def _fresh(name: str, taken: set[str]) -> str:
    out, i = name, 0
    while out in taken:
        i += 1
        out = f"{name}.{i}"
    taken.add(out)
    return out


class _RoundTemplate:
    """The nodes that round one float32 value to ``fmt``, instantiated per value."""

    _ARITH: dict[int, Any] = {}  # opset -> exported round_arith(x, "cbfloat16") ModelProto

    def __init__(self, fmt: str, opset: int) -> None:
        self.fmt = fmt
        self.count = 0
        self.model = None if fmt in _ONNX_DTYPES else self._arith(opset)
        self.prefix = f"dlspass_round_{fmt}/"

    @classmethod
    def _arith(cls, opset: int) -> Any:
        if opset not in cls._ARITH:
            from dlspass.formats import round_arith

            class Round(torch.nn.Module):
                def forward(self, x: torch.Tensor) -> torch.Tensor:
                    return round_arith(x, "cbfloat16")

            with quiet_torch():
                cls._ARITH[opset] = torch.onnx.export(
                    Round(), (torch.zeros(3),), dynamo=True, verbose=False, optimize=True,
                    verify=False, opset_version=opset,
                    dynamic_shapes=({0: torch.export.Dim.DYNAMIC},)).model_proto
            if cls._ARITH[opset].functions:
                raise RuntimeError("round_arith exported with ONNX functions; cannot splice it")
        return cls._ARITH[opset]

    def nodes(self, x: str, out: str) -> list[Any]:
        """Nodes reading ``x`` and writing its rounded value as ``out``."""
        from onnx import NodeProto, StringStringEntryProto, helper

        self.count += 1
        tag = f"dlspass_round/{self.count}"
        if self.model is None:
            made = [helper.make_node("Cast", [x], [f"{out}/{self.fmt}"], name=f"{tag}/down",
                                     to=_ONNX_DTYPES[self.fmt]),
                    helper.make_node("Cast", [f"{out}/{self.fmt}"], [out], name=f"{tag}/up", to=1)]
        else:
            g = self.model.graph
            inits = {t.name for t in g.initializer}
            rename = {g.input[0].name: x, g.output[0].name: out}
            made = []
            for i, src in enumerate(g.node):
                n = NodeProto()
                n.CopyFrom(src)
                del n.metadata_props[:]
                n.name = f"{tag}/{i}"
                for field in (n.input, n.output):
                    for k, v in enumerate(field):
                        if v:
                            field[k] = rename.get(v) or (self.prefix + v if v in inits else f"{out}/{v}")
                made.append(n)
        for n in made:
            n.metadata_props.extend([StringStringEntryProto(key=CAST_ROLE_KEY, value=roles.CAST),
                                     StringStringEntryProto(key="dlspass_pass", value="lower_precision"),
                                     StringStringEntryProto(key="dlspass_format", value=self.fmt)])
        return made

    def used_initializers(self) -> list[Any]:
        """The rounding's constants, once (named under ``dlspass_round_<fmt>/``)."""
        from onnx import TensorProto

        if self.model is None or not self.count:
            return []
        out = []
        for t in self.model.graph.initializer:
            c = TensorProto()
            c.CopyFrom(t)
            c.name = self.prefix + t.name
            out.append(c)
        return out


def insert_dls_onnx(proto: Any, config: Any, source: str = "model") -> Any:
    """DLS in an ONNX training graph whose outputs are gradients (``onnx.ModelProto`` in and out).

    The backward seed must be a graph input tagged ``backward_seed`` in ``metadata_props``
    (``dlspass export -o joint.onnx`` makes it ``loss_seed``): post hoc, a constant seed inside
    the graph cannot be told apart from other constants, so it cannot be scaled. The seed is
    multiplied by the new input ``dlspass_scaler_loss_scale``; the gradients are unscaled,
    checked (and clipped) by the exported ``dls_tail``, and the scaler state is updated:
    outputs ``grad.<param>.unscaled`` (what the optimizer must use), ``dlspass_isfinite`` (skip
    the optimizer update when False) and ``dlspass_scaler_<field>.new``. Precision lowering is
    ``lower_precision_onnx``'s (``transform_onnx`` runs it first).
    """
    from onnx import compose, helper

    from dlspass.scale_policy import STATE_FIELDS, init_state

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
    _check(proto, source)
    return proto


def _check(proto: Any, source: str) -> None:
    import onnx

    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:
        raise InputError(f"{source}: the transformed ONNX model does not validate "
                         f"({str(e).splitlines()[0]})") from None


def _torch_dtype(elem_type: int) -> torch.dtype:
    from onnx import TensorProto

    table = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
             TensorProto.BFLOAT16: torch.bfloat16, TensorProto.DOUBLE: torch.float64}
    if elem_type not in table:
        raise InputError(f"gradient outputs must be floating point, got ONNX type {elem_type}")
    return table[elem_type]


def _opset(proto: Any) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 18)
