"""Where a training step's time goes, dlspass against torch's best practice, side by side.

For each model (``--models``) and format (``--formats``), three steps are built with
``bench_native``'s builders: ``torch-<fmt>`` (``torch.compile(model)`` + fused AdamW +
``torch.autocast``, plus ``torch.amp.GradScaler`` for float16: torch's best practice) and
``dlspass-<fmt>`` (``dlspass.compile`` of the whole step, native 16-bit, dynamic DLS for
float16). Each is warmed up, then ``--steps`` steps run under ``torch.profiler``; per step:

- time per bucket: ``matmul``, ``attention``, ``elementwise/fused``, ``optimizer``, ``DLS``
  (the scaler's unscale, inf check and scale update), ``copies``, and ``host gaps`` (on CUDA:
  the time the GPU sits idle between kernels inside the step, i.e. launch and host overhead;
  on CPU: the step's wall time the profiled ops do not cover). On CUDA the buckets are the GPU
  kernels' times, sorted by kernel name; on CPU the ops' self times, by op name (inductor's
  generated C++ kernels count as ``elementwise/fused``: they run inside the compiled region's
  own time). A fused step puts the optimizer and DLS math in generated kernels: there the
  ``optimizer`` and ``DLS`` buckets stay empty and the time is in ``elementwise/fused``.
- kernel launches per step: on CUDA the GPU kernels and memcpy/memset the profiler saw; on CPU
  the kernels inductor's generated code launches (``dlspass.debug.kernel_count`` over the code
  of every graph compiled for the step: generated and library kernels) plus the ATen ops the
  step runs outside compiled graphs (GradScaler, the fused optimizer), each counted once at its
  outermost call. Both steps are counted the same way.
- the attention kernels (CUDA kernel names, or the ATen attention ops on CPU) of both steps.

Usage (CPU smoke, seconds of steady time after the compiles):

    .venv/bin/python tools/bench/gpu_profile.py --small --models gpt --formats bfloat16

On a GPU: ``tools/bench/gpu_check.sh`` (this script, then ``bench_native.py``). Runs on torch
2.11 and 2.13 (it uses only ``torch.profiler.profile``, its events and ``FunctionEvent``
fields both releases have). ``--zoo`` takes the models of ``tests/models/zoo.py`` (the
compatibility matrix's GPT-2, MHA GPT and ResNet) instead, as ``--launches-only`` tables in
RESULTS.md do.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from baselines import run_and_report  # this folder: sys.path[0]
from bench_native import (
    DTYPES,
    MODELS,
    ZOO_NAMES,
    _timed,
    step_alloc_peak_mb,
    step_peak_mb,
)
from bench_native import build as native_build
from torch import Tensor

from dlspass.debug.kernel_count import compiled_launches, eager_ops

BUCKETS = ("matmul", "attention", "elementwise/fused", "optimizer", "DLS", "copies", "host gaps")

# kernel (CUDA) or ATen op (CPU) names per bucket, first match wins; everything else is
# elementwise/fused
_RULES: list[tuple[str, re.Pattern[str]]] = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|scaled_dot_product", re.I)),
    ("DLS", re.compile(r"amp_|non_finite|unscale|update_scale", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|sgd", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|cublas|nvjet|xmma|wgmma|splitk|sm\d+_|aten::(mm|addmm|bmm|baddbmm"
                          r"|linear|matmul|convolution|_convolution|mkldnn_convolution|convolution_backward)$"
                          r"|conv|implicit_gemm|winograd", re.I)),
    ("copies", re.compile(r"memcpy|memset|aten::(copy_|_to_copy|clone|contiguous)$|copy", re.I)),
]

def bucket_of(name: str) -> str:
    """The time bucket of a kernel or ATen op name."""
    for bucket, pattern in _RULES:
        if pattern.search(name):
            return bucket
    return "elementwise/fused"


# ---- models --------------------------------------------------------------------------------

def build(model_name: str, variant: str, device: str, size: str, zoo: bool = False
          ) -> tuple[Callable[..., Tensor], tuple[Tensor, ...]]:
    """``variant`` (``torch-<fmt>`` or ``dlspass-<fmt>``) of a fresh ``model_name`` (``zoo``: the
    compatibility matrix's model of that name, ``bench_native.ZOO_NAMES``)."""
    return native_build(ZOO_NAMES[model_name] if zoo else model_name, variant, device, size, zoo)


# ---- measurement ---------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_step(step: Callable[..., Tensor], batch: tuple[Tensor, ...], device: str, steps: int
                 ) -> dict[str, Any]:
    """Bucket times (ms per step), launches per step and attention kernel names of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(*batch)
        _sync(device)
        wall = time.perf_counter() - t0
    events = list(prof.events())
    times = dict.fromkeys(BUCKETS, 0.0)
    attention: set[str] = set()
    if device == "cuda":
        kernels = [e for e in events if _is_device_event(e)]
        kernels.sort(key=lambda e: e.time_range.start)
        for e in kernels:
            b = bucket_of(e.name)
            times[b] += e.time_range.elapsed_us() / 1e3
            if b == "attention":
                attention.add(e.name)
        gaps = 0.0
        for a, b in zip(kernels, kernels[1:]):  # noqa: B905 - pairs of neighbours
            gaps += max(0.0, b.time_range.start - a.time_range.end) / 1e3
        times["host gaps"] = gaps
        launches = len(kernels) / steps
        eager = []
    else:
        busy = 0.0
        for e in events:
            self_ms = e.self_cpu_time_total / 1e3
            busy += self_ms
            b = bucket_of(e.name) if e.name.startswith("aten::") else "elementwise/fused"
            times[b] += self_ms
            if e.name.startswith("aten::") and b == "attention":
                attention.add(e.name)
        times["host gaps"] = max(0.0, wall * 1e3 - busy)
        eager = eager_ops(events)
        launches = None  # the compiled code's count is added by the caller
    out = {b: t / steps for b, t in times.items()}
    out.update(wall_ms=wall * 1e3 / steps, launches=launches, attention_kernels=sorted(attention),
               eager=Counter(eager), eager_per_step=len(eager) / steps)
    return out


def _is_device_event(e: Any) -> bool:
    dt = getattr(e, "device_type", None)
    return dt is not None and str(dt).endswith(("CUDA", "PrivateUse1"))


def measure(model_name: str, fmt: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both steps of one model and format: first call, then ``--steps`` profiled steps."""
    rows: dict[str, dict[str, Any]] = {}
    for kind in ("torch", "dlspass"):
        variant = f"{kind}-{fmt}"
        torch._dynamo.reset()
        step, batch = build(model_name, variant, args.device, args.size, args.zoo)
        t0 = time.perf_counter()
        kc = compiled_launches(step, *batch)
        compiled = kc.launches + kc.extern_launches
        _sync(args.device)
        first = time.perf_counter() - t0
        for _ in range(args.warmup):
            step(*batch)
        row = {"first_s": first, "compiled": compiled, "kernels": kc}
        row.update(profile_step(step, batch, args.device, 1 if args.launches_only else args.steps))
        if not args.launches_only:  # the step unprofiled: median of interleaved-free samples
            samples = [_timed(step, batch, args.steps, args.device) for _ in range(args.repeats)]
            row["step_ms"] = 1e3 * statistics.median(samples)
            # the matrix's models are too small for the resident size: the allocator's events
            row["peak_mb"] = (step_alloc_peak_mb(step, batch) if args.zoo and args.device == "cpu"
                              else step_peak_mb(step, batch, args.device))
        if args.device == "cpu":
            row["launches"] = compiled + row["eager_per_step"]
        rows[variant] = row
    return rows


# ---- report --------------------------------------------------------------------------------

def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s)"


def report(results: dict[tuple[str, str], dict[str, dict[str, Any]]], args: argparse.Namespace,
           command: str) -> str:
    lines = [f"# Step profile: dlspass vs torch's best practice ({args.device}: {machine(args.device)})", "",
             f"`{command}`; torch {torch.__version__}; sizes: {'zoo' if args.zoo else args.size}; "
             f"{1 if args.launches_only else args.steps} profiled step(s) after {args.warmup} warm-up", ""]
    if not args.launches_only:
        lines += ["| model | format | step | " + " | ".join(BUCKETS) + " | wall ms | launches/step |",
                  "|---" * (len(BUCKETS) + 5) + "|"]
        for (m, fmt), rows in results.items():
            for v, r in rows.items():
                cells = [m, fmt, v.partition("-")[0], *(f"{r[b]:.2f}" for b in BUCKETS),
                         f"{r['wall_ms']:.2f}", f"{r['launches']:.0f}"]
                lines.append("| " + " | ".join(cells) + " |")
        goal = 0.90 if args.device == "cuda" else 1.0
        lines += ["", f"Unprofiled step (median of {args.repeats} samples of {args.steps} steps) and peak "
                  f"memory above the resident state (bench_native.step_peak_mb); goals: step <= {goal}x "
                  "torch, peak <= 1.0x torch:", "",
                  "| model | format | torch ms | dlspass ms | ratio | torch peak MB | dlspass peak MB | ratio "
                  "| first call s (torch / dlspass) |", "|---|---|---|---|---|---|---|---|---|"]
        for (m, fmt), rows in results.items():
            t, d = rows[f"torch-{fmt}"], rows[f"dlspass-{fmt}"]
            r = d["step_ms"] / t["step_ms"]
            mem = (d["peak_mb"] / t["peak_mb"]) if d.get("peak_mb") and t.get("peak_mb") else None
            lines.append(f"| {m} | {fmt} | {t['step_ms']:.2f} | {d['step_ms']:.2f} | {r:.2f}"
                         f"{'' if r <= goal else ' MISS'} | {_mb(t)} | {_mb(d)} | "
                         f"{'' if mem is None else f'{mem:.2f}' + ('' if mem <= 1.0 else ' MISS')} | "
                         f"{t['first_s']:.1f} / {d['first_s']:.1f} |")
        lines += ["", "Attention kernels:", ""]
        for (m, _fmt), rows in results.items():
            for v, r in rows.items():
                lines.append(f"- {m} {v}: {', '.join(r['attention_kernels']) or '(none)'}")
        lines.append("")
    lines += ["Kernel launches per step (compiled code: generated + library kernels; eager: ATen "
              "ops outside compiled graphs):", "",
              "| model | format | torch: compiled + eager = total | dlspass: compiled + eager = total "
              "| dlspass <= torch |", "|---|---|---|---|---|"]
    for (m, fmt), rows in results.items():
        t, d = rows[f"torch-{fmt}"], rows[f"dlspass-{fmt}"]
        tl, dl = _total(t, args.device), _total(d, args.device)
        lines.append(f"| {m} | {fmt} | {_parts(t, args.device)} | {_parts(d, args.device)} | "
                     f"{'ok' if dl <= tl else 'MISS'} |")
    lines.append("")
    for (m, _fmt), rows in results.items():
        for v, r in rows.items():
            if r.get("eager"):
                lines.append(f"- {m} {v} eager ops: " + ", ".join(f"{k} x{n}" for k, n in sorted(r["eager"].items())))
    return "\n".join(lines)


def _mb(r: dict[str, Any]) -> str:
    return "" if r.get("peak_mb") is None else f"{r['peak_mb']:.3g}"


def _total(r: dict[str, Any], device: str) -> float:
    return r["launches"]


def _parts(r: dict[str, Any], device: str) -> str:
    if device == "cuda":
        return f"{r['launches']:.0f} (profiler)"
    return f"{r['compiled']} + {r['eager_per_step']:.0f} = {r['launches']:.0f}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=("cpu", "cuda"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--formats", nargs="+", default=["bfloat16", "float16"], choices=list(DTYPES))
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="unprofiled timing samples of --steps steps")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--small", dest="size", action="store_const", const="small")
    sizes.add_argument("--large", dest="size", action="store_const", const="large")
    parser.add_argument("--zoo", action="store_true", help="the models of tests/models/zoo.py")
    parser.add_argument("--launches-only", action="store_true",
                        help="only the kernel-launch table (one profiled step)")
    parser.add_argument("--out", type=Path, help="also write the report here (after each model)")
    parser.set_defaults(size="default")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "gpu_profile: --device cuda but torch sees no CUDA device\n")
    command = (f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')} python "
               f"tools/bench/gpu_profile.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    jobs = [((m, fmt), lambda m=m, fmt=fmt: measure(m, fmt, args))
            for m in args.models for fmt in args.formats]
    return run_and_report(jobs, lambda results: report(results, args, command), args.out)


if __name__ == "__main__":
    main()
