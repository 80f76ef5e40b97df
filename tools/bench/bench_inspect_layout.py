"""Benchmark: ``inspect``'s SVG and HTML render time against graph size (a Relu chain).

Run: ``.venv/bin/python tools/bench/bench_inspect_layout.py [--sizes 2500 5000 10000 20000]
[--repeat 3]``. Prints one row per size (the best of ``--repeat`` renders, in ms) and the time
ratio to the previous size beside the size ratio: about equal is linear, the square of it
quadratic (the layout once bucketed nodes by scanning all of them for every column: 20k nodes
took about 27 s). The tests assert the growth on a count that load does not change
(``tests/hostile/test_inspect_scaling.py``); this is the wall time, which it does.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.fx as fx

from dlspass.debug.inspect_report import render, summarize_graph

SIZES = (2_500, 5_000, 10_000, 20_000)


def chain_report(n: int) -> dict:
    """The inspect report of an FX graph ``x -> n x relu -> output``."""
    g = fx.Graph()
    v = g.placeholder("x")
    for _ in range(n):
        v = g.call_function(torch.ops.aten.relu.default, (v,))
    g.output(v)
    return summarize_graph(fx.GraphModule(torch.nn.Module(), g))


def best_ms(report: dict, fmt: str, repeat: int) -> float:
    """The fastest of ``repeat`` renders of ``report`` as ``fmt``, in milliseconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        render(report, fmt)
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    render(chain_report(100), "html")  # warm-up: lazy imports
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), best of {args.repeat}")
    print("| nodes | svg ms | html ms | svg us/node | size ratio | svg ratio | html ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    prev = None
    for n in args.sizes:
        report = chain_report(n)
        svg, page = best_ms(report, "svg", args.repeat), best_ms(report, "html", args.repeat)
        ratios = ("", "", "") if prev is None else (
            f"{n / prev[0]:.2f}", f"{svg / prev[1]:.2f}", f"{page / prev[2]:.2f}")
        print(f"| {n} | {svg:.1f} | {page:.1f} | {svg * 1e3 / n:.1f} | " + " | ".join(ratios) + " |")
        prev = (n, svg, page)


if __name__ == "__main__":
    main()
