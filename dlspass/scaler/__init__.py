"""The eager scalers: dynamic loss scaling for training loops that call ``optimizer.step()``.

- `eager` — `GradScaler`: cstorch's constructor, torch.amp's methods, no host sync per step;
- `optimizer_step` — how `GradScaler.step` makes an overflowed step a no-op without a host sync;
- `torch_amp` — `TorchGradScaler`: torch.amp.GradScaler's contract, step for step;
- `state_dict` — what a scaler ``state_dict`` holds and the checks a checkpoint passes before
  anything is restored (files are written and read by ``dlspass.checkpoint``);
- `scheduler_hold` — `HeldScheduler` / `hold_scheduler_on_skip`: an LR scheduler that does not
  advance on skipped steps;
- `errors` — `ScalerStateError`, `ScaleFloorError`, `ScaleFloorWarning` and the usage errors.

Both scalers run the policy math of ``dlspass.scale_policy`` and agree over a process group
through ``dlspass.distributed``; this package imports nothing from ``graph``, ``passes`` or
``capture``.
"""

from __future__ import annotations

from dlspass.scaler.eager import GradScaler
from dlspass.scaler.errors import (
    ScaleFloorError,
    ScaleFloorWarning,
    ScalerAssertionError,
    ScalerStateError,
    ScalerUsageError,
)
from dlspass.scaler.scheduler_hold import HeldScheduler, hold_scheduler_on_skip
from dlspass.scaler.torch_amp import TorchGradScaler

__all__ = [
    "GradScaler", "HeldScheduler", "ScaleFloorError", "ScaleFloorWarning", "ScalerAssertionError",
    "ScalerStateError", "ScalerUsageError", "TorchGradScaler", "hold_scheduler_on_skip",
]

