"""`dlspass.analyze` on every matrix model, its verdicts checked against training.

For each model of ``tests/models/zoo.py`` this runs ``dlspass.analyze`` (default settings) on
the model's batch, then trains each emulated format (float16, bfloat16, cbfloat16) through the
cheapest entry point that lowers (``capture_step``: no dynamo, no inductor;
``harness.run_cell_at_scale``) at the matrix's initial scale 2^10 and at analyze's recommended
initial scale, each compared with the float32 eager scaler at the same config within the
matrix's tolerance. The float8 formats get a verdict only (dlspass does not lower to float8).
Results go to ``tools/compat/analyze_results.jsonl``, and the section "analyze against
training" of docs/COMPATIBILITY.md is rewritten from them (``run_models.py`` keeps the section
when it regenerates the document).

    OMP_NUM_THREADS=1 .venv/bin/python tools/compat/analyze_vs_training.py
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))

DOC = ROOT / "docs" / "COMPATIBILITY.md"
RESULTS = ROOT / "tools" / "compat" / "analyze_results.jsonl"
HEADING = "## analyze against training"
TRAINED = ("float16", "bfloat16", "cbfloat16")
# bfloat16 runs at scale 1 whatever the initial scale: its window's edge is not a training run
EDGE_TRAINED = ("float16", "cbfloat16")


def matrix_exponent() -> int:
    import harness

    return int(math.log2(harness.INIT_SCALE))


@functools.cache
def _train(model: str, fmt: str, exponent: int) -> dict:
    import harness

    t0 = time.perf_counter()
    res = harness.run_cell_at_scale(model, fmt, math.ldexp(1.0, exponent))
    return {"exponent": exponent, "ok": res.ok, "update_error": res.update_error,
            "reason": res.reason, "seconds": round(time.perf_counter() - t0, 1)}


def measure(model: str) -> list[dict]:
    """One row per format: analyze's verdict, and training at 2^10 and at the recommended scale."""
    import zoo

    import dlspass
    from dlspass.debug.precision_risk import SCALE_EXPONENTS

    case = zoo.MODELS[model]()
    analysis = dlspass.analyze(case.model, case.loss_fn, case.batch)
    k0 = matrix_exponent()
    rows = []
    for v in analysis.verdicts:
        row = {"model": model, "format": v.format, "verdict": v.verdict,
               "window": None if v.window is None else list(v.window),
               "recommended_exponent": v.recommended_exponent, "fits_at_matrix": v.fits_at(k0),
               "underflow": v.underflow_deciders[:3], "overflow": v.overflow_deciders[:3],
               "matrix": None, "recommended": None, "lower_edge": None}
        if v.format in TRAINED:
            row["matrix"] = _train(model, v.format, k0)
            if v.recommended_exponent is not None:
                row["recommended"] = _train(model, v.format, v.recommended_exponent)
            if v.window is not None and v.format in EDGE_TRAINED and v.window[0] > SCALE_EXPONENTS.start:
                # the smallest scale analyze allows
                row["lower_edge"] = _train(model, v.format, v.window[0])
        print(f"{model:12s} {v.format:14s} {v.verdict[:40]:40s} {_cell(row['matrix'])} | "
              f"{_cell(row['recommended'])} | {_cell(row['lower_edge'])}", flush=True)
        rows.append(row)
    return rows


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _cell(r: dict | None) -> str:
    if r is None:
        return "—"
    err = "" if r["update_error"] is None else f" ({r['update_error']:.3g})"
    if r["ok"]:
        return f"works{err}"
    reason = r["reason"]
    if reason.startswith("skipped-step counts"):
        return "fails: an extra skipped step (a float16 overflow the float32 reference does not have)"
    return f"fails{err}" if reason.startswith("parameter update differs") else f"fails: `{reason[:80]}`"


def _scale(k: int | None) -> str:
    return "—" if k is None else f"2^{k}"


def agreement(rows: list[dict]) -> list[str]:
    """Where analyze and training disagree: at the matrix scale, at the recommended scale, or
    at the window's lower edge (except the misses `harness.ANALYZE_EDGE_MISSES` lists)."""
    import harness

    return [line for r in rows for line in _disagreements(r)
            if not (line.startswith("edge") and (r["model"], r["format"]) in harness.ANALYZE_EDGE_MISSES)]


def _disagreements(r: dict) -> list[str]:
    """Each line starts with what it is about: ``matrix``, ``recommended`` or ``edge``."""
    out = []
    name = f"{r['model']} {r['format']}"
    if r["matrix"] is not None and r["fits_at_matrix"] != r["matrix"]["ok"]:
        out.append(f"matrix: {name}: analyze says "
                   f"{'fits' if r['fits_at_matrix'] else 'does not fit'} at 2^{matrix_exponent()}, "
                   f"training {'works' if r['matrix']['ok'] else 'fails'}")
    if r["recommended"] is not None and not r["recommended"]["ok"]:
        out.append(f"recommended: {name}: training from the recommended "
                   f"2^{r['recommended_exponent']} fails")
    if r.get("lower_edge") is not None and not r["lower_edge"]["ok"]:
        out.append(f"edge: {name}: training from the window's lower edge 2^{r['window'][0]} fails")
    return out


def section(rows: list[dict]) -> str:
    """The "analyze against training" section of docs/COMPATIBILITY.md."""
    import harness

    k0 = matrix_exponent()
    lines = [
        HEADING,
        "",
        "`dlspass analyze` on each model's batch (default settings: one float32 calibration "
        "step, `DEFAULT_THRESHOLD`: at most 0.5% of the parameter-gradient values may flush to "
        "zero; headroom 2^3 below the first overflow), then the `capture_step` cell trained in "
        f"the format (10 AdamW steps, the loss times inf at step {harness.OVERFLOW_STEP}) from "
        f"the matrix's initial scale 2^{k0}, from analyze's recommended initial scale and from "
        "the lowest scale analyze allows (the window's lower edge; float16 and cbfloat16 "
        "where something flushes), each compared with the float32 eager scaler at the same "
        "settings within the matrix's tolerance (" + ", ".join(
            f"{f} {harness.TOLERANCE[f]}" for f in TRAINED) + "; in brackets the update "
        "difference). Generated by `OMP_NUM_THREADS=1 .venv/bin/python "
        "tools/compat/analyze_vs_training.py` (results in `tools/compat/analyze_results.jsonl`); "
        "`tests/test_analyze_vs_training.py` checks the same agreement. The float8 formats have "
        "a verdict only: dlspass does not lower to float8. bfloat16 runs at scale 1 whatever "
        "the initial scale (dlspass turns loss scaling off for it, as cstorch), so its training "
        "columns are one run. \"fits\" means scale 1 is in the window (no scaling needed); the "
        "recommended scale is still the one to start a dynamic scaler at.",
        "",
        "| model | format | analyze's verdict | window | recommended | "
        f"training at 2^{k0} | training at the recommended scale | training at the lower edge |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        window = "—" if r["window"] is None else f"2^{r['window'][0]} .. 2^{r['window'][1]}"
        verdict = r["verdict"]
        if len(verdict) > 140:
            verdict = verdict[:137] + "..."
        lines.append(f"| {r['model']} | {r['format']} | {verdict} | {window} | "
                     f"{_scale(r['recommended_exponent'])} | {_cell(r['matrix'])} | "
                     f"{_cell(r['recommended'])} | {_cell(r.get('lower_edge'))} |")
    bad = agreement(rows)
    lines.append("")
    if bad:
        lines.append("Disagreements: " + "; ".join(bad) + ".")
    else:
        lines.append(f"Agreement: wherever analyze says a format fits at 2^{k0}, training from "
                     f"2^{k0} works, and where it says 2^{k0} is outside the window (ConvNeXt "
                     f"float16: too small, its smallest gradients flush) training from 2^{k0} "
                     "fails; training from every recommended scale works, and from every "
                     "lower edge but those below.")
    known_misses = [f"{line.removeprefix('edge: ')} ({harness.ANALYZE_EDGE_MISSES[(r['model'], r['format'])]})"
                    for r in rows if (r["model"], r["format"]) in harness.ANALYZE_EDGE_MISSES
                    for line in _disagreements(r) if line.startswith("edge")]
    if known_misses:
        lines.append("")
        lines.append("Known misses (`harness.ANALYZE_EDGE_MISSES`): " + "; ".join(known_misses)
                     + ". analyze counts flushed parameter-gradient values; "
            "at scales this far below 1 the activation gradients also sit deep in the format's "
            "subnormals, which lose precision without flushing, so the lower edge can be a "
            "binade too low. The recommended scale is 2^3 below the first overflow and far "
            "from that edge on every model here.")
    lines.append("")
    return "\n".join(lines)


def splice(doc: str, text: str) -> str:
    """``doc`` with its "analyze against training" section replaced by ``text`` (or added
    before "## Reasons", or at the end)."""
    if HEADING in doc:
        start = doc.index(HEADING)
        nxt = doc.find("\n## ", start + len(HEADING))
        return doc[:start] + text + ("" if nxt < 0 else "\n" + doc[nxt + 1:])
    at = doc.find("## Reasons")
    return doc + "\n" + text if at < 0 else doc[:at] + text + "\n" + doc[at:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--doc-only", action="store_true", help="rewrite the section from --results")
    ap.add_argument("--only", default="", help="models whose name contains this")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if not args.doc_only:
        import zoo

        rows = []
        for model in zoo.MODELS:
            if args.only in model:
                rows += measure(model)
        args.results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = load(args.results)
    DOC.write_text(splice(DOC.read_text(), section(rows)))
    print(f"wrote {DOC}", file=sys.stderr)
    for line in agreement(rows):
        print("DISAGREES:", line)
    return 1 if agreement(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
