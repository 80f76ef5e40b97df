"""Benchmark of dlspass.formats rounding against a plain ``clone()`` on 16M float32 values.

Run: ``.venv/bin/python tools/bench/bench_rounding.py [--repeats 15] [--numel 16777216]``.
Writes its Markdown section to ``tools/bench/results/rounding.md`` and prints it. Each variant is
warmed up first (compiles happen there), then all variants are timed in interleaved rounds so
that load from other processes hits them alike; the table reports medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dlspass import formats as F

RESULTS = Path(__file__).resolve().parent / "results" / "rounding.md"
FMT = "cbfloat16"


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _eager_no_compile(x: torch.Tensor) -> torch.Tensor:
    old = os.environ.get("DLSPASS_ROUNDING_COMPILE")
    os.environ["DLSPASS_ROUNDING_COMPILE"] = "0"
    try:
        return F.round_to_format(x, FMT)
    finally:
        if old is None:
            del os.environ["DLSPASS_ROUNDING_COMPILE"]
        else:
            os.environ["DLSPASS_ROUNDING_COMPILE"] = old


def run(numel: int = 1 << 24, repeats: int = 15, seed: int = 0) -> list[dict]:
    """Time every variant; returns one row per variant (median seconds and ratio to clone)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.exp2(torch.randint(-45, 35, (numel,), generator=g).float())
    compiled_bits = torch.compile(F.round_bits, dynamic=True)
    variants: dict[str, tuple[Callable[[], torch.Tensor], float | None]] = {
        "clone()": (lambda: x.clone(), None),
        "eager op (round_to_format)": (lambda: F.round_to_format(x, FMT), 3.0),
        "eager op, DLSPASS_ROUNDING_COMPILE=0": (lambda: _eager_no_compile(x), 3.0),
        "bit form, torch.compile(round_bits)": (lambda: compiled_bits(x, FMT), 1.1),
        "bit form, eager round_bits": (lambda: F.round_bits(x, FMT), None),
        "arith form, eager round_arith": (lambda: F.round_arith(x, FMT), None),
        "float16 eager op (native cast)": (lambda: F.round_to_format(x, "float16"), 3.0),
    }
    outs = {name: fn() for name, (fn, _) in variants.items()}  # warm-up, compiles
    want = outs["bit form, eager round_bits"].view(torch.int32)
    for name in ("eager op (round_to_format)", "eager op, DLSPASS_ROUNDING_COMPILE=0",
                 "bit form, torch.compile(round_bits)", "arith form, eager round_arith"):
        if not torch.equal(outs[name].view(torch.int32), want):
            raise AssertionError(f"{name} disagrees bitwise with round_bits")
    del outs, want
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (fn, _) in variants.items():
            times[name].append(_timed(fn))
    base = statistics.median(times["clone()"])
    rows = []
    for name, (_, goal) in variants.items():
        med = statistics.median(times[name])
        rows.append({"variant": name, "median_s": med, "ratio": med / base, "goal": goal})
    return rows


def render(rows: list[dict], numel: int, repeats: int, command: str) -> str:
    """Markdown section for ``rows``."""
    lines = [
        "## Rounding to cbfloat16 (dlspass.formats)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"os.cpu_count()={os.cpu_count()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads (shared machine: other jobs were running).",
        "",
        f"{numel:,} float32 values, median of {repeats} interleaved repeats after a warm-up call.",
        "",
        "| variant | median ms | x clone | eager <= 3x clone | compiled <= 1.1x clone |",
        "|---|---:|---:|---|---|",
    ]
    for r in rows:
        eager_goal = compiled_goal = ""
        if r["goal"] == 3.0:
            eager_goal = "met" if r["ratio"] <= 3.0 else "MISS"
        elif r["goal"] == 1.1:
            compiled_goal = "met" if r["ratio"] <= 1.1 else "MISS"
        lines.append(f"| {r['variant']} | {r['median_s'] * 1e3:.2f} | {r['ratio']:.2f} | "
                     f"{eager_goal} | {compiled_goal} |")
    lines += [
        "",
        "The eager op uses a lazily compiled bit kernel for tensors of at least "
        f"{F.COMPILE_MIN_NUMEL:,} elements (first call compiles, later calls reuse it); with "
        "`DLSPASS_ROUNDING_COMPILE=0` it runs the bit form as aten ops on L2-sized chunks.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark, write ``tools/bench/results/rounding.md``, print and return it.

    ``argv`` defaults to no arguments (not ``sys.argv``), so callers such as ``run_all.py`` get
    the default settings whatever their own command line was.
    """
    argv = [] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    if args.repeats < 15:
        p.error("--repeats must be at least 15")
    command = ".venv/bin/python tools/bench/bench_rounding.py " + " ".join(argv)
    rows = run(args.numel, args.repeats)
    md = render(rows, args.numel, args.repeats, command.strip())
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(md)
    print(md)
    return md


if __name__ == "__main__":
    main(sys.argv[1:])
