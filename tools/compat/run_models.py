"""Run the model compatibility matrix and regenerate docs/COMPATIBILITY.md.

Every cell (model x entry point x format, plus gradient accumulation) runs in its own
subprocess with a timeout (``tests/models/harness.run_cell``: 10 AdamW steps, the loss times
inf at step 4, compared with the eager scaler). Results are appended to a JSON-lines file as
they finish, so an interrupted run keeps what it measured; ``--doc-only`` rebuilds the table
from that file.

    OMP_NUM_THREADS=1 .venv/bin/python tools/compat/run_models.py --timeout 600 \
        --results tools/compat/results.jsonl

Cells run fp32 first, then cbfloat16, float16 and bfloat16 (emulated), then float16 and bfloat16
native (``--only native`` runs only those), each from the smallest model and
the cheapest entry point up, accumulation last, so that a time box (``--time-box``) cuts the
slowest and least informative ones; those are listed as "not run".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import analyze_vs_training  # noqa: E402 - beside this file
import harness  # noqa: E402
import known  # noqa: E402

DOC = ROOT / "docs" / "COMPATIBILITY.md"
FLOAT8_COUNTS = ROOT / "tools" / "bench" / "results" / "float8_counts.md"
FLOAT8_INTRO = """
## float8

Matmuls of one training step (forward and backward: `mm`, `addmm`, `bmm`) that run in float8 with
`float8="tensorwise"` (dlspass, counted in the `capture_step` graph, default filter
`float8_filter="all"`) and with torchao 0.18.0's `convert_to_float8_training` (its default: no
`module_filter_fn`; the matmuls that read its float8 tensors, `emulate=True`), from
`tools/bench/bench_float8.py --counts` (below: its command and machine). Each matrix model
trains through every entry point in both recipes in the float8 columns of the table above
(ONNX output refuses float8 in one line). The rest of each model's matmul-like ops (fused
attention kernels, convolutions) stays in the step's precision, with its reason in
`dlspass inspect`.

"""


def float8_section() -> str:
    """The float8 section, from bench_float8.py's counts where that file exists."""
    if not FLOAT8_COUNTS.exists():
        return ""
    return FLOAT8_INTRO + FLOAT8_COUNTS.read_text()
RESULTS = ROOT / "tools" / "compat" / "results.jsonl"
MARK = "@@cell@@ "
# cheapest first: compile cost grows with the model and the entry point's graphs
ENTRY_COST = {"GradScaler": 0, "TorchGradScaler": 0, "capture_step": 1, "cli": 2,
              "dlspass.compile": 3, "make_backend": 4, "backend=dlspass": 5}
MODEL_COST = {"graph_break": 0, "mhagpt": 1, "resnet": 2, "convnext": 3, "vit": 4, "bert": 5, "gpt2": 6,
              "t5": 7}


def run_one(model: str, entry: str, fmt: str, accumulate: bool) -> None:
    """The ``--cell`` mode: run one cell in this process and print its result as JSON."""
    t0 = time.perf_counter()
    res = harness.run_cell(model, entry, fmt, accumulate)
    out = {"key": res.key, "model": model, "entry": entry, "fmt": fmt, "accumulate": accumulate,
           "compiler": _compiler(entry), "status": "works" if res.ok else "fails", "reason": res.reason,
           "update_error": res.update_error, "float8_matmuls": res.float8_matmuls,
           "seconds": round(time.perf_counter() - t0, 1)}
    print(MARK + json.dumps(out), flush=True)


def _compiler(entry: str) -> str:
    return harness.BACKEND_COMPILER if entry in harness.COMPILED else ""


def result_key(r: dict) -> str:
    """A result's identity: the cell, and for compiled entry points what compiled it."""
    compiler = r.get("compiler", "inductor" if r["entry"] in harness.COMPILED else "")
    return f"{r['key']}@{compiler}"


def spawn(cell: tuple[str, str, str, bool], timeout: float) -> dict:
    model, entry, fmt, accumulate = cell
    cmd = [sys.executable, __file__, "--cell", model, entry, fmt,
           "--backend-compiler", harness.BACKEND_COMPILER] + (["--accumulate"] if accumulate else [])
    base = {"key": harness.cell_id(*cell), "model": model, "entry": entry, "fmt": fmt,
            "accumulate": accumulate, "compiler": _compiler(entry)}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**base, "status": "timeout", "reason": f"did not finish in {timeout:.0f} s",
                "seconds": round(time.perf_counter() - t0, 1)}
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = [ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or [""]
    return {**base, "status": "fails", "reason": f"process exit {p.returncode}: {tail[0][:200]}",
            "seconds": round(time.perf_counter() - t0, 1)}


def ordered_cells() -> list[tuple[str, str, str, bool]]:
    """By format (fp32, then cbfloat16, float16, bfloat16), then model size, then entry-point
    cost, accumulation last: a time box cuts the slowest and least informative cells."""
    fmt_cost = {"fp32": 0, "cbfloat16": 1, "float16": 2, "bfloat16": 3, "float16-native": 4,
                "bfloat16-native": 5, "float8-tensorwise": 6, "float8-rowwise": 7}
    return sorted(harness.cells(), key=lambda c: (
        c[3], fmt_cost[c[2]], MODEL_COST[c[0]], ENTRY_COST[c[1]]))


def load_results(path: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[result_key(r)] = r  # a later run of a cell replaces an earlier one
    return out


# ---- the document --------------------------------------------------------------------------

def _machine() -> str:
    import torch
    import transformers

    return (f"{platform.machine()} Linux, {os.cpu_count()} CPU cores (shared), "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}")


def render(results: dict[str, dict], command: str, started: str, note: str = "") -> str:
    notes: dict[str, tuple[int, str]] = {}

    def cell_text(r: dict | None, expected: known.Known | None) -> str:
        if r is None:
            return "not run"
        if r["status"] == "works":
            # float8: how many matmuls of the step ran in float8 (all graphs of the entry point)
            return f"works ({r['float8_matmuls']})" if r.get("float8_matmuls") else "works"
        reason = r["reason"].replace("`", "'")
        # cells failing for one known cause share a note (the first error line seen for it)
        group = expected.summary if expected is not None else reason
        if group not in notes:
            notes[group] = (len(notes) + 1, f"{group} — e.g. `{reason}`" if expected else f"`{reason}`")
        word = "timeout" if r["status"] == "timeout" else "fails"
        return f"{word} [{notes[group][0]}]"

    lines = [
        "# Compatibility: outside models x entry points x formats",
        "",
        f"Generated by `{command}` on {started} UTC, on {_machine()}. Do not edit by hand: "
        "rerun the script (it reuses `tools/compat/results.jsonl`; `--doc-only` only rewrites "
        "this file)." + (f" {note}" if note else ""),
        "",
        "Each cell trains a tiny model built from its transformers config with random weights "
        f"(`tests/models/zoo.py`) for {harness.STEPS} AdamW steps (lr {harness.LR}, weight "
        f"decay {harness.WEIGHT_DECAY}) with the loss times inf at step {harness.OVERFLOW_STEP} "
        f"(initial scale {harness.INIT_SCALE:g}, steps_per_increase {harness.GROWTH_INTERVAL}), "
        "and compares with the eager `dlspass.GradScaler` at the same settings "
        "(`tests/models/harness.py`): **works** means the same skipped steps and scale after "
        "every step, no non-finite weight, and the total parameter update within the format's "
        "tolerance of the eager one. The eager `GradScaler` is checked against "
        "`torch.amp.GradScaler` (skips, parameters) and a hand-worked cerebras scale "
        "trajectory; `TorchGradScaler` against `torch.amp.GradScaler` bit for bit.",
        "",
        "Models: transformers 5.23.0 `GPT2LMHeadModel` (as shipped: `loss_type` default), "
        "`BertForMaskedLM`, `T5ForConditionalGeneration`, `ViTForImageClassification`, "
        "`ResNetForImageClassification` (BatchNorm), `ConvNextForImageClassification` "
        "(LayerNorm), and `graph_break`, a two-linear module with `torch._dynamo.graph_break()` "
        "between two losses whose overflow is in the second graph only. timm is not in the "
        "matrix: timm 1.0.31 imports torchvision, and the torchvision wheel on PyPI does not "
        "import beside torch 2.13.0+cpu.",
        "",
        "Formats: `fp32` is DLS without lowering (`mixed_precision=False`); `float16`, "
        "`bfloat16`, `cbfloat16` round every matmul-like op's inputs and outputs to the format "
        "(`precision_mode=\"emulate\"`). "
        "The eager scalers run the model as written (no lowering), so only their fp32 column "
        "applies. bfloat16 turns loss scaling off by design (scale 1, nothing checked, as "
        "cstorch), so bfloat16 cells inject no overflow: **with bfloat16 an inf in the loss "
        "reaches the weights in every entry point, the eager scaler included.**",
        "",
        "**Native columns** (`float16 native`, `bfloat16 native`): the same model trained with "
        "real 16-bit kernels (`precision_mode=\"native\"`, the default for float16 and bfloat16; "
        "the torch policy) and compared with torch's own recipe on the same model and data, "
        "`torch.autocast` + `torch.amp.GradScaler` (float16; bfloat16 needs no scaler): the same "
        "skipped steps and scale after every step, no non-finite weight, and the update within "
        + ", ".join(f"{k} {v}" for k, v in harness.NATIVE_TOLERANCE.items())
        + " of autocast's (`harness.NATIVE_TOLERANCE`: autocast on CPU runs layer norm, softmax "
        "and the losses in 16 bits, dlspass keeps them in float32 as CUDA's autocast does).",
        "",
        "**float8 columns** (`float8 tensorwise`, `float8 rowwise`): the `bfloat16 native` step "
        "with `DLSConfig(float8=...)`, every matmul of the step (forward and backward, the "
        "default filter `float8_filter=\"all\"`) in float8 by that recipe with `torch._scaled_mm`, "
        "compared with torchao 0.18.0's `convert_to_float8_training` of the same recipe "
        "(`emulate=True`, its float8 math on a CPU) trained under bfloat16 `torch.autocast`: no "
        "non-finite weight and the update within "
        + ", ".join(f"{k} {v}" for k, v in harness.FLOAT8_TOLERANCE.items())
        + " of torchao's (`harness.FLOAT8_TOLERANCE`: dlspass also runs in float8 the matmuls "
        "torchao leaves in bfloat16, and autocast keeps other ops in bfloat16). The number after "
        "**works** is how many matmuls `LowerMatmulsToFloat8Pass` converted, summed over every "
        "graph the entry point rewrote (a graph dynamo compiles again counts again; the CLI's "
        "exported program spells a fused attention kernel as batched matmuls, which it converts "
        "too); a cell whose step ran none fails. `tools/bench/bench_float8.py --counts` compares "
        "the counts of one step with torchao's (section float8 below).",
        "",
        "Compiled entry points (`dlspass.compile`, `backend=dlspass`, `make_backend`) are "
        "meant to run with inductor; \"eager:\" after a cell is the same cell with "
        "`backend_compiler=\"eager\"` (`--backend-compiler eager`: every dlspass rewrite, the "
        "graphs run without inductor's code generation), which fits the time box where "
        "inductor on shared cores does not.",
        "",
        "Tolerances on `||update - eager update|| / ||eager update||`: "
        + ", ".join(f"{k} {v}" for k, v in harness.TOLERANCE.items())
        + " (fp32: summation order, amplified by AdamW's division by sqrt(v); the lowered "
        "formats: about twice the largest difference measured on these models, which grows "
        "faster than the format's round-off because AdamW flips the update of near-zero "
        "gradients and BatchNorm leaves conv weights cancelling gradients; one lost step moves "
        "it by about 0.1, and the exact skip and scale checks catch a step taken or skipped "
        "wrongly; see `harness.TOLERANCE`).",
        "",
    ]
    for accumulate in (False, True):
        fmts = ("fp32",) if accumulate else (*harness.FORMATS, *harness.NATIVE_FORMATS, *harness.FLOAT8_FORMATS)
        lines.append("## Gradient accumulation (two backward calls per step, inf in the first)"
                     if accumulate else "## One backward per step")
        lines.append("")
        if accumulate:
            lines.append("capture_step and the CLI's transformed step trace one backward per "
                         "step (accumulate by summing micro-batch losses in the loss function); "
                         "they are not in this table.")
            lines.append("")
        lines.append("| model | entry point | " + " | ".join(f.replace("-", " ") for f in fmts) + " |")
        lines.append("|---|---|" + "---|" * len(fmts))
        for model in harness.zoo.MODELS:
            for entry in harness.ENTRY_POINTS:
                if accumulate and entry not in harness.ACCUMULATING:
                    continue
                row = []
                for fmt in fmts:
                    if (entry in harness.EAGER and fmt != "fp32") or (
                            fmt in (*harness.NATIVE_FORMATS, *harness.FLOAT8_FORMATS)
                            and entry not in harness.NATIVE_ENTRY_POINTS):
                        row.append("—")
                        continue
                    key = harness.cell_id(model, entry, fmt, accumulate)
                    expected = known.KNOWN.get(key)
                    if entry not in harness.COMPILED:
                        row.append(cell_text(results.get(f"{key}@"), expected))
                        continue
                    text = cell_text(results.get(f"{key}@inductor"), expected)
                    if f"{key}@eager" in results:
                        text += "; eager: " + cell_text(results[f"{key}@eager"], expected)
                    row.append(text)
                lines.append(f"| {model} | `{entry}` | " + " | ".join(row) + " |")
        lines.append("")
    lines.append("## Reasons")
    lines.append("")
    lines.append("The text in backquotes is the first line of the error the user sees (or "
                 "the check that failed); the words before it say where it comes from and, "
                 "where torch is the limit, which torch issue.")
    lines.append("")
    for n, text in notes.values():
        lines.append(f"{n}. {text}")
    lines.append("")
    return "\n".join(lines)


def check_known(results: dict[str, dict]) -> int:
    """Print each measured cell whose outcome disagrees with `known.KNOWN`; 1 if any does."""
    bad = 0
    for rk, r in sorted(results.items()):
        key = r["key"]
        listed = key in known.KNOWN
        if (r["status"] == "works") == listed:
            bad += 1
            what = "works but is listed in known.py" if listed else "fails but is not in known.py"
            print(f"{rk}: {what}: {r.get('reason', '')[:160]}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", nargs=3, metavar=("MODEL", "ENTRY", "FORMAT"))
    ap.add_argument("--accumulate", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    ap.add_argument("--time-box", type=float, default=None,
                    help="stop starting cells after this many seconds")
    ap.add_argument("--backend-compiler", choices=("inductor", "eager"), default="inductor",
                    help="what compiles the compiled entry points' graphs (eager: no inductor)")
    ap.add_argument("--jobs", type=int, default=1, help="cells run at the same time")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--only", default="", help="run only cells whose id contains this")
    ap.add_argument("--compiled", choices=("all", "only", "none"), default="all",
                    help="run the compiled entry points' cells too, only them, or not")
    ap.add_argument("--skip-done", action="store_true", help="keep results already in --results")
    ap.add_argument("--doc-only", action="store_true")
    ap.add_argument("--check-known", action="store_true",
                    help="list cells whose result disagrees with tests/models/known.py and exit")
    ap.add_argument("--note", default="", help="a sentence for the header (how the results were run)")
    args = ap.parse_args(argv)
    os.environ["DLSPASS_MATRIX_COMPILER"] = harness.BACKEND_COMPILER = args.backend_compiler
    if args.cell:
        run_one(*args.cell, args.accumulate)
        return 0
    if args.check_known:
        return check_known(load_results(args.results))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    given = list(argv if argv is not None else sys.argv[1:])
    if "--note" in given:  # the note is printed on its own
        del given[given.index("--note"):given.index("--note") + 2]
    command = "OMP_NUM_THREADS=1 .venv/bin/python tools/compat/run_models.py " + " ".join(given)
    if not args.doc_only:
        done = load_results(args.results) if args.skip_done else {}
        if not args.skip_done:
            args.results.write_text("")
        t0 = time.monotonic()
        want = {"all": (True, False), "only": (True,), "none": (False,)}[args.compiled]
        todo = [c for c in ordered_cells() if args.only in harness.cell_id(*c)
                and (c[1] in harness.COMPILED) in want
                and f"{harness.cell_id(*c)}@{_compiler(c[1])}" not in done]

        def work(cell: tuple[str, str, str, bool]) -> None:
            if args.time_box is not None and time.monotonic() - t0 > args.time_box:
                return  # left out: the table says "not run"
            r = spawn(cell, args.timeout)
            with lock, args.results.open("a") as f:
                print(f"{r['status']:8s} {r.get('seconds', 0):7.1f}s {r['key']} "
                      f"{r.get('reason', '')[:120]}", flush=True)
                f.write(json.dumps(r) + "\n")

        lock = threading.Lock()
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(work, todo))
    text = render(load_results(args.results), command.strip(), started, args.note)
    # the "analyze against training" section comes from analyze_vs_training.py's results
    rows = analyze_vs_training.load(analyze_vs_training.RESULTS)
    if rows:
        text = analyze_vs_training.splice(text, analyze_vs_training.section(rows))
    DOC.write_text(text + float8_section())
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
