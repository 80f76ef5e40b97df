"""Captured-step (graph run eagerly, no inductor) costs on the anchor model.

Usage: ``.venv/bin/python tools/bench/bench_capture.py``

Rows, all medians of interleaved repeats in one process: the captured DLS step (fp32) against
the same captured step without DLS; emulated cbfloat16 against fp32; the captured DLS step
against an eager loop with torch.amp.GradScaler; host syncs per step (calls of ``.item()`` and
friends on tensors, counted by patching them) and the capture + pass time.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dlspass
from dlspass.models import TinyGPT, copy_task_batch

REPEATS = 15
VOCAB, D, LAYERS, HEADS, BATCH, SEQ = 256, 128, 2, 4, 16, 64


def loss_fn(model, batch):
    idx, tgt = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def _setup(config):
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d=D, n_layer=LAYERS, n_head=HEADS, block_size=SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = copy_task_batch(VOCAB, BATCH, SEQ, torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    step = dlspass.capture_step(model, loss_fn, opt, batch, config=config)
    return step, batch, time.perf_counter() - t0


def _eager_amp():
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d=D, n_layer=LAYERS, n_head=HEADS, block_size=SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    batch = copy_task_batch(VOCAB, BATCH, SEQ, torch.Generator().manual_seed(0))

    def run():
        loss = loss_fn(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    return run


class SyncCounter:
    """Counts host reads of tensor values (the calls that synchronise a GPU)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.count = 0
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for n, fn in self.saved.items():
            def wrapped(t, *a, _fn=fn, **k):
                self.count += 1
                return _fn(t, *a, **k)
            setattr(torch.Tensor, n, wrapped)
        return self

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(torch.Tensor, n, fn)


def main() -> str:
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    configs = {
        "no_dls": dlspass.DLSConfig(loss_scale=None, mixed_precision=False),
        "dls_fp32": dlspass.DLSConfig(mixed_precision=False),
        "dls_cb16": dlspass.DLSConfig(fp16_type="cbfloat16"),
    }
    steps, capture_s = {}, {}
    for name, cfg in configs.items():
        step, batch, secs = _setup(cfg)
        steps[name] = (step, batch)
        capture_s[name] = secs
    amp = _eager_amp()
    runners = {name: (lambda s=s, b=b: s(b)) for name, (s, b) in steps.items()}
    runners["torch_amp_eager"] = amp
    for fn in runners.values():  # warm-up
        fn()
    times = {k: [] for k in runners}
    for _ in range(REPEATS):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    syncs = {}
    for name, fn in runners.items():
        with SyncCounter() as c:
            fn()
        syncs[name] = c.count
    r_dls = med["dls_fp32"] / med["no_dls"]
    r_cb = med["dls_cb16"] / med["dls_fp32"]
    r_amp = med["dls_fp32"] / med["torch_amp_eager"]
    cmd = "`.venv/bin/python tools/bench/bench_capture.py`"
    lines = [
        "## Captured step run eagerly (FX graph, no inductor)",
        "",
        f"Command: {cmd}. Model: TinyGPT vocab {VOCAB}, d={D}, {LAYERS} layers, {HEADS} heads, "
        f"batch {BATCH}x{SEQ}, AdamW. {REPEATS} interleaved repeats, medians. Machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.",
        "",
        "| measure | value | goal | met |",
        "|---|---|---|---|",
        f"| captured DLS step / captured step without DLS (fp32) | {r_dls:.3f} | <= 1.02 (compiled goal; "
        f"eager informational) | {'yes' if r_dls <= 1.02 else 'MISS'} |",
        f"| emulated cbfloat16 / fp32 (captured, eager kernels) | {r_cb:.3f} | <= 1.2 (compiled goal) | "
        f"{'yes' if r_cb <= 1.2 else 'MISS'} |",
        f"| captured DLS step / eager loop with torch.amp.GradScaler | {r_amp:.3f} | informational | - |",
        f"| host syncs per step: captured DLS / torch.amp eager | {syncs['dls_fp32']} / "
        f"{syncs['torch_amp_eager']} | 0 for dlspass | {'yes' if syncs['dls_fp32'] == 0 else 'MISS'} |",
        f"| capture + passes time (s): no DLS / DLS fp32 / DLS cbfloat16 | "
        f"{capture_s['no_dls']:.2f} / {capture_s['dls_fp32']:.2f} / {capture_s['dls_cb16']:.2f} | "
        "informational | - |",
        "",
        "Median step times (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in med.items()) + ".",
    ]
    md = "\n".join(lines) + "\n"
    out = Path(__file__).resolve().parent / "results" / "capture.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(md)
    print(md)
    return md


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
