"""Run every benchmark in tools/bench and write tools/bench/RESULTS.md.

Usage: ``.venv/bin/python tools/bench/run_all.py [--only NAME ...] [--reuse]``

Each ``bench_*.py`` module exposes ``main() -> str`` (its Markdown section, also written to
``tools/bench/results/<name>.md``). ``--reuse`` skips running and stitches the committed
sections together (for updating the summary without re-measuring).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ORDER = ["compile", "eager_scaler", "capture", "rounding", "pass_time", "distributed"]


def _load(name: str):
    path = HERE / f"bench_{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="benchmark names (e.g. rounding)")
    ap.add_argument("--reuse", action="store_true", help="stitch existing results/*.md")
    args = ap.parse_args(argv)
    names = [n for n in ORDER if (HERE / f"bench_{n}.py").exists()]
    if args.only:
        names = [n for n in names if n in args.only]
    sections = []
    for name in names:
        out = HERE / "results" / f"{name}.md"
        if not args.reuse:
            t0 = time.time()
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            try:
                fn = _load(name).main
                # benchmarks with their own flags get none: run_all's argv is not theirs
                fn([]) if "argv" in inspect.signature(fn).parameters else fn()
            except Exception as e:  # one failing benchmark must not hide the others
                out.parent.mkdir(exist_ok=True)
                out.write_text(f"## {name}\n\nFAILED to run: {type(e).__name__}: {e}\n")
            print(f"[bench] {name} done in {time.time() - t0:.0f} s", file=sys.stderr)
        if out.exists():
            sections.append(out.read_text().strip())
    summary = HERE / "results" / "summary.md"  # hand-written reading of the runs below
    if summary.exists():
        sections.insert(0, summary.read_text().strip())
    header = (
        "# Benchmark results\n\n"
        "Produced by `.venv/bin/python tools/bench/run_all.py` (each section names its own command;\n"
        "sections are measured in separate processes). Ratios are medians of interleaved repeats\n"
        "measured side by side in one process, because these machines are shared and noisy.\n"
        "MISS marks a goal that is not met. No GPU was lent to the session that produced these\n"
        "numbers, so there is no GPU table yet.\n\n"
        f"Machine: {platform.platform()}, {os.cpu_count()} CPU cores, torch {torch.__version__}.\n"
    )
    (HERE / "RESULTS.md").write_text(header + "\n" + "\n\n".join(sections) + "\n")
    print(HERE / "RESULTS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
