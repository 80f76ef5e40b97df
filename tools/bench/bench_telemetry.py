"""Benchmark: the cost of in-graph numerics telemetry (``DLSConfig(telemetry=True)``).

TinyGPT (vocab 64, d 128, 2 layers, 2 heads, block 64; ``--small``: d 32), batch 16x64, AdamW,
float16 lowered (native) with a dynamic scale, compiled with inductor by ``dlspass.compile``,
with and without ``DLSConfig(telemetry=True)`` (amax and the flushed / subnormal / overflow
counts of every gradient and lowered op output, written into a device buffer).
Timed in interleaved repeats of ``--steps`` steps (medians). Goal (issue 24): telemetry / plain
<= 1.05.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_telemetry.py [--repeats 7]
[--steps 5] [--small]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import dlspass
from dlspass.models import TinyGPT, copy_task_batch, gpt_train_step


def _step(d: int, telemetry: bool):
    """The TinyGPT step (`dlspass.models.gpt_train_step`) compiled by ``dlspass.compile``,
    float16 lowered with a dynamic scale; with ``telemetry`` the config asks for it."""
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
    steps = {"plain": _step(d, False), "telemetry": _step(d, True)}
    compile_s = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        step(idx, tgt)
        compile_s[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(idx, tgt)
            times[name].append((time.perf_counter() - t0) / args.steps)
    rows = steps["telemetry"].telemetry.read()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"TinyGPT d={d}, float16 + DLS, inductor, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(rows)} watched tensors")
    print("| step | median ms/step | first call (compile) s |\n|---|---|---|")
    for k in steps:
        print(f"| {k} | {med[k] * 1e3:.2f} | {compile_s[k]:.1f} |")
    print(f"\ntelemetry / plain = {med['telemetry'] / med['plain']:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
