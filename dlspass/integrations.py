"""dlspass scalers in the training frameworks that drive a ``torch.amp.GradScaler`` themselves.

Lightning (Trainer and Fabric) take a scaler through their ``MixedPrecision`` plugin and need
nothing from here. accelerate and the transformers Trainer (which trains through accelerate)
have no argument for a scaler of one's own, and on CPU they create none: `attach_scaler` puts
one in. Both decide that an optimizer step was skipped by whether ``optimizer.step`` ran, and
hold the LR scheduler on such a step; `dlspass.GradScaler` always runs it (it restores the old
values on an overflow, which is how it avoids a host sync), so with it they would advance the LR
on skipped steps. `SkipVisibleGradScaler` is the `GradScaler` that does not call
``optimizer.step`` on a skipped step (one host read per step, as torch.amp's scaler);
`TorchGradScaler` already behaves so. docs/INTEGRATIONS.md has the recipes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dlspass.errors import InputTypeError, InputValueError
from dlspass.scaler import GradScaler, TorchGradScaler

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["SkipVisibleGradScaler", "attach_scaler"]


class SkipVisibleGradScaler(GradScaler):
    """`dlspass.GradScaler` whose ``step`` calls ``optimizer.step`` only when the step is
    taken, so that code that watches ``optimizer.step`` sees a skipped step (accelerate's
    ``optimizer.step_was_skipped``, the transformers Trainer's LR scheduler).

    The cost is one host read of the overflow flag per optimizer step, as torch.amp's scaler
    has. The parameters, optimizer state, scale and counters are those of `GradScaler`: a
    skipped step leaves the optimizer untouched either way.
    """

    steps_on_overflow = False


def attach_scaler(accelerator: Accelerator, scaler: GradScaler | torch.amp.GradScaler) -> None:
    """Make ``accelerator`` (``accelerate.Accelerator``, or a transformers Trainer's
    ``trainer.accelerator``) scale with ``scaler``; call it before ``accelerator.prepare``
    (for the Trainer: after constructing it, before ``train()``).

    ``scaler`` must show skipped steps to accelerate: a `TorchGradScaler`, a
    `SkipVisibleGradScaler` or torch.amp's own (a plain `GradScaler` is refused, naming them). The accelerator
    must be built with ``mixed_precision="fp16"``. Besides ``accelerator.scaler``, this sets
    ``accelerator.native_amp``, which accelerate leaves off on CPU: without it
    ``accelerator.clip_grad_norm_`` (and the Trainer's ``max_grad_norm``) would clip the
    still-scaled gradients, and the model's forward would not run under float16 autocast.
    ``save_state``/``load_state`` (and the Trainer's checkpoints) then save and restore the
    scaler.
    """
    if not isinstance(scaler, (torch.amp.GradScaler, GradScaler)):
        raise InputTypeError(f"attach_scaler: scaler must be a dlspass scaler or a "
                             f"torch.amp.GradScaler, got {type(scaler).__name__}")
    if isinstance(scaler, GradScaler) and not isinstance(scaler, (TorchGradScaler,
                                                                  SkipVisibleGradScaler)):
        raise InputTypeError(
            "attach_scaler: accelerate (and the transformers Trainer) tell a skipped step by "
            "whether optimizer.step ran, which dlspass.GradScaler always does; use "
            "dlspass.integrations.SkipVisibleGradScaler (the same arguments) or "
            "dlspass.TorchGradScaler")
    if accelerator.mixed_precision != "fp16":
        raise InputValueError(f"attach_scaler: the accelerator's mixed_precision is "
                              f"{accelerator.mixed_precision!r}; loss scaling is for 'fp16' "
                              f"(Accelerator(mixed_precision='fp16'), TrainingArguments(fp16=True))")
    if accelerator._optimizers:
        raise InputValueError("attach_scaler: call it before accelerator.prepare(...): the "
                              "prepared optimizers keep the scaler they were given")
    accelerator.scaler = scaler
    accelerator.native_amp = True
