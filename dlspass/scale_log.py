"""Loss-scale logging without a host sync per step: what Model Zoo's ``log_loss_scale`` promises.

`ScaleLogger` is called once per training step, after the scaler's update: the dlspass scalers
call it at the end of ``update()`` and, for ``capture_step`` and ``dlspass.compile``, after the
graph ran (``GradScaler.record_compiled_step``) once ``GradScaler.log_scale`` switched it on
(the config's ``log_loss_scale``, or a ``summary_writer``). On an ordinary step it only keeps, on the scaler's device, a copy of the
scale and of the step's overflow flag (two device copies, no read). Every ``every`` steps it
reads what it kept in one transfer and writes:

- to Python logging (logger ``dlspass.scale_log`` unless one is given): one INFO line with the
  scale, the skipped-step count and the steps skipped since the last line;
- to a ``torch.utils.tensorboard.SummaryWriter`` when given: the scalars ``loss_scale`` (every
  step of the window, so the trajectory is complete), ``skipped_steps`` (the scaler's count) and
  ``skipped`` (1 at a skipped step, 0 otherwise), and the overflow localisation as text.

Overflow localisation is costly (it re-runs a step), so it runs only where the caller passes a
``localize`` callable (e.g. ``lambda: dlspass.debug.localize.nonfinite_grads(model)``), and only
on a logging step whose window saw a skipped step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from dlspass.config import DLSConfig
from dlspass.errors import InputValueError

__all__ = ["DEFAULT_LOG_STEPS", "ScaleLogError", "ScaleLogger", "ScaleRecord", "ScalerLike", "log_steps"]

DEFAULT_LOG_STEPS = 100
"""How often the scale is logged when the config does not say (Model Zoo's ``log_steps``)."""

log = logging.getLogger(__name__)


def log_steps(config: DLSConfig | None) -> int:
    """The logging interval of ``config``: Model Zoo's ``log_steps`` (``runconfig.log_steps``
    or ``trainer.init.logging.log_steps``, kept in ``config.extras``), else `DEFAULT_LOG_STEPS`."""
    every = None if config is None else config.extras.get("log_steps")
    return DEFAULT_LOG_STEPS if every is None else every


class ScaleLogError(InputValueError):
    """A bad ``ScaleLogger`` argument (a logging interval below 1, a scaler without state)."""


class ScalerLike(Protocol):
    """What the logger reads: the dlspass scalers and the scaler of a captured or compiled step."""

    def get_scale_tensor(self) -> Tensor: ...

    def get_num_skipped_steps(self) -> Tensor: ...

    @property
    def found_inf(self) -> Tensor: ...


@dataclass
class ScaleRecord:
    """What one logging step read: the window's steps, their scales and overflow flags."""

    step: int
    scale: float
    skipped_steps: int
    steps: list[int] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    overflow: Any = None  # what ``localize`` returned, when it ran

    @property
    def skipped_in_window(self) -> list[int]:
        """The steps of this window that were skipped."""
        return [s for s, k in zip(self.steps, self.skipped, strict=True) if k]


class ScaleLogger:
    """Log ``scaler``'s scale and skipped steps every ``every`` calls of `step`.

    ``writer``: a ``SummaryWriter`` (or anything with ``add_scalar``/``add_text``/``flush``);
    ``logger``: a ``logging.Logger``; ``localize``: called on a logging step whose window has a
    skipped step, its result logged. ``first_step`` numbers the first call (TensorBoard's
    ``global_step``).
    """

    def __init__(self, scaler: ScalerLike, every: int = DEFAULT_LOG_STEPS, *, writer: Any = None,
                 logger: logging.Logger | None = None,
                 localize: Callable[[], Any] | None = None, first_step: int = 1) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ScaleLogError(f"every: expected a positive int, got {every!r}")
        missing = [a for a in ("get_scale_tensor", "get_num_skipped_steps", "found_inf")
                   if not hasattr(scaler, a)]
        if missing:
            raise ScaleLogError(f"scaler: {type(scaler).__name__} has no {', '.join(missing)} "
                                "(expected a dlspass scaler)")
        self.scaler = scaler
        self.every = every
        self.writer = writer
        self.logger = logger or log
        self.localize = localize
        self.next_step = first_step
        self.records: list[ScaleRecord] = []
        self._pending: list[tuple[int, Tensor, Tensor]] = []

    def step(self) -> ScaleRecord | None:
        """Record this step (device copies only); on every ``every``-th call, read and log."""
        step = self.next_step
        self.next_step += 1
        scale = self.scaler.get_scale_tensor().detach().clone()
        flag = self.scaler.found_inf.detach().clone()
        self._pending.append((step, scale, flag))
        if len(self._pending) < self.every:
            return None
        return self.flush()

    def flush(self) -> ScaleRecord | None:
        """Read and log what the steps since the last logging step kept (None when nothing)."""
        if not self._pending:
            return None
        steps = [s for s, _, _ in self._pending]
        scales_t = torch.stack([sc.to(torch.float64) for _, sc, _ in self._pending])
        flags_t = torch.stack([f.to(torch.float64) for _, _, f in self._pending])
        count = self.scaler.get_num_skipped_steps().detach().to(torch.float64, copy=True)
        # one transfer: every value of the window and the count, read together
        packed = torch.cat([scales_t, flags_t, count.reshape(1).to(scales_t.device)]).tolist()
        self._pending.clear()
        n = len(steps)
        record = ScaleRecord(step=steps[-1], scale=packed[n - 1], skipped_steps=int(packed[-1]),
                             steps=steps, scales=packed[:n], skipped=[v != 0 for v in packed[n:2 * n]])
        if record.skipped_in_window and self.localize is not None:
            record.overflow = self.localize()
        self._write(record)
        self.records.append(record)
        return record

    def _write(self, r: ScaleRecord) -> None:
        skipped = r.skipped_in_window
        self.logger.info("step %d: loss scale %g, %d skipped steps (%s in the last %d steps)%s",
                         r.step, r.scale, r.skipped_steps,
                         ", ".join(map(str, skipped)) if skipped else "none", len(r.steps),
                         "" if r.overflow is None else f"; overflow: {_text(r.overflow)}")
        if self.writer is None:
            return
        for s, sc, k in zip(r.steps, r.scales, r.skipped, strict=True):
            self.writer.add_scalar("loss_scale", sc, global_step=s)
            self.writer.add_scalar("skipped", float(k), global_step=s)
        self.writer.add_scalar("skipped_steps", float(r.skipped_steps), global_step=r.step)
        if r.overflow is not None:
            self.writer.add_text("overflow", _text(r.overflow), global_step=r.step)
        self.writer.flush()


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Iterable):
        return ", ".join(map(str, value))
    return str(value)
