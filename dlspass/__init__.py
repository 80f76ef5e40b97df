"""dlspass: dynamic loss scaling (DLS) for mixed-precision training, as a compiler pass.

Public verbs (importing ``dlspass`` stays light: heavy modules load on first use):

- ``DLSConfig``: the DLS settings, with cstorch's names and presets (cerebras, torch, ...).
- ``GradScaler``: an eager scaler with cstorch's constructor and torch.amp's methods.
- ``capture_step``: one training step captured as one FX graph and rewritten for DLS.
- ``compile``: the whole training step compiled by inductor as one graph, DLS included.
  Every entry point takes ``config=`` plus keyword overrides, merged by
  ``DLSConfig.with_overrides``; a step that cannot be captured or compiled raises
  ``StepCaptureError`` (``CaptureError`` and ``CompileError`` are its other names).
- ``verify``: prove a rewritten graph's DLS invariants (raises ``VerificationError``).
- ``formats`` / ``round_to_format``: float16, bfloat16 and cbfloat16 rounding.
- ``DLSPassError``: the root of every exception dlspass raises; ``DLSInputError`` (bad input)
  and ``DLSInternalError`` (a broken contract) are its two families.

Example:
    >>> import torch, dlspass
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = dlspass.GradScaler(loss_scale="dynamic")
    >>> loss = model(torch.randn(8, 4)).pow(2).mean()
    >>> scaler.scale(loss).backward()
    >>> stepped = scaler.step(opt)
    >>> scaler.update()
    >>> float(scaler.get_scale())
    32768.0
"""

from __future__ import annotations

import importlib
from typing import Any

from dlspass.config import ConfigError, DLSConfig
from dlspass.errors import DLSInputError, DLSInternalError, DLSPassError

__version__ = "0.1.0"

_LAZY = {
    "GradScaler": "dlspass.scaler",
    "TorchGradScaler": "dlspass.scaler",
    "hold_scheduler_on_skip": "dlspass.scaler",
    "HeldScheduler": "dlspass.scaler",
    "ScaleFloorWarning": "dlspass.scaler",
    "ScaleFloorError": "dlspass.scaler",
    "ScalerStateError": "dlspass.scaler",
    "ScalerState": "dlspass.scale_policy",
    "round_to_format": "dlspass.formats",
    "formats": "dlspass.formats",
    "capture_step": "dlspass.capture.functional",
    "CapturedStep": "dlspass.capture.functional",
    "capture_step_distributed": "dlspass.capture.functional",
    "StepCaptureError": "dlspass.capture.step_pipeline",
    "CaptureError": "dlspass.capture.functional",
    "CompileError": "dlspass.capture.compiled_step",
    "verify": "dlspass.graph.invariants",
    "VerificationError": "dlspass.graph.invariants",
    "compile": "dlspass.capture.compiled_step",
    "make_backend": "dlspass.capture.dynamo_backend",
    "analyze": "dlspass.debug.precision_risk",
}

__all__ = [
    "ConfigError", "DLSConfig", "DLSInputError", "DLSInternalError", "DLSPassError", *_LAZY,
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dlspass' has no attribute {name!r}")
    module = importlib.import_module(mod)
    value = module if name == "formats" else getattr(module, name)
    globals()[name] = value
    return value
