"""A small deterministic training run that checkpoints and resumes (used by tests/test_resume.py).

MLP + Adam + StepLR held on skipped steps + dlspass.GradScaler, CPU, fixed seeds, one thread.
Batches come from the global torch RNG (so resuming must restore it) and every 7th step
overflows on purpose (so the scaler state and the held scheduler matter). On start the run
resumes from the newest readable checkpoint in ``--ckpt-dir``; it saves one every ``--every``
steps and prints ``step N`` after each step. The final state goes to ``--out``.

    python tools/reliability/resume_worker.py --ckpt-dir /tmp/ck --steps 60 --every 5 --out f.pt
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import dlspass
from dlspass.checkpoint import checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
from dlspass.models import MLP, mse_loss


def build() -> tuple:
    torch.manual_seed(0)
    random.seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dlspass.GradScaler(steps_per_increase=3)
    sched = dlspass.hold_scheduler_on_skip(torch.optim.lr_scheduler.StepLR(opt, 10, 0.5), scaler)
    return model, opt, sched, scaler


def train(ckpt_dir: str, steps: int, every: int, out: str, sleep: float = 0.0,
          echo: bool = True) -> None:
    """Run (or resume) the training and write the final state to ``out``."""
    torch.set_num_threads(1)
    model, opt, sched, scaler = build()
    start = 0
    last = latest_checkpoint(ckpt_dir)
    if last is not None:
        start = load_checkpoint(last, model, opt, sched, scaler)
        if echo:
            print(f"resumed from step {start}", flush=True)
    for k in range(start, steps):
        x = torch.randn(8, 8)
        y = torch.randn(8, 4) + random.random()
        opt.zero_grad(set_to_none=True)
        loss = mse_loss(model, (x, y))
        if k % 7 == 3:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        if (k + 1) % every == 0:
            save_checkpoint(checkpoint_path(ckpt_dir, k + 1), model, opt, sched, scaler, k + 1)
        if echo:
            print(f"step {k + 1}", flush=True)
        if sleep:
            time.sleep(sleep)
    save_checkpoint(out, model, opt, sched, scaler, steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    a = ap.parse_args(argv)
    train(a.ckpt_dir, a.steps, a.every, a.out, a.sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
