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

Run: ``OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_telemetry.py [--repeats 7]
[--steps 5] [--small]``; prints a Markdown table.
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


def _step(d: int, telemetry: bool | str):
    """The TinyGPT step (`dlspass.models.gpt_train_step`) compiled by ``dlspass.compile``,
    float16 lowered with a dynamic scale; ``telemetry`` is the config's (False: none)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=d, n_layer=2, n_head=2, block_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = dlspass.DLSConfig(fp16_type="float16", telemetry=telemetry)
    return dlspass.compile(gpt_train_step(model, opt), optimizer=opt, config=config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    d = 32 if args.small else 128
    idx, tgt = copy_task_batch(64, 16, 64, torch.Generator().manual_seed(0))
    load_before = os.getloadavg()
    steps = {"plain": _step(d, False), "telemetry (default list)": _step(d, True),
             "telemetry=\"all\"": _step(d, "all")}
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
    print(f"TinyGPT d={d}, float16 + DLS, inductor, {platform.processor() or platform.machine()}, "
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
