"""Reading an ONNX model that a user hands in: ``load_onnx`` (with the checks a damaged or
hostile file needs), the dlspass metadata it carries, and ``check_onnx`` for what we write."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from onnx import TensorProto

from dlspass.errors import InputValueError
from dlspass.files.bounded_text import excerpt
from dlspass.files.file_meta import META_FILE, check_onnx_meta
from dlspass.files.paths import check_input_file
from dlspass.files.quiet import quiet_torch
from dlspass.graph import roles

MAX_LOCATION_CHARS = 1024


def load_onnx(path: str | Path) -> ir.Model:
    """An ``onnx_ir.Model`` from ``path``; ``InputValueError`` when it is not a readable ONNX model.

    External data stays on disk (read when the model is saved), and every reference to it has
    been checked to stay inside the model's folder."""
    p = check_input_file(path, (".onnx",))
    try:
        with quiet_torch():
            model = ir.load(str(p))
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputValueError(f"{p}: cannot read the ONNX model ({type(e).__name__}: {first[:200]})") from None
    if not model.graph.outputs:
        raise InputValueError(f"{p}: the ONNX model has no outputs")
    _check_wellformed(model, p)
    check_onnx_meta(model.metadata_props, str(p), check_config=roles.config_from_record)
    _check_external_data(p)
    return model


def _check_external_data(p: Path) -> None:
    """Every external-data reference must name a regular file inside the model's folder, and
    its offset and length must lie inside that file: ``onnx.load`` would otherwise read any
    file the path reaches, block on a FIFO, or fail with an exception of its own."""
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as e:
        raise InputValueError(f"{p}: cannot read the ONNX model ({type(e).__name__}: "
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
            raise InputValueError(f"{where}, which is not a short relative path inside the model's folder")
        target = os.path.realpath(os.path.join(base, loc))
        if os.path.commonpath([base, target]) != base:
            raise InputValueError(f"{where}, which leads outside the model's folder")
        try:
            st = os.stat(target)
        except OSError as e:
            raise InputValueError(f"{where}, which cannot be read ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise InputValueError(f"{where}, which is not a regular file")
        try:
            offset = int(info.get("offset", "0"))
            length = int(info.get("length", str(st.st_size - offset)))
        except ValueError:
            raise InputValueError(f"{where} at an offset or length that is not a number") from None
        if offset < 0 or length < 0 or offset + length > st.st_size:
            raise InputValueError(f"{where} at bytes {offset}..{offset + length}, outside the "
                                  f"{st.st_size:,}-byte file")


def _all_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of a model: initializers and node attributes, in every subgraph and
    function (walked with a stack, not recursion)."""
    stack: list[Any] = [proto.graph, *proto.functions]
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


def _check_wellformed(model: ir.Model, p: Path) -> None:
    """Reject what a damaged file can still parse into: names that are not text (bytes that
    are not UTF-8) and values that no input, initializer or node defines."""
    defined = {v.name for v in model.graph.inputs} | set(model.graph.initializers)
    for node in model.graph:
        for field in (node.name, node.op_type, node.domain):
            if field is not None and not isinstance(field, str):
                raise InputValueError(f"{p}: invalid ONNX model (a node name or op type is not UTF-8 text)")
        for v in node.inputs:
            if v is None:
                continue
            if not isinstance(v.name, str):
                raise InputValueError(f"{p}: invalid ONNX model (a value name is not UTF-8 text)")
            if v.producer() is None and v.name not in defined and not v.is_initializer():
                raise InputValueError(f"{p}: invalid ONNX model (node {node.name!r} reads {v.name!r}, "
                                      "which nothing defines)")
        defined.update(o.name for o in node.outputs)


def onnx_meta(model: ir.Model) -> dict[str, Any] | None:
    """The ``dlspass.json`` a dlspass ONNX export carries (None for foreign models)."""
    raw = model.metadata_props.get(META_FILE)
    return json.loads(raw) if raw else None


def gradient_outputs(model: ir.Model) -> list[str]:
    """Names of outputs tagged as gradients (``metadata_props`` roles or a ``grad`` name)."""
    tagged = json.loads(model.metadata_props.get(roles.ONNX_ROLES_KEY, "{}"))
    found = [name for name, (role, _t) in tagged.items() if role == roles.GRAD]
    found += [v.name for v in model.graph.outputs
              if v.name not in found and ("grad" in v.name.lower())]
    return found


def check_onnx(proto: onnx.ModelProto, source: str) -> None:
    """``InputValueError`` unless ``onnx.checker`` accepts the model we made from ``source``."""
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:
        raise InputValueError(f"{source}: the transformed ONNX model does not validate "
                              f"({str(e).splitlines()[0]})") from None


def inline_external_data(model: ir.Model) -> None:
    """Read every external tensor of ``model`` into memory (initializers, and the tensor
    attributes that ``ir.external_data.load_to_model`` leaves out), so that the model saves as
    one self-contained file wherever it goes, as ``onnx.load`` + ``onnx.save`` would."""
    ir.external_data.load_to_model(model)
    graphs = [model.graph, *model.functions.values()]
    for node in (n for g in graphs for n in ir.traversal.RecursiveGraphIterator(g)):
        for attr in list(node.attributes.values()):
            if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                (t,) = ir.external_data.convert_tensors_from_external([attr.value])
                node.attributes[attr.name] = ir.AttrTensor(attr.name, t)
            elif attr.type == ir.AttributeType.TENSORS \
                    and any(isinstance(t, ir.ExternalTensor) for t in attr.value):
                ts = ir.external_data.convert_tensors_from_external(list(attr.value))
                node.attributes[attr.name] = ir.AttrTensors(attr.name, ts)
