"""LowerPrecisionOnnxPass: every float32 input and output of MatMul/Gemm/Conv/ConvTranspose is rounded to the 16-bit format (fp32 containers)."""

from __future__ import annotations

import json
from collections.abc import Callable

import onnx
import onnx_ir as ir
import torch

from dlspass.errors import GraphContractError, InputValueError
from dlspass.files.file_meta import META_FILE
from dlspass.files.quiet import quiet_torch
from dlspass.formats import round_arith
from dlspass.graph import roles
from dlspass.graph.onnx_opset import default_opset

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

CAST_ROLE_KEY = roles.ROLE_KEY
"""``Node.metadata_props`` key of the nodes dlspass inserted (value: a ``roles`` name)."""

_ONNX_DTYPES = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}
_FORMATS = (*_ONNX_DTYPES, "cbfloat16")
_PASS = "lower_precision"


class LowerPrecisionOnnxPass(ir.passes.InPlacePass):
    """Round every float32 input and output of MatMul/Gemm/Conv/ConvTranspose to ``fmt``,
    keeping float32 containers.

    Rules:

    1. float16/bfloat16 round with ``Cast(to=16-bit)`` then ``Cast(to=FLOAT)``; cbfloat16 with
       the float-only ``dlspass.formats.round_arith``, exported once by torch and copied in
       per value (its constants once, as initializers named ``dlspass_round_cbfloat16/...``).
    2. An input already rounded (a rounding's output, possibly through views, ``Relu``, ``Neg``
       or ``MaxPool``) is read as is; each value is rounded at most once however many ops read it.
    3. A view (Transpose, Reshape, ...) of a rounded value is rebuilt from the rounded value
       (a copy tagged ``dlspass_pass=lower_precision``), not rounded again; an unrounded view of
       a whole value rounds that value instead, so that its other views share the rounding.
    4. An op's output ``y`` keeps its name on the rounded value (the raw result becomes
       ``y.unrounded``), so graph outputs and every reader see the rounded value.
    5. Inserted rounding nodes carry ``metadata_props[dlspass_role] = "cast"``; the rounded
       values are tagged ``cast`` in the model's ``dlspass_roles`` and ``dlspass.json`` records
       ``precision`` and ``lower_precision`` in ``applied_passes``.

    A model that already has dlspass casts, or an unknown ``fmt``, is an ``InputValueError``.
    """

    def __init__(self, fmt: str, source: str = "model") -> None:
        super().__init__()
        self.fmt = fmt
        self.source = source

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        # checked here, not in requires(): the pass infrastructure would wrap the InputValueError
        if self.fmt not in _FORMATS:
            raise InputValueError(f"{self.source}: cannot lower ONNX precision to {self.fmt!r} "
                                  "(expected float16, bfloat16 or cbfloat16)")
        graph = model.graph
        if any(n.metadata_props.get(CAST_ROLE_KEY) == roles.CAST for n in graph):
            raise InputValueError(f"{self.source}: the ONNX model already has dlspass precision casts")
        targets = [n for n in graph if n.op_type in LOWERED_OPS and n.domain in ("", "ai.onnx")]
        rounder = _Rounder(graph, _RoundTemplate(self.fmt, default_opset(model), graph),
                           _float_test(model, targets))
        for node in targets:
            rounder.lower(node)
        _record(model, self.fmt, sorted(v.name for v in rounder.cast_outputs), targets)
        return ir.passes.PassResult(model, modified=True)  # the metadata changes in any case


def _float_test(model: ir.Model, targets: list[ir.Node]) -> Callable[[ir.Value], bool]:
    """Whether a value is float32; by ONNX shape inference where the file leaves a lowered
    op's value untyped (inference only informs this test: the model is not changed)."""
    inferred: dict[str, int] = {}
    if any(v is not None and v.name and v.dtype is None for n in targets for v in (*n.inputs, *n.outputs)):
        proto = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model))
        g = proto.graph
        inferred = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.value_info, *g.output)
                    if vi.type.HasField("tensor_type")}
        inferred.update({t.name: t.data_type for t in g.initializer})

    def is_float(v: ir.Value) -> bool:
        if v.dtype is not None:
            return v.dtype == ir.DataType.FLOAT
        return inferred.get(v.name or "") == onnx.TensorProto.FLOAT

    return is_float


class _Rounder:
    """The rewrite: roundings in front of and behind each lowered op, with the bookkeeping
    (what is rounded, through which views) that keeps every value rounded once."""

    def __init__(self, graph: ir.Graph, template: _RoundTemplate,
                 is_float: Callable[[ir.Value], bool]) -> None:
        self.graph = graph
        self.template = template
        self.fmt = template.fmt
        self.is_float = is_float
        # ONNX needs unique value names; onnx_ir keeps the names it is given
        self.taken = {v.name for v in graph.inputs} | set(graph.initializers) | {
            o.name for n in graph for o in n.outputs}
        self.cast_outputs: set[ir.Value] = set()
        self.known: dict[ir.Value, bool] = {}          # is_rounded, memoized
        self.rounded: dict[ir.Value, ir.Value] = {}    # value -> its rounded equivalent
        self.pending: list[ir.Node] = []               # nodes to insert before the current op

    def fresh(self, name: str) -> str:
        out, i = name, 0
        while out in self.taken:
            i += 1
            out = f"{name}.{i}"
        self.taken.add(out)
        return out

    def lower(self, node: ir.Node) -> None:
        """Round ``node``'s float inputs (reusing roundings) and its float outputs."""
        for k, x in enumerate(node.inputs):
            if x is None or not self.is_float(x) or self.is_rounded(x):
                continue
            if self.via_view(x) is None:
                base = x
                while (src := base.producer()) is not None and src.op_type in _RESHAPING_OPS \
                        and src.inputs and src.inputs[0] is not None and self.is_float(src.inputs[0]) \
                        and base is src.outputs[0]:
                    base = src.inputs[0]
                out = ir.Value(name=self.fresh(f"{base.name}.{self.fmt}"))
                self.rounded[base] = out
                self.pending += self.template.nodes(base, out)
                self.cast_outputs.add(out)
                self.via_view(x)
            node.replace_input_with(k, self.rounded[x])
        if self.pending:
            self.graph.insert_before(node, self.pending)
            self.pending = []
        after = node
        for raw in node.outputs:
            if not raw.name or not self.is_float(raw):
                continue
            name = raw.name
            raw.name = self.fresh(f"{name}.unrounded")
            out = ir.Value(name=name, type=raw.type, shape=raw.shape.copy() if raw.shape else None)
            ir.convenience.replace_all_uses_with(raw, out, replace_graph_outputs=True)
            made = self.template.nodes(raw, out)
            self.graph.insert_after(after, made)
            after = made[-1]
            self.cast_outputs.add(out)
            self.known[out] = True
            self.rounded[out] = out

    def is_rounded(self, value: ir.Value) -> bool:
        """Whether ``value`` is a rounding's output, possibly through value-preserving ops.
        Iterative: a chain of thousands of ops before a MatMul must not exhaust the stack
        (and a cycle, which a crafted file can hold, must not loop)."""
        chain: list[ir.Value] = []
        on_chain: set[ir.Value] = set()
        cur = value
        while cur not in self.known:
            src = cur.producer()
            if cur in self.cast_outputs:
                self.known[cur] = True
            elif cur in on_chain or src is None or src.op_type not in _PRESERVING_OPS \
                    or cur is not src.outputs[0] or not src.inputs or src.inputs[0] is None:
                self.known[cur] = False
            else:
                chain.append(cur)
                on_chain.add(cur)
                cur = src.inputs[0]
        for v in chain:
            self.known[v] = self.known[cur]
        return self.known[value]

    def via_view(self, x: ir.Value) -> ir.Value | None:
        """``x`` rebuilt from an already rounded value by a copy of the data movement that
        made it (the backward's Transpose of a forward weight, say): no second rounding.
        Walks down the chain of data movement iteratively, then copies it bottom-up."""
        chain: list[tuple[ir.Value, ir.Node]] = []
        on_chain: set[ir.Value] = set()
        cur = x
        while cur not in self.rounded:
            src = cur.producer()
            if src is None or src.op_type not in _MOVING_OPS or not src.inputs \
                    or src.inputs[0] is None or cur in on_chain:
                return None
            chain.append((cur, src))
            on_chain.add(cur)
            if self.is_rounded(src.inputs[0]):
                base = src.inputs[0]
                break
            cur = src.inputs[0]
        else:
            base = self.rounded[cur]
        for cur, src in reversed(chain):
            outs = [ir.Value(name=self.fresh(f"{o.name}.{self.fmt}") if o.name else "")
                    for o in src.outputs]
            view = ir.Node(src.domain, src.op_type, [base, *src.inputs[1:]],
                           attributes=list(src.attributes.values()), outputs=outs,
                           overload=src.overload, version=src.version, doc_string=src.doc_string,
                           name=self.fresh(f"dlspass_view/{src.name or src.op_type}"),
                           metadata_props={roles.PASS_KEY: _PASS})
            for o, v in zip(src.outputs, outs, strict=True):
                if o.name:
                    self.rounded[o] = v
                    self.known[v] = True
            self.pending.append(view)
            base = self.rounded[cur]
        return self.rounded[x]


class _RoundTemplate:
    """The nodes that round one float32 value to ``fmt``, instantiated per value."""

    _ARITH: dict[int, ir.Model] = {}  # opset -> exported round_arith(x, "cbfloat16")

    def __init__(self, fmt: str, opset: int, graph: ir.Graph) -> None:
        self.fmt = fmt
        self.graph = graph
        self.count = 0
        self.model = None if fmt in _ONNX_DTYPES else self._arith(opset)
        self.prefix = f"dlspass_round_{fmt}/"
        self._constants: dict[ir.Value, ir.Value] = {}  # template initializer -> graph's copy

    @classmethod
    def _arith(cls, opset: int) -> ir.Model:
        if opset not in cls._ARITH:
            class Round(torch.nn.Module):
                def forward(self, x: torch.Tensor) -> torch.Tensor:
                    return round_arith(x, "cbfloat16")

            with quiet_torch():
                model = torch.onnx.export(
                    Round(), (torch.zeros(3),), dynamo=True, verbose=False, optimize=True,
                    verify=False, opset_version=opset,
                    dynamic_shapes=({0: torch.export.Dim.DYNAMIC},)).model
            if model.functions:
                raise GraphContractError("round_arith exported with ONNX functions; cannot splice it")
            cls._ARITH[opset] = model
        return cls._ARITH[opset]

    def nodes(self, x: ir.Value, out: ir.Value) -> list[ir.Node]:
        """Nodes reading ``x`` and writing its rounded value into ``out`` (not yet produced)."""
        self.count += 1
        tag = f"dlspass_round/{self.count}"
        meta = {CAST_ROLE_KEY: roles.CAST, roles.PASS_KEY: _PASS, "dlspass_format": self.fmt}
        if self.model is None:
            down = ir.Node("", "Cast", [x], [ir.AttrInt64("to", _ONNX_DTYPES[self.fmt])],
                           outputs=[ir.Value(name=f"{out.name}/{self.fmt}")], name=f"{tag}/down",
                           metadata_props=dict(meta))
            up = ir.Node("", "Cast", down.outputs, [ir.AttrInt64("to", ir.DataType.FLOAT)],
                         outputs=[out], name=f"{tag}/up", metadata_props=dict(meta))
            return [down, up]
        g = self.model.graph
        values: dict[ir.Value, ir.Value] = {g.inputs[0]: x}
        made = []
        for i, src in enumerate(g):
            inputs = [None if v is None else values[v] if v in values else self._constant(v)
                      for v in src.inputs]
            outs = [out if o is g.outputs[0] else ir.Value(name=f"{out.name}/{o.name}" if o.name else "")
                    for o in src.outputs]
            values.update(zip(src.outputs, outs, strict=True))
            made.append(ir.Node(src.domain, src.op_type, inputs, attributes=list(src.attributes.values()),
                                outputs=outs, overload=src.overload, version=src.version,
                                name=f"{tag}/{i}", metadata_props=dict(meta)))
        return made

    def _constant(self, v: ir.Value) -> ir.Value:
        """The graph's initializer for the template's constant ``v`` (added on first use)."""
        if v not in self._constants:
            if v.const_value is None:
                raise GraphContractError(f"round_arith's value {v.name!r} is neither computed nor constant")
            c = ir.Value(name=self.prefix + (v.name or ""), type=v.type,
                         shape=v.shape.copy() if v.shape else None, const_value=v.const_value)
            self.graph.register_initializer(c)
            self._constants[v] = c
        return self._constants[v]


def _record(model: ir.Model, fmt: str, rounded: list[str], targets: list[ir.Node]) -> None:
    """The rounded values' ``cast`` roles and the ``precision`` record in the model's metadata."""
    props = model.metadata_props
    tagged = json.loads(props.get(roles.ONNX_ROLES_KEY, "{}"))
    tagged.update({v: [roles.CAST, fmt] for v in rounded if v not in tagged})
    meta = json.loads(props.get(META_FILE, "{}") or "{}")
    meta["precision"] = {"fp16_type": fmt, "rounded_values": len(rounded),
                         "lowered_ops": sorted({n.op_type for n in targets})}
    meta["applied_passes"] = [*meta.get("applied_passes", []), _PASS]
    props[META_FILE] = json.dumps(meta, sort_keys=True)
    props[roles.ONNX_ROLES_KEY] = json.dumps(tagged, sort_keys=True)


def lower_precision_onnx(model: ir.Model | onnx.ModelProto, fmt: str, source: str = "model") -> int:
    """``LowerPrecisionOnnxPass(fmt)`` on ``model``, edited in place (an ``onnx.ModelProto`` is
    rewritten through onnx_ir); returns the number of values rounded."""
    ir_model = ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else model
    LowerPrecisionOnnxPass(fmt, source)(ir_model)
    if ir_model is not model:
        model.CopyFrom(ir.serde.serialize_model(ir_model))
    return json.loads(ir_model.metadata_props[META_FILE])["precision"]["rounded_values"]
