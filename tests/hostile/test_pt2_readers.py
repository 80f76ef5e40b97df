""".pt2 archives that torch's zip reader and Python's ``zipfile`` read differently, declared
tensor sizes that the records do not back, and symbolic expressions that are cheap to write
and expensive to sympify.

The exploits here pass the first round's checker (which read the archive with ``zipfile``)
and run their payload under plain ``torch.export.load`` (the control test); dlspass must
refuse them with one line and exit 2. The differential test checks, for every archive the
hostile tests build, that the checker's reading of it is torch's or the checker refuses it.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import torch
import zip_tricks as zt
from hostile_files import (
    SENTINEL,
    Result,
    evil_torch_save,
    live_under_plain_torch,
    members,
    rewrite,
    run_cli_batch,
    save_tiny,
)
from test_pt2_archives import EVIL_EXPR, MODEL, VECTORS, _build, _set_every_expr

from dlspass.files.pt2_archive import UnsafeArchiveError, check_pt2_archive
from dlspass.files.pt2_program import (
    MAX_EXPR_CHARS,
    MAX_EXPR_TOTAL_CHARS,
    MAX_MINMAX_ARGS,
    MAX_MINMAX_PAIRS,
)
from dlspass.files.zip_view import read_view

pytestmark = pytest.mark.timeout(300)

SI = "data/sample_inputs/model.pt"
WEIGHTS = "data/weights/model_weights_config.json"
CONSTANTS = "data/constants/model_constants_config.json"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pt2r")
    return {"static": save_tiny(d / "tiny.pt2"), "dynamic": save_tiny(d / "dyn.pt2", dynamic=True)}


def _evil_program(src: Path) -> bytes:
    prog = json.loads(members(src)[1][MODEL])
    _set_every_expr(EVIL_EXPR)(prog)
    return json.dumps(prog).encode()


def _case_sample_inputs(b: dict[str, Path]) -> bytes:
    root, m = members(b["static"])
    return zt.case_variant(root, m, SI, evil_torch_save(), "data/sample_inputs/MODEL.pt")


def _case_folder(b: dict[str, Path]) -> bytes:
    root, m = members(b["static"])
    return zt.case_variant(root, m, SI, evil_torch_save(), "DATA/Sample_Inputs/model.pt")


def _case_program(b: dict[str, Path]) -> bytes:
    root, m = members(b["dynamic"])
    return zt.case_variant(root, m, MODEL, _evil_program(b["dynamic"]), "MODELS/model.json")


def _prepended(b: dict[str, Path]) -> bytes:
    root, m = members(b["static"])
    evil = {**m, SI: evil_torch_save()}
    padded = {**m, MODEL: m[MODEL] + b" " * 4096}  # room for the evil members in front
    return zt.prepended(root, padded, evil)


# name: builder of the archive's bytes. Each runs its payload under plain torch.export.load.
EXPLOITS = {
    "case_variant_sample_inputs": _case_sample_inputs,
    "case_variant_folder": _case_folder,
    "case_variant_program": _case_program,
    "prepended_archive": _prepended,
}


def _evil_pair(b: dict[str, Path]) -> tuple[str, dict[str, bytes], dict[str, bytes]]:
    root, m = members(b["static"])
    return root, m, {**m, SI: evil_torch_save()}


# Layouts on which the readers disagree (or that hide bytes), not exploits on their own.
DISAGREEMENTS = {
    "zip64_locator": lambda b: zt.zip64_locator(*_evil_pair(b)),
    "trailing_directory": lambda b: zt.trailing_directory(*_evil_pair(b)),
    "local_header_name": lambda b: zt.local_name(*_evil_pair(b)[::2], SI, "data/sample_inputs/other.pt"),
    "hidden_bytes": lambda b: zt.hidden_bytes(*_evil_pair(b)[:2], evil_torch_save()),
    "nul_in_name": lambda b: zt.nul_name(*_evil_pair(b)[:2], SI, evil_torch_save()),
    "unflagged_utf8_name": lambda b: zt.cp437_name(*_evil_pair(b)[:2], b"{}"),
    "missing_descriptor": lambda b: zt.descriptor_lie(*_evil_pair(b)[:2]),
}


def _write(folder: Path, name: str, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.pt2"
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def inspected(base, tmp_path_factory) -> dict[str, tuple[Path, Path, Result]]:
    """``dlspass inspect`` in a subprocess, each in an empty folder of its own, of two of the
    exploits and of the 1.5 GiB empty weight record: name -> (file, folder, result). The calls
    share one child that imports dlspass once (``run_cli_batch``)."""
    d = tmp_path_factory.mktemp("inspected")
    files = {name: _write(d / "in", name, EXPLOITS[name](base))
             for name in ("prepended_archive", "case_variant_program")}
    files["empty_weight_record"] = SIZE_VECTORS["empty_weight_record"](
        base, d / "in" / "empty_weight_record.pt2")
    folders = {name: d / "work" / name for name in files}
    for folder in folders.values():
        folder.mkdir(parents=True)
    results = run_cli_batch({name: (["inspect", files[name]], folders[name]) for name in files})
    return {name: (files[name], folders[name], results[name]) for name in files}


@pytest.mark.parametrize("name", ["prepended_archive", "case_variant_program"])
def test_reader_disagreement_cannot_run_code(inspected, name):
    """The real entry point in a subprocess: exit 2, one line, no sentinel, within bounds
    (two of the exploits; the next test runs all of them in process)."""
    evil, work, res = inspected[name]
    with pytest.raises(UnsafeArchiveError):
        check_pt2_archive(evil)
    assert res.rc == 2, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("dlspass: error:"), res.stderr
    assert not (work / SENTINEL).exists(), f"{name}: the payload ran under inspect"
    assert res.seconds < 60 and res.peak_rss_mb < 1024


@pytest.mark.parametrize("name", sorted(EXPLOITS))
def test_reader_disagreement_refused_by_every_command(base, tmp_path, monkeypatch, capsys, name):
    from dlspass.cli import run

    evil = _write(tmp_path / "in", name, EXPLOITS[name](base))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for args in (["inspect", evil], ["verify", evil], ["transform", evil, "-o", work / "out.pt2"]):
        capsys.readouterr()
        rc = run([str(a) for a in args])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
        assert not (work / SENTINEL).exists()
        assert list(work.iterdir()) == []


def test_the_reader_exploits_are_live_under_plain_torch(base, tmp_path):
    """Control: each exploit runs its payload under ``torch.export.load`` itself (in a fresh
    process, in its own folder), so the refusals above are not vacuous."""
    files = {n: _write(tmp_path / n, n, build(base)) for n, build in EXPLOITS.items()}
    ran, stderr = live_under_plain_torch(files)
    assert ran == {n: True for n in EXPLOITS}, stderr


@pytest.mark.parametrize("name", sorted(DISAGREEMENTS))
def test_layouts_the_readers_could_disagree_on_are_refused(base, tmp_path, name):
    path = _write(tmp_path, name, DISAGREEMENTS[name](base))
    t = time.monotonic()
    with pytest.raises(UnsafeArchiveError):
        check_pt2_archive(path)
    assert time.monotonic() - t < 30


def _torch_view(data: bytes) -> dict[str, bytes] | None:
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        return {n: reader.get_record(n) for n in reader.get_all_records()}
    except Exception:
        return None


def test_checker_and_torch_read_every_crafted_archive_alike(base, tmp_path):
    """Differential: for every archive the hostile tests build (the first round's vectors,
    the exploits and layouts above, and valid ones), the checker's reading (names -> bytes)
    is torch's, or the checker refuses the archive."""
    archives: dict[str, bytes] = {"valid_static": base["static"].read_bytes(),
                                  "valid_dynamic": base["dynamic"].read_bytes()}
    for name in VECTORS:
        archives[f"vector_{name}"] = _build(base, name, tmp_path / "v").read_bytes()
    for name, build in {**EXPLOITS, **DISAGREEMENTS}.items():
        archives[name] = build(base)
    (tmp_path / "s").mkdir()
    for name, build in SIZE_VECTORS.items():
        archives[f"size_{name}"] = build(base, tmp_path / "s" / f"{name}.pt2").read_bytes()
    accepted = 0
    for name, data in archives.items():
        try:
            view = read_view(data, name)
        except ValueError:  # refused (UnsafeZipError)
            continue
        accepted += 1
        ours = {rel: view.read(rel) for rel in view.records}
        assert ours == _torch_view(data), name
    assert accepted >= len(VECTORS)  # the payload-level vectors are valid zips: compared, not refused


# ---- declared tensor sizes -------------------------------------------------------------------

def _first_weight(edit):
    def build(b: dict[str, Path], dst: Path) -> Path:
        _, files = members(b["static"])
        cfg = json.loads(files[WEIGHTS])
        entry = cfg["config"]["fc.weight"]
        changes = edit(entry)
        return rewrite(b["static"], dst, {WEIGHTS: json.dumps(cfg).encode(), **changes})
    return build


def _sizes(*dims: int) -> list[dict[str, int]]:
    return [{"as_int": d} for d in dims]


def _strides(*dims: int) -> list[dict[str, int]]:
    out, acc = [], 1
    for d in reversed(dims):
        out.insert(0, {"as_int": acc})
        acc *= d
    return out


def _empty_record(dims: tuple[int, ...]):
    def edit(entry: dict) -> dict:
        entry["tensor_meta"]["sizes"], entry["tensor_meta"]["strides"] = _sizes(*dims), _strides(*dims)
        return {f"data/weights/{entry['path_name']}": b""}
    return edit


def _larger_than_record(entry: dict) -> dict:
    entry["tensor_meta"]["sizes"], entry["tensor_meta"]["strides"] = _sizes(64, 64), _strides(64, 64)
    return {}


def _broadcast(entry: dict) -> dict:
    entry["tensor_meta"]["sizes"], entry["tensor_meta"]["strides"] = _sizes(2**40), [{"as_int": 0}]
    return {}


def _empty_constant(b: dict[str, Path], dst: Path) -> Path:
    _, files = members(b["static"])
    cfg = json.loads(files[CONSTANTS])
    dims = (3 * 2**13, 2**14)
    cfg["config"]["big"] = {"path_name": "tensor_0", "is_param": False, "use_pickle": False,
                            "tensor_meta": {"dtype": 7, "sizes": _sizes(*dims), "strides": _strides(*dims),
                                            "requires_grad": False, "storage_offset": {"as_int": 0},
                                            "device": {"type": "cpu", "index": None}, "layout": 7}}
    return rewrite(b["static"], dst, {CONSTANTS: json.dumps(cfg).encode(), "data/constants/tensor_0": b""})


def _huge_user_input(b: dict[str, Path], dst: Path) -> Path:
    _, files = members(b["static"])
    prog = json.loads(files[MODEL])
    prog["graph_module"]["graph"]["tensor_values"]["x"]["sizes"] = _sizes(3 * 2**13, 2**14)
    return rewrite(b["static"], dst, {MODEL: json.dumps(prog).encode()})


# name: builder(base, dst) -> path. 1.5 GiB of float32 declared by a ~10 kB file.
SIZE_VECTORS = {
    "empty_weight_record": _first_weight(_empty_record((3 * 2**13, 2**14))),
    "empty_constant_record": _empty_constant,
    "weight_larger_than_record": _first_weight(_larger_than_record),
    "weight_broadcast_from_four_bytes": _first_weight(_broadcast),
    "huge_declared_user_input": _huge_user_input,
}


@pytest.mark.parametrize("name", sorted(SIZE_VECTORS))
def test_declared_tensor_sizes_are_bounded_by_the_records(base, tmp_path, name):
    evil = SIZE_VECTORS[name](base, tmp_path / f"{name}.pt2")
    assert evil.stat().st_size < 64 * 1024
    with pytest.raises(UnsafeArchiveError):
        check_pt2_archive(evil)


@pytest.mark.parametrize("name", ["empty_weight_record"])
def test_a_tiny_archive_cannot_make_inspect_allocate_gigabytes(inspected, name):
    """torch allocates ``torch.zeros`` of the declared size for an empty record: 1.5 GiB here,
    in a subprocess whose peak RSS must stay under the documented 1 GB."""
    evil, _, res = inspected[name]
    assert evil.stat().st_size < 64 * 1024
    assert res.rc == 2, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("dlspass: error:"), res.stderr
    assert res.seconds < 60 and res.peak_rss_mb < 1024, (res.seconds, res.peak_rss_mb)


def test_valid_archives_pass_the_size_checks(base):
    for which in ("static", "dynamic"):
        check_pt2_archive(base[which])


# ---- symbolic expressions: cost, not only length ---------------------------------------------

def _max_of(n: int, fn: str = "Max") -> str:
    return f"{fn}(" + ", ".join(f"Symbol('s{i}')" for i in range(n)) + ")"


def _nested_max(groups: int, each: int) -> str:
    inner = (f"Max({', '.join(f'Symbol({chr(39)}s{g}_{i}{chr(39)})' for i in range(each))})"
             for g in range(groups))
    return f"Max({', '.join(inner)})"


EXPENSIVE = {
    "max_of_250_symbols": _max_of(250),  # 4 KB; minutes in sympy
    "min_of_250_symbols": _max_of(250, "Min"),
    "nested_max_flattens_to_64": _nested_max(8, 8),  # every call has 8 arguments
    "calls_nested_40_deep": "Add(" * 40 + "Symbol('s0')" + ", Integer(1))" * 40,
}


@pytest.mark.parametrize("name", sorted(EXPENSIVE))
def test_expressions_that_are_slow_to_sympify_are_refused_fast(base, tmp_path, name):
    expr = EXPENSIVE[name]
    assert len(expr) <= 4096  # within the first round's length bound
    evil = tmp_path / f"{name}.pt2"
    _, files = members(base["dynamic"])
    prog = json.loads(files[MODEL])
    _set_every_expr(expr)(prog)
    rewrite(base["dynamic"], evil, {MODEL: json.dumps(prog).encode()})
    t = time.monotonic()
    with pytest.raises(UnsafeArchiveError, match="sympify"):
        check_pt2_archive(evil)
    assert time.monotonic() - t < 5


def test_a_4kb_expression_refused_through_the_cli_within_the_bounds(base, tmp_path, monkeypatch, capsys):
    """The issue's vector through the CLI: one line, exit 2, in seconds (sympify alone would
    take minutes)."""
    from dlspass.cli import run

    evil = tmp_path / "slow.pt2"
    _, files = members(base["dynamic"])
    prog = json.loads(files[MODEL])
    _set_every_expr(EXPENSIVE["max_of_250_symbols"])(prog)
    rewrite(base["dynamic"], evil, {MODEL: json.dumps(prog).encode()})
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    t = time.monotonic()
    rc = run(["inspect", str(evil)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "sympify" in err, err
    assert time.monotonic() - t < 10


# ---- symbolic expressions: the per-program budget --------------------------------------------

def _with_exprs(base: dict[str, Path], dst: Path, exprs: list[str]) -> Path:
    """The dynamic program with one more tensor per expression, of sizes ``(3, expression)``
    (torch sympifies the sizes of every tensor of the program when it loads it)."""
    _, files = members(base["dynamic"])
    prog = json.loads(files[MODEL])
    values = prog["graph_module"]["graph"]["tensor_values"]
    for i, expr in enumerate(exprs):
        meta = json.loads(json.dumps(values["x"]))
        meta["sizes"] = [{"as_int": 3}, {"as_expr": {"expr_str": expr, "hint": {"as_int": 4}}}]
        values[f"budget_{i}"] = meta
    return rewrite(base["dynamic"], dst, {MODEL: json.dumps(prog).encode()})


def _max_group(g: int) -> str:
    """A ``Max`` of ``MAX_MINMAX_ARGS`` symbols of its own: the most one expression may take."""
    return "Max(" + ", ".join(f"Symbol('g{g}_{i}')" for i in range(MAX_MINMAX_ARGS)) + ")"


def test_max_min_pairs_are_budgeted_per_program(base, tmp_path):
    """Each expression within its own bounds, but sympy compares ``n * (n - 1) / 2`` argument
    pairs per ``Max``/``Min``: over the distinct expressions of one program at most
    ``MAX_MINMAX_PAIRS``. The same text repeated counts once (sympy caches it)."""
    pairs = MAX_MINMAX_ARGS * (MAX_MINMAX_ARGS - 1) // 2
    fit = MAX_MINMAX_PAIRS // pairs
    check_pt2_archive(_with_exprs(base, tmp_path / "fit.pt2", [_max_group(g) for g in range(fit)]))
    check_pt2_archive(_with_exprs(base, tmp_path / "same.pt2", [_max_group(0)] * (fit + 1)))
    over = _with_exprs(base, tmp_path / "over.pt2", [_max_group(g) for g in range(fit + 1)])
    t = time.monotonic()
    with pytest.raises(UnsafeArchiveError, match=f"more than {MAX_MINMAX_PAIRS:,} Max/Min argument pairs"):
        check_pt2_archive(over)
    assert time.monotonic() - t < 5


def _long_sum(i: int) -> str:
    """A sum of 30 symbols with long names, about 4 KB: within every per-expression bound."""
    expr = "Add(" + ", ".join(f"Symbol('t{i:04d}_{j:02d}_{'x' * 110}')" for j in range(30)) + ")"
    assert len(expr) <= MAX_EXPR_CHARS
    return expr


def test_expression_text_is_budgeted_per_program(base, tmp_path):
    """sympify parses about 0.1 MB/s: the expressions of one program hold at most
    ``MAX_EXPR_TOTAL_CHARS`` characters in all, however each is bounded."""
    each = len(_long_sum(0))
    fit = (MAX_EXPR_TOTAL_CHARS - 2 * each) // each  # room for the program's own expressions
    check_pt2_archive(_with_exprs(base, tmp_path / "fit.pt2", [_long_sum(i) for i in range(fit)]))
    over = _with_exprs(base, tmp_path / "over.pt2", [_long_sum(i) for i in range(fit + 3)])
    t = time.monotonic()
    with pytest.raises(UnsafeArchiveError, match=f"total more than {MAX_EXPR_TOTAL_CHARS:,} characters"):
        check_pt2_archive(over)
    assert time.monotonic() - t < 5
