"""Benchmark: apply_dls run time against graph size (TinyGPT, 2..48 layers; capture excluded).

Run: ``.venv/bin/python tools/bench/bench_pass_time.py`` (writes
``tools/bench/results/pass_time.md``). The per-node time staying flat as the graph grows is
the evidence that the pipeline, verifier included, is linear in the graph size.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch

from dlspass.config import DLSConfig
from dlspass.models import TinyGPT, gpt_loss

RESULTS = Path(__file__).parent / "results" / "pass_time.md"
LAYERS = (2, 8, 16, 32, 48)


def _capture(n_layer: int, config: DLSConfig):
    """The un-rewritten step graph (Adam) of a TinyGPT with ``n_layer`` blocks."""
    from dlspass.capture.functional import trace_step

    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d=16, n_layer=n_layer, n_head=2, block_size=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 32, (2, 8))
    gm, _, _ = trace_step(model, gpt_loss, opt, (idx, torch.roll(idx, 1, 1)), config)
    return gm


def measure(layers: tuple[int, ...] = LAYERS, config: DLSConfig | None = None) -> list[dict]:
    """One row per size: nodes before/after and the apply_dls wall time (seconds)."""
    from dlspass.passes import apply_dls

    config = config or DLSConfig(max_gradient_norm=1.0)
    rows = []
    for n in layers:
        gm = _capture(n, config)
        before = len(gm.graph.nodes)
        t0, c0 = time.perf_counter(), time.process_time()
        gm = apply_dls(gm, config)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append({"layers": n, "nodes_in": before, "nodes_out": len(gm.graph.nodes),
                     "seconds": dt, "cpu": cpu})
        print(f"{n:3d} layers  {before:6d} -> {len(gm.graph.nodes):6d} nodes  {dt:7.3f} s "
              f"(cpu {cpu:.3f} s)", file=sys.stderr)
    return rows


def render(rows: list[dict], config: DLSConfig) -> str:
    """The results as a markdown page (command, machine, table)."""
    lines = [
        "# apply_dls run time vs graph size",
        "",
        "Command: `.venv/bin/python tools/bench/bench_pass_time.py`",
        "",
        f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPU cores (shared with other jobs), Python {platform.python_version()}, "
        f"torch {torch.__version__}.",
        "",
        f"Model: TinyGPT(vocab=32, d=16, n_head=2, block_size=8) + Adam, captured with "
        f"`dlspass.capture.functional.trace_step` (capture time excluded). Config: "
        f"`{config.to_dict()}` (float16 emulation, dynamic scaling, clipping; all six passes and "
        "the verifier run). One run per size. The machine is shared, so wall time is noisy; "
        "process CPU time is the steadier measure and the per-node column uses it.",
        "",
        "| layers | nodes in | nodes out | apply_dls wall (s) | apply_dls CPU (s) | CPU µs / node in |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['nodes_in']} | {r['nodes_out']} | {r['seconds']:.3f} | "
                     f"{r['cpu']:.3f} | {1e6 * r['cpu'] / r['nodes_in']:.1f} |")
    first, last = rows[0], rows[-1]
    growth = (last["cpu"] / first["cpu"]) / (last["nodes_in"] / first["nodes_in"])
    lines += ["", f"CPU time grew {last['cpu'] / first['cpu']:.1f}x for "
              f"{last['nodes_in'] / first['nodes_in']:.1f}x the nodes (ratio {growth:.2f}; "
              "1.0 is exactly linear, values below 1 are fixed per-call costs being amortised).", ""]
    return "\n".join(lines)


def main(layers: tuple[int, ...] = LAYERS) -> str:
    """Measure, write ``tools/bench/results/pass_time.md`` and return its text."""
    config = DLSConfig(max_gradient_norm=1.0)
    text = render(measure(layers, config), config)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    return text


if __name__ == "__main__":
    print(main())
