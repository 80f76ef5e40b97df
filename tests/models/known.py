"""Cells of the matrix that fail today, with where the failure comes from.

`test_models_matrix.py` marks these ``xfail(strict=True)``: when a fix lands the test passes,
the strict xfail fails, and whoever fixed it removes the entry here and reruns
``tools/compat/run_models.py`` to regenerate docs/COMPATIBILITY.md. Entries are measured
(``tools/compat/results.jsonl``), not guessed; the summaries say whose limit it is.
"""

from __future__ import annotations

from dataclasses import dataclass

LOWERED = ("float16", "bfloat16", "cbfloat16")
FORMATS = ("fp32", *LOWERED)
NATIVE = ("float16-native", "bfloat16-native")
FLOAT8 = ("float8-tensorwise", "float8-rowwise")


@dataclass(frozen=True)
class Known:
    """Why a cell fails: a short cause, and the torch issue where torch is the limit."""

    summary: str


ONE_GRAPH = Known(
    "by design: `dlspass.compile` compiles a whole step as one graph and rejects a graph break "
    "at the first call with a one-line CompileError (use `backend=\"dlspass\"` with the eager "
    "scaler)")
ONE_BACKWARD = Known(
    "by design: `dlspass.compile` traces one backward per step (the one seed it scales); two "
    "backward calls are refused at the first call with a one-line CompileError that says to "
    "sum the micro-batch losses and call backward once; `backend=\"dlspass\"` and "
    "`make_backend` accumulate")
CONVNEXT_FLOAT16 = Known(
    "float16's range, not dlspass: at the matrix's initial scale 2^10 ConvNeXt's smallest "
    "gradients still fall below float16's smallest subnormal (2^-24) and flush to zero, so the "
    "update differs from the float32 eager reference by 0.043 (bound 0.04); the same cell "
    "started at 2^15 differs by 0.0023, and bfloat16 / cbfloat16 (float32's exponent range) by "
    "0.024 / 0.004")


def _key(model: str, entry: str, fmt: str, accumulate: bool = False) -> str:
    return f"{model}-{entry}-{fmt}" + ("-accum" if accumulate else "")


KNOWN: dict[str, Known] = {
    **{_key("graph_break", "dlspass.compile", f): ONE_GRAPH for f in FORMATS},
    _key("graph_break", "dlspass.compile", "fp32", True): ONE_GRAPH,
    **{_key(m, "dlspass.compile", "fp32", True): ONE_BACKWARD
       for m in ("resnet", "convnext", "vit", "bert", "gpt2", "t5", "mhagpt")},
    **{_key("graph_break", "dlspass.compile", f): ONE_GRAPH for f in (*NATIVE, *FLOAT8)},
    **{_key("convnext", e, "float16"): CONVNEXT_FLOAT16
       for e in ("capture_step", "cli", "dlspass.compile", "make_backend", "backend=dlspass")},
}
