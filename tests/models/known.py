"""Cells of the matrix that fail today, with where the failure comes from.

`test_models_matrix.py` marks these ``xfail(strict=True)``: when a fix lands the test passes,
the strict xfail fails, and whoever fixed it removes the entry here and reruns
``tools/compat/run_models.py`` to regenerate docs/COMPATIBILITY.md. Entries are measured
(``tools/compat/results.jsonl``), not guessed; the summaries say whose limit it is.
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSFORMERS = ("gpt2", "bert", "t5", "vit")
LOWERED = ("float16", "bfloat16", "cbfloat16")
FORMATS = ("fp32", *LOWERED)


@dataclass(frozen=True)
class Known:
    """Why a cell fails: a short cause, and the torch issue where torch is the limit."""

    summary: str


ROUNDING_STRIDES = Known(
    "dlspass: the eager `dlspass::round_to_format` returns a contiguous tensor while its fake "
    "kernel reports the input's strides, so attention's views of a transposed value fail at "
    "the first call (issue 13)")
GRAPH_FLAGS = Known(
    "dlspass: each backward graph overwrites `scaler.backend_found_finite`; the first graph's "
    "backward runs last, so its finite flag hides the second graph's overflow and inf/NaN "
    "reaches the weights (issue 13)")
ONE_GRAPH = Known(
    "by design: `dlspass.compile` compiles a whole step as one graph and rejects a graph break "
    "at the first call with a one-line CompileError (use `backend=\"dlspass\"` with the eager "
    "scaler)")
EXPORT_VIEW = Known(
    "torch: `torch.export` `run_decompositions` cannot view GPT-2's transposed attention output "
    "(pytorch/pytorch#141107, same error); the CLI exits 2")
BN_UNSCALE = Known(
    "dlspass: UnscaleGradsPass points a BatchNorm bias gradient's uses inside the backward at "
    "the unscaled value; transform exits 3 (issue 13)")
T5_COMPILE = Known(
    "dlspass: compiling T5's step fails in dlspass's AOT compiler at the first call (the run "
    "records dynamo's wrapper line only; issue 13 traces it to find_seed taking T5's "
    "ones_like/full_like as backward-seed candidates: 'expected one backward seed ... found 3')")
GPT2_SEEDS = Known(
    "dlspass: GPT-2 as shipped logs through `logger.warning_once` in every forward, which "
    "breaks dynamo's graph; the graph before the break returns several tensors that need "
    "gradients and make_backend rejects it at the first call (issue 13)")
TIED_EXPORT = Known(
    "dlspass: export of a model whose embedding and output weights are tied stops at 'a "
    "parameter that did not receive a gradient'; the CLI exits 3 (issue 13)")
MISSING_VAL = Known(
    "dlspass: a conv on the input leaves a node without `val` when the step is packaged; "
    "transform exits 3 (issue 13)")


def _key(model: str, entry: str, fmt: str, accumulate: bool = False) -> str:
    return f"{model}-{entry}-{fmt}" + ("-accum" if accumulate else "")


KNOWN: dict[str, Known] = {
    **{_key(m, "capture_step", "cbfloat16"): ROUNDING_STRIDES for m in TRANSFORMERS},
    **{_key("graph_break", "make_backend", f): GRAPH_FLAGS for f in ("fp32", "float16", "cbfloat16")},
    _key("graph_break", "make_backend", "fp32", True): GRAPH_FLAGS,
    **{_key("graph_break", "dlspass.compile", f): ONE_GRAPH for f in FORMATS},
    _key("t5", "dlspass.compile", "fp32"): T5_COMPILE,
    _key("gpt2", "make_backend", "fp32"): GPT2_SEEDS,
    _key("gpt2", "make_backend", "fp32", True): GPT2_SEEDS,
    _key("t5", "dlspass.compile", "fp32", True): T5_COMPILE,
    _key("graph_break", "dlspass.compile", "fp32", True): ONE_GRAPH,
    **{_key("gpt2", "cli", f): EXPORT_VIEW for f in FORMATS},
    **{_key("resnet", "cli", f): BN_UNSCALE for f in ("fp32", "float16", "cbfloat16")},
    _key("resnet", "cli", "bfloat16"): MISSING_VAL,
    **{_key(m, "cli", f): TIED_EXPORT for m in ("bert", "t5") for f in FORMATS},
    **{_key(m, "cli", f): MISSING_VAL for m in ("convnext", "vit") for f in FORMATS},
}
