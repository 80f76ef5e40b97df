"""The model compatibility matrix (`harness.run_cell` per cell) and checks of the harness itself.

The default suite runs the cheap cells (`FAST`: the eager scalers on every model, and the
cells of the small models that fail or pass within seconds); every other cell is
``@pytest.mark.slow`` and runs with ``pytest -m slow tests/models`` or, one subprocess per
cell with a timeout, ``tools/compat/run_models.py`` (which regenerates docs/COMPATIBILITY.md).
Cells listed in `known.KNOWN` are strict expected failures: a fix makes the test fail until the
entry is removed and the table regenerated.
"""

from __future__ import annotations

import math
from pathlib import Path

import harness  # tests/models is on pytest's pythonpath (pyproject.toml)
import known
import pytest
import torch
import zoo

import dlspass

FAST = {
    *(harness.cell_id(m, e, "fp32") for m in zoo.MODELS for e in harness.EAGER),
    *(harness.cell_id(m, "GradScaler", "fp32", True) for m in zoo.MODELS),
    *(harness.cell_id(*cell) for cell in (
        ("gpt2", "TorchGradScaler", "fp32", True),
        ("graph_break", "capture_step", "fp32"),
        ("graph_break", "capture_step", "cbfloat16"),
        ("graph_break", "dlspass.compile", "fp32"),
        ("graph_break", "cli", "fp32"),
        ("graph_break", "make_backend", "fp32"),
        ("gpt2", "capture_step", "cbfloat16"),
        # two micro-batches through inductor: past the float32 bound (0.0022), bit for bit what
        # torch.compile(backend="inductor") trains with the eager scaler (harness.run_cell)
        ("mhagpt", "make_backend", "fp32", True),
        # native 16-bit kernels against torch.autocast + torch.amp.GradScaler, one cell per entry
        # point and format (the whole native matrix is slow: tools/compat/run_models.py)
        ("mhagpt", "capture_step", "float16-native"),
        ("mhagpt", "capture_step", "bfloat16-native"),
        ("graph_break", "make_backend", "float16-native"),
        ("graph_break", "backend=dlspass", "bfloat16-native"),
        ("resnet", "capture_step", "float16-native"),
        ("graph_break", "cli", "float16-native"),
        # float8 against torchao's float8 training, both recipes, every entry point on the small
        # models (make_backend rowwise with inductor: the rowwise scales' layout, which inductor
        # once laid out transposed for torch._scaled_mm)
        ("mhagpt", "capture_step", "float8-tensorwise"),
        ("graph_break", "make_backend", "float8-rowwise"),
        ("graph_break", "backend=dlspass", "float8-tensorwise"),
        ("graph_break", "cli", "float8-rowwise"),
    )),
    # dlspass.compile native: tests/test_native_precision.py trains MHAGPT through it by default
    # gpt2 cli fp32 is slow here: tests/test_cli_outside_models.py trains the same CLI path in
    # the default suite.
}


def _cells() -> list:
    out = []
    for cell in harness.cells():
        key = harness.cell_id(*cell)
        marks = [] if key in FAST else [pytest.mark.slow]
        if key in known.KNOWN:
            marks.append(pytest.mark.xfail(strict=True, reason=known.KNOWN[key].summary))
        out.append(pytest.param(*cell, id=key, marks=marks))
    return out


@pytest.mark.parametrize(("model", "entry", "fmt", "accumulate"), _cells())
def test_cell(model: str, entry: str, fmt: str, accumulate: bool) -> None:
    res = harness.run_cell(model, entry, fmt, accumulate)
    assert res.ok, res.reason


def test_known_failures_name_real_cells() -> None:
    ids = {harness.cell_id(*c) for c in harness.cells()}
    assert set(known.KNOWN) <= ids, sorted(set(known.KNOWN) - ids)


# ---- the harness can fail: each check catches the fault it is there for ---------------------

def _plain_adamw(case: zoo.Case, overflow_steps: tuple[int, ...]) -> harness.Trace:
    """AdamW with no scaler (an overflow step is simply not taken), scale fixed at 1024."""
    opt = torch.optim.AdamW(case.model.parameters(), lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)
    tr = harness.Trace()
    for i in range(harness.STEPS):
        if i not in overflow_steps:
            case.loss_fn(case.model, case.batch).backward()
            opt.step()
            opt.zero_grad()
        tr.scales.append(harness.INIT_SCALE)
        tr.skipped.append(sum(s <= i for s in overflow_steps))
    tr.params = {k: v.detach().clone() for k, v in case.model.named_parameters()}
    return tr


def test_compare_catches_an_overflow_that_reaches_the_weights() -> None:
    case = zoo.graph_break()
    opt = torch.optim.AdamW(case.model.parameters(), lr=harness.LR)
    case.loss_fn(case.model, zoo.with_mult(case.batch, math.inf)).backward()
    opt.step()
    tr = harness.Trace(params={k: v.detach() for k, v in case.model.named_parameters()})
    failures, _ = harness.compare(tr, tr, tr.params, 1.0)
    assert failures and "non-finite weights" in failures[0]


def test_compare_catches_a_wrong_skip_and_scale() -> None:
    ref = harness.reference("graph_break", "fp32", False)
    init = harness.initial_params("graph_break")
    assert harness.compare(ref, ref, init, 0.0) == ([], 0.0)
    moved = harness.Trace(ref.scales, [0, *ref.skipped[:-1]], ref.losses, ref.params)
    assert "skipped-step counts" in harness.compare(moved, ref, init, 1.0)[0][0]
    rescaled = harness.Trace([s * 2 for s in ref.scales], ref.skipped, ref.losses, ref.params)
    assert "loss scales" in harness.compare(rescaled, ref, init, 1.0)[0][0]


@pytest.mark.parametrize("model", ["gpt2", "resnet"])
def test_tolerances_catch_lost_steps(model: str) -> None:
    """One lost update exceeds the fp32 and float16 bounds, four lost updates every bound
    (the float8 columns' too)."""
    init = harness.initial_params(model)
    ref = _plain_adamw(zoo.MODELS[model](), (harness.OVERFLOW_STEP,))
    one = _plain_adamw(zoo.MODELS[model](), (harness.OVERFLOW_STEP, 6))
    four = _plain_adamw(zoo.MODELS[model](), (harness.OVERFLOW_STEP, 5, 6, 7, 8))
    tol = harness.TOLERANCE
    assert harness.update_error(one.params, ref.params, init) > 2 * max(tol["fp32"], tol["float16"])
    assert harness.update_error(four.params, ref.params, init) > max(tol.values())
    native = harness.NATIVE_TOLERANCE
    assert harness.update_error(one.params, ref.params, init) > native["float16-native"]
    assert harness.update_error(four.params, ref.params, init) > max(native.values())
    assert harness.update_error(four.params, ref.params, init) > max(harness.FLOAT8_TOLERANCE.values())


def test_reference_matches_plain_adamw_that_skips_the_overflow_step() -> None:
    """The eager reference is AdamW with step 4 left out (scaling by a power of 2 is exact)."""
    ref = harness.reference("gpt2", "fp32", False)
    plain = _plain_adamw(zoo.gpt2(), (harness.OVERFLOW_STEP,))
    assert ref.skipped == plain.skipped
    assert ref.scales == harness.CEREBRAS_SCALES
    err = harness.update_error(ref.params, plain.params, harness.initial_params("gpt2"))
    assert err <= 1e-6, err


def test_bfloat16_scaler_passes_an_inf_through_by_design() -> None:
    """docs/COMPATIBILITY.md: with bfloat16 nothing is checked, so an inf reaches the weights."""
    case = zoo.graph_break()
    opt = torch.optim.AdamW(case.model.parameters(), lr=harness.LR)
    with pytest.warns(UserWarning, match="bfloat16"):
        scaler = dlspass.GradScaler(config=harness.config("bfloat16"))
    scaler.scale(case.loss_fn(case.model, zoo.with_mult(case.batch, math.inf))).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.isfinite(case.model.b.weight).all()
    assert int(scaler.get_num_skipped_steps()) == 0


# ---- docs/COMPATIBILITY.md's float8 cells are what a rerun gives ------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "COMPATIBILITY.md"


def _doc_cell(model: str, entry: str, fmt: str) -> str:
    """The text of one cell of the document's first table (one backward per step)."""
    lines = DOC.read_text().splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| model | entry point |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    for ln in lines[header + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cells[0] == model and cells[1] == f"`{entry}`":
            return cells[columns.index(fmt.replace("-", " "))]
    raise AssertionError(f"no row {model} {entry} in {DOC}")


@pytest.mark.parametrize(("model", "entry", "fmt"), [
    ("graph_break", "cli", "float8-rowwise"),
    ("mhagpt", "capture_step", "float8-tensorwise"),
])
def test_the_documented_float8_cells_are_what_a_rerun_gives(model: str, entry: str, fmt: str) -> None:
    """A sample of the generated table: the cell reads "works (N)" with N the matmuls the
    rerun ran in float8 (tools/compat/run_models.py wrote it from its own run)."""
    res = harness.run_cell(model, entry, fmt)
    assert res.ok, res.reason
    assert _doc_cell(model, entry, fmt) == f"works ({res.float8_matmuls})"
