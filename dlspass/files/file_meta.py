"""The shape of the dlspass metadata a file carries, checked once when the file is read.

A ``.pt2`` carries ``dlspass.json`` (an extra file) and an ``.onnx`` carries ``dlspass.json``
and ``dlspass_roles`` in ``metadata_props``. ``inspect``, ``verify`` and ``transform`` index
into them (``meta["output_roles"]``, ``role, target = ...``), so a file whose metadata has a
wrong type, a missing key or an extra level of nesting would fail deep inside with a
``KeyError`` or ``TypeError`` (exit 3, a traceback). ``check_pt2_meta`` and ``check_onnx_meta``
refuse such metadata up front with a one-line ``MetadataError`` (exit 2) naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from dlspass.errors import InputValueError
from dlspass.files.bounded_text import excerpt

META_FILE = "dlspass.json"
"""The name of dlspass's metadata: an extra file in a ``.pt2``, a ``metadata_props`` key in ONNX."""
FORMAT_VERSION = 1
"""The ``"version"`` of the ``dlspass.json`` that dlspass writes."""

# a file's dlspass metadata does not have the shape dlspass writes
MetadataError = InputValueError


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _dict_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(_is_str(k) and check(x) for k, x in v.items())


def _role_pair(v: Any) -> bool:
    """``[role, target]``: a role name and its target (a string or null)."""
    return isinstance(v, list) and len(v) == 2 and _is_str(v[0]) and _opt(_is_str)(v[1])


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict)


MAX_TIED = 10_000
"""Most ``"tied"`` entries a file may carry: a model that shares whole layers (ALBERT-style)
ties a few thousand names at most; more is a hostile file, and ``inspect`` prints them all."""
MAX_NAME_CHARS = 1024
"""Longest parameter name in ``"tied"`` (as ``pt2_archive`` bounds member names); real dotted
names are well under 200 characters."""


def _name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS


def _tied(v: Any) -> bool:
    """``{dropped_name: kept_name}`` as ``merge_tied_parameters`` writes it: bounded, and one
    merge per name (a kept name is never also dropped, and no name is merged into itself)."""
    return (isinstance(v, dict) and len(v) <= MAX_TIED
            and all(_name(k) and _name(x) and k != x for k, x in v.items())
            and not set(v.values()) & v.keys())


# key -> (check, what it should be); absent keys are fine unless listed as required below
_PT2_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (_is_str, "a string"),
    "version": (_is_int, "an integer"),
    "kind": (_is_str, "a string"),
    "source": (_is_str, "a string"),
    "config": (_opt(_is_dict), "an object or null"),
    "optimizer": (_opt(_is_dict), "an object or null"),
    "precision_mode": (_opt(_is_str), "a string or null"),
    "output_roles": (_list_of(_role_pair), "a list of [role, target] pairs"),
    "placeholder_roles": (_dict_of(_role_pair), "an object of [role, target] pairs"),
    "buffer_names": (_dict_of(_is_str), "an object of strings"),
    "inputs": (_list_of(_is_str), "a list of strings"),
    "applied_passes": (_list_of(_is_str), "a list of strings"),
    "tied": (_tied, f"an object of at most {MAX_TIED:,} parameter names (dropped -> kept, each "
                    f"1 to {MAX_NAME_CHARS} characters, a kept name never dropped)"),
}
_STEP_REQUIRED = ("output_roles", "config", "optimizer", "precision_mode")

_ONNX_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **_PT2_KEYS,
    "state_inputs": (_list_of(_is_str), "a list of strings"),
    "user_inputs": (_list_of(_is_str), "a list of strings"),
    "outputs": (_list_of(_is_str), "a list of strings"),
    "state_inputs_dls": (_list_of(_is_str), "a list of strings"),
    "precision": (_is_dict, "an object"),
}


ConfigCheck = Callable[[dict[str, Any]], object]
"""How a caller reads a file's recorded config (``dlspass.graph.roles.config_from_record``); it
raises on a config dlspass would refuse. Passed in: this module sits below the config."""


def _check_keys(meta: Any, keys: dict[str, tuple[Callable[[Any], bool], str]], where: str,
                check_config: ConfigCheck | None) -> None:
    if not isinstance(meta, dict):
        raise MetadataError(f"{where}: expected a JSON object, got {excerpt(meta)}")
    for key, (check, want) in keys.items():
        if key in meta and not check(meta[key]):
            raise MetadataError(f"{where}: {key!r} must be {want}, got {excerpt(meta[key])}")
    cfg = meta.get("config")
    if cfg is not None and check_config is not None:
        try:
            check_config(cfg)
        except Exception as e:
            raise MetadataError(f"{where}: 'config' is not a dlspass config ({type(e).__name__}: "
                                f"{excerpt(str(e), 120)})") from None


def check_pt2_meta(meta: Any, where: str, n_outputs: int | None = None, *,
                   check_config: ConfigCheck | None = None) -> None:
    """Raise ``MetadataError`` unless ``meta`` (a ``.pt2``'s parsed ``dlspass.json``, or None)
    has the shape dlspass writes; a step's ``output_roles`` must cover ``n_outputs`` outputs,
    and its ``config`` must pass ``check_config`` (not checked without one)."""
    if meta is None:
        return
    where = f"{where}: {META_FILE}"
    _check_keys(meta, _PT2_KEYS, where, check_config)
    if not str(meta.get("format", "")).startswith("dlspass-"):
        raise MetadataError(f"{where}: no 'format' of a dlspass file (dlspass-joint or dlspass-step)")
    if meta.get("kind") == "step":
        missing = [k for k in _STEP_REQUIRED if k not in meta]
        if missing:
            raise MetadataError(f"{where}: a step needs {', '.join(map(repr, missing))}")
        if n_outputs is not None and len(meta["output_roles"]) != n_outputs:
            raise MetadataError(f"{where}: 'output_roles' names {len(meta['output_roles'])} "
                                f"outputs, the program has {n_outputs}")


def check_onnx_meta(props: Mapping[str, str], where: str, *,
                    check_config: ConfigCheck | None = None) -> None:
    """Raise ``MetadataError`` unless the ``dlspass.json`` and ``dlspass_roles`` entries of an
    ONNX model's ``metadata_props`` (when present) are JSON of the shape dlspass writes (the
    ``config`` checked by ``check_config``, as in `check_pt2_meta`)."""
    for key, check in ((META_FILE, lambda v: _check_keys(v, _ONNX_KEYS, f"{where}: {META_FILE}",
                                                         check_config)),
                       ("dlspass_roles", lambda v: _check_roles(v, f"{where}: dlspass_roles"))):
        raw = props.get(key)
        if not raw:
            continue
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            raise MetadataError(f"{where}: metadata {key} is not valid JSON: {excerpt(raw)}") from None
        check(value)


def _check_roles(value: Any, where: str) -> None:
    if not _dict_of(_role_pair)(value):
        bad = next((k for k, v in value.items() if not _role_pair(v)), None) \
            if isinstance(value, dict) else None
        shown = excerpt(value) if bad is None else f"{excerpt(bad)}: {excerpt(value[bad])}"
        raise MetadataError(f"{where}: expected an object of [role, target] pairs, got {shown}")
