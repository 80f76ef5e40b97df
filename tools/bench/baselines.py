"""The baseline every compile benchmark compares with: torch's best practice for a scaled step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

K = TypeVar("K")
R = TypeVar("R")


def torch_best_practice_step(model: nn.Module, loss_of: Callable[..., Tensor],
                             optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                             device: str = "cpu", autocast_dtype: torch.dtype | None = None,
                             scale: bool = True, backend: str = "inductor",
                             backend_options: dict[str, Any] | None = None, scaler: Any = None,
                             **opt_kwargs: object) -> Callable[..., Tensor]:
    """``step(*batch)``: ``torch.compile(model)`` (inductor), a fused ``optimizer`` and
    ``torch.amp.GradScaler`` (scale, unscale, inf check and skip, run eagerly), float32.

    ``loss_of(compiled_model, *batch)`` is the loss the backward starts from; the step returns
    it detached. ``autocast_dtype`` runs the forward under ``torch.autocast`` (torch's
    mixed-precision recipe); ``scale=False`` drops the GradScaler (bfloat16 needs none).
    ``backend``, ``backend_options`` and ``scaler`` (an object with GradScaler's ``scale``,
    ``step`` and ``update``, in place of torch's) build the same step around another compiler
    backend, e.g. ``backend="dlspass"`` with ``dlspass.GradScaler``.
    """
    cmodel = torch.compile(model, backend=backend, options=backend_options)
    opt = optimizer(model.parameters(), fused=True, **opt_kwargs)
    scaler = scaler if scaler is not None else torch.amp.GradScaler(device, enabled=scale)

    def step(*batch: Tensor) -> Tensor:
        with torch.autocast(device, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            loss = loss_of(cmodel, *batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def whole_step(model: nn.Module, loss_of: Callable[..., Tensor],
               optimizer: torch.optim.Optimizer) -> Callable[..., Tensor]:
    """``train_step(*batch)``: forward, backward, ``optimizer.step()`` and ``zero_grad()``, as a
    user writes the step ``dlspass.compile`` compiles whole; returns the detached loss."""

    def train_step(*batch: Tensor) -> Tensor:
        loss = loss_of(model, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


def run_and_report(jobs: Iterable[tuple[K, Callable[[], R]]], report: Callable[[dict[K, R]], str],
                   out: Path | None) -> str:
    """Run each ``(key, job)`` in order and return the report of all their results, printed.

    The report is rewritten (to ``out``, when given) after each job, so a run that a time
    budget cuts off (``tools/bench/gpu_check.sh``) keeps the rows of the jobs that finished.
    """
    results: dict[K, R] = {}
    text = ""
    for key, job in jobs:
        results[key] = job()
        text = report(results)
        if out:
            out.write_text(text + "\n")
    print(text)
    return text
