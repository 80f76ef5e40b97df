"""The scaler's exceptions and its warning, all input errors (`dlspass.errors.DLSInputError`)."""

from __future__ import annotations

from dlspass.errors import InputAssertionError, InputRuntimeError, InputValueError


class ScaleFloorWarning(RuntimeWarning):
    """The loss scale keeps hitting ``min_loss_scale`` while gradients still overflow."""


class ScaleFloorError(InputRuntimeError):
    """Raised instead of `ScaleFloorWarning` when ``on_scale_floor="raise"``.

    An input error: the model, its data or ``min_loss_scale`` keeps overflowing at the floor,
    not a fault in dlspass."""


# a scaler method called out of order (``unscale_`` twice in a step, ``step`` after ``step``),
# with torch.amp's message and builtin type
ScalerUsageError = InputRuntimeError


# the cases ``torch.amp.GradScaler`` reports with ``AssertionError`` (``TorchGradScaler`` keeps
# the type, so code and tests written for torch catch it)
ScalerAssertionError = InputAssertionError


class ScalerStateError(InputValueError):
    """A scaler state_dict (or ``update(new_scale)``) holds a value the scaler cannot resume from.

    The message names the key. ``load_state_dict`` checks every entry before it changes
    anything, so after this error the scaler is exactly as it was.
    """
