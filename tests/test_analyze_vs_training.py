"""`dlspass.analyze`'s verdicts on the matrix models against training in the format.

The reference is the training run, not analyze's numbers: `harness.run_cell_at_scale` trains
the model's ``capture_step`` cell (the cheapest entry point that lowers: no dynamo, no
inductor) for 10 AdamW steps in emulated float16 / bfloat16 / cbfloat16 from a given initial
scale and compares it with the float32 eager scaler at the same settings within the matrix's
tolerance (`harness.TOLERANCE`). Checked:

- at the matrix's initial scale 2^10, analyze says the format fits exactly where training
  works (and where `tests/models/known.py` lists no failure);
- ConvNeXt in float16 (the known case): analyze says 2^10 is below the window (its gradients
  flush), training from 2^10 fails, and training from analyze's recommended scale works;
- training from the recommended scale works for every model and format, and from the lowest
  scale analyze allows (the window's lower edge: the underflow threshold is not too lax);
- ``dlspass analyze zoo:cli_<model>`` runs on every matrix model and says what the API says.

The default run keeps ConvNeXt in float16, the two-linear ``graph_break`` model and the CLI; every other training cell is
``@pytest.mark.slow`` (tools/compat/analyze_vs_training.py runs them all and writes the
table in docs/COMPATIBILITY.md).
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path

import harness  # tests/models is on pytest's pythonpath (pyproject.toml)
import jsonschema
import known
import pytest
import zoo

import dlspass
from dlspass.cli import commands as cli
from dlspass.debug.precision_risk import SCALE_EXPONENTS, Analysis

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "analyze.schema.json").read_text())
TRAINED = ("float16", "bfloat16", "cbfloat16")
MATRIX_EXPONENT = int(math.log2(harness.INIT_SCALE))
FAST = {("convnext", "float16"), ("graph_break", "float16"), ("graph_break", "cbfloat16")}


@functools.cache
def _analysis(model: str) -> Analysis:
    case = zoo.MODELS[model]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dlspass.analyze(case.model, case.loss_fn, case.batch)


def _verdict(model: str, fmt: str) -> dlspass.debug.precision_risk.FormatVerdict:
    (v,) = [v for v in _analysis(model).verdicts if v.format == fmt]
    return v


@functools.cache
def _train(model: str, fmt: str, exponent: int) -> harness.CellResult:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bfloat16's "scaling is off" warning
        return harness.run_cell_at_scale(model, fmt, math.ldexp(1.0, exponent))


def _cells() -> list:
    return [pytest.param(m, f, id=f"{m}-{f}",
                         marks=[] if (m, f) in FAST else [pytest.mark.slow])
            for m in zoo.MODELS for f in TRAINED]


@pytest.mark.parametrize(("model", "fmt"), _cells())
def test_verdict_at_the_matrix_scale_agrees_with_training(model: str, fmt: str) -> None:
    v = _verdict(model, fmt)
    res = _train(model, fmt, MATRIX_EXPONENT)
    assert v.fits_at(MATRIX_EXPONENT) == res.ok, (v.verdict, v.window, res.reason)
    # and with the matrix's own list of failures (its capture_step cell at 2^10)
    listed = harness.cell_id(model, "capture_step", fmt) in known.KNOWN
    assert v.fits_at(MATRIX_EXPONENT) != listed


@pytest.mark.parametrize(("model", "fmt"), _cells())
def test_training_from_the_recommended_scale_works(model: str, fmt: str) -> None:
    v = _verdict(model, fmt)
    assert v.fits and v.recommended_exponent is not None, v.verdict
    res = _train(model, fmt, v.recommended_exponent)
    assert res.ok, (v.recommended_exponent, res.reason)


def _edge_cells() -> list:
    out = []
    for c in _cells():
        if c.values[1] == "bfloat16":
            continue
        miss = harness.ANALYZE_EDGE_MISSES.get(c.values)
        marks = [*c.marks, *([pytest.mark.xfail(strict=True, reason=miss)] if miss else [])]
        out.append(pytest.param(*c.values, id=c.id, marks=marks))
    return out


@pytest.mark.parametrize(("model", "fmt"), _edge_cells())
def test_training_from_the_window_s_lower_edge_works(model: str, fmt: str) -> None:
    """The smallest scale analyze allows trains: its underflow threshold is not too lax.
    (bfloat16 runs at scale 1 whatever the initial scale: no edge to train.)"""
    v = _verdict(model, fmt)
    assert v.window is not None, v.verdict
    lo = v.window[0]
    if lo == SCALE_EXPONENTS.start:
        pytest.skip("nothing flushes at any scale tried: the window's edge is the search's")
    res = _train(model, fmt, lo)
    assert res.ok, (lo, res.reason)


def test_convnext_float16_needs_more_than_the_matrix_scale() -> None:
    """The known case (known.CONVNEXT_FLOAT16): 2^10 is too small, not too large."""
    v = _verdict("convnext", "float16")
    lo, hi = v.window
    assert MATRIX_EXPONENT < lo <= v.recommended_exponent <= hi  # below the window: underflow
    assert v.verdict == f"fits with DLS from 2^{v.recommended_exponent}"
    assert v.underflow_deciders  # the tensors that flush just below the window are named
    assert all(n.startswith(("activation_grad:", "param_grad:")) for n in v.underflow_deciders)
    at_matrix = _train("convnext", "float16", MATRIX_EXPONENT)
    assert not at_matrix.ok and "parameter update differs" in at_matrix.reason
    assert _train("convnext", "float16", v.recommended_exponent).ok
    # the same model in cbfloat16 and bfloat16 (float32's exponent range, or close) fits at 2^10
    assert _verdict("convnext", "cbfloat16").fits_at(MATRIX_EXPONENT)
    assert _verdict("convnext", "bfloat16").fits_at(MATRIX_EXPONENT)


def test_float8_verdicts_are_reported_for_every_model() -> None:
    """No training reference (dlspass does not lower to float8): each model gets a verdict."""
    for model in ("mhagpt", "convnext"):
        names = {v.format for v in _analysis(model).verdicts}
        assert {"float8_e4m3fn", "float8_e5m2"} <= names
    # ConvNeXt's gradients span more binades than float8 e4m3 has: no scale fits
    assert _verdict("convnext", "float8_e4m3fn").verdict.startswith("does not fit")


@pytest.mark.parametrize("model", list(zoo.MODELS))
def test_cli_analyze_runs_on_every_matrix_model(model: str, capsys) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = cli.run(["analyze", f"zoo:cli_{model}", "--format", "json",
                      "--formats", "float16,bfloat16,cbfloat16"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)
    jsonschema.validate(data, SCHEMA)
    # the CLI calibrates the same model on the same batch as the API: the same verdicts
    for fmt in TRAINED:
        v = _verdict(model, fmt)
        got = data["formats"][fmt]
        assert got["verdict"] == v.verdict
        assert got["recommended_initial_loss_scale"] == v.recommended_initial_loss_scale
