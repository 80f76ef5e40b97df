"""Benchmark: the steady training step on the compatibility matrix's outside models.

For each model of ``tests/models/zoo.py`` (transformers GPT-2, BERT, T5, ViT, ResNet, ConvNeXt;
the matrix's tiny configs, random weights) three steps train the same model from the same
weights on the same batch, float32, AdamW:

- ``eager``: plain eager torch, no scaler;
- ``torch``: torch's best practice: ``torch.compile(model)`` (inductor), fused AdamW,
  ``torch.amp.GradScaler("cpu")`` (scale, unscale, inf check and skip, eagerly);
- ``dls``: ``dlspass.compile`` of the whole step with a dynamic ``dlspass.GradScaler``
  (``mixed_precision=False``: the same float32 math with loss scaling), one inductor graph.

Each step is called once (its first call compiles; the seconds are reported) and then timed in
interleaved repeats (eager, torch, dls, eager, ...), ``--steps`` steps per sample; the table
gives medians and the ratios ``dls / torch`` (goal <= 1.0) and ``dls / eager``.

``--models resnet18`` is a full-size ResNet-18 (not in the matrix: its compiles take minutes);
``--profile`` prints each step's top ops (torch.profiler) after the timings.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_models.py [--models gpt2,resnet]
[--repeats 11] [--steps 5] [--profile] [--no-write]``; writes ``tools/bench/results/models.md``
and prints it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "results" / "models.md"
MODELS = ("gpt2", "bert", "t5", "vit", "resnet", "convnext")
CONFIGS = ("eager", "torch", "dls")
GOAL = 1.0

sys.path[:0] = [str(ROOT / "tests" / "models"), str(HERE)]
import zoo  # noqa: E402  (the matrix's own model factories)
from baselines import torch_best_practice_step  # noqa: E402


def resnet18() -> zoo.Case:
    """ResNet-18's layout (transformers ``ResNetConfig`` defaults with basic blocks: widths
    64-512, depths 2-2-2-2, BatchNorm), 8 images of 64x64, random weights: the full-size model
    behind issue 14's ResNet-18 row, small images to keep a CPU step short."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                       num_labels=10)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g),
             torch.tensor(1.0))
    return zoo.Case(ResNetForImageClassification(cfg).train(), batch, zoo._image_loss)


FACTORIES: dict[str, Callable[[], zoo.Case]] = {**{m: getattr(zoo, m) for m in MODELS},
                                                "resnet18": resnet18}


def _step(model_name: str, config: str) -> Callable[[], torch.Tensor]:
    """One training step of ``config`` on a fresh copy of the model (CPU: no sync needed)."""
    import dlspass

    case = FACTORIES[model_name]()
    model, batch, loss_fn = case.model, case.batch, case.loss_fn
    if config == "torch":
        step = torch_best_practice_step(model, lambda m, *b: loss_fn(m, b), lr=1e-4)
        return lambda: step(*batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(*b: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if config == "eager":
        return lambda: train_step(*batch)
    scaler = dlspass.GradScaler(loss_scale="dynamic", fp16_type="float16")
    step = dlspass.compile(train_step, optimizer=opt, scaler=scaler, mixed_precision=False)
    return lambda: step(*batch)


def _profile(step: Callable[[], torch.Tensor], steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)


def run(models: tuple[str, ...], repeats: int, steps: int,
        profile: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in models:
        # each model's steps are new closures of the same code objects: without a reset, dynamo's
        # per-code recompile limit (8) would be shared by all the models of the run
        torch._dynamo.reset()
        built = {c: _step(name, c) for c in CONFIGS}
        first: dict[str, float] = {}
        for c, step in built.items():
            t0 = time.perf_counter()
            step()
            first[c] = time.perf_counter() - t0
            step()  # a second call: any recompile shows here, not in the samples
        samples: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for _ in range(repeats):
            for c, step in built.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                samples[c].append((time.perf_counter() - t0) / steps)
        out[name] = {c: {"first_call_s": first[c], "step_ms": 1e3 * statistics.median(samples[c])}
                     for c in CONFIGS}
        if profile:
            for c, step in built.items():
                print(f"## {name} / {c}: top ops by self CPU time over {steps} steps\n"
                      f"```\n{_profile(step, steps)}\n```", flush=True)
        print(name, {c: round(v["step_ms"], 3) for c, v in out[name].items()}, flush=True)
    return out


def report(results: dict[str, dict[str, dict[str, float]]], command: str, repeats: int,
           steps: int) -> str:
    import transformers

    lines = [
        "# Steady step on the compatibility matrix's models (issue 14)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {torch.get_num_threads()} intra-op thread(s). "
        f"Medians of {repeats} interleaved samples of {steps} steps each; first calls compile "
        "(inductor, from an empty cache; the image models' second call compiles again, as "
        "transformers sets `config.problem_type` at the first).",
        "",
        "| model | eager (ms) | torch best practice (ms) | dlspass.compile + DLS (ms) | dls / torch | "
        "dls / eager | goal dls / torch <= 1.0 | first call: torch / dls (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        e, t, d = (r[c]["step_ms"] for c in CONFIGS)
        lines.append(f"| {name} | {e:.2f} | {t:.2f} | {d:.2f} | {d / t:.2f} | {d / e:.2f} | "
                     f"{'met' if d / t <= GOAL else 'MISS'} | "
                     f"{r['torch']['first_call_s']:.1f} / {r['dls']['first_call_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed sample")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also print each step's top ops (torch.profiler) after its timings")
    args = ap.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    unknown = [m for m in models if m not in FACTORIES]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(FACTORIES)}")
    torch.set_num_threads(1)
    # a cold inductor cache, so that the first calls are compiles (read before inductor's first use)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dlspass-bench-models-")
    given = " ".join(argv if argv is not None else sys.argv[1:])
    command = f"OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_models.py {given}".strip()
    text = report(run(models, args.repeats, args.steps, args.profile), command, args.repeats, args.steps)
    if not args.no_write:
        RESULTS.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
