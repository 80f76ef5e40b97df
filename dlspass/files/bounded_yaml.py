"""Bounded, safe reading of a YAML file from an untrusted source (a Model Zoo ``params.yaml``).

PyYAML's SafeLoader constructs no Python objects, but on its own it reads files of any size,
follows aliases of aliases (the "billion laughs"), recurses past Python's limit on deep
nesting, keeps the last of duplicate keys silently and builds values JSON cannot hold
(self-referencing collections, binary blobs, sets, timestamps, non-string keys); `load_yaml`
bounds or refuses each and turns every failure into one line naming the file.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from dlspass.errors import InputValueError
from dlspass.files.bounded_text import excerpt, one_line

MAX_YAML_BYTES = 1 << 20
"""Largest params.yaml read (Model Zoo's biggest config is about 20 kB)."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and sequences (Model Zoo configs nest fewer than 10 levels)."""
MAX_YAML_NODES = 200_000
"""Most nodes the document may expand to once aliases are followed (an alias bomb's guard)."""


class _Loader:
    """A PyYAML SafeLoader with bounds, no duplicate keys, and YAML 1.2 floats (``1e-4``)."""

    _cls: Any = None

    @classmethod
    def get(cls) -> Any:
        if cls._cls is None:
            cls._cls = _make_loader()
        return cls._cls


def _make_loader() -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        _depth = 0

        def fetch_flow_collection_start(self, token_class: Any) -> None:
            # The scanner keeps one possible simple key per flow level and rescans them all at
            # every token: 5,000 nested "[" cost minutes before the composer sees a node.
            if self.flow_level >= MAX_YAML_DEPTH:
                raise yaml.scanner.ScannerError(None, None, f"nesting deeper than {MAX_YAML_DEPTH} levels",
                                                self.get_mark())
            super().fetch_flow_collection_start(token_class)

        def compose_node(self, parent: Any, index: Any) -> Any:
            # Composition is recursive: bound the depth before Python's recursion limit, and
            # weigh every node by the size it expands to, so that aliases of aliases (the
            # "billion laughs") are refused before anything walks the tree.
            if self._depth >= MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(f"nesting deeper than {MAX_YAML_DEPTH} levels (line {mark.line + 1})")
            self._depth += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            if not hasattr(node, "dls_weight"):
                if isinstance(node, yaml.MappingNode):
                    weight = 1 + sum(k.dls_weight + v.dls_weight for k, v in node.value)
                elif isinstance(node, yaml.SequenceNode):
                    weight = 1 + sum(n.dls_weight for n in node.value)
                else:
                    weight = 1
                if weight > MAX_YAML_NODES:
                    raise yaml.YAMLError(f"aliases expand the document past {MAX_YAML_NODES} nodes "
                                         f"(line {node.start_mark.line + 1})")
                node.dls_weight = weight
            return node

        def compose_document(self) -> Any:
            node = super().compose_document()
            _check_json_tree(node)
            return node

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            # Model Zoo's UniqueKeyLoader (common/utils/utils.py, 2.5+) refuses repeated keys;
            # PyYAML alone keeps the last one silently.
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if isinstance(key_node, yaml.ScalarNode):
                        key = (key_node.tag, key_node.value)
                        if key in seen:
                            raise yaml.constructor.ConstructorError(
                                None, None, f"duplicate key {excerpt(key_node.value)}", key_node.start_mark)
                        seen.add(key)
            return super().construct_mapping(node, deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    return Loader


_YAML_TAG = "tag:yaml.org,2002:"
_JSON_TAGS = frozenset(_YAML_TAG + t for t in ("str", "int", "float", "bool", "null", "seq", "map"))


def _check_json_tree(root: Any) -> None:
    """Refuse what YAML can express and JSON (and so a config) cannot: a collection that
    contains itself through an alias, binary blobs, sets, timestamps, ordered pairs, other
    tags, and keys that are not strings. Iterative: every distinct node is visited once."""
    import yaml

    def fail(node: Any, why: str) -> yaml.YAMLError:
        return yaml.YAMLError(f"{why} (line {node.start_mark.line + 1}); a config holds only "
                              "strings, numbers, booleans, null, lists and string-keyed mappings")

    state: dict[int, bool] = {}  # node id -> finished
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            state[id(node)] = True
            continue
        if id(node) in state:
            if not state[id(node)]:
                raise fail(node, "an alias refers to a collection that contains it")
            continue
        if node.tag not in _JSON_TAGS:
            raise fail(node, f"a value of type {_tag(node)}")
        if isinstance(node, yaml.ScalarNode):
            state[id(node)] = True
            continue
        state[id(node)] = False
        stack.append((node, True))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag == _YAML_TAG + "merge":
                    stack.append((value, False))
                    continue
                if not isinstance(key, yaml.ScalarNode) or key.tag != _YAML_TAG + "str":
                    raise fail(key, f"a key of type {_tag(key)}")
                stack.append((value, False))
        else:
            stack.extend((item, False) for item in node.value)


def _tag(node: Any) -> str:
    return one_line(node.tag.removeprefix(_YAML_TAG), 40)


def _read_bounded(path: str | Path) -> str:
    """The text of a regular file of at most MAX_YAML_BYTES; never blocks on a FIFO or device."""
    name = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputValueError(f"{name}: no such file") from None
    except OSError as exc:
        raise InputValueError(f"{name}: cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputValueError(f"{name}: is a directory, not a YAML file")
    if not stat.S_ISREG(st.st_mode):
        raise InputValueError(f"{name}: not a regular file (a device, FIFO or socket); give a YAML file")
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO after the stat, open does not wait.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InputValueError(f"{name}: cannot read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InputValueError(f"{name}: not a regular file (a device, FIFO or socket); give a YAML file")
        data = f.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise InputValueError(f"{name}: larger than {MAX_YAML_BYTES} bytes; not a Model Zoo params file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputValueError(f"{name}: cannot read: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file, turning every failure into a one-line `InputValueError` naming the file."""
    import yaml

    name = str(path)
    text = _read_bounded(path)
    try:
        return yaml.load(text, Loader=_Loader.get())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputValueError(f"{name}: invalid YAML{where}: {problem[:200]}") from None
    except (ValueError, RecursionError) as exc:
        # e.g. an integer literal past Python's digit limit
        raise InputValueError(f"{name}: invalid YAML: {str(exc).splitlines()[0][:200]}") from None
