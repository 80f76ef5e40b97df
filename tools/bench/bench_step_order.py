"""A/B of the whole-step node order: dlspass's native bfloat16 step compiled as it is (inductor's
``reorder_for_locality`` off, ``dlspass.capture.aot.step_inductor_config``) and with that pass
back on, against torch's best practice (autocast, compiled model, fused AdamW), in one process.

Per ``--models`` (bench_native's default sizes): the three steps are built and called once (the
first call compiles), then timed in ``--repeats`` interleaved samples of ``--steps`` steps
(medians), then their step peak memory is read as bench_native reads it (median of three).
Prints one line per model. The measurement of issue 32 (RESULTS.md):

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_step_order.py --models gpt gpt2 resnet18
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import bench_native as bn  # this folder: sys.path[0]

import dlspass.capture.aot as aot

VARIANTS = ("torch-bfloat16", "dlspass-bfloat16", "dlspass-bfloat16+reorder")


def _build(model: str, variant: str) -> tuple[Callable[..., Any], tuple, float]:
    """The step of ``variant``, its batch and its first call's seconds (the compile happens
    there, so the setting is patched around it)."""
    real = aot.step_inductor_config
    if variant.endswith("+reorder"):
        aot.step_inductor_config = lambda ex: {**real(ex), "reorder_for_locality": True}
    try:
        step, batch = bn.build(model, variant.removesuffix("+reorder"), "cpu", "default")
        t0 = time.perf_counter()
        step(*batch)
        return step, batch, time.perf_counter() - t0
    finally:
        aot.step_inductor_config = real


def measure(model: str, repeats: int, steps: int) -> str:
    built = {v: _build(model, v) for v in VARIANTS}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):  # interleaved: every variant sees the same load
        for v, (step, batch, _) in built.items():
            samples[v].append(bn._timed(step, batch, steps, "cpu"))
    ms = {v: 1000 * statistics.median(s) for v, s in samples.items()}
    peak = {v: statistics.median(bn.step_peak_mb(step, batch, "cpu") for _ in range(3))
            for v, (step, batch, _) in built.items()}
    base = VARIANTS[0]
    cells = [f"{v}: {ms[v]:.1f} ms ({ms[v] / ms[base]:.3f}x), peak {peak[v]:.1f} MB "
             f"({peak[v] / peak[base]:.2f}x), first call {built[v][2]:.1f} s" for v in VARIANTS]
    return f"{model}: " + "; ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt", "gpt2", "resnet18"], choices=list(bn.MODELS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    for m in args.models:
        print(measure(m, args.repeats, args.steps), flush=True)


if __name__ == "__main__":
    main()
