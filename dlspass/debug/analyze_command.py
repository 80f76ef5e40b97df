"""The body of ``dlspass analyze``: a factory's model calibrated and judged, the report written."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# the factory is resolved as `dlspass export` resolves it
from dlspass.capture.export import _resolve_factory
from dlspass.config import FLOAT8_RECIPES
from dlspass.debug.analyze_program import calibrate_program
from dlspass.debug.float8_risk import analyze_float8, render_float8
from dlspass.debug.precision_risk import RENDER_FORMATS, AnalyzeError, analyze, judge, render
from dlspass.files.atomic_write import write_text_atomic
from dlspass.files.bounded_text import printable
from dlspass.files.paths import check_output_path
from dlspass.format_ranges import RANGES, get_range


def run_analyze(factory: str, fmt: str, output: Path | None, formats: str | None, steps: int,
                threshold: float, fp16_type: str | None = None, float8: str = "tensorwise") -> None:
    """``FACTORY()`` -> ``(model, example_inputs)``; ``model(*inputs)`` is the loss. A path ending in
    ``.pt2`` is a joint program from ``dlspass export``, run once on its example inputs.
    ``fp16_type="float8"``: the per-matmul float8 report (`dlspass.debug.float8_risk`) instead."""
    if fmt not in RENDER_FORMATS:
        raise AnalyzeError(f"--format: expected one of {', '.join(RENDER_FORMATS)}, got {fmt!r}")
    out = check_output_path(output, (f".{fmt}", ".txt")) if output is not None else None
    if fp16_type is not None and fp16_type != "float8":
        if formats:
            raise AnalyzeError("--fp16-type and --formats: give one of them")
        formats = fp16_type
    names = [f.strip() for f in formats.split(",")] if formats else list(RANGES)
    if fp16_type == "float8":
        if factory.endswith(".pt2"):
            raise AnalyzeError("--fp16-type float8 runs a MODULE:FACTORY's step; a .pt2 program is not judged per matmul")
        if float8 not in FLOAT8_RECIPES:
            raise AnalyzeError(f"--float8: expected one of {', '.join(FLOAT8_RECIPES)}, got {float8!r}")
        if fmt == "html":
            raise AnalyzeError("--fp16-type float8: the per-matmul report is text or json")
        model, inputs = _made(factory)
        rows = analyze_float8(model, lambda m, batch: m(*batch), inputs, recipe=float8, threshold=threshold)
        _write(render_float8(rows, float8, fmt), out)
        return
    if factory.endswith(".pt2"):  # an exported joint program: one run on its example inputs
        for f in names:
            get_range(f)  # an unknown format is refused before the program is run
        result = judge(calibrate_program(Path(factory)), formats=names, threshold=threshold)
    else:
        model, inputs = _made(factory)
        result = analyze(model, lambda m, batch: m(*batch), inputs, steps=steps, formats=names,
                         threshold=threshold)
    _write(render(result, fmt), out)


def _made(factory: str) -> tuple[Any, tuple]:
    """``FACTORY()``'s ``(model, example_inputs)``, the inputs as a tuple."""
    made = _resolve_factory(factory)()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise AnalyzeError(f"{factory!r}: the factory must return (model, example_inputs), "
                           f"got {type(made).__name__}")
    model, inputs = made
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _write(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(out, text)
        print(f"wrote {printable(str(out))}", file=sys.stderr)
