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

``check_pt2_archive(path)`` reads the zip directory and the small JSON members with Python's
``zipfile`` (never more bytes than a member declares, and never a member whose declared size
is over the bounds below) and raises ``UnsafeArchiveError`` for any of these, so that torch
only ever sees an archive it loads without unpickling or evaluating anything. What is checked
is the same bytes torch reads next, except for a file replaced on disk in between, which only
someone who can already write the user's files can do.
"""

from __future__ import annotations

import io
import json
import operator
import re
import zipfile
from pathlib import Path
from typing import IO, Any

from dlspass.errors import InputValueError
from dlspass.files.bounded_text import excerpt

MAX_JSON_BYTES = 128 * 2**20
"""Largest inflated JSON member (``models/model.json``, payload configs, extra files)."""
MAX_INFLATION_BYTES = 64 * 2**20
"""How much larger than the archive its members may inflate in total. ``torch.export.save``
stores every member uncompressed, so a real archive inflates by nothing; a zip bomb (a 2 MB
file whose ``model.json`` declares 2 GiB) is refused from its directory alone."""
MAX_MEMBERS = 100_000
MAX_NAME_CHARS = 1024

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

# A call target: an operator overload, a higher-order op (of _HOPS), or a symbolic-shape op.
_TARGET = re.compile(r"(torch\.ops\.\w+\.\w+(\.\w+)?|torch\.\w+|_operator\.\w+|math\.\w+)")
# A symbolic expression: numbers, symbol names (s0, u3, zuf0), the torch/sympy functions below,
# arithmetic and comparisons. No quotes, attributes, subscripts or powers: nothing that
# sympify's eval could turn into a call of a Python builtin or an exponential computation.
_IDENTIFIER = re.compile(r"[A-Za-z_]\w{0,199}")
# Symbolic sizes as torch writes them (sympy's srepr): "Mul(Integer(2), Symbol('s0',
# positive=True, integer=True))". Left out because they compute without bound on small
# literals: powers (Pow(9, 10**9)), LShift, RoundDecimal; keyword values are capped (a Float's
# precision=10**18 would too).
_EXPR_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Half", "One", "Zero", "NegativeOne", "Infinity",
    "NegativeInfinity", "oo", "true", "false", "BooleanTrue", "BooleanFalse",
    "Add", "Mul", "Mod", "Max", "Min", "Abs", "floor", "ceiling", "Eq", "Ne", "Lt", "Le", "Gt",
    "Ge", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "Equality",
    "Unequality", "And", "Or", "Not",
    # torch.utils._sympy.functions, as ExportedProgramDeserializer maps them (no powers)
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "RShift", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt",
    "ToFloat", "Identity",
})
_HOPS = frozenset({
    "cond", "while_loop", "while_loop_stack_output", "map_impl", "scan", "associative_scan",
    "wrap_with_set_grad_enabled", "wrap_with_autocast", "invoke_subgraph", "auto_functionalized",
    "auto_functionalized_v2", "with_effects", "flex_attention", "flex_attention_backward",
    "out_dtype", "run_const_graph", "print", "hints_wrapper", "_export_tracepoint",
})
MAX_EXPR_CHARS = 4096
MAX_GUARDS = 10_000

def _ast_grammar() -> tuple[type, ...]:
    import ast

    return (ast.Expression, ast.Compare, ast.BinOp, ast.BoolOp, ast.UnaryOp, ast.Subscript,
            ast.Call, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod,
            ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.And, ast.Or, ast.Not,
            ast.USub, ast.UAdd)


_AST_GRAMMAR = _ast_grammar()
# Shape guards as torch.export writes them: "(L['x'].size()[0] % 2) == 0" (run in a namespace
# of sympy's interpreter names).
_GUARD_NAMES = frozenset({"L", "Max", "Min", "Mod", "FloorDiv", "CeilToInt", "FloorToInt",
                          "math", "floor", "ceiling", "Abs"})
_GUARD_ATTRS = frozenset({"size", "stride", "storage_offset", "dim", "floor", "ceil", "trunc"})


ARCHIVE_ROOT = "archive"
"""The root folder of every ``.pt2`` dlspass writes (torch names it after the file otherwise,
which for an atomic write is the temporary file's random name)."""


def save_pt2(ep: Any, path: str | Path, extra_files: dict[str, str] | None = None) -> None:
    """``torch.export.save(ep)`` to ``path`` with the stable root folder ``ARCHIVE_ROOT``."""
    import torch

    with open(path, "wb") as f:  # torch names the root of a file object's archive "archive"
        torch.export.save(ep, f, extra_files=extra_files)


# a ``.pt2`` archive that torch would unpickle, evaluate or inflate without bound
UnsafeArchiveError = InputValueError


def check_pt2_archive(path: str | Path) -> None:
    """Raise ``UnsafeArchiveError`` unless ``torch.export.load(path)`` would only parse data.

    Checks the zip layout (one root folder, no duplicate names, no encrypted members, bounded
    sizes), the PT2 format and version, refuses AOTInductor payloads, legacy layouts and any
    payload stored with pickle, loads the sample inputs with ``weights_only=True`` (what torch
    tries first; on failure it would unpickle), and checks every call target, symbolic
    expression and guard of ``models/model.json``.
    """
    p = Path(path)
    try:
        zf = zipfile.ZipFile(p)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise UnsafeArchiveError(f"{p}: not a .pt2 archive (not a zip file; truncated or "
                                 f"corrupt? {excerpt(str(e), 60)})") from None
    with zf:
        members = _members(zf, p)
        archive = _Archive(zf, p, members)
        archive.check_layout()
        archive.check_payload_config(_WEIGHTS_CONFIG, allow_other_prefixes=True)
        archive.check_payload_config(_CONSTANTS_CONFIG, allow_other_prefixes=False)
        archive.check_sample_inputs()
        archive.check_program()
        archive.check_dlspass_meta()


def check_zip_bounds(source: str | Path | IO[bytes], name: str | None = None) -> None:
    """Raise ``UnsafeArchiveError`` when a zip written by ``torch.save`` or
    ``torch.export.save`` (one root folder) has duplicate, encrypted or oddly compressed
    members, or members that inflate beyond ``MAX_INFLATION_BYTES`` in total (torch's reader
    allocates each member's declared size). Reads only the zip directory; ``name`` names a
    file-like ``source`` in messages."""
    p = Path(name if name is not None else str(source))
    try:
        with zipfile.ZipFile(source) as zf:
            _members(zf, p)
    except UnsafeArchiveError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise UnsafeArchiveError(f"{p}: not a readable zip ({excerpt(str(e), 60)})") from None


def _members(zf: zipfile.ZipFile, p: Path) -> dict[str, zipfile.ZipInfo]:
    """The members by name relative to the root folder, after the directory-level checks."""
    infos = zf.infolist()
    if not infos:
        raise UnsafeArchiveError(f"{p}: not a .pt2 archive (an empty zip)")
    if len(infos) > MAX_MEMBERS:
        raise UnsafeArchiveError(f"{p}: {len(infos):,} members (more than {MAX_MEMBERS:,})")
    root = infos[0].filename.split("/", 1)[0]
    out: dict[str, zipfile.ZipInfo] = {}
    inflation = 0
    for info in infos:
        name = info.filename
        if len(name) > MAX_NAME_CHARS:
            raise UnsafeArchiveError(f"{p}: a member name of {len(name):,} characters")
        head, _, rel = name.partition("/")
        if head != root or not rel:
            # torch reads one root folder; anything outside it (such as the top-level
            # `version` of the legacy layout) is read by other code paths
            raise UnsafeArchiveError(f"{p}: member {excerpt(name, 80)} is outside the archive's "
                                     f"root folder {excerpt(root, 40)} (not a torch.export archive)")
        if rel in out:
            raise UnsafeArchiveError(f"{p}: member {excerpt(rel, 80)} appears twice "
                                     "(which copy a reader takes is not defined)")
        if info.flag_bits & 0x1:
            raise UnsafeArchiveError(f"{p}: member {excerpt(rel, 80)} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise UnsafeArchiveError(f"{p}: member {excerpt(rel, 80)} uses an unsupported "
                                     f"compression method ({info.compress_type})")
        inflation += max(0, info.file_size - info.compress_size)
        if inflation > MAX_INFLATION_BYTES:
            raise UnsafeArchiveError(
                f"{p}: its members inflate to {inflation:,}+ bytes more than they occupy "
                f"(more than {MAX_INFLATION_BYTES:,}; a zip bomb?)")
        out[rel] = info
    return out


class _Archive:
    def __init__(self, zf: zipfile.ZipFile, p: Path, members: dict[str, zipfile.ZipInfo]) -> None:
        self.zf, self.p, self.members = zf, p, members

    def fail(self, why: str) -> UnsafeArchiveError:
        return UnsafeArchiveError(f"{self.p}: cannot load the .pt2 archive: {why}")

    def read(self, rel: str, limit: int) -> bytes:
        info = self.members[rel]
        if info.file_size > limit:
            raise self.fail(f"member {excerpt(rel, 80)} inflates to {info.file_size:,} bytes "
                            f"(more than {limit:,})")
        try:
            with self.zf.open(info) as f:
                data = f.read(limit + 1)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise self.fail(f"member {excerpt(rel, 80)} is damaged ({excerpt(str(e), 80)})") from None
        if len(data) > limit:  # zipfile stops at the declared size; belt and braces
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
        from torch.export.pt2_archive.constants import ARCHIVE_VERSION_VALUE

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

    def check_payload_config(self, rel: str, *, allow_other_prefixes: bool) -> None:
        """No entry of a weights/constants payload config may be loaded with pickle."""
        cfg = self.read_json(rel)
        entries = cfg.get("config") if isinstance(cfg, dict) else None
        if not isinstance(entries, dict):
            raise self.fail(f"{rel} has no 'config' object")
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

    def check_sample_inputs(self) -> None:
        """torch loads these with ``weights_only=True`` and, when that fails, with pickle."""
        info = self.members[_SAMPLE_INPUTS]
        if info.file_size == 0:
            return  # torch reads an empty member as no inputs
        import torch

        raw = self.read(_SAMPLE_INPUTS, info.file_size)
        # torch.load allocates what the nested zip declares (and the legacy non-zip format
        # what its stream declares) before reading: bound it first
        if not zipfile.is_zipfile(io.BytesIO(raw)):
            raise self.fail(f"{_SAMPLE_INPUTS} is not in torch.save's zip format")
        check_zip_bounds(io.BytesIO(raw), f"{self.p}: {_SAMPLE_INPUTS}")
        try:
            loaded = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:
            raise self.fail(f"{_SAMPLE_INPUTS} cannot be loaded without pickle "
                            f"({type(e).__name__}), and torch would retry with pickle") from None
        if not isinstance(loaded, (tuple, dict)):
            raise self.fail(f"{_SAMPLE_INPUTS} holds a {type(loaded).__name__}, not inputs")

    def check_program(self) -> None:
        """Every call target resolves to an operator, every expression is arithmetic, no guards."""
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

    def check_dlspass_meta(self) -> None:
        """The shape of ``extra/dlspass.json`` (also checked after loading, with the output
        count): refused here, before torch spends time deserialising the program."""
        if _DLSPASS_META not in self.members:
            return
        from dlspass.files.file_meta import check_pt2_meta

        check_pt2_meta(self.read_json(_DLSPASS_META), str(self.p))

    def check_target(self, target: Any) -> None:
        if not isinstance(target, str) or not _TARGET.fullmatch(target):
            raise self.fail(f"call target {excerpt(target, 80)} is not an operator")
        resolved = _resolve_target(target)
        if not _is_operator(resolved):
            raise self.fail(f"call target {excerpt(target, 80)} is not an operator "
                            "(running the graph would call it)")

    def check_guard(self, guard: Any) -> None:
        """A shape guard: ``ExportedProgram.module()`` pastes it into Python source and
        ``exec``s it, and again inside a string literal, so only size comparisons pass."""
        if not _python_subset(guard, _GUARD_NAMES, _GUARD_ATTRS, keywords=False):
            raise self.fail(f"{_MODEL_JSON}: guard {excerpt(guard, 80)} is not a shape "
                            "comparison (ExportedProgram.module() would execute it as Python)")

    def check_expr(self, expr: Any) -> None:
        """A symbolic size (``srepr`` form): ``sympy.sympify`` evaluates it as Python."""
        if not _python_subset(expr, _EXPR_NAMES, frozenset(), keywords=True):
            raise self.fail(f"symbolic expression {excerpt(expr, 80)} is not a sympy size "
                            "expression (sympify would evaluate it as Python)")


def _python_subset(text: Any, names: frozenset[str], attrs: frozenset[str], *, keywords: bool) -> bool:
    """Whether ``text`` parses as an expression made only of arithmetic, comparisons, calls of
    ``names`` (or methods in ``attrs``), numbers below 2**64, identifier-like strings and, with
    ``keywords``, ``name=value`` arguments of booleans or integers up to 4096. No attribute escapes, no powers (an
    exponential computation), no string that could close the literal torch pastes it into."""
    import ast

    if not isinstance(text, str) or len(text) > MAX_EXPR_CHARS:
        return False
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, _AST_GRAMMAR):
            continue
        if isinstance(node, ast.Name) and node.id in names:
            continue
        if isinstance(node, ast.Attribute) and node.attr in attrs:
            continue
        if isinstance(node, ast.keyword) and keywords and node.arg is not None \
                and _IDENTIFIER.fullmatch(node.arg) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, (bool, int)) and abs(node.value.value) <= 4096:
            continue
        if isinstance(node, ast.Constant) and (
                isinstance(node.value, bool) or node.value is None
                or isinstance(node.value, (int, float)) and abs(node.value) < 2**64
                or isinstance(node.value, str) and _IDENTIFIER.fullmatch(node.value)):
            continue
        return False
    return True


def _resolve_target(target: str) -> Any:
    """The object torch's deserializer binds ``target`` to (its ``deserialize_operator``)."""
    import math

    import torch

    head, *names = target.split(".")
    obj: Any = {"torch": torch, "_operator": operator, "math": math}[head]
    for name in names:
        if name.startswith("_") and head != "torch" or not hasattr(obj, name):
            return target  # unresolved: torch keeps the string and refuses the node
        obj = getattr(obj, name)
    return obj


def _is_operator(obj: Any) -> bool:
    import torch
    from torch._export.serde.serialize import _SYM_OPS

    if isinstance(obj, torch._ops.OpOverload):
        return True
    if isinstance(obj, torch._ops.HigherOrderOperator):
        # control flow and functionalization only: others call compiled code, delegates or
        # Python functions named in their arguments
        return obj.name() in _HOPS
    if isinstance(obj, str):
        return True  # left unresolved, torch raises "Unsupported target type" itself
    try:
        return obj in _SYM_OPS or obj is operator.getitem
    except TypeError:  # unhashable
        return False
