"""The layout's rules, checked on the source tree: imports run downwards through the layers
below and form no cycle, every FX rewrite is a pass in ``passes/`` (one ``VerbNounPass`` per
file, a one-line docstring of its rewrite, one test file, named by its module), graph mutation
happens only in ``passes/`` and ``dlspass/graph/``, no test reaches a helper through
``sys.path.insert``, and no module is named like a public verb."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from torch.fx.passes.infra.pass_base import PassBase

import dlspass

ROOT = Path(__file__).resolve().parents[1]
PASS_FILES = sorted((ROOT / "passes").glob("*_pass.py"))
# calls and assignments that change an FX graph (reading `node.op == "call_function"` is not one)
MUTATION = re.compile(r"\.(create_node|call_function|call_method|call_module|get_attr|placeholder"
                      r"|output|inserting_before|inserting_after|replace_all_uses_with"
                      r"|replace_input_with|erase_node|graph_copy|node_copy)\("
                      r"|\.(args|kwargs|target)\s*=(?!=)")

# The layers, lowest first: a module imports only from layers below its own, or from its own
# layer without a cycle (imports inside functions count; ``if TYPE_CHECKING:`` ones do not, as
# they never run). A module is in the layer of its longest listed prefix. ``passes/`` is
# shipped as ``dlspass.passes``; ``from dlspass import scale_policy`` imports that submodule,
# not the facade.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("dlspass.errors",)),
    ("files", ("dlspass.files",)),  # untrusted-file readers
    ("presets", ("dlspass.presets", "dlspass.modelzoo_releases", "dlspass.modelzoo",
                 "dlspass.deepspeed_config")),
    ("config", ("dlspass.config",)),
    ("numerics", ("dlspass.formats", "dlspass.format_ranges", "dlspass.scale_policy",
                  "dlspass.precision_policy", "dlspass.cudagraph_policy", "dlspass.float8_policy",
                  "dlspass.cache_facts")),
    ("models", ("dlspass.models",)),  # the toy models: nothing of dlspass above numerics
    ("runtime", ("dlspass.scale_log", "dlspass.scaler", "dlspass.distributed", "dlspass.checkpoint")),
    ("graph", ("dlspass.graph",)),
    ("passes", ("dlspass.passes",)),
    ("capture", ("dlspass.capture",)),
    ("onnx", ("dlspass.onnx",)),
    ("debug", ("dlspass.debug",)),
    ("cli", ("dlspass.cli",)),
    # the frameworks' glue (accelerate, the transformers Trainer): nothing of dlspass imports it
    ("integrations", ("dlspass.integrations",)),
    ("facade", ("dlspass", "dlspass.__main__")),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in [*(ROOT / "dlspass").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]:
        rel = path.relative_to(ROOT).with_suffix("")
        parts = ["dlspass", *rel.parts] if rel.parts[0] == "passes" else list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int | None:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                    best is None or len(prefix) > len(best[1])):
                best = (i, prefix)
    return None if best is None else best[0]


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    skip: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip |= set(ast.walk(sub))
    return skip


def _imports(module: str, path: Path) -> set[str]:
    """The package modules ``module`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            src = "dlspass." + src if src == "passes" or src.startswith("passes.") else src
            # `from pkg import submodule` imports the submodule; `from mod import name`, the module
            names = [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in node.names]
        else:
            continue
        out |= {n for n in names if n in MODULES and n != module}
    return out


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_is_in_a_layer() -> None:
    assert len(MODULES) > 40 and "dlspass.passes.base" in MODULES  # the walk reaches the tree
    assert sorted(m for m in MODULES if _layer(m) is None) == []


def test_imports_form_no_cycle() -> None:
    graph = nx.DiGraph((a, b) for a, bs in IMPORTS.items() for b in bs)
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    assert cycles == []


def test_imports_run_downwards() -> None:
    names = [name for name, _ in LAYERS]
    upward = [f"{a} ({names[_layer(a)]}) imports {b} ({names[_layer(b)]})"
              for a, bs in sorted(IMPORTS.items()) for b in sorted(bs)
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert upward == []


def test_the_layer_check_sees_function_level_and_submodule_imports() -> None:
    # what the two checks above rely on, on imports the tree has today
    assert "dlspass.graph.invariants" in IMPORTS["dlspass.passes"]  # inside apply_dls
    assert "dlspass.scale_policy" in IMPORTS["dlspass.passes.update_scale_pass"]
    assert "dlspass" not in IMPORTS["dlspass.passes.update_scale_pass"]


def test_every_pass_is_a_graph_pass_named_by_its_module() -> None:
    """A pass's ``name`` is its id in logs, skip reasons and provenance (``dlspass_pass``)."""
    from dlspass.passes import PASSES
    from dlspass.passes.base import GraphPass

    names = {}
    for path in PASS_FILES:
        cls = getattr(importlib.import_module(f"dlspass.passes.{path.stem}"), _class_name(path))
        if not issubclass(cls, PassBase):  # the ONNX rewrites are onnx_ir passes
            assert path.stem.endswith("_onnx_pass"), f"{path.name}: not an FX pass"
            continue
        assert issubclass(cls, GraphPass), f"{cls.__name__} is not a GraphPass"
        names[path.stem.removesuffix("_pass")] = cls.name
    assert set(PASSES) <= set(names)  # the pipeline's passes are among them
    assert {stem: name for stem, name in names.items() if stem != name} == {}


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


def _readme_layout_rows() -> list[str]:
    """The first cell of each row of README's layout table (``dlspass/...``, ``passes/``)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| path | what it holds |"):text.index("### Where to change what")]
    return [row.split("|")[1].strip() for row in table.splitlines()[2:] if row.startswith("|")]


def test_readme_layout_table_is_in_layer_order() -> None:
    layers = []
    for cell in _readme_layout_rows():
        path = re.match(r"`((?:dlspass|passes)/[\w/]*?)(?:/?__init__)?(?:\.py)?/?`", cell)
        if path is None:
            continue
        parts = path.group(1).strip("/").split("/")
        module = ".".join(["dlspass", *parts] if parts[0] == "passes" else parts)
        layer = _layer(module)
        assert layer is not None, f"README's layout table names {cell}, which is in no layer"
        layers.append((layer, cell))
    assert len(layers) > 30  # the table was read
    out_of_order = [f"{b} ({LAYERS[lb][0]}) after {a} ({LAYERS[la][0]})"
                    for (la, a), (lb, b) in zip(layers, layers[1:], strict=False) if lb < la]
    assert out_of_order == []


# A module past this is due for a split (docs/STATUS.md: "no module over ~500 lines"); the
# largest today is dlspass/scaler/eager.py (510)
MAX_MODULE_LINES = 520


def test_no_module_is_larger_than_the_limit() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert max(sizes.values()) > 300  # the sizes were read
    assert {m: n for m, n in sizes.items() if n > MAX_MODULE_LINES} == {}


# Where a function-level import of dlspass's own modules may stay: start-up time (the CLI, the
# lazy facade). Every other module imports at the top: no cycle needs a late import (the
# checks above see function-level imports too), except the few named in LAZY_FOR_START_UP with
# the start-up cost each one saves.
LAZY_IMPORTS_ALLOWED = ("dlspass.cli", "dlspass")
LAZY_FOR_START_UP = {
    # an isinstance check; at the top it would load the compile path (dynamo, inductor: some
    # seconds) for every eager user of dlspass.debug.faults and dlspass.debug.localize
    ("dlspass.debug.faults", "dlspass.capture.compiled_step"),
    # the CPU-facts key of the lazily compiled rounding kernel: cache_facts loads inductor and
    # dynamo (about 0.9 s) for every importer of dlspass.formats, eager ones included
    ("dlspass.formats", "dlspass.cache_facts"),
}


def _late_internal_imports(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    late = []
    for node in ast.walk(tree):
        if node in skip or not isinstance(node, ast.Import | ast.ImportFrom) or node.col_offset == 0:
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
        if (module, *names) in LAZY_FOR_START_UP:
            continue
        if node.__class__ is ast.ImportFrom and node.level or any(
                n == "dlspass" or n.startswith(("dlspass.", "passes")) for n in names):
            late.append(f"{module}:{node.lineno}")
    return late


def test_internal_imports_are_at_the_top_except_where_start_up_needs_laziness() -> None:
    def exempt(module: str) -> bool:
        return module in LAZY_IMPORTS_ALLOWED or module.startswith("dlspass.cli.")

    late = [site for m, p in sorted(MODULES.items()) if not exempt(m) for site in _late_internal_imports(m, p)]
    assert late == []
    # the check sees a late import where there is one (the CLI keeps them for start-up time)
    assert any(_late_internal_imports(m, p) for m, p in MODULES.items() if m.startswith("dlspass.cli"))
    # each named exception is still a late import there (a hoisted one leaves the list)
    for module, imported in LAZY_FOR_START_UP:
        tree = ast.parse(MODULES[module].read_text())
        assert any(isinstance(n, ast.ImportFrom) and n.col_offset > 0 and n.module == imported
                   for n in ast.walk(tree)), (module, imported)


# modules an eager user imports (the eager scalers, the formats, analyze's ranges, the configs):
# none of them may load the compile path (inductor, dynamo: about 0.9 s on top of torch's import)
EAGER_MODULES = ("dlspass", "dlspass.scaler", "dlspass.formats", "dlspass.format_ranges",
                 "dlspass.config", "dlspass.presets", "dlspass.modelzoo")


@pytest.mark.parametrize("module", EAGER_MODULES)
def test_eager_modules_do_not_load_the_compile_path(module: str) -> None:
    probe = (f"import sys, {module}\n"
             "print(sorted(m for m in sys.modules if m.startswith(('torch._inductor', 'torch._dynamo'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} loads: {out.stdout.strip()[:300]}"
