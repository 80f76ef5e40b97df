"""The eager scalers (split into modules in the next commit)."""

from dlspass.scaler.eager import (
    GradScaler,
    HeldScheduler,
    ScaleFloorError,
    ScaleFloorWarning,
    ScalerStateError,
    TorchGradScaler,
    hold_scheduler_on_skip,
)

__all__ = ["GradScaler", "HeldScheduler", "ScaleFloorError", "ScaleFloorWarning",
           "ScalerStateError", "TorchGradScaler", "hold_scheduler_on_skip"]
