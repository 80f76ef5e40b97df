"""torch's fused multi-tensor Adam/AdamW kernel for a whole param group of a compiled step.

The policy (`fused_kernel_problem`): a group whose optimizer was built ``fused=True`` is updated
by torch's own fused kernel, once for the group; every other group keeps the per-parameter math
of ``dlspass.capture.optim.update_one``. The mechanism (`fused_group_update`): the kernel's
functional form on the group's marked tensors, as ``torch.optim.adam._fused_adam`` calls it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dlspass.capture.optim import GroupPlan

# the options torch's fused Adam/AdamW kernel takes as Python numbers, not tensors
FUSED_CONSTANTS = ("beta1", "beta2", "eps", "weight_decay")


def fused_kernel_problem(kind: str, plan: GroupPlan, device_type: str = "cpu") -> str | None:
    """Why ``plan``'s group is updated per parameter (``update_one``) rather than by torch's
    fused multi-tensor kernel (`fused_group_update`), or None when the fused kernel runs.

    The policy: the user's choice. A group built with ``fused=True`` (torch's best practice)
    gets torch's own fused kernel, so the step's numerics are that optimizer's; any other
    group keeps the single-tensor math its optimizer runs eagerly on a CPU. The fused kernel
    runs as one library call, so the compiler generates no code for the update. SGD keeps
    the per-parameter form: torch's fused SGD takes "first step" as a constant, which a
    momentum buffer created lazily inside the graph does not have. CPU only for now: the
    CUDA kernel's tensor-lr form and its numerics against torch's have not been run on a GPU.
    """
    if not plan.fused:
        return "the optimizer was not built with fused=True"
    if device_type != "cpu":
        return f"the fused kernel path is checked on the CPU only, not on {device_type}"
    if kind != "Adam":
        return f"torch's fused {kind} takes its first-step flag as a constant"
    return None


def fused_group_update(plan: GroupPlan, params: list[Tensor], grads: list[Tensor],
                       states: list[dict[str, Tensor]], lr: Tensor,
                       constants: dict[str, float]) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """One Adam/AdamW step of a whole group by torch's fused kernel (functional form):
    ``(new_params, new_states)``, in the order given; ``states`` as for ``update_one``.

    As ``torch.optim.adam._fused_adam`` does: the step counts advance first and the kernel reads
    them advanced; ``lr`` is the group's 0-d float64 tensor (the kernel reads its value as the
    double torch passes for a float lr); ``constants`` holds `FUSED_CONSTANTS` as Python
    floats (the kernel takes them so). Gradients come unscaled, so no ``grad_scale`` and no
    ``found_inf`` here: DLS guards the outputs as it guards ``update_one``'s, then
    ``GuardFusedUpdatesPass`` hands the overflow flag to the kernel as its ``found_inf``.
    """
    steps = [st["step"] + 1 for st in states]
    op = torch.ops.aten._fused_adamw if plan.decoupled else torch.ops.aten._fused_adam
    new_params, _, exp_avgs, exp_avg_sqs, maxes = op.tensor_lr(
        params, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
        [st["max_exp_avg_sq"] for st in states] if plan.amsgrad else [], steps, lr=lr,
        beta1=constants["beta1"], beta2=constants["beta2"],
        weight_decay=constants["weight_decay"], eps=constants["eps"], amsgrad=plan.amsgrad,
        maximize=plan.maximize, grad_scale=None, found_inf=None)
    new_states = [{"step": s, "exp_avg": m, "exp_avg_sq": v} for s, m, v in
                  zip(steps, exp_avgs, exp_avg_sqs, strict=True)]
    if plan.amsgrad:
        for st, mx in zip(new_states, maxes, strict=True):
            st["max_exp_avg_sq"] = mx
    return list(new_params), new_states


def fused_constants(group: dict[str, Any]) -> dict[str, float] | None:
    """`FUSED_CONSTANTS` of a torch param group as Python floats, or None when one is a tensor
    (the group then keeps the per-parameter form, whose hyperparameters are tensors). Read
    while dynamo traces, they are guarded: changing one recompiles, as torch's own fused
    optimizer does under ``torch.compile``; ``lr`` stays a tensor input (schedulers never
    recompile)."""
    beta1, beta2 = group["betas"]
    values = {"beta1": beta1, "beta2": beta2, "eps": group["eps"],
              "weight_decay": group["weight_decay"]}
    if any(isinstance(v, Tensor) for v in values.values()):
        return None
    return {k: float(v) for k, v in values.items()}
