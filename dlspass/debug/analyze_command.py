"""The body of ``dlspass analyze``: a factory's model calibrated and judged, the report written."""

from __future__ import annotations

import sys
from pathlib import Path

# the factory is resolved as `dlspass export` resolves it
from dlspass.capture.export import _resolve_factory
from dlspass.debug.analyze_program import calibrate_program
from dlspass.debug.precision_risk import RENDER_FORMATS, AnalyzeError, analyze, judge, render
from dlspass.files.atomic_write import write_text_atomic
from dlspass.files.bounded_text import printable
from dlspass.files.paths import check_output_path
from dlspass.format_ranges import RANGES, get_range


def run_analyze(factory: str, fmt: str, output: Path | None, formats: str | None, steps: int,
                threshold: float) -> None:
    """``FACTORY()`` -> ``(model, example_inputs)``; ``model(*inputs)`` is the loss. A path ending in
    ``.pt2`` is a joint program from ``dlspass export``, run once on its example inputs."""
    if fmt not in RENDER_FORMATS:
        raise AnalyzeError(f"--format: expected one of {', '.join(RENDER_FORMATS)}, got {fmt!r}")
    out = check_output_path(output, (f".{fmt}", ".txt")) if output is not None else None
    names = [f.strip() for f in formats.split(",")] if formats else list(RANGES)
    if factory.endswith(".pt2"):  # an exported joint program: one run on its example inputs
        for f in names:
            get_range(f)  # an unknown format is refused before the program is run
        result = judge(calibrate_program(Path(factory)), formats=names, threshold=threshold)
    else:
        made = _resolve_factory(factory)()
        if not (isinstance(made, tuple) and len(made) == 2):
            raise AnalyzeError(f"{factory!r}: the factory must return (model, example_inputs), "
                               f"got {type(made).__name__}")
        model, inputs = made
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        result = analyze(model, lambda m, batch: m(*batch), inputs, steps=steps, formats=names,
                         threshold=threshold)
    text = render(result, fmt)
    if out is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(out, text)
        print(f"wrote {printable(str(out))}", file=sys.stderr)
