"""Small inline-SVG line charts for the HTML reports (``dlspass demo``): no plotting library,
so a report is one self-contained file whose plots are elements a test can find in the DOM."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

__all__ = ["line_chart"]

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 680, 260, 64, 16, 28, 40


def line_chart(title: str, series: Mapping[str, Sequence[float]], *, x_label: str = "step",
               y_label: str = "", log2_y: bool = False, marks: Sequence[int] = (),
               mark_label: str = "", first_x: int = 1, css_class: str = "plot") -> str:
    """A ``<figure>`` with one polyline per series (x = ``first_x``, ``first_x + 1``, ...), the
    y range's ends and the x range's ends as tick labels, a legend, and a red dashed line with a
    dot on the first series at each x in ``marks`` (e.g. skipped steps). ``log2_y`` plots
    log2(y) (labels as powers of two); non-finite and (with ``log2_y``) non-positive values
    leave gaps."""
    def ty(v: float) -> float | None:
        if not math.isfinite(v) or (log2_y and v <= 0):
            return None
        return math.log2(v) if log2_y else v

    pts = {name: [ty(v) for v in vals] for name, vals in series.items()}
    ys = [v for vals in pts.values() for v in vals if v is not None]
    n = max((len(v) for v in pts.values()), default=1)
    lo, hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if hi - lo < 1e-12:  # one value: a band around it (that stays positive for a positive value)
        lo, hi = (lo * 0.5, hi * 1.5) if lo > 0 and not log2_y else (lo - 1, hi + 1)
    x0, x1 = first_x, first_x + max(n - 1, 1)

    def px(i: float) -> float:
        return _LEFT + (i - x0) / (x1 - x0) * (_W - _LEFT - _RIGHT)

    def py(v: float) -> float:
        return _TOP + (hi - v) / (hi - lo) * (_H - _TOP - _BOTTOM)

    out = [f"<rect x='{_LEFT}' y='{_TOP}' width='{_W - _LEFT - _RIGHT}' height='{_H - _TOP - _BOTTOM}' "
           "fill='#fafafa' stroke='#999'/>"]
    for k, (name, vals) in enumerate(pts.items()):
        color = COLORS[k % len(COLORS)]
        for run in _runs(vals):
            coords = " ".join(f"{px(first_x + i):.1f},{py(v):.1f}" for i, v in run)
            if len(run) == 1:
                i, v = run[0]
                out.append(f"<circle cx='{px(first_x + i):.1f}' cy='{py(v):.1f}' r='2' fill='{color}'/>")
            else:
                out.append(f"<polyline class='series' data-series='{html.escape(name)}' fill='none' "
                           f"stroke='{color}' stroke-width='1.8' points='{coords}'/>")
        out.append(f"<rect x='{_LEFT + 8 + 170 * k}' y='8' width='12' height='4' fill='{color}'/>"
                   f"<text x='{_LEFT + 24 + 170 * k}' y='14' font-size='11'>{html.escape(name)}</text>")
    first = next(iter(pts.values()), [])
    for m in marks:
        i = m - first_x
        out.append(f"<line class='mark' x1='{px(m):.1f}' x2='{px(m):.1f}' y1='{_TOP}' y2='{_H - _BOTTOM}' "
                   "stroke='#d00' stroke-dasharray='4,3'><title>"
                   f"{html.escape(mark_label)} {m}</title></line>")
        if 0 <= i < len(first) and first[i] is not None:
            out.append(f"<circle class='mark' cx='{px(m):.1f}' cy='{py(first[i]):.1f}' r='4' fill='#d00'/>")
    if marks and mark_label:
        out.append(f"<line x1='{_W - 150}' x2='{_W - 138}' y1='10' y2='10' stroke='#d00' "
                   f"stroke-dasharray='4,3'/><text x='{_W - 134}' y='14' font-size='11'>"
                   f"{html.escape(mark_label)}</text>")
    fmt = (lambda v: f"2^{v:.3g}") if log2_y else (lambda v: f"{v:.4g}")
    out += [f"<text x='{_LEFT - 6}' y='{py(hi) + 4:.1f}' font-size='10' text-anchor='end'>{fmt(hi)}</text>",
            f"<text x='{_LEFT - 6}' y='{py(lo) + 4:.1f}' font-size='10' text-anchor='end'>{fmt(lo)}</text>",
            f"<text x='{px(x0):.1f}' y='{_H - _BOTTOM + 14}' font-size='10' text-anchor='middle'>{x0}</text>",
            f"<text x='{px(x1):.1f}' y='{_H - _BOTTOM + 14}' font-size='10' text-anchor='middle'>{x1}</text>",
            f"<text x='{(_LEFT + _W - _RIGHT) / 2:.1f}' y='{_H - 8}' font-size='11' "
            f"text-anchor='middle'>{html.escape(x_label)}</text>",
            f"<text x='14' y='{(_TOP + _H - _BOTTOM) / 2:.1f}' font-size='11' text-anchor='middle' "
            f"transform='rotate(-90 14 {(_TOP + _H - _BOTTOM) / 2:.1f})'>{html.escape(y_label)}</text>"]
    return (f"<figure class='{css_class}'><figcaption>{html.escape(title)}</figcaption>"
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{_H}' "
            f"viewBox='0 0 {_W} {_H}'>{''.join(out)}</svg></figure>")


def _runs(vals: Sequence[float | None]) -> list[list[tuple[int, float]]]:
    """The stretches of consecutive defined values, with their indices."""
    runs: list[list[tuple[int, float]]] = [[]]
    for i, v in enumerate(vals):
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((i, v))
    return [r for r in runs if r]
