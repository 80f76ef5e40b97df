"""Does a model fit a narrow float format, and from which loss scale? (``dlspass.analyze``)

A few calibration steps run in float32 (forward and backward; with an optimizer, its steps too).
Hooks record, named by module path, every leaf module's output (activations) and the gradient
flowing into it (activation gradients), and after each backward every parameter's gradient.
Then, for each format of `dlspass.format_ranges.RANGES` and each tensor, the fraction of its
values that flush to zero, land subnormal or overflow, with the exact round-to-nearest-even
thresholds of ``format_ranges``:

- activations at scale 1 (the loss scale does not reach the forward);
- gradients (activation and parameter) at every loss scale 2^k, k in ``SCALE_EXPONENTS``.

The window of a format is the range of k where no gradient overflows and at most ``threshold``
of all non-zero parameter-gradient values (every parameter together) flush to zero. What the
optimizer is given decides training: an Adam-type update is normalised per element, so each
parameter whose gradient flushes loses its update whatever its size, and the update's error
grows with the fraction of parameters that lose it (flushed activation gradients count through
the parameter gradients they feed, whose smallest values they are). The fraction is over the
whole model, not per tensor: a tensor whose float32 gradient is only round-off (an attention
key bias: the softmax does not depend on it) flushes entirely at any scale without changing
training. ``DEFAULT_THRESHOLD`` is set from training runs (see there). Overflow only grows with
k and flushing only shrinks, so the window is an interval ``[lo, hi]``; the recommended initial
loss scale is ``2^max(lo, hi - headroom)`` (``headroom`` powers of two below the first
overflow: gradients grow during training, and a dynamic scaler grows the scale back by
itself), or 1 where scale 1 is in the window and nothing overflows at any scale scanned
(bfloat16's float32 range). The tensors that decide it are those that overflow at ``2^(hi+1)`` and those that lose
the most values at ``2^(lo-1)``. The lower edge can be a binade low where the scale is far
below 1 (ViT in float16 at 2^-6: its activation gradients lose precision in the subnormals
without flushing, which the count does not see); the recommended scale is far from it unless
the window is narrow.

Verdicts: ``fits`` (scale 1 is in the window), ``fits with DLS from 2^k``, ``does not fit: these
tensors overflow in the forward: ...`` (forward values are not scaled, so no loss scale helps),
``does not fit: the gradients need more range than the format has``.
"""

from __future__ import annotations

import functools
import html
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dlspass.errors import InputValueError
from dlspass.files.bounded_text import printable
from dlspass.format_ranges import RANGES, FormatRange, get_range

__all__ = ["DEFAULT_THRESHOLD", "SCALE_EXPONENTS", "AnalyzeError", "Analysis", "Sample", "analyze",
           "calibrate", "judge", "render", "sample"]

SCALE_EXPONENTS = range(-30, 65)
KINDS = ("activation", "activation_grad", "param_grad")
GRAD_KINDS = ("activation_grad", "param_grad")
SCHEMA_VERSION = 1
# The largest fraction of the model's non-zero parameter-gradient values that may flush to
# zero. Measured on the compatibility matrix's models (tools/compat/analyze_vs_training.py:
# 10 AdamW steps in emulated float16 against float32, the matrix's tolerance 0.04), at the
# lowest scales where training still works and the highest where it fails:
#   ConvNeXt 0.74% at 2^11 works, 1.4% at 2^10 fails (0.043); BERT 0.74% at 2^0 works, 1.0% at
#   2^-1 fails; GPT-2 0.86% at 2^-7, ViT 0.84% at 2^-7, MHA-GPT 0.98% at 2^-10, T5 0.92% and
#   ResNet 0.87% at 2^-12 fail.
# Every failure lost 0.84% or more, every success 0.74% or less; the threshold keeps a margin
# below both (a window edge too low is silent wrong training, one too high costs a binade).
DEFAULT_THRESHOLD = 0.005


class AnalyzeError(InputValueError):
    """Bad input to ``dlspass.analyze`` (no gradient, a bad threshold, an unknown format)."""


@dataclass
class Sample:
    """The magnitudes one tensor took over the calibration steps (non-zero finite, sorted)."""

    name: str
    kind: str
    magnitudes: Tensor  # float64, sorted ascending
    zeros: int
    infinite: int
    nan: int

    @property
    def count(self) -> int:
        return self.magnitudes.numel() + self.zeros + self.infinite + self.nan

    def below(self, threshold: float, inclusive: bool) -> int:
        """How many non-zero finite magnitudes are ``<= threshold`` (``<`` when not inclusive)."""
        t = torch.tensor([threshold], dtype=torch.float64)
        return int(torch.searchsorted(self.magnitudes, t, right=inclusive))

    def fractions(self, r: FormatRange, k: int) -> dict[str, float]:
        """Fractions of this tensor's non-zero values flushed/subnormal/overflowing at scale 2^k."""
        s = math.ldexp(1.0, -k)  # compare |x| * 2^k with t as |x| with t * 2^-k: exact in float64
        flushed = self.below(r.flush_below * s, True)
        subnormal = self.below(r.subnormal_below * s, False) - flushed
        over = self.magnitudes.numel() - self.below(r.overflow_at * s, not r.max_is_odd)
        nonzero = max(self.magnitudes.numel() + self.infinite, 1)
        return {"flushed": flushed / nonzero, "subnormal": subnormal / nonzero,
                "overflow": (over + self.infinite) / nonzero}

    def histogram(self) -> list[list[int]]:
        """``[[e, n], ...]``: n magnitudes with ``floor(log2 |x|) == e``."""
        if not self.magnitudes.numel():
            return []
        e = torch.floor(torch.log2(self.magnitudes)).to(torch.int64)
        vals, counts = torch.unique(e, return_counts=True)
        return [[int(v), int(c)] for v, c in zip(vals, counts, strict=True)]


def sample(name: str, kind: str, tensors: list[Tensor]) -> Sample:
    """The `Sample` of ``tensors`` (one named tensor's values over the calibration steps)."""
    x = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    a = x.abs()
    finite = torch.isfinite(a)
    mags = a[finite & (a > 0)]
    return Sample(name, kind, torch.sort(mags).values, int((a == 0).sum()),
                  int(torch.isinf(a).sum()), int(torch.isnan(a).sum()))


def calibrate(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor],
              batches: Iterable[Any], optimizer: torch.optim.Optimizer | None = None) -> list[Sample]:
    """Run ``loss_fn(model, batch).backward()`` (and ``optimizer.step()``) per batch in float32;
    the activations, activation gradients and parameter gradients, named by module path."""
    acts: dict[str, list[Tensor]] = {}
    agrads: dict[str, list[Tensor]] = {}
    pgrads: dict[str, list[Tensor]] = {}
    handles = []
    for path, mod in model.named_modules():
        if path == "" or any(True for _ in mod.children()):
            continue  # leaf modules: each value is recorded once, at the module that made it

        def fwd(_m: nn.Module, _i: Any, out: Any, path: str = path) -> None:
            for t in _tensors(out):
                acts.setdefault(path, []).append(t.detach().clone())
                if t.requires_grad:
                    # a hook on the output tensor, not a module backward hook: those wrap the
                    # output in a view that a later in-place op (ResNet's `h += residual`)
                    # may not modify; a tensor hook registered before such an op sees the
                    # gradient of the value the module returned
                    t.register_hook(functools.partial(_record, agrads.setdefault(path, [])))

        handles.append(mod.register_forward_hook(fwd))
    n = 0
    try:
        for batch in batches:
            n += 1
            for p in model.parameters():
                p.grad = None
            loss = loss_fn(model, batch)
            if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise AnalyzeError("loss_fn: expected a scalar loss that requires grad, got "
                                   f"{type(loss).__name__}")
            loss.backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    pgrads.setdefault(name, []).append(p.grad.detach().clone())
            if optimizer is not None:
                optimizer.step()
    finally:
        for h in handles:
            h.remove()
    if n == 0:
        raise AnalyzeError("batches: expected at least one calibration batch")
    if not pgrads:
        raise AnalyzeError("the model has no parameter gradient: nothing to analyze")
    return ([sample(k, "activation", v) for k, v in acts.items()]
            + [sample(k, "activation_grad", v) for k, v in agrads.items() if v]
            + [sample(k, "param_grad", v) for k, v in pgrads.items()])


def _record(into: list[Tensor], grad: Tensor) -> None:
    into.append(grad.detach().clone())


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


@dataclass
class FormatVerdict:
    """One format's result (see the module docstring)."""

    format: str
    verdict: str
    fits: bool
    window: tuple[int, int] | None
    recommended_exponent: int | None
    forward_overflow: list[str]
    overflow_deciders: list[str]
    underflow_deciders: list[str]
    at_recommended: list[dict[str, Any]] = field(default_factory=list)

    def fits_at(self, exponent: int) -> bool:
        """Whether training may start at loss scale ``2^exponent``: no forward overflow and
        ``exponent`` in the window."""
        return (not self.forward_overflow and self.window is not None
                and self.window[0] <= exponent <= self.window[1])

    @property
    def recommended_initial_loss_scale(self) -> float | None:
        k = self.recommended_exponent
        return None if k is None else math.ldexp(1.0, k)


def _flushed_fraction(grads: list[tuple[Sample, dict[str, float]]]) -> float:
    """The fraction of all non-zero parameter-gradient values (every parameter together)
    flushed to zero."""
    params = [(s, f) for s, f in grads if s.kind == "param_grad"]
    total = sum(s.magnitudes.numel() + s.infinite for s, _ in params)
    lost = sum(f["flushed"] * (s.magnitudes.numel() + s.infinite) for s, f in params)
    return lost / max(total, 1)


def _judge(samples: list[Sample], r: FormatRange, threshold: float, headroom: int) -> FormatVerdict:
    grads = [s for s in samples if s.kind in GRAD_KINDS]
    fwd_over = [s.name for s in samples if s.kind == "activation" and s.fractions(r, 0)["overflow"] > 0]
    table = {k: [(s, s.fractions(r, k)) for s in grads] for k in SCALE_EXPONENTS}
    no_over = [k for k in SCALE_EXPONENTS if all(f["overflow"] == 0 for _, f in table[k])]
    flush_ok = [k for k in SCALE_EXPONENTS if _flushed_fraction(table[k]) <= threshold]
    hi = max(no_over) if no_over else None
    lo = min(flush_ok) if flush_ok else None
    over_dec = [] if hi is None or hi + 1 not in table else [
        f"{s.kind}:{s.name}" for s, f in table[hi + 1] if f["overflow"] > 0]
    under_dec = [] if lo is None or lo - 1 not in table else _most_flushed(table[lo - 1])
    window = (lo, hi) if lo is not None and hi is not None and lo <= hi else None
    if window is None:
        rec = None
    elif window[1] == SCALE_EXPONENTS.stop - 1 and window[0] <= 0:
        rec = 0  # nothing overflows at any scale scanned (bfloat16): no loss scale is needed
    else:
        rec = max(window[0], window[1] - headroom)
    if fwd_over:
        verdict, fits = f"does not fit: these tensors overflow in the forward: {', '.join(fwd_over)}", False
    elif window is None:
        if lo is None:
            under_dec = _most_flushed(table[SCALE_EXPONENTS.stop - 1])
        verdict, fits = ("does not fit: the gradients need more range than the format has "
                         f"(underflow: {', '.join(under_dec) or '-'}; overflow: {', '.join(over_dec) or '-'})"), False
    elif window[0] <= 0 <= window[1]:
        verdict, fits = "fits", True
    else:
        verdict, fits = f"fits with DLS from 2^{rec}", True
    at = []
    for s in samples:
        k = 0 if s.kind == "activation" or rec is None else rec
        at.append({"name": s.name, "kind": s.kind, "scale_exponent": k, **s.fractions(r, k)})
    return FormatVerdict(r.name, verdict, fits, window, rec, fwd_over, over_dec, under_dec, at)


def _most_flushed(grads: list[tuple[Sample, dict[str, float]]], limit: int = 5) -> list[str]:
    """The tensors that lose the most values to zero (by count), most first."""
    lost = sorted(((f["flushed"] * (s.magnitudes.numel() + s.infinite), f"{s.kind}:{s.name}")
                   for s, f in grads if f["flushed"] > 0), key=lambda t: -t[0])
    return [name for _, name in lost[:limit]]


@dataclass
class Analysis:
    """What ``dlspass.analyze`` found: the samples and one verdict per format."""

    samples: list[Sample]
    verdicts: list[FormatVerdict]
    threshold: float
    headroom: int
    steps: int

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (``docs/analyze.schema.json`` describes it)."""
        return {
            "version": SCHEMA_VERSION,
            "steps": self.steps,
            "threshold": self.threshold,
            "headroom": self.headroom,
            "scale_exponents": [SCALE_EXPONENTS.start, SCALE_EXPONENTS.stop - 1],
            "tensors": [{"name": s.name, "kind": s.kind, "count": s.count, "zeros": s.zeros,
                         "infinite": s.infinite, "nan": s.nan,
                         "amax": float(s.magnitudes[-1]) if s.magnitudes.numel() else 0.0,
                         "log2_histogram": s.histogram()} for s in self.samples],
            "formats": {v.format: {
                "range": _range_json(RANGES[v.format]),
                "verdict": v.verdict, "fits": v.fits,
                "window": None if v.window is None else list(v.window),
                "recommended_initial_loss_scale": v.recommended_initial_loss_scale,
                "forward_overflow": v.forward_overflow,
                "deciding": {"overflow": v.overflow_deciders, "underflow": v.underflow_deciders},
                "at_recommended": v.at_recommended,
            } for v in self.verdicts},
        }


def _range_json(r: FormatRange) -> dict[str, float]:
    return {"max": r.max, "min_normal": r.min_normal, "min_subnormal": r.min_subnormal}


def analyze(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], batch: Any, *,
            steps: int = 1, batches: Iterable[Any] | None = None,
            optimizer: torch.optim.Optimizer | None = None,
            formats: Sequence[str] = tuple(RANGES), threshold: float = DEFAULT_THRESHOLD,
            headroom: int = 3) -> Analysis:
    """Calibrate ``model`` in float32 and judge each format (see the module docstring).

    ``loss_fn(model, batch)`` returns the scalar loss (as for ``dlspass.capture_step``); the
    calibration runs ``steps`` times on ``batch``, or once per batch of ``batches``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AnalyzeError(f"steps: expected a positive int, got {steps!r}")
    if not (isinstance(threshold, (int, float)) and 0 <= threshold < 1):
        raise AnalyzeError(f"threshold: expected a fraction in [0, 1), got {threshold!r}")
    if isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0:
        raise AnalyzeError(f"headroom: expected an int >= 0, got {headroom!r}")
    ranges = [get_range(f) for f in formats]
    feed = list(batches) if batches is not None else [batch] * steps
    return judge(calibrate(model, loss_fn, feed, optimizer), formats=[r.name for r in ranges],
                 threshold=threshold, headroom=headroom, steps=len(feed))


def judge(samples: list[Sample], *, formats: Sequence[str] = tuple(RANGES),
          threshold: float = DEFAULT_THRESHOLD, headroom: int = 3, steps: int = 1) -> Analysis:
    """Each format's verdict on calibrated ``samples`` (from `calibrate`, or from a program's
    values: ``dlspass.debug.analyze_program``)."""
    return Analysis(samples, [_judge(samples, get_range(f), float(threshold), headroom) for f in formats],
                    float(threshold), headroom, steps)


# ---- rendering -------------------------------------------------------------------------------

RENDER_FORMATS = ("text", "json", "html")


def render(analysis: Analysis, fmt: str = "text") -> str:
    """The report as ``text``, ``json`` or a self-contained ``html`` page (inline SVG)."""
    if fmt == "json":
        return json.dumps(analysis.to_json(), indent=2) + "\n"
    if fmt == "text":
        return _text(analysis)
    if fmt == "html":
        return _html(analysis)
    raise AnalyzeError(f"format: expected one of {', '.join(RENDER_FORMATS)}, got {fmt!r}")


def _text(a: Analysis) -> str:
    lines = [f"calibration: {a.steps} step(s), {len(a.samples)} tensors; underflow threshold "
             f"{a.threshold:g}, headroom 2^{a.headroom}"]
    for v in a.verdicts:
        lines.append(f"{v.format}: {v.verdict}")
        if v.window is not None:
            lines.append(f"  window of loss scales: 2^{v.window[0]} .. 2^{v.window[1]}; "
                         f"recommended initial_loss_scale: 2^{v.recommended_exponent}")
        if v.overflow_deciders:
            lines.append(f"  first to overflow above the window: {', '.join(v.overflow_deciders)}")
        if v.underflow_deciders:
            lines.append(f"  first to underflow below the window: {', '.join(v.underflow_deciders)}")
    # parameter and node names come from the model or the file: escaped, as inspect's are
    return "\n".join(printable(line) for line in lines) + "\n"


_KIND_TITLES = {"activation": "activations (scale 1)", "activation_grad": "activation gradients",
                "param_grad": "parameter gradients"}


def _html(a: Analysis) -> str:
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>dlspass analyze</title>",
             "<style>body{font-family:sans-serif;margin:1.5em}svg{border:1px solid #ccc;margin:4px}"
             ".fit{color:#064}.nofit{color:#a00}</style></head><body>",
             "<h1>dlspass analyze</h1>", f"<pre>{html.escape(_text(a))}</pre>"]
    for v in a.verdicts:
        r = RANGES[v.format]
        cls = "fit" if v.fits else "nofit"
        parts.append(f"<section class='format' data-format='{v.format}'><h2>{v.format}: "
                     f"<span class='{cls}'>{html.escape(printable(v.verdict))}</span></h2>")
        shift = v.recommended_exponent or 0
        for kind in KINDS:
            hist: dict[int, int] = {}
            for s in a.samples:
                if s.kind != kind:
                    continue
                k = 0 if kind == "activation" else shift
                for e, n in s.histogram():
                    hist[e + k] = hist.get(e + k, 0) + n
            title = _KIND_TITLES[kind] + ("" if kind == "activation" else f" at 2^{shift}")
            parts.append(_svg_histogram(hist, r, title))
        parts.append("</section>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _svg_histogram(hist: dict[int, int], r: FormatRange, title: str) -> str:
    """Bars of log2|value| counts, the format's subnormal, normal and overflow limits as lines."""
    marks = {"min subnormal": math.log2(r.min_subnormal), "min normal": math.log2(r.min_normal),
             "max": math.log2(r.max)}
    lo = min([*hist, math.floor(marks["min subnormal"])]) - 2
    hi = max([*hist, math.ceil(marks["max"])]) + 2
    w, h, pad = 640, 180, 30
    def x(e: float) -> float:
        return pad + (e - lo) / (hi - lo) * (w - 2 * pad)
    top = max(hist.values(), default=1)
    bars = []
    bw = max((w - 2 * pad) / (hi - lo) - 1, 1)
    for e, n in sorted(hist.items()):
        bh = (h - 2 * pad) * math.log1p(n) / math.log1p(top)
        color = ("#c33" if e >= marks["max"] else "#e90" if e < marks["min subnormal"]
                 else "#fb3" if e < marks["min normal"] else "#37a")
        bars.append(f"<rect class='bar' x='{x(e):.1f}' y='{h - pad - bh:.1f}' width='{bw:.1f}' "
                    f"height='{bh:.1f}' fill='{color}'><title>2^{e}: {n}</title></rect>")
    # labels on two rows: bfloat16's min subnormal and min normal are 7 binades apart
    lines = [f"<line x1='{x(v):.1f}' x2='{x(v):.1f}' y1='{pad - 8}' y2='{h - pad}' stroke='#000' "
             f"stroke-dasharray='3,2'/><text x='{x(v) + 2:.1f}' y='{pad - 10 - 10 * (i % 2)}' "
             f"font-size='10'>{name}</text>" for i, (name, v) in enumerate(marks.items())]
    axis = (f"<line x1='{pad}' x2='{w - pad}' y1='{h - pad}' y2='{h - pad}' stroke='#000'/>"
            f"<text x='{pad}' y='{h - 8}' font-size='10'>log2|x| = {lo}</text>"
            f"<text x='{w - pad - 70}' y='{h - 8}' font-size='10'>log2|x| = {hi}</text>")
    return (f"<figure><figcaption>{html.escape(title)}</figcaption>"
            f"<svg class='histogram' xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}'>"
            f"{''.join(bars)}{''.join(lines)}{axis}</svg></figure>")
