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
MAX_NODES = 50_000
"""Most nodes (graph, subgraphs and functions together) of an ONNX model that dlspass reads:
``onnx_ir`` builds Python objects of about 4 kB per node, so this bound keeps ``transform``
within the documented 1 GB; a 14 MB file can hold a few hundred thousand trivial nodes."""
MAX_DOMAIN_VERSION = 1000
"""Highest opset version accepted for a domain other than the default one."""


def load_onnx(path: str | Path) -> ir.Model:
    """An ``onnx_ir.Model`` from ``path``; ``InputValueError`` when it is not a readable ONNX model.

    The file is read once: its protobuf is checked (opsets, node count, external data
    references) before ``onnx_ir`` builds the model from that same protobuf. External data
    stays on disk (read when the model is saved), and every reference to it has been checked
    to stay inside the model's folder."""
    p = check_input_file(path, (".onnx",))
    try:
        proto = onnx.load_model_from_string(p.read_bytes())  # external data stays on disk
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputValueError(f"{p}: cannot read the ONNX model ({type(e).__name__}: {first[:200]})") from None
    _check_opsets(proto, p)
    _check_node_count(proto, p)
    _check_external_data(proto, p)
    try:
        with quiet_torch():
            model = ir.serde.deserialize_model(proto)
            ir.external_data.set_base_dir(model.graph, str(p.parent))  # as ir.load does
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputValueError(f"{p}: cannot read the ONNX model ({type(e).__name__}: {first[:200]})") from None
    del proto
    if not model.graph.outputs:
        raise InputValueError(f"{p}: the ONNX model has no outputs")
    _check_wellformed(model, p)
    check_onnx_meta(model.metadata_props, str(p), check_config=roles.config_from_record)
    return model


def _check_opsets(proto: onnx.ModelProto, p: Path) -> None:
    """The default domain imported once, at a version this ONNX knows; other domains at
    plausible versions. torch.onnx and onnx_ir fail with tracebacks (or loop over versions)
    on an opset of 10**9, a negative one, or none at all."""
    newest = onnx.defs.onnx_opset_version()
    imports = [*proto.opset_import, *(op for f in proto.functions for op in f.opset_import)]
    model_domains = [op.domain for op in proto.opset_import]
    if len(set(model_domains)) != len(model_domains):
        raise InputValueError(f"{p}: the ONNX model imports a domain twice")
    if not any(op.domain in ("", "ai.onnx") for op in proto.opset_import):
        raise InputValueError(f"{p}: the ONNX model does not import the default ONNX domain (opset)")
    if sum(op.domain in ("", "ai.onnx") for op in proto.opset_import) > 1:
        raise InputValueError(f"{p}: the ONNX model imports the default domain twice ('' and 'ai.onnx')")
    for op in imports:
        top = newest if op.domain in ("", "ai.onnx") else MAX_DOMAIN_VERSION
        if not 1 <= op.version <= top:
            raise InputValueError(f"{p}: the ONNX model imports opset {op.version} of domain "
                                  f"{excerpt(op.domain or 'ai.onnx', 60)} (expected 1 to {top})")


def _check_node_count(proto: onnx.ModelProto, p: Path) -> None:
    count = 0
    for g in _all_graphs(proto):
        count += len(g.node)
        if count > MAX_NODES:
            raise InputValueError(f"{p}: the ONNX model has more than {MAX_NODES:,} nodes")


def _all_graphs(proto: onnx.ModelProto) -> Iterator[Any]:
    """The main graph, every function and every subgraph (walked with a stack)."""
    stack: list[Any] = [proto.graph, *proto.functions]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for a in node.attribute:
                if a.HasField("g"):
                    stack.append(a.g)
                stack.extend(a.graphs)


def _check_external_data(proto: onnx.ModelProto, p: Path) -> None:
    """Every external-data reference must name a regular file inside the model's folder, and
    its offset and length must lie inside that file: ``onnx.load`` would otherwise read any
    file the path reaches, block on a FIFO, or fail with an exception of its own."""
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
    function."""
    for g in _all_graphs(proto):
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
