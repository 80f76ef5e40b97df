"""Benchmark: the whole training step compiled by ``dlspass.compile`` against its baselines.

Anchor model TinyGPT (vocab 64, d 128, 2 layers, 2 heads, block 64), batch 16x64, AdamW.
Configurations, each compiled with inductor, timed in interleaved repeats (medians):

- ``dls``: ``dlspass.compile`` with a dynamic GradScaler, float32 (``mixed_precision=False``);
- ``plain``: the same compiled step without a scaler (goal: dls / plain <= 1.02);
- ``torch``: torch best practice: model compiled with inductor, fused AdamW,
  ``torch.amp.GradScaler`` (goal: dls / torch <= 1.0);
- ``cb16``: ``dls`` with emulated cbfloat16 matmuls (goal: cb16 / dls <= 1.2).

Run: ``.venv/bin/python tools/bench/bench_compile.py [--repeats 15] [--steps 3]``; writes
``tools/bench/results/compile.md`` and prints it.
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
from torch._dynamo.utils import counters

import dlspass
from dlspass.models import TinyGPT, copy_task_batch, gpt_loss

RESULTS = Path(__file__).resolve().parent / "results" / "compile.md"
GOALS = {"plain": ("dls / plain", 1.02), "torch": ("dls / torch", 1.0), "cb16": ("cb16 / dls", 1.2)}


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, d=128, n_layer=2, n_head=2, block_size=64)


def _dlspass_step(scaler: dlspass.GradScaler | None, **kw: object) -> Callable:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = gpt_loss(model, (idx, targets))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return dlspass.compile(train_step, optimizer=opt, scaler=scaler, **kw)


def _torch_step() -> Callable:
    model = _model()
    cmodel = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")

    def train_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = gpt_loss(cmodel, (idx, targets))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return train_step


BUILDERS: dict[str, Callable[[], Callable]] = {
    "dls": lambda: _dlspass_step(dlspass.GradScaler(loss_scale="dynamic"), mixed_precision=False),
    "plain": lambda: _dlspass_step(None, mixed_precision=False),
    "torch": _torch_step,
    "cb16": lambda: _dlspass_step(dlspass.GradScaler(loss_scale="dynamic", fp16_type="cbfloat16")),
}


def _time(step: Callable, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*batch)
    return (time.perf_counter() - t0) / steps


def _cold_cache() -> None:
    """Compile times are cold-cache times: a fresh inductor cache and no FX graph cache."""
    import tempfile

    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dlspass-bench-inductor-")
    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False


def run(repeats: int = 15, steps: int = 3) -> dict[str, dict[str, float]]:
    """Compile each configuration (timing it and counting graph breaks), then time them interleaved."""
    batch = copy_task_batch(64, 16, 64, torch.Generator().manual_seed(0))
    results: dict[str, dict[str, float]] = {}
    fns: dict[str, Callable] = {}
    for name, build in BUILDERS.items():
        torch._dynamo.reset()
        counters.clear()
        step = build()
        t0 = time.perf_counter()
        step(*batch)  # first call compiles
        compile_s = time.perf_counter() - t0
        step(*batch)
        results[name] = {"compile_s": compile_s,
                         "graph_breaks": float(sum(counters["graph_break"].values())),
                         "graphs": float(counters["stats"]["unique_graphs"])}
        fns[name] = step
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, step in fns.items():
            samples[name].append(_time(step, batch, steps))
    for name, vals in samples.items():
        results[name]["median_ms"] = 1e3 * statistics.median(vals)
    return results


def report(results: dict[str, dict[str, float]], command: str, repeats: int, steps: int) -> str:
    """The markdown report (MISS where a goal is not met)."""
    med = {k: v["median_ms"] for k, v in results.items()}
    ratios = {"plain": med["dls"] / med["plain"], "torch": med["dls"] / med["torch"],
              "cb16": med["cb16"] / med["dls"]}
    lines = [
        "# dlspass.compile benchmark", "",
        f"Command: `{command}`", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), {platform.system()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads.", "",
        "Model: TinyGPT(vocab 64, d 128, 2 layers, 2 heads, block 64), batch 16x64, AdamW. "
        f"{repeats} interleaved repeats of {steps} steps; medians.", "",
        "| config | step (ms, median) | compile (s) | graphs | graph breaks |",
        "|---|---|---|---|---|",
    ]
    labels = {"dls": "dlspass.compile, DLS, fp32", "plain": "dlspass.compile, no DLS, fp32",
              "torch": "torch.compile(model) + fused AdamW + torch.amp.GradScaler",
              "cb16": "dlspass.compile, DLS, emulated cbfloat16"}
    for name, r in results.items():
        lines.append(f"| {labels[name]} | {r['median_ms']:.2f} | {r['compile_s']:.1f} | "
                     f"{int(r['graphs'])} | {int(r['graph_breaks'])} |")
    lines += ["", "| ratio | value | goal | status |", "|---|---|---|---|"]
    for key, (label, goal) in GOALS.items():
        status = "ok" if ratios[key] <= goal else "MISS"
        lines.append(f"| {label} | {ratios[key]:.3f} | <= {goal} | {status} |")
    lines += ["", "Notes: the torch baseline has no autocast (fp32 like the dls row); its "
              "graph-break count is over the compiled model only (the scaler and optimizer run "
              "eagerly). Timings on a shared 2-core machine are noisy."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark, write ``tools/bench/results/compile.md`` and return its text."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed sample")
    args = parser.parse_args(argv)
    _cold_cache()
    command = "python tools/bench/bench_compile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(run(args.repeats, args.steps), command.strip(), args.repeats, args.steps)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
