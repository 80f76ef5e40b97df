"""Where a training step's time goes, from one torch.profiler trace of a few steps.

Buckets (ms per step): ``matmul`` (aten mm/bmm/addmm/baddbmm: inductor calls them as library
kernels, eager code directly), ``compiled kernels`` (the rest of the time inside compiled
regions: inductor's generated kernels and wrapper), ``eager ops`` (aten ops outside compiled
regions: the eager optimizer, the scaler, zero_grad), and ``host`` (the step's wall time not
spent in any profiled op: Python, dynamo guards, autograd bookkeeping, waiting).

CPU only: on a GPU the profiled times are launch times (no device activity, no synchronize).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"}
_COMPILED = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph")
BUCKETS = ("matmul", "compiled kernels", "eager ops", "host")


def _in_compiled(ev) -> bool:
    while ev is not None:
        if ev.name.startswith(_COMPILED) or "CompiledFunction" in ev.name:
            return True
        ev = ev.cpu_parent
    return False


def breakdown(step: Callable, batch: tuple, steps: int = 5) -> dict[str, float]:
    """Milliseconds per step in each of ``BUCKETS``, and ``wall``; ``host`` is what the other
    buckets leave of the wall time (clamped at 0)."""
    step(*batch)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(*batch)
        wall = (time.perf_counter() - t0) * 1e3 / steps
    matmul = matmul_in_compiled = compiled_total = eager = 0.0
    for ev in prof.events():
        us = ev.self_cpu_time_total
        compiled = _in_compiled(ev)
        if ev.name in MATMULS:
            matmul += us
            matmul_in_compiled += us if compiled else 0.0
        if compiled and not _in_compiled(ev.cpu_parent):
            # the outermost compiled event of a chain, with its children: nested regions once
            compiled_total += ev.cpu_time_total
        elif ev.name.startswith("aten::") and not compiled:
            eager += us
    out = {
        "matmul": matmul / 1e3 / steps,
        "compiled kernels": max(compiled_total - matmul_in_compiled, 0.0) / 1e3 / steps,
        "eager ops": (eager - (matmul - matmul_in_compiled)) / 1e3 / steps,
    }
    out["host"] = max(wall - sum(out.values()), 0.0)
    out["wall"] = wall
    return out

