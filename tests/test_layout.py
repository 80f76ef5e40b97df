"""The layout's rules, checked on the source tree: every FX rewrite is a pass in ``passes/``
(one ``VerbNounPass`` per file, a one-line docstring of its rewrite, one test file), graph
mutation happens only in ``passes/`` and ``dlspass/graph/``, no test reaches a helper through
``sys.path.insert``, and no module is named like a public verb."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dlspass

ROOT = Path(__file__).resolve().parents[1]
PASS_FILES = sorted((ROOT / "passes").glob("*_pass.py"))
# calls that change an FX graph (reading `node.op == "call_function"` is not one)
MUTATION = re.compile(r"\.(create_node|call_function|call_method|call_module|get_attr|placeholder"
                      r"|inserting_before|inserting_after|replace_all_uses_with|replace_input_with"
                      r"|erase_node|graph_copy|node_copy)\(")


def test_there_are_passes() -> None:
    assert len(PASS_FILES) >= 6


@pytest.mark.parametrize("path", PASS_FILES, ids=lambda p: p.stem)
def test_one_verb_noun_pass_per_file_with_a_one_line_docstring_and_a_test(path: Path) -> None:
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree, clean=False)
    name = _class_name(path)
    assert doc is not None and "\n" not in doc.strip(), f"{path.name}: module docstring must be one line"
    assert doc.startswith(f"{name}: "), f"{path.name}: docstring must start with '{name}: '"
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Pass")]
    assert classes == [name], f"{path.name}: expected exactly one pass class {name}, found {classes}"
    assert (ROOT / "tests" / "passes" / f"test_{path.stem}.py").exists(), f"no test file for {path.name}"


def test_graph_mutation_only_in_passes_and_graph() -> None:
    allowed = (ROOT / "passes", ROOT / "dlspass" / "graph")
    offenders = []
    for path in sorted((ROOT / "dlspass").rglob("*.py")):
        if any(a in path.parents for a in allowed):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if MUTATION.search(code) and not code.lstrip().startswith(("\"", "'")):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    # ONNX passes edit onnx_ir graphs, not FX ones; they live in passes/ too
    assert offenders == []


def test_tests_import_helpers_without_sys_path() -> None:
    hits = [f"{p.relative_to(ROOT)}" for p in (ROOT / "tests").rglob("*.py")
            if p.name != Path(__file__).name and "sys.path.insert" in p.read_text()]
    assert hits == []


def test_no_module_is_named_like_a_public_name() -> None:
    modules = {p.stem for p in (ROOT / "dlspass").rglob("*.py")} | {
        p.name for p in (ROOT / "dlspass").iterdir() if p.is_dir()}
    # `formats` is public as the module itself (dlspass.formats)
    clash = {name for name in dlspass.__all__ if name in modules and name != "formats"}
    assert clash == set()


def test_the_passes_package_docstring_names_every_pass() -> None:
    import dlspass.passes

    doc = dlspass.passes.__doc__ or ""
    missing = [p.stem for p in PASS_FILES
               if f"``{p.stem.removesuffix('_pass')}``" not in doc
               and _class_name(p) not in doc]
    assert missing == []


def _class_name(path: Path) -> str:
    want = {"dls": "DLS", "onnx": "Onnx"}
    return "".join(want.get(p, p.capitalize()) for p in path.stem.split("_"))
