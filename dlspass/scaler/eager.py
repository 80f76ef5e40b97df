"""`GradScaler`: the eager scaler, cstorch's constructor with torch.amp's methods, no host sync
per step.

`GradScaler` keeps a `DLSConfig` (``.config``) and a `ScalerState` (``.state``) and runs the
policy math of `dlspass.scale_policy` (the same functions a captured graph uses).

One class with torch.amp's whole method surface, so the module is about 500 lines: the checks,
the optimizer-step skipping and the state-dict layout live beside it in this package.

Per-optimizer protocol, as torch.amp: ``scale(loss).backward()`` -> ``unscale_(opt)``
(optional; clip after it) -> ``step(opt)`` -> ``update()``.

Overflow decision with several optimizers: each optimizer is checked on its own gradients when
it is unscaled and steps (its parameters and state change) only when they are finite - the
torch.amp semantics. ``update()`` combines the flags of every optimizer of the iteration: one
overflow anywhere backs the scale off once and counts one skipped iteration. Nothing non-finite
reaches any parameter either way. (In the cerebras policy the global-norm test then runs per
optimizer; with one optimizer it is the global norm of docs/SEMANTICS.md §1.5.) How a step is
skipped without a host sync: `dlspass.scaler.optimizer_step`.

Distributed training (``dlspass.distributed``, docs/DISTRIBUTED.md): once
``torch.distributed`` is initialized the scaler agrees over the default process group
(``process_group=`` overrides) with one on-device ``all_reduce`` per optimizer and iteration,
which gives both the global gradient norm (shards summed over every mesh dimension, replicas -
DDP's, HSDP's, tensor parallelism's - counted once, read from each gradient's DTensor
placements) and an overflow flag every rank shares; DTensor gradients and parameters are
handled through their local shards.

The scale-floor signal (`ScaleFloorWarning`, or `ScaleFloorError` with
``on_scale_floor="raise"``) reads the floor counter lazily: in ``get_scale()``, in
``state_dict()`` and once every ``FLOOR_CHECK_EVERY`` updates - never once per step.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dlspass import distributed, scale_policy
from dlspass.config import DLSConfig
from dlspass.errors import InputTypeError, InputValueError
from dlspass.scale_log import ScaleLogger, log_steps
from dlspass.scale_policy import ScalerState, clip, dls_tail, dls_tail_, init_state, update_state
from dlspass.scaler.errors import ScaleFloorError, ScaleFloorWarning, ScalerUsageError
from dlspass.scaler.optimizer_step import (
    SnapshotBuffers,
    fused_step,
    masked_step,
    params_with_grad,
)
from dlspass.scaler.scaled_outputs import map_tensors, tensors_in
from dlspass.scaler.state_dict import effective_factors, plan_load, write_state_dict


class _KeywordDefault(str):
    """A string keyword's default, told apart from the same value given by the caller (an
    explicit ``policy="cerebras"`` overrides ``config=``'s policy; the default does not)."""


_DYNAMIC, _FLOAT16 = _KeywordDefault("dynamic"), _KeywordDefault("float16")
_CEREBRAS, _WARN = _KeywordDefault("cerebras"), _KeywordDefault("warn")

# How often update() looks at the floor counter on its own (one host read per this many updates).
FLOOR_CHECK_EVERY = 1000

# the stages of an optimizer's record within an iteration (None: neither yet)
UNSCALED, STEPPED = "unscaled", "stepped"

def refuse_backend_flag_with_group(backend_flag: Tensor | None) -> None:
    """make_backend's graphs unscaled this rank's gradients and checked only them: unscaling
    again, or stepping on a flag the other ranks do not share, would be wrong."""
    if backend_flag is not None:
        raise ScalerUsageError(
            "dlspass.make_backend(scaler=...) checks gradients per rank and cannot be combined "
            "with a scaler's process_group; use dlspass.compile(..., process_group=...) or "
            "torch.compile's own backend with this scaler")


class GradScaler:
    """Dynamic loss scaling for eager training: cstorch's arguments, torch.amp's methods.

    Args:
        loss_scale: ``"dynamic"`` (DLS), a number (static scale) or ``None`` (no scaling).
        init_scale: the first scale (alias ``initial_loss_scale``; give at most one).
        steps_per_increase, min_loss_scale, max_loss_scale, overflow_tolerance,
        max_gradient_norm, max_gradient_value, fp16_type, policy, on_scale_floor,
        growth_factor, backoff_factor, hysteresis, consecutive_hysteresis: as `DLSConfig`
            (``None`` means the policy's default).
        config: a ready `DLSConfig`; the keywords given are merged into it by
            `DLSConfig.with_overrides` (the rule every entry point merges by).
        device: where the state lives; ``None`` moves it lazily to the first scaled loss.
        process_group: the group ranks agree over: a ProcessGroup or a DeviceMesh (the group
            over its ranks); ``None``: the default group when ``torch.distributed`` is
            initialized; nothing is communicated with one rank. It must hold every rank that
            holds a piece of the optimizer's gradients (for a 2-D mesh: the whole mesh).
        summary_writer: a ``torch.utils.tensorboard.SummaryWriter`` the scale is logged to
            (`log_scale`); the config's ``log_loss_scale`` logs it to Python logging alone.

    ``found_inf`` is a property: the last finished iteration's overflow flag (0-d bool tensor).
    ``steps_on_overflow``: ``step`` runs ``optimizer.step`` on an overflow too and undoes it
    (no host sync); a subclass that sets it False reads the flag and does not call it.
    """
    steps_on_overflow: bool = True
    # a config whose floor is below 2**-126 unscales by dividing (scale_policy.divides);
    # TorchGradScaler keeps torch's multiplication by the reciprocal, whatever the scale
    _divide_below_normal: bool = True

    def __init__(
        self,
        loss_scale: str | float | None = _DYNAMIC,
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float | None = None,
        max_gradient_norm: float | None = None,
        max_gradient_value: float | None = None,
        fp16_type: str = _FLOAT16,
        policy: str = _CEREBRAS,
        on_scale_floor: str = _WARN,
        config: DLSConfig | None = None,
        device: torch.device | str | None = None,
        *,
        initial_loss_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        hysteresis: int | None = None,
        consecutive_hysteresis: bool | None = None,
        process_group: Any = None,
        summary_writer: Any = None,
    ) -> None:
        if init_scale is not None and initial_loss_scale is not None:
            raise InputValueError("init_scale and initial_loss_scale are aliases: give only one")
        if config is not None and not isinstance(config, DLSConfig):
            raise InputTypeError(f"config: expected a DLSConfig, got {type(config).__name__}")
        # A keyword left at its default is not given; the given ones are merged into ``config``
        # (or the defaults) by the one config rule, `DLSConfig.with_overrides`.
        keywords = {
            "loss_scale": loss_scale, "initial_loss_scale": init_scale if init_scale is not None
            else initial_loss_scale, "steps_per_increase": steps_per_increase,
            "min_loss_scale": min_loss_scale, "max_loss_scale": max_loss_scale,
            "overflow_tolerance": overflow_tolerance, "max_gradient_norm": max_gradient_norm,
            "max_gradient_value": max_gradient_value, "fp16_type": fp16_type, "policy": policy,
            "on_scale_floor": on_scale_floor, "growth_factor": growth_factor,
            "backoff_factor": backoff_factor, "hysteresis": hysteresis,
            "consecutive_hysteresis": consecutive_hysteresis,
        }
        given = {k: v for k, v in keywords.items()
                 if not isinstance(v, _KeywordDefault) and (v is not None or k == "loss_scale")}
        config = (config if config is not None else DLSConfig()).with_overrides(**given)
        self._setup(config, device, process_group, summary_writer)

    def _setup(self, config: DLSConfig, device: torch.device | str | None,
               process_group: Any = None, summary_writer: Any = None) -> None:
        self.config = config  # what the user configured; `state_dict` writes this one
        self.process_group = process_group
        # The config the math runs on: `config`, or a copy with fp16_type="bfloat16" once a
        # bfloat16 loss turned scaling off at run time (see `scale`).
        self._active_config = config
        # set (ANDed) by the dlspass.make_backend graphs that unscaled and checked the gradients
        # themselves; it covers every gradient of the step's graphs, so every optimizer's
        # unscale_ reads it, and only the step's end (`_end_step`) clears it
        self.backend_found_finite: Tensor | None = None
        self._lazy_device = device is None
        self.state: ScalerState = init_state(config, device)
        self._per_opt: dict[int, dict[str, Any]] = {}
        self._buffers: SnapshotBuffers = {}
        self._last_stepped: dict[int, Tensor] = {}
        self._found_inf = torch.zeros((), dtype=torch.bool, device=self.state.loss_scale.device)
        self._updates = 0
        self._floor_reported = False
        self._bf16_warned = False
        self.scale_log: ScaleLogger | None = None
        if config.log_loss_scale or summary_writer is not None:
            self.log_scale(summary_writer)
        if config.fp16_type == "bfloat16" and config.loss_scale is not None:
            self._warn_bf16("fp16_type='bfloat16'")

    # ---- helpers ------------------------------------------------------------------------------
    def _warn_bf16(self, why: str) -> None:
        if not self._bf16_warned:
            self._bf16_warned = True
            warnings.warn(f"dlspass.GradScaler: {why}: bfloat16 has float32's range, so loss "
                          f"scaling is not needed; the scaler passes through (scale 1, no "
                          f"skipped steps)", UserWarning, stacklevel=3)

    def _needs_grad_work(self) -> bool:
        c = self._active_config
        return c.enabled or c.max_gradient_norm is not None or c.max_gradient_value is not None

    def _move_state(self, device: torch.device) -> None:
        self.state = ScalerState(*(t.to(device) for t in self.state))
        self._found_inf = self._found_inf.to(device)
        self._lazy_device = False

    # torch.amp's lazy set-up, which accelerate's FSDP2 load_state calls directly with _device
    @property
    def _device(self) -> str:
        return str(self.state.loss_scale.device)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        if self._lazy_device and self.state.loss_scale.device != torch.device(dev):
            self._move_state(torch.device(dev))

    def _check_floor(self) -> None:
        """The lazy floor signal: one host read, never on the per-step path."""
        cfg = self._active_config
        if not cfg.dynamic or (self._floor_reported and cfg.on_scale_floor == "warn"):
            return
        n = int(self.state.floor_overflows)
        if n <= 0:
            return
        msg = (f"dlspass: gradients overflowed {n} time(s) with the loss scale already at its "
               f"floor (min_loss_scale={cfg.min_scale!r}); the steps are being skipped. "
               f"Likely cause: weights or activations beyond the {cfg.fp16_type} range "
               f"(e.g. a bfloat16-pretrained model run in float16) or a diverging run; consider "
               f"bfloat16, a lower learning rate, or finding the first inf/NaN in the forward")
        if cfg.on_scale_floor == "raise":
            raise ScaleFloorError(msg)
        self._floor_reported = True
        warnings.warn(msg, ScaleFloorWarning, stacklevel=3)

    # ---- torch.amp API ------------------------------------------------------------------------
    def is_enabled(self) -> bool:
        """True when the scaler scales (dynamic or static scale other than 1)."""
        return self._active_config.enabled

    def scale(self, outputs: Any) -> Any:
        """``outputs`` times the current scale (a tensor or nested list/tuple/dict of them)."""
        tensors = list(tensors_in(outputs))
        if any(t.dtype == torch.bfloat16 for t in tensors) and self._active_config.enabled:
            self._warn_bf16("the loss is bfloat16")
            self._active_config = dataclasses.replace(self.config, fp16_type="bfloat16")
        if not self._active_config.enabled:
            map_tensors(outputs, lambda t: t)  # still reject non-tensors
            return outputs
        if tensors and self._lazy_device and tensors[0].device != self.state.loss_scale.device:
            self._move_state(tensors[0].device)
        scale = self.state.loss_scale
        return map_tensors(outputs, lambda t: t * scale.to(t.device))

    def _end_step(self) -> None:
        """Forget the step's per-optimizer records and make_backend's flag (at ``update`` and
        when a checkpoint is loaded), whatever path each ``unscale_`` took."""
        self._per_opt = {}
        self.backend_found_finite = None

    def _record(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_opt.setdefault(id(optimizer), {"stage": None, "isfinite": None})

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place, check and clip them.

        fp16 gradients are accepted: the math runs in float32 and the result is written back
        in the gradient's dtype.
        """
        rec = self._record(optimizer)
        if rec["stage"] == UNSCALED:
            raise ScalerUsageError("unscale_() has already been called on this optimizer since the "
                               "last update()")
        if rec["stage"] == STEPPED:
            raise ScalerUsageError("unscale_() is being called after step(); call it before "
                               "step(), once per optimizer per iteration")
        rec["stage"] = UNSCALED
        device = self.state.loss_scale.device
        backend_flag = self.backend_found_finite
        if not self._needs_grad_work():
            rec["isfinite"] = torch.ones((), dtype=torch.bool, device=device)
            return
        group = distributed.resolve_group(self.process_group)
        if group is not None:
            refuse_backend_flag_with_group(backend_flag)
            # a collective: every rank runs it, also one with no gradients
            rec["isfinite"] = self._unscale_distributed(optimizer, group).to(device)
            return
        grads = [p.grad for p in params_with_grad(optimizer)]
        if not grads:
            rec["isfinite"] = torch.ones((), dtype=torch.bool, device=device)
            return
        if backend_flag is not None:
            # A dlspass.make_backend graph already unscaled and checked these gradients in its
            # backward; only clipping is left to do here.
            cfg = self._active_config
            if cfg.max_gradient_norm is not None or cfg.max_gradient_value is not None:
                unscaled = [scale_policy.in_math_dtype(g) for g in grads]
                norm = scale_policy.global_norm(unscaled) if cfg.max_gradient_norm is not None else None
                torch._foreach_copy_(grads, clip(unscaled, norm, cfg))
            rec["isfinite"] = backend_flag.to(device)
            return
        scale = self.state.loss_scale.to(grads[0].device)
        cfg = self._active_config
        if all(g.dtype == torch.float32 and g.device == scale.device for g in grads):
            # in place: one pass fewer and no gradient-sized temporaries (this path is most
            # of the eager overhead)
            isfinite, _ = dls_tail_(grads, scale, cfg)
        else:
            out, isfinite, _ = dls_tail(grads, scale, cfg)
            torch._foreach_copy_(grads, out)
        rec["isfinite"] = isfinite.to(device)

    def _unscale_distributed(self, optimizer: torch.optim.Optimizer, group: Any) -> Tensor:
        """`unscale_` on local shards, with the flag and norm agreed over ``group``."""
        params = params_with_grad(optimizer)
        weights = distributed.grad_weights([p.grad for p in params], group)
        grads = [distributed.local_tensor(p.grad) for p in params]
        cfg = self._active_config
        scale = self.state.loss_scale
        if grads:
            scale = scale.to(grads[0].device)
        if cfg.enabled:
            unscaled = scale_policy.unscale(grads, scale,
                                            cfg if self._divide_below_normal else None)
        else:
            unscaled = [scale_policy.in_math_dtype(g) for g in grads]
        isfinite, norm = distributed.check_overflow_distributed(
            unscaled, weights, cfg, group, device=scale.device)
        if grads:
            torch._foreach_copy_(grads, clip(unscaled, norm, cfg))
        return isfinite

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Tensor:
        """Unscale if not done yet, then step unless this optimizer's gradients overflowed.

        ``*args`` and ``**kwargs`` are forwarded to ``optimizer.step`` (a closure is refused
        under dynamic scaling: it would recompute the gradients after they were checked).
        Returns a 0-d bool tensor, True when the optimizer stepped (no host sync); the
        optimizer's own return value is dropped (`TorchGradScaler.step` returns it).
        """
        closure = kwargs.get("closure", args[0] if args and callable(args[0]) else None)
        if closure is not None and self._active_config.dynamic:
            raise ScalerUsageError("dlspass.GradScaler.step: closures are not supported with "
                               "dynamic loss scaling")
        rec = self._record(optimizer)
        if rec["stage"] == STEPPED:
            raise ScalerUsageError("step() has already been called on this optimizer since the last "
                               "update()")
        if rec["stage"] is None:
            self.unscale_(optimizer)
        rec["stage"] = STEPPED
        ok = rec["isfinite"]
        if not self._active_config.dynamic:
            optimizer.step(*args, **kwargs)
            return ok
        if not self.steps_on_overflow and not bool(ok):  # the subclass's host read
            return ok
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            fused_step(optimizer, ok, args, kwargs)
        else:
            masked_step(optimizer, ok, args, kwargs, self._buffers)
        return ok

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Advance the scale once for the iteration (all optimizers stepped since the last one)."""
        if new_scale is not None and self._active_config.policy == "cerebras":
            raise ScalerUsageError("update(new_scale) is not supported in the cerebras policy: the "
                               "scale follows the policy (construct with loss_scale=<number> "
                               "for a static scale)")
        flags = [r["isfinite"] for r in self._per_opt.values() if r["isfinite"] is not None]
        self._last_stepped = {k: r["isfinite"] for k, r in self._per_opt.items()
                              if r["stage"] == STEPPED}
        self._end_step()
        if not self._active_config.enabled:
            return
        if not flags:
            raise ScalerUsageError("update(): no optimizer was unscaled or stepped since the last "
                               "update()")
        ok = flags[0] if len(flags) == 1 else torch.stack(flags).all()
        self._found_inf = ~ok
        if new_scale is not None:
            s = self.state
            v = torch.as_tensor(new_scale, dtype=torch.float32).to(s.loss_scale.device).reshape(())
            self.state = s._replace(
                loss_scale=v.clone(), non_clamped_scale=v.clone(),
                num_skipped_steps=s.num_skipped_steps + (~ok).to(torch.int64))
        else:
            self.state = update_state(self.state, ok, self._active_config)
        self._count_update()

    def record_compiled_step(self, skipped_before: Tensor,
                             optimizer: torch.optim.Optimizer) -> None:
        """The bookkeeping ``update()`` does, for a step whose graph updated ``state`` in place
        (``dlspass.compile`` calls it after each step): the overflow flag, read from the skip
        counter on the device against ``skipped_before`` (its value before the step), and
        whether ``optimizer`` stepped (for `stepped` and `hold_scheduler_on_skip`)."""
        self._found_inf = self.state.num_skipped_steps != skipped_before
        self._last_stepped = {id(optimizer): ~self._found_inf}
        self._count_update()

    def _count_update(self) -> None:
        # the scale-floor check reads the device state: every FLOOR_CHECK_EVERY iterations only
        self._updates += 1
        if self._updates % FLOOR_CHECK_EVERY == 0:
            self._check_floor()
        if self.scale_log is not None:
            self.scale_log.step()

    def log_scale(self, writer: Any = None, *, every: int | None = None) -> ScaleLogger:
        """Log the scale, the skipped-step count and the skipped steps every ``every`` updates
        (default: Model Zoo's ``log_steps`` from ``config.extras``, else 100) to the
        ``dlspass.scale_log`` logger and, when given, to ``writer`` (a ``SummaryWriter``),
        reading the device once per logging step (`dlspass.scale_log.ScaleLogger`).

        On from the start with ``log_loss_scale`` or ``summary_writer=``; ``dlspass.compile``
        and ``capture_step`` switch it on for the scaler they run. Replaces the logger the
        scaler had (steps keep counting from this scaler's updates).
        """
        self.scale_log = ScaleLogger(self, every or log_steps(self.config), writer=writer,
                                     first_step=self._updates + 1)
        return self.scale_log

    def get_scale(self) -> Tensor:
        """The scale the next ``scale()`` uses (0-d float32; 1.0 when disabled).

        Also the lazy point of the scale-floor warning/error (one host read while unreported).
        """
        self._check_floor()
        return self.get_scale_tensor()

    def get_scale_tensor(self) -> Tensor:
        """The scale as a 0-d float32 tensor, without a host sync (1.0 when disabled)."""
        if not self._active_config.enabled:
            return torch.ones((), dtype=torch.float32, device=self.state.loss_scale.device)
        return self.state.loss_scale

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean iterations."""
        return effective_factors(self.config)[0]

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1); raises `ConfigError` for an invalid value."""
        self._replace_config(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by on an overflow."""
        return effective_factors(self.config)[1]

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)); raises `ConfigError` for an invalid value."""
        self._replace_config(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """Clean iterations between two growths (cstorch: ``steps_per_increase``)."""
        return effective_factors(self.config)[2]

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (a positive int); raises `ConfigError` for an invalid value."""
        self._replace_config(steps_per_increase=new_interval)

    def _replace_config(self, **changes: Any) -> None:
        self._commit_config(dataclasses.replace(self.config, **changes))

    def _commit_config(self, config: DLSConfig) -> None:
        # the active config keeps a bfloat16 pass-through decided at run time
        self.config = config
        active = self._active_config.fp16_type
        self._active_config = (config if active == config.fp16_type
                               else dataclasses.replace(config, fp16_type=active))

    def get_non_clamped_scale(self) -> Tensor:
        """The scale before the floor clamp (cstorch): below ``min_loss_scale`` at the floor."""
        return self.state.non_clamped_scale

    def get_num_skipped_steps(self) -> Tensor:
        """Skipped iterations so far (0-d int64; one per iteration however many optimizers)."""
        return self.state.num_skipped_steps

    @property
    def found_inf(self) -> Tensor:
        """The last finished iteration's overflow flag (0-d bool tensor; False before any)."""
        return self._found_inf

    def stepped(self, optimizer: torch.optim.Optimizer) -> Tensor | None:
        """Whether ``optimizer`` stepped in the last finished iteration (None: not stepped)."""
        return self._last_stepped.get(id(optimizer))

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (``torch.load(weights_only=True)`` loads it).

        A dynamic scaler also writes its effective ``growth_factor``, ``backoff_factor`` and
        ``growth_interval``, which `load_state_dict` restores, and torch.amp's keys, which
        torch.amp.GradScaler loads (layout: `dlspass.scaler.state_dict.write_state_dict`).
        """
        self._check_floor()
        return write_state_dict(self.config, self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any] | None) -> None:
        """Restore a checkpoint; ``None``/``{}`` restarts from the configuration.

        Accepts this class's own dicts, cstorch's flattened ``grad_scaler.*`` keys, a nested
        ``{"grad_scaler": {...}}`` and (policy ``torch``) a torch.amp.GradScaler state_dict.
        The scale, the counters and the growth factor, backoff factor and interval are
        restored. Every entry is checked first (a scale float32 holds as a finite number > 0,
        counters non-negative integers, valid factors): a bad one raises `ScalerStateError`
        naming it and the scaler is left exactly as it was.
        """
        if state_dict is None or (isinstance(state_dict, Mapping) and not state_dict):
            device = self.state.loss_scale.device
            self._end_step()
            self.state = init_state(self.config, device)
            self._found_inf = torch.zeros((), dtype=torch.bool, device=device)
            return
        self._load_checked(state_dict)

    def _load_checked(self, state_dict: object) -> None:
        """The only place a checkpoint changes the scaler: after `plan_load` checked every
        entry of ``state_dict``."""
        config, state = plan_load(self.config, self.state.loss_scale.device, state_dict)
        self._end_step()
        self._commit_config(config)
        if state is not None:
            self.state = state
            self._floor_reported = False
