"""Reading and writing dlspass ``.pt2`` programs: ``load_program`` and ``save_program``.

``load_program`` checks an untrusted archive before torch reads it (``dlspass.files``:
the path, the archive's members and the shape of its ``dlspass.json``) and registers
dlspass's custom op, which a step written with ``rounding="op"`` calls; that registration
(``dlspass.formats``) is why this reader lives above the numerics and not in ``dlspass.files``.
``save_program`` writes atomically, with the metadata as the archive's ``dlspass.json``.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import torch

import dlspass.formats  # noqa: F401 - registers dlspass::round_to_format for deserialisation
from dlspass.errors import InputValueError
from dlspass.files.atomic_write import write_atomic
from dlspass.files.bounded_text import excerpt
from dlspass.files.file_meta import META_FILE, check_pt2_meta
from dlspass.files.paths import check_input_file
from dlspass.files.pt2_archive import read_checked_pt2, save_pt2
from dlspass.files.quiet import quiet_torch
from dlspass.graph import roles


def load_program(path: str | Path) -> tuple[torch.export.ExportedProgram, dict[str, Any] | None]:
    """Load a ``.pt2``; returns the program and its ``dlspass.json`` (None when absent)."""
    p = check_input_file(path, (".pt2",))
    if not zipfile.is_zipfile(p):
        raise InputValueError(f"{p}: not a .pt2 archive (not a zip file; truncated or corrupt?)")
    # refuses what torch would unpickle, evaluate or inflate without bound; torch then reads
    # these very bytes, not the file again
    data = read_checked_pt2(p)
    extra = {META_FILE: ""}
    try:
        with quiet_torch():
            ep = torch.export.load(io.BytesIO(data), extra_files=extra)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "warnings above" in first:  # torch's pointer to the log lines silenced here
            first = "torch could not deserialize the program (not a torch.export archive?)"
        raise InputValueError(f"{p}: cannot load the .pt2 archive ({first[:200]})") from None
    raw = extra.get(META_FILE) or ""
    meta = None
    if raw:
        try:
            meta = json.loads(raw)
        except json.JSONDecodeError:
            raise InputValueError(f"{p}: its {META_FILE} is not valid JSON") from None
    check_pt2_meta(meta, str(p), len(ep.graph_signature.output_specs),  # shape of dlspass.json
                   check_config=roles.config_from_record)
    check_node_custom(ep.graph_module, str(p))
    return ep, meta


# The node metadata dlspass reads back (``dlspass.graph.roles``) and the type each must have:
# read with ``.get`` by every pass and report, a dict where a role string belongs would fail
# deep inside one of them.
_CUSTOM_STRINGS = (roles.ROLE_KEY, roles.TARGET_KEY, roles.PASS_KEY, roles.ROUNDED_KEY,
                   roles.MODE_KEY)


def check_node_custom(gm: torch.fx.GraphModule, source: str) -> None:
    """``InputValueError`` naming the node and key when a node's ``meta["custom"]`` (in ``gm`` or
    any of its subgraphs) is not a mapping of strings, or a dlspass key in it has the wrong type."""
    for mod in gm.modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            custom = node.meta.get("custom")
            where = f"{source}: node {excerpt(node.name, 80)}: custom metadata"
            if custom is None:
                continue
            if not isinstance(custom, dict) or not all(isinstance(k, str) for k in custom):
                raise InputValueError(f"{where}: expected a mapping with string keys, got {excerpt(custom)}")
            for key in _CUSTOM_STRINGS:
                if key in custom and not isinstance(custom[key], str):
                    raise InputValueError(f"{where} {key!r}: expected a string, got {excerpt(custom[key])}")
            spec = custom.get(roles.OUTPUTS_KEY)
            if spec is not None and not (isinstance(spec, list) and all(
                    isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                    and (e[1] is None or isinstance(e[1], str)) for e in spec)):
                raise InputValueError(f"{where} {roles.OUTPUTS_KEY!r}: expected a list of "
                                      f"[role, target] pairs of strings, got {excerpt(spec)}")


def save_program(ep: torch.export.ExportedProgram, path: Path, meta: dict[str, Any] | None) -> None:
    """Save ``ep`` (and ``meta`` as ``dlspass.json``) atomically to ``path``."""
    extra = {META_FILE: json.dumps(meta, sort_keys=True)} if meta is not None else None
    write_atomic(path, lambda tmp: save_pt2(ep, tmp, extra))  # stable inner folder name
