"""Training parity of float8 (issue 33): do the GPT, GPT-2 and ViT of the compatibility matrix
train in float8 tensorwise as they do in bfloat16?

For each model (``tests/models/zoo.py``: ``mhagpt``, dlspass's GPT on ``nn.MultiheadAttention``;
``gpt2``, transformers' ``GPT2LMHeadModel``; ``vit``, transformers' ``ViTForImageClassification``)
and each seed, the same initial weights train ``--steps`` AdamW steps on the case's fixed batch:

- ``bfloat16``: ``dlspass.capture_step``, native bfloat16 (``DLSConfig(fp16_type="bfloat16")``);
- ``float8 capture_step`` and ``float8 dlspass.compile``: the same with ``float8="tensorwise"``
  (every matmul of the step, forward and backward, in float8 with ``torch._scaled_mm``;
  ``dlspass.compile`` with ``backend_compiler="eager"``: every dlspass rewrite, no inductor code
  generation, to keep the CPU time modest).

A seed re-draws every module's weights with torch's default initialisation
(``reset_parameters``, seeded); the batch stays the case's. The verdict is per model and entry
point: **within spread** when at every step each seed's float8 loss is closer to the bfloat16
loss of the same seed than the bfloat16 losses of the seeds are to each other (the largest
minus the smallest), i.e. float8 moves a run by less than the choice of seed does; else
**MISS**, with the step and the numbers. Writes ``float8_parity.json`` (every loss), the
figure ``figures/float8_parity.svg`` (the project's inline-SVG charts,
``dlspass.debug.svg_plot``) and prints the markdown table for tools/bench/RESULTS.md::

    OMP_NUM_THREADS=2 .venv/bin/python tools/study/float8_parity.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

import dlspass
from dlspass.debug.svg_plot import line_chart

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))
import zoo  # noqa: E402  (the matrix's own model factories)

MODELS = ("mhagpt", "gpt2", "vit")
RUNS = ("bfloat16", "float8 capture_step", "float8 dlspass.compile")


def spread_verdict(bf16: Sequence[Sequence[float]], f8: Sequence[Sequence[float]]) -> dict:
    """``bf16[s][t]``, ``f8[s][t]``: the loss of seed ``s`` at step ``t``. Per step, the
    float8 deviation (the largest ``|f8[s][t] - bf16[s][t]|`` over the seeds) against the
    bfloat16 seed spread (``max_s bf16[s][t] - min_s bf16[s][t]``); ``within`` when the
    deviation is at most the spread at every step, with the worst step (largest ratio)."""
    if len(bf16) != len(f8) or len(bf16) < 2:
        raise ValueError("one float8 run per bfloat16 seed, and at least 2 seeds for a spread")
    steps = len(bf16[0])
    dev = [max(abs(f[t] - b[t]) for b, f in zip(bf16, f8, strict=True)) for t in range(steps)]
    spread = [max(b[t] for b in bf16) - min(b[t] for b in bf16) for t in range(steps)]
    ratios = [d / s if s > 0 else (0.0 if d == 0 else float("inf")) for d, s in zip(dev, spread, strict=True)]
    worst = max(range(steps), key=ratios.__getitem__)
    return {"within": all(d <= s for d, s in zip(dev, spread, strict=True)), "deviation": dev,
            "spread": spread, "worst_step": worst, "worst_ratio": ratios[worst]}


def _case(name: str, seed: int) -> zoo.Case:
    case = getattr(zoo, name)()
    torch.manual_seed(seed)
    for m in case.model.modules():
        if hasattr(m, "reset_parameters") and m is not case.model:
            m.reset_parameters()
    return case


def _train(name: str, seed: int, run: str, steps: int, lr: float) -> list[float]:
    case = _case(name, seed)
    model = case.model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    config = dlspass.DLSConfig(fp16_type="bfloat16", float8=None if run == "bfloat16" else "tensorwise")
    if run == "float8 dlspass.compile":
        def train_step(*batch: Tensor) -> Tensor:
            loss = case.loss_fn(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        torch._dynamo.reset()  # each run compiles its own step, as a fresh process would
        compiled = dlspass.compile(train_step, optimizer=opt, config=config, backend_compiler="eager")
        step: Callable[[], Tensor] = lambda: compiled(*case.batch)  # noqa: E731
    else:
        captured = dlspass.capture_step(model, case.loss_fn, opt, case.batch, config=config)
        step = lambda: captured(case.batch)  # noqa: E731
    return [float(step()) for _ in range(steps)]


def run(steps: int, seeds: int, lr: float, models: Sequence[str] = MODELS) -> dict:
    losses: dict[str, dict[str, list[list[float]]]] = {}
    seconds: dict[str, dict[str, float]] = {}
    for name in models:
        losses[name], seconds[name] = {}, {}
        for r in RUNS:
            t0 = time.perf_counter()
            losses[name][r] = [_train(name, s, r, steps, lr) for s in range(seeds)]
            seconds[name][r] = round(time.perf_counter() - t0, 1)
            print(f"{name} {r}: {seconds[name][r]} s", flush=True)
    verdicts = {name: {r: spread_verdict(losses[name]["bfloat16"], losses[name][r]) for r in RUNS[1:]}
                for name in models}
    return {"steps": steps, "seeds": seeds, "lr": lr, "losses": losses, "seconds": seconds, "verdicts": verdicts}


def table(res: dict) -> str:
    rows = ["| model | entry point | verdict | worst step: float8 deviation / bfloat16 seed spread "
            "| final loss bfloat16 (seeds) | final loss float8 (seeds) |", "|---|---|---|---|---|---|"]
    for name, per in res["verdicts"].items():
        bf = res["losses"][name]["bfloat16"]
        for r, v in per.items():
            t = v["worst_step"]
            f8 = res["losses"][name][r]
            rows.append(
                f"| {name} | `{r.split()[1]}` | {'within spread' if v['within'] else 'MISS'} "
                f"| step {t}: {v['deviation'][t]:.4f} / {v['spread'][t]:.4f} ({v['worst_ratio']:.2f}) "
                f"| {', '.join(f'{b[-1]:.3f}' for b in bf)} | {', '.join(f'{f[-1]:.3f}' for f in f8)} |")
    return "\n".join(rows)


def figure(res: dict) -> str:
    """One SVG page: per model, the loss curves (bfloat16's seed band, float8's seed means) and
    the per-step float8 deviation against the bfloat16 seed spread."""
    parts = []
    for name, runs in res["losses"].items():
        bf = runs["bfloat16"]

        def mean(curves: list[list[float]]) -> list[float]:
            return [sum(c) / len(c) for c in zip(*curves, strict=True)]

        parts.append(line_chart(
            f"{name}: loss, bfloat16 seed min and max, float8 tensorwise mean of {len(bf)} seeds",
            {"bfloat16 min": [min(c) for c in zip(*bf, strict=True)],
             "bfloat16 max": [max(c) for c in zip(*bf, strict=True)],
             "float8 capture_step": mean(runs["float8 capture_step"]),
             "float8 compile": mean(runs["float8 dlspass.compile"])}, y_label="loss", first_x=0))
        v = res["verdicts"][name]
        parts.append(line_chart(
            f"{name}: float8 deviation from the same seed's bfloat16 loss against the bfloat16 seed spread",
            {"bfloat16 seed spread": v["float8 capture_step"]["spread"],
             "float8 capture_step": v["float8 capture_step"]["deviation"],
             "float8 compile": v["float8 dlspass.compile"]["deviation"]}, y_label="|loss difference|", first_x=0))
    body = "".join(f"<g transform='translate(0,{300 * i + 20})'>{_inner(p, i)}</g>" for i, p in enumerate(parts))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='680' height='{300 * len(parts) + 20}' "
            f"font-family='sans-serif'><rect width='100%' height='100%' fill='white'/>{body}</svg>\n")


def _inner(figure_html: str, i: int) -> str:
    """A `line_chart` figure as SVG elements: its caption as a text line above its chart."""
    caption = figure_html.split("<figcaption>", 1)[1].split("</figcaption>", 1)[0]
    svg = figure_html.split("<svg", 1)[1].split(">", 1)[1].rsplit("</svg>", 1)[0]
    return f"<text x='8' y='0' font-size='12' font-weight='bold'>{caption}</text><g transform='translate(0,6)'>{svg}</g>"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, default=HERE / "float8_parity.json")
    p.add_argument("--figure", type=Path, default=HERE / "figures" / "float8_parity.svg")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*bfloat16.*")  # the scaler's "no scaling needed"
    t0 = time.perf_counter()
    res = run(args.steps, args.seeds, args.lr)
    res["command"] = "OMP_NUM_THREADS=2 .venv/bin/python tools/study/float8_parity.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    res["machine"] = (f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
                      f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    res["total_seconds"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    args.figure.write_text(figure(res))
    print(table(res))
    return res


if __name__ == "__main__":
    main()
