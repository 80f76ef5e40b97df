"""Check a ``.pt2`` archive before torch reads it: nothing in it may run code or exhaust memory.

``torch.export.load`` is documented as unsafe for untrusted files ("uses pickle under the hood")
and it is, through every path below (torch 2.13, ``torch/export/pt2_archive/_package.py``,
``torch/_export/serde/serialize.py``, ``torch/export/_unlift.py``):

* weights and tensor constants whose payload config says ``"use_pickle": true`` go to
  ``torch.load(weights_only=False)``;
* constants named ``custom_obj_*`` go to ``torch._C._pickle_load_obj`` (TorchBind) and
  ``opaque_obj_*`` to ``pickle.loads``;
* the legacy layouts (``data/weights/<model>.pt``, ``data/constants/<model>.pt``, and the
  pre-2.8 zip with a top-level ``version`` that ``torch.export.load`` falls back to after any
  ``RuntimeError``) and ``data/sample_inputs/<model>.pt`` go to ``deserialize_torch_artifact``,
  which retries a failed ``weights_only=True`` load with ``weights_only=False``;
* ``data/aotinductor/`` holds compiled shared libraries that ``AOTIModelPackageLoader`` loads;
* ``models/<model>.json`` names its call targets by dotted path, resolved with ``getattr``
  anywhere under ``torch``, ``operator`` and ``math`` (``torch.os.system`` resolves; running
  the graph, as ``transform`` does, calls it); its symbolic expressions (``expr_str``) go to
  ``sympy.sympify``, which evaluates Python; its ``guards_code`` is ``exec``-ed by
  ``ExportedProgram.module()``.

and it allocates what the archive declares: a weight or constant whose record is empty
becomes ``torch.zeros`` of its declared size (a 36 kB file asking for GBs), and dlspass itself
builds zero inputs of the declared input shapes to export ONNX. ``sympy.sympify`` also takes
time superlinear in the arguments of ``Max``/``Min`` (64 symbols: seconds; 600: minutes).

``read_checked_pt2(path)`` reads the file once into memory and checks those bytes:

* the zip layout through ``dlspass.files.zip_view`` (one reading that miniz, torch's reader,
  and ``zipfile`` provably share; anything else is refused), after which every member is
  read through ``torch._C.PyTorchFileReader``, the reader ``torch.export.load`` uses;
* the payloads above, the sample inputs (loaded with ``weights_only=True`` from the bytes
  torch will load), every call target, symbolic expression (grammar, nesting, arity and a
  cost budget) and guard of ``models/model.json`` (``dlspass.files.pt2_program``);
* every weight and constant: its declared elements times the dtype's size within its
  record, an empty record only for an empty tensor; the declared user inputs within
  ``MAX_INPUT_BYTES``;

and returns the bytes, for ``torch.export.load(io.BytesIO(data))``: what was checked is
what torch reads, whatever happens to the file meanwhile.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE
from torch.export.pt2_archive.constants import ARCHIVE_VERSION_VALUE

from dlspass.files.bounded_text import excerpt
from dlspass.files.file_meta import check_pt2_meta
from dlspass.files.pt2_program import MAX_GUARDS, ExpressionBudget, guard_refusal, target_refusal
from dlspass.files.zip_view import (
    MAX_INFLATION_BYTES,
    UnsafeArchiveError,
    ZipView,
    check_zip_bounds,
    read_view,
)

__all__ = ["MAX_INFLATION_BYTES", "UnsafeArchiveError", "check_pt2_archive", "check_zip_bounds",
           "read_checked_pt2", "save_pt2"]

MAX_JSON_BYTES = 128 * 2**20
"""Largest inflated JSON member (``models/model.json``, payload configs, extra files)."""
MAX_INPUT_BYTES = 256 * 2**20
"""Largest total size of the program's declared user inputs (dlspass builds zero tensors of
those shapes to export ONNX); symbolic sizes count at their recorded hint."""
MAX_DIM = 2**62

# Relative to the archive's root folder (torch.export.pt2_archive.constants, torch 2.13).
_FORMAT, _VERSION = "archive_format", "archive_version"
_MODEL = "model"
_MODEL_JSON = f"models/{_MODEL}.json"
_WEIGHTS_DIR, _CONSTANTS_DIR = "data/weights/", "data/constants/"
_WEIGHTS_CONFIG = f"{_WEIGHTS_DIR}{_MODEL}_weights_config.json"
_CONSTANTS_CONFIG = f"{_CONSTANTS_DIR}{_MODEL}_constants_config.json"
_SAMPLE_INPUTS = f"data/sample_inputs/{_MODEL}.pt"
_TENSOR_CONSTANT = "tensor_"
_AOTI_DIR = "data/aotinductor/"
_DLSPASS_META = "extra/dlspass.json"
_LEGACY = (f"{_WEIGHTS_DIR}{_MODEL}.pt", f"{_CONSTANTS_DIR}{_MODEL}.pt")

ARCHIVE_ROOT = "archive"
"""The root folder of every ``.pt2`` dlspass writes (torch names it after the file otherwise,
which for an atomic write is the temporary file's random name)."""


def save_pt2(ep: Any, path: str | Path, extra_files: dict[str, str] | None = None) -> None:
    """``torch.export.save(ep)`` to ``path`` with the stable root folder ``ARCHIVE_ROOT``."""
    with open(path, "wb") as f:  # torch names the root of a file object's archive "archive"
        torch.export.save(ep, f, extra_files=extra_files)


def read_checked_pt2(path: str | Path) -> bytes:
    """The bytes of ``path`` once they pass every check, else ``UnsafeArchiveError``.

    Checks the zip layout (one reading shared by torch's reader and ``zipfile``; bounded
    sizes), the PT2 format and version, refuses AOTInductor payloads, legacy layouts and any
    payload stored with pickle, bounds every weight and constant by its record and the user
    inputs in total, loads the sample inputs with ``weights_only=True`` (what torch tries
    first; on failure it would unpickle), and checks every call target, symbolic expression
    and guard of ``models/model.json``. Members are read through torch's own reader.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UnsafeArchiveError(f"{p}: cannot be read ({e.strerror or type(e).__name__})") from None
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise UnsafeArchiveError(f"{p}: not a .pt2 archive (not a zip file; truncated or corrupt?)")
    archive = _Archive(read_view(data, f"{p}: cannot load the .pt2 archive"), p)
    archive.check_layout()
    archive.check_payload_config(_WEIGHTS_DIR, _WEIGHTS_CONFIG, allow_other_prefixes=True)
    archive.check_payload_config(_CONSTANTS_DIR, _CONSTANTS_CONFIG, allow_other_prefixes=False)
    archive.check_sample_inputs()
    archive.check_program()
    archive.check_dlspass_meta()
    return data


def check_pt2_archive(path: str | Path) -> None:
    """Raise ``UnsafeArchiveError`` unless ``torch.export.load(path)`` would only parse data
    (``read_checked_pt2`` without the bytes)."""
    read_checked_pt2(path)


class _Archive:
    def __init__(self, view: ZipView, p: Path) -> None:
        self.view, self.p, self.members = view, p, view.records
        # the reader torch.export.load opens, on the same bytes (read_view compared the two)
        self.reader = torch._C.PyTorchFileReader(io.BytesIO(view.data))
        self.expressions = ExpressionBudget()

    def fail(self, why: str) -> UnsafeArchiveError:
        return UnsafeArchiveError(f"{self.p}: cannot load the .pt2 archive: {why}")

    def read(self, rel: str, limit: int) -> bytes:
        """Member ``rel`` as torch's reader returns it, refused first when over ``limit``."""
        size = self.members[rel].size
        if size > limit:
            raise self.fail(f"member {excerpt(rel, 80)} inflates to {size:,} bytes "
                            f"(more than {limit:,})")
        data = self.reader.get_record(rel)
        if len(data) != size:  # read_view compared torch's sizes already; belt and braces
            raise self.fail(f"member {excerpt(rel, 80)} is larger than it declares")
        return data

    def read_json(self, rel: str) -> Any:
        raw = self.read(rel, MAX_JSON_BYTES)
        try:
            return json.loads(raw)
        except RecursionError:
            raise self.fail(f"{excerpt(rel, 80)} nests too deeply") from None
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise self.fail(f"{excerpt(rel, 80)} is not valid JSON ({excerpt(str(e), 80)})") from None

    def check_layout(self) -> None:
        m = self.members
        if _FORMAT not in m or self.read(_FORMAT, 64) != b"pt2":
            raise self.fail("not a torch.export archive (no archive_format 'pt2'; a legacy or "
                            "foreign layout)")

        if _VERSION not in m or self.read(_VERSION, 64).decode("ascii", "replace") != ARCHIVE_VERSION_VALUE:
            raise self.fail(f"archive version is not {ARCHIVE_VERSION_VALUE} (a legacy layout)")
        for rel in m:
            if rel.startswith(_AOTI_DIR):
                raise self.fail("it holds AOTInductor compiled code (data/aotinductor/), which "
                                "loading would execute")
            if rel in _LEGACY:
                raise self.fail(f"it uses the legacy pickled layout ({excerpt(rel, 80)})")
            if rel.startswith("models/") and rel != _MODEL_JSON:
                raise self.fail(f"unexpected program {excerpt(rel, 80)} (only {_MODEL_JSON} is read)")
        for rel in (_MODEL_JSON, _WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _SAMPLE_INPUTS):
            if rel not in m:
                raise self.fail(f"{rel} is missing")

    def check_payload_config(self, folder: str, rel: str, *, allow_other_prefixes: bool) -> None:
        """No entry of a weights/constants payload config may be loaded with pickle, and every
        tensor must fit the record it is read from."""
        cfg = self.read_json(rel)
        entries = cfg.get("config") if isinstance(cfg, dict) else None
        if not isinstance(entries, dict):
            raise self.fail(f"{rel} has no 'config' object")
        dtypes: dict[str, int] = {}
        for fqn, entry in entries.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("path_name"), str):
                raise self.fail(f"{rel}: entry {excerpt(fqn, 60)} is malformed")
            if entry.get("use_pickle", False) is not False:
                raise self.fail(f"{rel}: entry {excerpt(fqn, 60)} is stored with pickle "
                                "(use_pickle), which loading would execute")
            path_name = entry["path_name"]
            if not allow_other_prefixes and not path_name.startswith(_TENSOR_CONSTANT):
                # custom_obj_* (TorchBind pickle) and opaque_obj_* (pickle.loads)
                raise self.fail(f"{rel}: constant {excerpt(fqn, 60)} is an object payload "
                                f"({excerpt(path_name, 40)}), which loading would unpickle")
            self.check_payload_tensor(folder + path_name, f"{rel}: entry {excerpt(fqn, 60)}",
                                      entry.get("tensor_meta"), dtypes)

    def check_payload_tensor(self, record: str, where: str, meta: Any, dtypes: dict[str, int]) -> None:
        """torch builds the tensor as ``as_strided`` over the record's bytes, or, when the
        record is empty, as ``torch.zeros`` of the declared size: the declared elements must
        lie within the record, and an empty record must hold an empty tensor."""
        if not isinstance(meta, dict):
            raise self.fail(f"{where} has no tensor metadata")
        if record not in self.members:
            raise self.fail(f"{where} reads {excerpt(record, 80)}, which is missing")
        dtype = meta.get("dtype")
        itemsize = _ITEMSIZE.get(dtype) if isinstance(dtype, int) and not isinstance(dtype, bool) else None
        if itemsize is None:
            raise self.fail(f"{where} has an unknown dtype {excerpt(dtype, 20)}")
        if dtypes.setdefault(record, dtype) != dtype:
            raise self.fail(f"{where} reads {excerpt(record, 80)} as another dtype than an "
                            "earlier entry (torch keeps the first)")
        sizes, strides = self.ints(meta.get("sizes"), where), self.ints(meta.get("strides"), where)
        (offset,) = self.ints([meta.get("storage_offset")], where)
        if len(sizes) != len(strides):
            raise self.fail(f"{where} has {len(sizes)} sizes but {len(strides)} strides")
        numel = math.prod(sizes)
        extent = 0 if numel == 0 else offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides, strict=True))
        nbytes = self.members[record].size
        if numel and not nbytes:
            raise self.fail(f"{where} declares {numel:,} elements but its record "
                            f"{excerpt(record, 80)} is empty (torch would allocate them)")
        if numel * itemsize > nbytes or extent * itemsize > nbytes:
            raise self.fail(f"{where} declares {numel:,} elements of {itemsize} bytes, more "
                            f"than its {nbytes:,}-byte record {excerpt(record, 80)} holds")

    def ints(self, values: Any, where: str) -> list[int]:
        """Sizes, strides or an offset serialized as ``{"as_int": n}`` (what torch accepts
        for weights), each in ``[0, MAX_DIM]``."""
        if not isinstance(values, list):
            raise self.fail(f"{where} has malformed tensor metadata")
        out = []
        for v in values:
            n = v.get("as_int") if isinstance(v, dict) and len(v) == 1 else None
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_DIM:
                raise self.fail(f"{where} has a size, stride or offset that is not an "
                                f"integer in [0, 2**62]: {excerpt(json.dumps(v)[:100], 60)}")
            out.append(n)
        return out

    def check_sample_inputs(self) -> None:
        """torch loads these with ``weights_only=True`` and, when that fails, with pickle."""
        size = self.members[_SAMPLE_INPUTS].size
        if size == 0:
            return  # torch reads an empty member as no inputs

        raw = self.read(_SAMPLE_INPUTS, size)
        # torch.load allocates what the nested zip declares (and the legacy non-zip format
        # what its stream declares) before reading: bound it first, with the same reading
        # of the nested zip as torch's
        if not zipfile.is_zipfile(io.BytesIO(raw)):
            raise self.fail(f"{_SAMPLE_INPUTS} is not in torch.save's zip format")
        check_zip_bounds(raw, f"{self.p}: {_SAMPLE_INPUTS}")
        try:
            loaded = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:
            raise self.fail(f"{_SAMPLE_INPUTS} cannot be loaded without pickle "
                            f"({type(e).__name__}), and torch would retry with pickle") from None
        if not isinstance(loaded, (tuple, dict)):
            raise self.fail(f"{_SAMPLE_INPUTS} holds a {type(loaded).__name__}, not inputs")

    def check_program(self) -> None:
        """Every call target resolves to an operator, every expression is arithmetic of
        bounded cost, no guards, user inputs of bounded size."""
        prog = self.read_json(_MODEL_JSON)
        if not isinstance(prog, dict):
            raise self.fail(f"{_MODEL_JSON} is not an object")
        guards = prog.get("guards_code") or []
        if not isinstance(guards, list) or len(guards) > MAX_GUARDS:
            raise self.fail(f"{_MODEL_JSON}: guards_code is not a short list")
        for guard in guards:
            self.check_guard(guard)
        stack: list[Any] = [prog]
        while stack:  # iterative: the JSON's depth is the attacker's choice
            item = stack.pop()
            if isinstance(item, list):
                stack.extend(item)
                continue
            if not isinstance(item, dict):
                continue
            if "target" in item and "inputs" in item:  # a node
                self.check_target(item["target"])
            if "as_operator" in item:
                self.check_target(item["as_operator"])
            if "expr_str" in item:
                self.check_expr(item["expr_str"])
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
        self.check_user_inputs(prog)

    def check_user_inputs(self, prog: dict[str, Any]) -> None:
        """The declared user inputs, in total, within ``MAX_INPUT_BYTES``."""
        gm = prog.get("graph_module")
        graph = gm.get("graph") if isinstance(gm, dict) else None
        sig = gm.get("signature") if isinstance(gm, dict) else None
        specs = sig.get("input_specs") if isinstance(sig, dict) else None
        values = graph.get("tensor_values") if isinstance(graph, dict) else None
        if not isinstance(specs, list) or not isinstance(values, dict):
            return  # torch refuses the program itself
        total = 0
        for spec in specs:
            user = spec.get("user_input") if isinstance(spec, dict) else None
            arg = user.get("arg") if isinstance(user, dict) else None
            tensor = arg.get("as_tensor") if isinstance(arg, dict) else None
            name = tensor.get("name") if isinstance(tensor, dict) else None
            meta = values.get(name) if isinstance(name, str) else None
            if not isinstance(meta, dict):
                continue
            sizes, dtype = meta.get("sizes"), meta.get("dtype")
            numel = 1
            for dim in sizes if isinstance(sizes, list) else []:
                numel *= _size_hint(dim)
                if numel > MAX_INPUT_BYTES:
                    break
            total += numel * (_ITEMSIZE.get(dtype, 8) if isinstance(dtype, int) else 8)
            if total > MAX_INPUT_BYTES:
                raise self.fail(f"its user inputs declare more than {MAX_INPUT_BYTES:,} bytes "
                                f"(input {excerpt(name, 60)})")

    def check_dlspass_meta(self) -> None:
        """The shape of ``extra/dlspass.json`` (also checked after loading, with the output
        count): refused here, before torch spends time deserialising the program."""
        if _DLSPASS_META not in self.members:
            return
        check_pt2_meta(self.read_json(_DLSPASS_META), str(self.p))

    def check_target(self, target: Any) -> None:
        why = target_refusal(target)
        if why is not None:
            raise self.fail(why)

    def check_guard(self, guard: Any) -> None:
        why = guard_refusal(guard)
        if why is not None:
            raise self.fail(f"{_MODEL_JSON}: {why}")

    def check_expr(self, expr: Any) -> None:
        why = self.expressions.refusal(expr)
        if why is not None:
            raise self.fail(why)


def _size_hint(dim: Any) -> int:
    """A serialized size as a number: the integer, or a symbolic size's recorded hint."""
    if isinstance(dim, dict):
        if "as_int" in dim:
            dim = dim["as_int"]
        else:
            expr = dim.get("as_expr")
            hint = expr.get("hint") if isinstance(expr, dict) else None
            dim = hint.get("as_int") if isinstance(hint, dict) else 1
    return dim if isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 else 1


def _itemsizes() -> dict[int, int]:
    return {int(k): v.itemsize for k, v in _SERIALIZE_TO_TORCH_DTYPE.items()}


_ITEMSIZE = _itemsizes()
"""Bytes per element of each dtype, by the number torch's serializer writes for it."""

