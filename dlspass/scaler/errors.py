"""The scaler's exceptions and its warning, all input errors (`dlspass.errors.DLSInputError`)."""

from __future__ import annotations

from dlspass.errors import DLSInputError


class ScaleFloorWarning(RuntimeWarning):
    """The loss scale keeps hitting ``min_loss_scale`` while gradients still overflow."""


class ScaleFloorError(DLSInputError, RuntimeError):
    """Raised instead of `ScaleFloorWarning` when ``on_scale_floor="raise"``.

    An input error: the model, its data or ``min_loss_scale`` keeps overflowing at the floor,
    not a fault in dlspass."""


class ScalerUsageError(DLSInputError, RuntimeError):
    """A scaler method called out of order (``unscale_`` twice in a step, ``step`` after
    ``step``), with torch.amp's message and builtin type."""


class ScalerAssertionError(DLSInputError, AssertionError):
    """The cases ``torch.amp.GradScaler`` reports with ``AssertionError`` (``TorchGradScaler``
    keeps the type, so code and tests written for torch catch it)."""


class ScalerStateError(DLSInputError, ValueError):
    """A scaler state_dict (or ``update(new_scale)``) holds a value the scaler cannot resume from.

    The message names the key. ``load_state_dict`` checks every entry before it changes
    anything, so after this error the scaler is exactly as it was.
    """
