"""The scale policy as pure tensor functions: one definition for eager code and graphs.

Every function here is written in torch ops with no Python branching on tensor values (only on
the static `DLSConfig`), so the same code runs eagerly inside `dlspass.GradScaler` and traces
with ``make_fx`` into a captured training step. All scale arithmetic is float32
(docs/SEMANTICS.md §1.3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dlspass.config import DLSConfig
from dlspass.presets import DEEPSPEED_POLICIES, FLOAT32_SMALLEST_NORMAL

CLIP_EPS = 1e-6


class ScalerState(NamedTuple):
    """The scaler's state: a pytree of 0-d tensors, so a graph can carry it in and out."""

    loss_scale: Tensor  # float32: the scale the next backward uses
    steps_since_rescale: Tensor  # int64: updates since the scale last changed (torch: growth tracker)
    overflows_since_rescale: Tensor  # int64
    num_skipped_steps: Tensor  # int64: one per skipped iteration, however many optimizers
    hysteresis: Tensor  # int64: overflows still absorbed before backing off (deepspeed/megatron)
    non_clamped_scale: Tensor  # float32: the scale before the floor (cstorch get_non_clamped_scale)
    floor_overflows: Tensor  # int64: overflows that wanted to push the scale below the floor


STATE_FIELDS = ScalerState._fields
STATE_DTYPES = {
    name: (torch.float32 if name in ("loss_scale", "non_clamped_scale") else torch.int64)
    for name in STATE_FIELDS
}


def init_state(config: DLSConfig, device: torch.device | str | None = None) -> ScalerState:
    """The state of a fresh scaler for ``config``."""
    scale = config.init_scale

    def t(name: str, value: float) -> Tensor:
        return torch.tensor(value, dtype=STATE_DTYPES[name], device=device)

    return ScalerState(
        loss_scale=t("loss_scale", scale),
        steps_since_rescale=t("steps_since_rescale", 0),
        overflows_since_rescale=t("overflows_since_rescale", 0),
        num_skipped_steps=t("num_skipped_steps", 0),
        hysteresis=t("hysteresis", config.hysteresis_steps),
        non_clamped_scale=t("non_clamped_scale", scale),
        floor_overflows=t("floor_overflows", 0),
    )


def _f32(x: float) -> float:
    # Rounding a Python float to float32 first makes a comparison against a float32 tensor
    # exact whatever precision the scalar is carried in (docs/SEMANTICS.md §1.3: 0.1 at 1/10).
    return float(np.float32(x))


def _cerebras(state: ScalerState, ok: Tensor, config: DLSConfig) -> ScalerState:
    """cstorch: back off when the overflow ratio since the last change exceeds the tolerance,
    grow after ``steps_per_increase`` steps without backing off."""
    zero = torch.zeros_like(state.steps_since_rescale)
    scale = state.loss_scale
    steps = state.steps_since_rescale + 1
    ovf = state.overflows_since_rescale + (1 - ok.to(torch.int64))
    ratio = ovf.to(torch.float32) / steps.to(torch.float32)
    shrink = ratio > _f32(config.tolerance)
    scale = torch.where(shrink, scale * _f32(config.backoff), scale)
    steps = torch.where(shrink, zero, steps)
    ovf = torch.where(shrink, zero, ovf)
    grow = steps > config.growth_interval
    scale = torch.where(grow, scale * _f32(config.growth), scale)
    steps = torch.where(grow, zero, steps)
    ovf = torch.where(grow, zero, ovf)
    return state._replace(loss_scale=scale, steps_since_rescale=steps, overflows_since_rescale=ovf)


def _times(scale: Tensor, factor: float, config: DLSConfig) -> Tensor:
    """``scale * factor`` as the policy's tool computes it.

    torch's `_amp_update_scale_` kernel multiplies the float32 scale by the factor as a C++
    double and rounds the product to float32 once; DeepSpeed keeps its scale as a Python float
    (a double). Both are reproduced by the product in float64, rounded to float32 once. cstorch,
    Megatron and Keras multiply two float32 values (docs/SEMANTICS.md §3.1). For a power of two
    factor the two ways agree; for ``backoff_factor=0.3`` they do not (27.6480007 vs 27.6480026).
    """
    if config.policy == "torch" or config.policy in DEEPSPEED_POLICIES:
        # the factor as a float64 tensor constant: ONNX export carries a Python scalar, or the
        # fill value of `torch.full`, as float32 (0.3 would become 0.30000001192...)
        wide = torch.tensor(factor, dtype=torch.float64, device=scale.device)
        return (scale.to(torch.float64) * wide).to(torch.float32)
    return scale * _f32(factor)


def _torch_like(state: ScalerState, ok: Tensor, config: DLSConfig) -> ScalerState:
    """torch.amp and Keras: back off on every overflow, grow after an interval of clean steps;
    torch refuses a growth that would overflow float32, Keras does not."""
    zero = torch.zeros_like(state.steps_since_rescale)
    bad = ~ok
    scale = torch.where(bad, _times(state.loss_scale, config.backoff, config), state.loss_scale)
    steps = torch.where(bad, zero, state.steps_since_rescale + 1)
    grow = steps == config.growth_interval
    grown = _times(scale, config.growth, config)
    grow_ok = grow & torch.isfinite(grown) if config.policy == "torch" else grow
    scale = torch.where(grow_ok, grown, scale)
    steps = torch.where(grow, zero, steps)
    return state._replace(loss_scale=scale, steps_since_rescale=steps)


def _deepspeed(state: ScalerState, ok: Tensor, config: DLSConfig) -> ScalerState:
    """DeepSpeed: an overflow first uses up the hysteresis, then backs off; the hysteresis is
    refilled on growth (or on every clean step with ``consecutive_hysteresis``).

    ``steps_since_rescale`` counts clean iterations since the last overflow, restarting at
    growth. DeepSpeed grows when ``stable = it - last_overflow_it - 1`` is a positive multiple
    of the window (since 0.17.1; ``deepspeed``): ``window + 1`` clean iterations after an
    overflow, then every ``window``; the counter restarts at 1 on growth so that the same test,
    ``steps > window``, serves both. Up to 0.17.0 (``deepspeed-0.17.0``) the test was
    ``(it - last_overflow_it) % window == 0``: every ``window`` clean iterations, the counter
    restarting at 0. DeepSpeed's fp16 optimizer without ZeRO (``deepspeed-fp16-optimizer``)
    has the current growth test and no hysteresis (docs/SEMANTICS.md §3.2).
    """
    zero = torch.zeros_like(state.steps_since_rescale)
    bad = ~ok
    hyst = state.hysteresis
    full = torch.full_like(hyst, config.hysteresis_steps)
    no_hysteresis = config.policy == "deepspeed-fp16-optimizer"
    at_last = torch.ones_like(bad) if no_hysteresis else hyst <= 1
    scale = torch.where(bad & at_last, _times(state.loss_scale, config.backoff, config),
                        state.loss_scale)
    if not no_hysteresis:
        hyst = torch.where(bad & ~at_last, hyst - 1, hyst)
    steps = torch.where(bad, zero, state.steps_since_rescale + 1)
    if config.consecutive_hysteresis and not no_hysteresis:
        hyst = torch.where(ok, full, hyst)
    if config.policy == "deepspeed-0.17.0":
        grow = ok & (steps == config.growth_interval)
        restart = zero
    else:
        grow = ok & (steps > config.growth_interval)
        restart = torch.ones_like(steps)
    scale = torch.where(grow, _times(scale, config.growth, config), scale)
    steps = torch.where(grow, restart, steps)
    if not config.consecutive_hysteresis and not no_hysteresis:
        hyst = torch.where(grow, full, hyst)
    return state._replace(loss_scale=scale, steps_since_rescale=steps, hysteresis=hyst)


def _megatron(state: ScalerState, ok: Tensor, config: DLSConfig) -> ScalerState:
    """Megatron: every overflow uses up the hysteresis, backing off once it is spent; growth
    refills it."""
    zero = torch.zeros_like(state.steps_since_rescale)
    bad = ~ok
    full = torch.full_like(state.hysteresis, config.hysteresis_steps)
    # Megatron lets the tracker go negative; clamping at 0 backs off identically (h <= 0)
    # and keeps every counter non-negative.
    hyst = torch.where(bad, torch.clamp(state.hysteresis - 1, min=0), state.hysteresis)
    scale = torch.where(bad & (hyst <= 0), state.loss_scale * _f32(config.backoff), state.loss_scale)
    steps = torch.where(bad, zero, state.steps_since_rescale + 1)
    grow = ok & (steps == config.growth_interval)
    scale = torch.where(grow, scale * _f32(config.growth), scale)
    steps = torch.where(grow, zero, steps)
    hyst = torch.where(grow, full, hyst)
    return state._replace(loss_scale=scale, steps_since_rescale=steps, hysteresis=hyst)


_UpdateRule = Callable[[ScalerState, Tensor, DLSConfig], ScalerState]
_UPDATE_RULES: dict[str, _UpdateRule] = {
    "cerebras": _cerebras,
    "torch": _torch_like,
    "keras": _torch_like,
    "deepspeed": _deepspeed,
    "deepspeed-0.17.0": _deepspeed,
    "deepspeed-fp16-optimizer": _deepspeed,
    "megatron": _megatron,
}
"""Each policy's rule: ``(state, ok, config) -> state`` with the scale before the floor and cap.

A rule branches only on the static config, never on tensor values, so it traces into a graph."""


def update_state(state: ScalerState, isfinite: Tensor, config: DLSConfig) -> ScalerState:
    """One scale update after an iteration; ``isfinite`` is a 0-d bool tensor.

    A static or disabled configuration leaves the state unchanged (no check, no skipping).
    The policy's rule (``_UPDATE_RULES``) moves the scale and its counters; then the scale is
    capped and floored and the skip and floor counters advance, the same for every policy.
    """
    if not config.dynamic:
        return state
    ok = isfinite.to(torch.bool)
    bad = ~ok
    ruled = _UPDATE_RULES[config.policy](state, ok, config)
    pre = torch.clamp(ruled.loss_scale, max=_f32(config.max_scale))
    new_scale = torch.clamp(pre, min=_f32(config.min_scale))
    floor_hit = bad & (pre < _f32(config.min_scale))
    return ScalerState(
        loss_scale=new_scale,
        steps_since_rescale=ruled.steps_since_rescale,
        overflows_since_rescale=ruled.overflows_since_rescale,
        num_skipped_steps=state.num_skipped_steps + (1 - ok.to(torch.int64)),
        hysteresis=ruled.hysteresis,
        non_clamped_scale=pre,
        floor_overflows=state.floor_overflows + floor_hit.to(torch.int64),
    )


def divides(config: DLSConfig | None) -> bool:
    """Whether unscaling divides by the scale instead of multiplying by its reciprocal.

    cstorch and torch multiply by the float32 reciprocal, and so does dlspass wherever the
    config's floor keeps the scale a normal float32 number (>= 2**-126). Below that the
    reciprocal can be inf (1/2**-128 is), so a config whose floor lies there divides, as Keras
    does: ``g / s`` is finite whenever the unscaled gradient is (docs/SEMANTICS.md §1.3). For a
    power-of-two scale both ways give the same values.
    """
    return config is not None and config.min_scale < FLOAT32_SMALLEST_NORMAL


def in_math_dtype(grad: Tensor) -> Tensor:
    """``grad`` in the dtype the scaler's arithmetic runs in: float32, or float64 for a float64
    gradient (torch.amp unscales those in double too; float32 would round them and turn values
    beyond its range into inf, skipping a step that should run)."""
    return grad if grad.dtype == torch.float64 else grad.to(torch.float32)


def unscale(grads: Sequence[Tensor], loss_scale: Tensor,
            config: DLSConfig | None = None) -> list[Tensor]:
    """Gradients divided by the scale, in float32 (fp16 gradients are accepted; float64 ones stay
    float64): times the float32 reciprocal, or (`divides`, a floor below 2**-126) divided."""
    s = loss_scale.to(torch.float32)
    if divides(config):
        return [in_math_dtype(g) / s for g in grads]
    inv = torch.reciprocal(s)
    return [in_math_dtype(g) * inv for g in grads]


def global_norm(grads: Sequence[Tensor], device: torch.device | str | None = None) -> Tensor:
    """``sqrt(sum over grads of sum(g*g))`` in float32; inf/NaN carry through."""
    return torch.sqrt(sum_squares(grads, device))


def all_finite(grads: Sequence[Tensor], device: torch.device | str | None = None) -> Tensor:
    """A 0-d bool tensor: True when every element of every gradient is finite."""
    if not grads:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([torch.isfinite(g).all() for g in grads]).all()


def check_overflow(unscaled: Sequence[Tensor], config: DLSConfig) -> tuple[Tensor, Tensor | None]:
    """``(isfinite, norm)`` on the unscaled gradients by the policy's method.

    cerebras: ``isfinite = global_norm < inf`` (NaN counts as overflow; so do finite gradients
    whose squares overflow float32). The others: every element finite. ``norm`` is returned
    when it was computed (cerebras, or when clipping needs it), else None.
    """
    norm = None
    if config.overflow_check == "global_norm" or config.max_gradient_norm is not None:
        norm = global_norm(unscaled)
    if config.overflow_check == "global_norm":
        assert norm is not None
        isfinite = norm < float("inf")
    else:
        isfinite = all_finite(unscaled)
    return isfinite, norm


def clip(unscaled: Sequence[Tensor], norm: Tensor | None, config: DLSConfig) -> list[Tensor]:
    """Global-norm clipping (``max_gradient_norm``) or value clipping (``max_gradient_value``)."""
    out = list(unscaled)
    if config.max_gradient_norm is not None:
        assert norm is not None
        coef = torch.clamp(config.max_gradient_norm / (norm + CLIP_EPS), max=1.0)
        out = [g * coef for g in out]
    if config.max_gradient_value is not None:
        v = config.max_gradient_value
        out = [torch.clamp(g, -v, v) for g in out]
    return out


def dls_tail(
    grads: Sequence[Tensor], loss_scale: Tensor, config: DLSConfig
) -> tuple[list[Tensor], Tensor, Tensor | None]:
    """Unscale, check and clip: ``(grads for the optimizer, isfinite, norm)``.

    With scaling disabled the gradients are only cast to float32 and clipped, and ``isfinite``
    is True (a static scale checks nothing and skips nothing, as in cstorch).
    """
    if config.enabled:
        unscaled = unscale(grads, loss_scale, config)
    else:
        unscaled = [in_math_dtype(g) for g in grads]
    isfinite, norm = _tail_check(unscaled, loss_scale, config)
    return clip(unscaled, norm, config), isfinite, norm


def dls_tail_(
    grads: Sequence[Tensor], loss_scale: Tensor, config: DLSConfig
) -> tuple[Tensor, Tensor | None]:
    """`dls_tail` in place, for eager code: ``grads`` are unscaled and clipped where they are
    (no gradient-sized temporaries); returns ``(isfinite, norm)``.

    ``grads`` must be float32 tensors on ``loss_scale``'s device: then the values written are
    bit for bit the ones `dls_tail` returns.
    """
    if config.enabled:
        if divides(config):
            torch._foreach_div_(grads, loss_scale.to(torch.float32))
        else:
            torch._foreach_mul_(grads, torch.reciprocal(loss_scale.to(torch.float32)))
    isfinite, norm = _tail_check(grads, loss_scale, config)
    if config.max_gradient_norm is not None or config.max_gradient_value is not None:
        torch._foreach_copy_(grads, clip(grads, norm, config))
    return isfinite, norm


def _tail_check(unscaled: Sequence[Tensor], loss_scale: Tensor,
                config: DLSConfig) -> tuple[Tensor, Tensor | None]:
    """`dls_tail`'s ``(isfinite, norm)``: checked under dynamic scaling, always True otherwise."""
    if config.dynamic:
        return check_overflow(unscaled, config)
    isfinite = torch.ones((), dtype=torch.bool, device=loss_scale.device)
    norm = global_norm(unscaled) if config.max_gradient_norm is not None else None
    return isfinite, norm


def sum_squares(grads: Sequence[Tensor], device: torch.device | str | None = None) -> Tensor:
    """``sum over grads of sum(g*g)`` in float32 (the square of `global_norm`); 0 for no grads.

    Kept apart from the square root so that partial sums can be added up first, e.g. over the
    ranks that each hold a shard of the gradients (`dlspass.distributed`).
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([torch.sum(g.to(torch.float32) * g.to(torch.float32)) for g in grads]).sum()
