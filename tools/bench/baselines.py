"""The baseline every compile benchmark compares with: torch's best practice for a scaled step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def torch_best_practice_step(model: nn.Module, loss_of: Callable[..., Tensor],
                             optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
                             **opt_kwargs: object) -> Callable[..., Tensor]:
    """``step(*batch)``: ``torch.compile(model)`` (inductor), a fused ``optimizer`` and
    ``torch.amp.GradScaler`` (scale, unscale, inf check and skip, run eagerly), float32.

    ``loss_of(compiled_model, *batch)`` is the loss the backward starts from; the step returns
    it detached.
    """
    cmodel = torch.compile(model)
    opt = optimizer(model.parameters(), fused=True, **opt_kwargs)
    scaler = torch.amp.GradScaler("cpu")

    def step(*batch: Tensor) -> Tensor:
        loss = loss_of(cmodel, *batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step
