"""An LR scheduler that holds its position on the steps a scaler skipped (Cerebras semantics)."""

from __future__ import annotations

from typing import Any

from dlspass.scaler.eager import GradScaler


class HeldScheduler:
    """An LR scheduler that holds its position on skipped steps (Cerebras semantics).

    ``step()`` reads the scaler's per-optimizer "stepped" flag of the last finished iteration
    (one host read, here and nowhere else) and forwards to the wrapped scheduler only when the
    optimizer really stepped, so torch's "lr_scheduler.step() before optimizer.step()" warning
    cannot fire. Call it after ``scaler.update()``. Other attributes forward to the scheduler.
    """

    def __init__(self, scheduler: Any, scaler: GradScaler) -> None:
        self.scheduler = scheduler
        self.scaler = scaler
        self.held_steps = 0

    def step(self, *args: Any, **kwargs: Any) -> bool:
        """Advance the scheduler if its optimizer stepped; returns whether it advanced."""
        flag = self.scaler.stepped(self.scheduler.optimizer)
        if flag is None or not bool(flag):
            self.held_steps += 1
            return False
        self.scheduler.step(*args, **kwargs)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


def hold_scheduler_on_skip(scheduler: Any, scaler: GradScaler) -> HeldScheduler:
    """Wrap ``scheduler`` so that it does not advance on steps ``scaler`` skipped."""
    return HeldScheduler(scheduler, scaler)
