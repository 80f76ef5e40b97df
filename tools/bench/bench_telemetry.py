"""Benchmark: the cost of in-graph numerics telemetry (``DLSConfig(telemetry=True)``).

TinyGPT (vocab 64, d 128, 2 layers, 2 heads, block 64; ``--small``: d 32), batch 16x64, AdamW,
float16 lowered (native) with a dynamic scale, compiled with inductor by ``dlspass.compile``:
without telemetry, with ``DLSConfig(telemetry=True)`` (the default watch list: amax and the
flushed / subnormal / overflow counts of every gradient; a float8 step would add its matmul
operands, this one has none) and with ``telemetry="all"`` (every lowered op's output too), all
written into a device buffer. Timed in interleaved repeats of ``--steps`` steps (medians), in
wall time and in the process's CPU time: on a shared machine the wall time also counts the
time the step waited for a core, which the CPU time leaves out (one thread: the CPU time is the
step's own work). Goal (issues 24 and 33): the default list / plain <= 1.05.

``--fp16-type bfloat16`` runs the same step in bfloat16 (native; no loss scaling, which
bfloat16 does not need; the telemetry counts the gradients in bfloat16): on a CPU without
float16 GEMM kernels (no AVX512-FP16 / AMX-FP16) a float16 matmul takes a slow path that
makes it most of the step (on the AMD EPYC of RESULTS.md, a [1024, 128] @ [128, 512] matmul:
53 ms in float16, 0.5 ms in bfloat16), which hides the telemetry's cost; bfloat16 keeps the
matmuls fast, so the ratio is the telemetry's.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_telemetry.py [--repeats 7]
[--steps 5] [--small] [--fp16-type bfloat16]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import dlspass
from dlspass.models import TinyGPT, copy_task_batch, gpt_train_step


def _step(d: int, telemetry: bool | str, fp16_type: str = "float16"):
    """The TinyGPT step (`dlspass.models.gpt_train_step`) compiled by ``dlspass.compile``,
    lowered to ``fp16_type`` (native) with its default scaling (float16: a dynamic scale);
    ``telemetry`` is the config's (False: none)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=d, n_layer=2, n_head=2, block_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = dlspass.DLSConfig(fp16_type=fp16_type, telemetry=telemetry)
    return dlspass.compile(gpt_train_step(model, opt), optimizer=opt, config=config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--fp16-type", choices=("float16", "bfloat16"), default="float16")
    args = ap.parse_args()
    d = 32 if args.small else 128
    idx, tgt = copy_task_batch(64, 16, 64, torch.Generator().manual_seed(0))
    load_before = os.getloadavg()
    fmt = args.fp16_type
    steps = {"plain": _step(d, False, fmt), "telemetry (default list)": _step(d, True, fmt),
             "telemetry=\"all\"": _step(d, "all", fmt)}
    compile_s = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        step(idx, tgt)
        compile_s[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step(idx, tgt)
            times[name].append((time.perf_counter() - t0) / args.steps)
            cpu[name].append((time.process_time() - c0) / args.steps)
    watched = {k: len(s.telemetry.read()) for k, s in steps.items() if s.telemetry is not None}
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    scaling = " + DLS" if fmt == "float16" else ""
    print(f"TinyGPT d={d}, {fmt} native{scaling}, inductor, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.repeats} interleaved "
          f"repeats of {args.steps} steps; load average (1, 5, 15 min) before "
          f"{tuple(round(x, 2) for x in load_before)}, after {tuple(round(x, 2) for x in os.getloadavg())}")
    print("| step | watched tensors | wall ms/step | / plain | CPU ms/step | / plain | first call (compile) s |\n"
          "|---|---|---|---|---|---|---|")
    for k in steps:
        print(f"| {k} | {watched.get(k, 0)} | {med[k] * 1e3:.2f} | {med[k] / med['plain']:.3f} | "
              f"{med_cpu[k] * 1e3:.2f} | {med_cpu[k] / med_cpu['plain']:.3f} | {compile_s[k]:.1f} |")
    for clock, m in (("wall", med), ("CPU", med_cpu)):
        ratio = m["telemetry (default list)"] / m["plain"]
        print(f"\n{clock}: default list / plain = {ratio:.3f} (goal <= 1.05: {'met' if ratio <= 1.05 else 'MISS'})")


if __name__ == "__main__":
    main()
