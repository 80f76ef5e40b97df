"""The eager scaler: cstorch's constructor with torch.amp's methods, no host sync per step.

`GradScaler` keeps a `DLSConfig` (``.config``) and a `ScalerState` (``.state``) and runs the
policy math of `dlspass.scale_policy` (the same functions a captured graph uses).

Per-optimizer protocol, as torch.amp: ``scale(loss).backward()`` -> ``unscale_(opt)``
(optional; clip after it) -> ``step(opt)`` -> ``update()``.

Overflow decision with several optimizers: each optimizer is checked on its own gradients when
it is unscaled and steps (its parameters and state change) only when they are finite - the
torch.amp semantics. ``update()`` combines the flags of every optimizer of the iteration: one
overflow anywhere backs the scale off once and counts one skipped iteration. Nothing non-finite
reaches any parameter either way. (In the cerebras policy the global-norm test then runs per
optimizer; with one optimizer it is the global norm of docs/SEMANTICS.md §1.5.)

Skipping without a host sync:

- fused optimizers (``fused=True``, torch's ``_step_supports_amp_scaling``): the already
  unscaled gradients go in with ``found_inf`` as the kernel argument, so the kernel itself is a
  no-op on overflow and rolls its step count back (no snapshot). ``grad_scale`` stays None:
  the overflow test and clipping need the unscaled gradients before the kernel runs anyway;
- other optimizers: parameters and tensor state are snapshotted before ``opt.step()`` and put
  back in place with ``torch.where(isfinite, new, old)`` (bit-exact on both branches). This
  costs one copy of the parameters and of the optimizer state, as cstorch's clones do.

The one host read: when ``opt.step()`` just created state that did not exist before (an
optimizer's first step: Adam's moments, SGD's momentum buffer) or changed a non-tensor state
value, the flag is read once so that, on overflow, that state can be removed again - a skipped
first step then leaves the optimizer exactly as a fresh one (torch's own fused SGD leaves an
uninitialized momentum buffer there). After the first successful step this never happens again.

Distributed training (``dlspass.distributed``): once ``torch.distributed`` is initialized the
scaler agrees over the default process group (``process_group=`` overrides) with one on-device
``all_reduce`` per optimizer and iteration, which gives both the global gradient norm (FSDP2
shards summed, DDP replicas counted once) and an overflow flag every rank shares; DTensor
gradients and parameters are handled through their local shards.

The scale-floor signal (`ScaleFloorWarning`, or `ScaleFloorError` with
``on_scale_floor="raise"``) reads the floor counter lazily: in ``get_scale()``, in
``state_dict()`` and once every ``FLOOR_CHECK_EVERY`` updates - never once per step.

`TorchGradScaler` is the other contract: torch.amp.GradScaler's, step for step (torch's own
unscale helper and update kernel on this module's state, a host read in ``step`` as torch
makes, torch's ``state_dict`` keys); docs/TORCH_AMP_DIFFERENCES.md lists where either class
differs from torch.amp. Both validate checkpoints completely before restoring anything
(`ScalerStateError`) and refuse scales float32 cannot hold.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import warnings
from collections import abc
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from dlspass import distributed, scale_policy
from dlspass.config import FLOAT32_MAX, ConfigError, DLSConfig
from dlspass.errors import DLSInputError, InputTypeError, InputValueError
from dlspass.scale_policy import (
    STATE_DTYPES,
    STATE_FIELDS,
    ScalerState,
    check_overflow,
    clip,
    dls_tail,
    init_state,
    update_state,
)

FORMAT_VERSION = 1
# docs/SEMANTICS.md §1.7: the keys a dynamic checkpoint must carry (the others have safe defaults).
REQUIRED_DYNAMIC_KEYS = ("loss_scale", "steps_since_rescale", "overflows_since_rescale",
                         "num_skipped_steps")
TORCH_AMP_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
# How often update() looks at the floor counter on its own (one host read per this many updates).
FLOOR_CHECK_EVERY = 1000

_UNSCALED, _STEPPED = "unscaled", "stepped"


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


# The smallest positive float32 (a subnormal): a scale must survive the cast to float32, the
# dtype every scale is kept in, as a finite number > 0 (1e39 would become inf, 1e-50 zero).
FLOAT32_TINY = 2.0**-149
_INT64_MAX = 2**63 - 1


def _short(value: object) -> str:
    """A bounded repr for error messages (a 10**1000 or a long string is cut)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"<a {type(value).__name__} too long to print>"
    return text if len(text) <= 60 else text[:57] + "..."


def _as_float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def _plain_number(key: str, value: object, error: type[Exception]) -> float | int:
    """A Python number from an int/float (not bool) or a one-element real tensor."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise error(f"{key}: expected a number or a one-element real tensor, got a "
                        f"{value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.detach().reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{key}: expected a number, got {type(value).__name__}")
    return value


def checked_scale(key: str, value: object, error: type[Exception] = ScalerStateError) -> float:
    """``value`` as a float that float32 holds as a finite number > 0, else ``error`` naming
    ``key`` (NaN, inf, 0, negative, 1e39 -> inf, 1e-50 -> 0 are all refused)."""
    v = _plain_number(key, value, error)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f <= 0:
        raise error(f"{key}: must be a finite number > 0, got {_short(v)}")
    f32 = _as_float32(f)
    if not math.isfinite(f32) or f32 == 0.0:
        raise error(f"{key}: {_short(v)} does not fit float32, the dtype of the scale (it "
                    f"would become {f32!r}); use a value in [{FLOAT32_TINY!r}, {FLOAT32_MAX!r}]")
    return f


def _checked_count(key: str, value: object, minimum: int = 0) -> int:
    """A counter: an integer (an integral float is accepted) in ``[minimum, 2**63 - 1]``."""
    v = _plain_number(key, value, ScalerStateError)
    if isinstance(v, numbers.Integral):
        n = int(v)
    else:
        f = float(v)
        if not math.isfinite(f) or not f.is_integer():
            raise ScalerStateError(f"{key}: expected an integer, got {_short(v)}")
        n = int(f)
    if not minimum <= n <= _INT64_MAX:
        raise ScalerStateError(f"{key}: must be an integer in [{minimum}, 2**63 - 1], got "
                               f"{_short(n)}")
    return n


def _checked_factor(key: str, value: object, *, growth: bool) -> float | int:
    """A growth factor (finite, > 1) or a backoff factor (in (0, 1)), returned as given."""
    v = _plain_number(key, value, ScalerStateError)
    f = float(v)
    ok = (math.isfinite(f) and f > 1.0) if growth else (0.0 < f < 1.0)
    if not ok:
        want = "a finite number > 1" if growth else "a number in (0, 1)"
        raise ScalerStateError(f"{key}: must be {want}, got {_short(v)}")
    return v


def _walk_tensors(obj: Any) -> Iterable[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_tensors(v)


def _map_tensors(obj: Any, fn: Any) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    raise InputTypeError(f"scale(): expected a tensor or a (nested) list/tuple/dict of tensors, "
                    f"got {type(obj).__name__}")


def _params_with_grad(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise ScalerUsageError("dlspass.GradScaler: sparse gradients are not supported")
                out.append(p)
    return out



def _refuse_backend_flag_with_group(backend_flag: Tensor | None) -> None:
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
        max_gradient_norm, max_gradient_value, fp16_type, policy, on_scale_floor: as
            `DLSConfig` (``None`` means the policy's default).
        config: a ready `DLSConfig` instead of the keywords (not both).
        device: where the state lives; ``None`` moves it lazily to the first scaled loss.
        process_group: the group ranks agree over (``None``: the default group when
            ``torch.distributed`` is initialized; nothing is communicated with one rank).

    ``found_inf`` is a property: the last finished iteration's overflow flag (0-d bool tensor).
    """

    def __init__(
        self,
        loss_scale: str | float | None = "dynamic",
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float | None = None,
        max_gradient_norm: float | None = None,
        max_gradient_value: float | None = None,
        fp16_type: str = "float16",
        policy: str = "cerebras",
        on_scale_floor: str = "warn",
        config: DLSConfig | None = None,
        device: torch.device | str | None = None,
        *,
        initial_loss_scale: float | None = None,
        process_group: Any = None,
    ) -> None:
        if init_scale is not None and initial_loss_scale is not None:
            raise InputValueError("init_scale and initial_loss_scale are aliases: give only one")
        if init_scale is None:
            init_scale = initial_loss_scale
        if config is not None:
            given = {
                "loss_scale": loss_scale != "dynamic", "init_scale": init_scale is not None,
                "steps_per_increase": steps_per_increase is not None,
                "min_loss_scale": min_loss_scale is not None,
                "max_loss_scale": max_loss_scale is not None,
                "overflow_tolerance": overflow_tolerance is not None,
                "max_gradient_norm": max_gradient_norm is not None,
                "max_gradient_value": max_gradient_value is not None,
                "fp16_type": fp16_type != "float16", "policy": policy != "cerebras",
                "on_scale_floor": on_scale_floor != "warn",
            }
            both = [k for k, v in given.items() if v]
            if both:
                raise InputValueError(f"config= and keyword settings are alternatives; got both "
                                 f"(config and {', '.join(both)})")
            if not isinstance(config, DLSConfig):
                raise InputTypeError(f"config: expected a DLSConfig, got {type(config).__name__}")
        else:
            config = DLSConfig(
                loss_scale=loss_scale, initial_loss_scale=init_scale,
                steps_per_increase=steps_per_increase, min_loss_scale=min_loss_scale,
                max_loss_scale=max_loss_scale, overflow_tolerance=overflow_tolerance,
                max_gradient_norm=max_gradient_norm, max_gradient_value=max_gradient_value,
                fp16_type=fp16_type, policy=policy, on_scale_floor=on_scale_floor,  # type: ignore[arg-type]
            )
        self._setup(config, device, process_group)

    def _setup(self, config: DLSConfig, device: torch.device | str | None,
               process_group: Any = None) -> None:
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
        self._buffers: dict[int, tuple] = {}
        self._last_stepped: dict[int, Tensor] = {}
        self._found_inf = torch.zeros((), dtype=torch.bool, device=self.state.loss_scale.device)
        self._updates = 0
        self._floor_reported = False
        self._bf16_warned = False
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
        tensors = list(_walk_tensors(outputs))
        if any(t.dtype == torch.bfloat16 for t in tensors) and self._active_config.enabled:
            self._warn_bf16("the loss is bfloat16")
            self._active_config = dataclasses.replace(self.config, fp16_type="bfloat16")
        if not self._active_config.enabled:
            _map_tensors(outputs, lambda t: t)  # still reject non-tensors
            return outputs
        if tensors and self._lazy_device and tensors[0].device != self.state.loss_scale.device:
            self._move_state(tensors[0].device)
        scale = self.state.loss_scale
        return _map_tensors(outputs, lambda t: t * scale.to(t.device))

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
        if rec["stage"] == _UNSCALED:
            raise ScalerUsageError("unscale_() has already been called on this optimizer since the "
                               "last update()")
        if rec["stage"] == _STEPPED:
            raise ScalerUsageError("unscale_() is being called after step(); call it before "
                               "step(), once per optimizer per iteration")
        rec["stage"] = _UNSCALED
        device = self.state.loss_scale.device
        backend_flag = self.backend_found_finite
        if not self._needs_grad_work():
            rec["isfinite"] = torch.ones((), dtype=torch.bool, device=device)
            return
        group = distributed.resolve_group(self.process_group)
        if group is not None:
            _refuse_backend_flag_with_group(backend_flag)
            # a collective: every rank runs it, also one with no gradients
            rec["isfinite"] = self._unscale_distributed(optimizer, group).to(device)
            return
        grads = [p.grad for p in _params_with_grad(optimizer)]
        if not grads:
            rec["isfinite"] = torch.ones((), dtype=torch.bool, device=device)
            return
        if backend_flag is not None:
            # A dlspass.make_backend graph already unscaled and checked these gradients in its
            # backward; only clipping is left to do here.
            cfg = self._active_config
            if cfg.max_gradient_norm is not None or cfg.max_gradient_value is not None:
                unscaled = [g.to(torch.float32) for g in grads]
                norm = scale_policy.global_norm(unscaled) if cfg.max_gradient_norm is not None else None
                torch._foreach_copy_(grads, clip(unscaled, norm, cfg))
            rec["isfinite"] = backend_flag.to(device)
            return
        scale = self.state.loss_scale.to(grads[0].device)
        cfg = self._active_config
        if cfg.dynamic and all(g.dtype == torch.float32 and g.device == scale.device
                               for g in grads):
            # Same float32 math as scale_policy.dls_tail, in place: one pass fewer and no
            # gradient-sized temporaries (this path is most of the eager overhead).
            torch._foreach_mul_(grads, torch.reciprocal(scale))
            isfinite, norm = check_overflow(grads, cfg)
            if cfg.max_gradient_norm is not None or cfg.max_gradient_value is not None:
                torch._foreach_copy_(grads, clip(grads, norm, cfg))
        else:
            out, isfinite, _ = dls_tail(grads, scale, cfg)
            torch._foreach_copy_(grads, out)
        rec["isfinite"] = isfinite.to(device)

    def _unscale_distributed(self, optimizer: torch.optim.Optimizer, group: Any) -> Tensor:
        """`unscale_` on local shards, with the flag and norm agreed over ``group``."""
        params = _params_with_grad(optimizer)
        grads = [distributed.local_tensor(p.grad) for p in params]
        sharded = [distributed.is_sharded(p.grad) for p in params]
        cfg = self._active_config
        scale = self.state.loss_scale
        if grads:
            scale = scale.to(grads[0].device)
        if cfg.enabled:
            unscaled = scale_policy.unscale(grads, scale)
        else:
            unscaled = [g.to(torch.float32) for g in grads]
        isfinite, norm = distributed.check_overflow_distributed(
            unscaled, sharded, cfg, group, device=scale.device)
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
        if rec["stage"] == _STEPPED:
            raise ScalerUsageError("step() has already been called on this optimizer since the last "
                               "update()")
        if rec["stage"] is None:
            self.unscale_(optimizer)
        rec["stage"] = _STEPPED
        ok = rec["isfinite"]
        if not self._active_config.dynamic:
            optimizer.step(*args, **kwargs)
            return ok
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            self._fused_step(optimizer, ok, args, kwargs)
        else:
            self._masked_step(optimizer, ok, args, kwargs)
        return ok

    @staticmethod
    def _state_keys(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> list[set]:
        return [set(optimizer.state[p].keys()) if p in optimizer.state else set() for p in params]

    def _drop_new_state(self, optimizer: torch.optim.Optimizer, params: list[Tensor],
                        before: list[set], scalars: list[tuple], ok: Tensor) -> None:
        """The documented host read: only when the step created state or changed scalars."""
        created = any(
            set(optimizer.state[p].keys()) - keys if p in optimizer.state else False
            for p, keys in zip(params, before, strict=True)
        )
        changed = [(st, k, v) for st, k, v in scalars if st.get(k) is not v]
        if not created and not changed:
            return
        if bool(ok):
            return
        for p, keys in zip(params, before, strict=True):
            if p not in optimizer.state:
                continue
            st = optimizer.state[p]
            for k in list(st.keys()):
                if k not in keys:
                    del st[k]
            if not st:
                del optimizer.state[p]
        for st, k, v in changed:
            st[k] = v

    def _fused_step(self, optimizer: torch.optim.Optimizer, ok: Tensor, args: tuple,
                    kwargs: dict) -> None:
        params = _params_with_grad(optimizer)
        before = self._state_keys(optimizer, params)
        # Gradients are already unscaled (and clipped), so only a grad_scale the user set on
        # the optimizer is left for the kernel to divide by (torch.amp multiplies it into its
        # own scale); found_inf as a float. Both attributes are removed afterwards, as torch does.
        optimizer.grad_scale = getattr(optimizer, "grad_scale", None)  # type: ignore[attr-defined]
        optimizer.found_inf = (~ok).to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        self._drop_new_state(optimizer, params, before, [], ok)

    def _snapshot(self, optimizer: torch.optim.Optimizer, live: list[Tensor]) -> list[Tensor]:
        # The snapshot buffers are reused across iterations (one foreach copy, no fresh
        # allocation and page faults per step); they hold no information between steps, so a
        # fresh scaler that loaded a state_dict behaves the same.
        if not live:  # an optimizer none of whose parameters got a gradient this step
            return []
        sig = tuple((t.shape, t.dtype, t.device) for t in live)
        cached = self._buffers.get(id(optimizer))
        if cached is None or cached[0] != sig:
            cached = (sig, [torch.empty_like(t) for t in live])
            self._buffers[id(optimizer)] = cached
        torch._foreach_copy_(cached[1], live)
        return cached[1]

    def _masked_step(self, optimizer: torch.optim.Optimizer, ok: Tensor, args: tuple,
                     kwargs: dict) -> None:
        params = _params_with_grad(optimizer)
        before = self._state_keys(optimizer, params)
        # DTensor parameters and state (FSDP2): snapshot and restore this rank's shards
        live: list[Tensor] = [distributed.local_tensor(p.data) for p in params]
        scalars: list[tuple] = []
        for p in params:
            st = optimizer.state.get(p, {})
            for k, v in st.items():
                if isinstance(v, Tensor):
                    live.append(distributed.local_tensor(v))
                else:
                    scalars.append((st, k, v))
        saved = self._snapshot(optimizer, live)
        optimizer.step(*args, **kwargs)
        for new, old in zip(live, saved, strict=True):
            torch.where(ok.to(new.device), new, old, out=new)  # in place: exact on both branches
        self._drop_new_state(optimizer, params, before, scalars, ok)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Advance the scale once for the iteration (all optimizers stepped since the last one)."""
        if new_scale is not None and self._active_config.policy == "cerebras":
            raise ScalerUsageError("update(new_scale) is not supported in the cerebras policy: the "
                               "scale follows the policy (construct with loss_scale=<number> "
                               "for a static scale)")
        flags = [r["isfinite"] for r in self._per_opt.values() if r["isfinite"] is not None]
        self._last_stepped = {k: r["isfinite"] for k, r in self._per_opt.items()
                              if r["stage"] == _STEPPED}
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

    def _after_compiled_step(self, skipped_before: Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Bookkeeping ``update()`` does, for a step whose graph updated ``state`` in place
        (``dlspass.compile``): the overflow flag, read from the skip counter on the device,
        and whether ``optimizer`` stepped (for `stepped` and `hold_scheduler_on_skip`)."""
        self._found_inf = self.state.num_skipped_steps != skipped_before
        self._last_stepped = {id(optimizer): ~self._found_inf}
        self._count_update()

    def _count_update(self) -> None:
        # the scale-floor check reads the device state: every FLOOR_CHECK_EVERY iterations only
        self._updates += 1
        if self._updates % FLOOR_CHECK_EVERY == 0:
            self._check_floor()

    def get_scale(self) -> Tensor:
        """The scale the next ``scale()`` uses (0-d float32; 1.0 when disabled).

        Also the lazy point of the scale-floor warning/error (one host read while unreported).
        """
        self._check_floor()
        if not self._active_config.enabled:
            return torch.ones((), dtype=torch.float32, device=self.state.loss_scale.device)
        return self.state.loss_scale

    def get_scale_tensor(self) -> Tensor:
        """The scale as a 0-d float32 tensor, without a host sync (1.0 when disabled)."""
        if not self._active_config.enabled:
            return torch.ones((), dtype=torch.float32, device=self.state.loss_scale.device)
        return self.state.loss_scale

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean iterations."""
        v = self.config.growth_factor
        return v if v is not None else self.config.growth

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1); raises `ConfigError` for an invalid value."""
        self._replace_config(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by on an overflow."""
        v = self.config.backoff_factor
        return v if v is not None else self.config.backoff

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)); raises `ConfigError` for an invalid value."""
        self._replace_config(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """Clean iterations between two growths (cstorch: ``steps_per_increase``)."""
        v = self.config.steps_per_increase
        return v if v is not None else self.config.growth_interval

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
        ``growth_interval``, which `load_state_dict` restores.
        """
        self._check_floor()
        cfg = {k: v for k, v in self.config.to_dict().items() if k != "extras"}
        if self.config.dynamic:
            out: dict[str, Any] = {f: getattr(self.state, f).detach().clone() for f in STATE_FIELDS}
            out["growth_factor"] = self.get_growth_factor()
            out["backoff_factor"] = self.get_backoff_factor()
            out["growth_interval"] = self.get_growth_interval()
        else:
            out = {"loss_scale": self.state.loss_scale.detach().clone()}
        out["format_version"] = FORMAT_VERSION
        out["config"] = cfg
        return out

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
        self._install(*self._plan_load(state_dict))

    def _install(self, config: DLSConfig, state: ScalerState | None) -> None:
        """The only place a checkpoint changes the scaler: after every entry was checked."""
        self._end_step()
        self._commit_config(config)
        if state is not None:
            self.state = state
            self._floor_reported = False

    def _plan_load(self, state_dict: object) -> tuple[DLSConfig, ScalerState | None]:
        """Check every entry of ``state_dict``; return the config and state to install.

        Three steps: bring the accepted forms to one dict (`_normalized_checkpoint`), check its
        entries under the names the checkpoint uses, then rebuild the state from the checked
        values. ``None`` for the state: a static or disabled scaler keeps its configuration.
        """
        torch_amp, sd = _normalized_checkpoint(state_dict)
        checked = self._checked_torch_amp if torch_amp else self._checked_entries
        config, vals = checked(sd)
        return config, (None if vals is None else self._state_from(config, vals))

    def _checked_entries(self, sd: Mapping[str, Any]
                         ) -> tuple[DLSConfig, dict[str, float | int] | None]:
        """This class's own entries (also cstorch's): the config and the state values."""
        version = sd.get("format_version", FORMAT_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version > FORMAT_VERSION:
            raise ScalerStateError(f"format_version: {_short(version)} is not a format this "
                                   f"dlspass understands (newest: {FORMAT_VERSION})")
        ck_cfg = sd.get("config")
        if ck_cfg is None:
            ck_cfg = {}
        if not isinstance(ck_cfg, Mapping):
            raise ScalerStateError(f"config: expected a dict, got {type(ck_cfg).__name__}")
        config = self._config_with_factors(sd, ck_cfg)
        vals: dict[str, float | int] = {
            f: (checked_scale(f, sd[f]) if STATE_DTYPES[f] == torch.float32
                else _checked_count(f, sd[f]))
            for f in STATE_FIELDS if f in sd
        }
        if not self.config.dynamic:
            return self.config, None  # a static/disabled scaler's scale is its configuration
        missing = [k for k in REQUIRED_DYNAMIC_KEYS if k not in sd]
        static = "loss_scale" in ck_cfg and ck_cfg["loss_scale"] != "dynamic"
        if static or (missing and "loss_scale" in sd):
            raise ScalerStateError(
                f"load_state_dict: the checkpoint holds a static loss scale (no "
                f"{', '.join(missing) or 'dynamic state'}); it cannot resume a dynamic scaler. "
                f"Pass load_state_dict({{}}) to restart DLS from the configuration instead")
        if missing:
            raise ScalerStateError(f"load_state_dict: missing key(s) {', '.join(missing)}")
        return config, vals

    def _checked_torch_amp(self, sd: Mapping[str, Any]
                           ) -> tuple[DLSConfig, dict[str, float | int] | None]:
        """torch.amp.GradScaler's five entries, as the same config and state values."""
        if self.config.policy != "torch":
            raise ScalerStateError("load_state_dict: this is a torch.amp.GradScaler state_dict; "
                                   "it loads into policy='torch' (dlspass.TorchGradScaler) only")
        missing = [k for k in TORCH_AMP_KEYS if k not in sd]
        if missing:
            raise ScalerStateError(f"load_state_dict: missing key(s) {', '.join(missing)}")
        scale = checked_scale("scale", sd["scale"])
        tracker = _checked_count("_growth_tracker", sd["_growth_tracker"])
        config = self._config_with_factors(sd, {})
        if not self.config.dynamic:
            return self.config, None
        return config, {"loss_scale": scale, "steps_since_rescale": tracker}

    def _state_from(self, config: DLSConfig, vals: Mapping[str, float | int]) -> ScalerState:
        """The state rebuilt from checked values; a key not given takes its fresh value."""
        given = {"hysteresis": config.hysteresis_steps, "non_clamped_scale": vals["loss_scale"],
                 **vals}
        device = self.state.loss_scale.device
        return ScalerState(**{f: torch.tensor(given.get(f, 0), dtype=STATE_DTYPES[f],
                                              device=device)
                              for f in STATE_FIELDS})

    def _config_with_factors(self, sd: Mapping[str, Any], ck_cfg: Mapping[str, Any]) -> DLSConfig:
        """The config with the checkpoint's growth factor, backoff factor and interval."""
        changes: dict[str, Any] = {}
        resolved = {"growth_factor": self.config.growth, "backoff_factor": self.config.backoff,
                    "steps_per_increase": self.config.growth_interval}
        for key, field in (("growth_factor", "growth_factor"), ("backoff_factor", "backoff_factor"),
                           ("growth_interval", "steps_per_increase")):
            if key in sd:
                name, raw = key, sd[key]
            elif ck_cfg.get(field) is not None:
                name, raw = f"config.{field}", ck_cfg[field]
            else:
                continue
            if field == "steps_per_increase":
                value = _checked_count(name, raw, minimum=1)
            else:
                value = _checked_factor(name, raw, growth=field == "growth_factor")
            # A value equal to what the config already resolves to (the preset's default)
            # leaves the config as it is: a restored scaler then equals a fresh one.
            if value != resolved[field]:
                changes[field] = value
        if not changes:
            return self.config
        try:
            return dataclasses.replace(self.config, **changes)
        except ConfigError as e:  # pragma: no cover - the checks above are DLSConfig's
            raise ScalerStateError(str(e)) from e


def _normalized_checkpoint(state_dict: object) -> tuple[bool, dict[Any, Any]]:
    """The scaler entries of a checkpoint in one flat dict, and whether they are torch.amp's.

    Accepted forms: a nested ``{"grad_scaler": {...}}`` (a whole Cerebras/Model Zoo
    checkpoint), flattened ``grad_scaler.<key>`` keys, this class's own dict, and
    torch.amp.GradScaler's (``scale`` and ``_growth_tracker`` among its keys).
    """
    if not isinstance(state_dict, Mapping):
        raise ScalerStateError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
    sd = dict(state_dict)
    if isinstance(sd.get("grad_scaler"), Mapping):
        sd = dict(sd["grad_scaler"])
    prefix = "grad_scaler."
    flat = {k[len(prefix):] if isinstance(k, str) and k.startswith(prefix) else k: v
            for k, v in sd.items()}
    return "scale" in flat and "_growth_tracker" in flat, flat


class TorchGradScaler(GradScaler, torch.amp.GradScaler):
    """``torch.amp.GradScaler``, step for step, on dlspass's scaler state.

    The signature, defaults, return values, errors, ``state_dict`` keys and the scale
    trajectory are torch's: unscaling runs torch's own helper and kernel (the reciprocal in
    float64), the update runs ``torch._amp_update_scale_`` (no floor, a growth that would
    overflow float32 is refused). ``get_scale()`` returns a Python float, ``step()`` the
    optimizer's return value (None when skipped, after one host read of the overflow flag, as
    torch), fused optimizers get torch's ``grad_scale``/``found_inf`` protocol (or the scaler
    itself when their ``step`` takes ``grad_scaler=``), and a ``state_dict()`` loads into
    ``torch.amp.GradScaler`` and back. It is a ``torch.amp.GradScaler`` for ``isinstance``.

    Added on top: the sync-free ``get_scale_tensor()``, ``found_inf`` and ``stepped(opt)``
    (for `hold_scheduler_on_skip`); checkpoints checked before anything is restored
    (`ScalerStateError`); agreement over ``process_group`` under ``torch.distributed``; and
    one guard: below a scale of 1, where unscaling can turn finite gradients into inf, a
    step whose unscaled gradients are not finite is skipped with a warning instead of writing
    inf/NaN into the parameters (the scale trajectory stays torch's). As torch,
    ``device="cuda"`` without CUDA warns and disables the scaler.
    docs/TORCH_AMP_DIFFERENCES.md lists every difference and the test that shows it.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        process_group: Any = None,
    ) -> None:
        if enabled and device == "cuda" and not torch.cuda.is_available():
            warnings.warn("dlspass.TorchGradScaler is enabled, but CUDA is not available. "
                          "Disabling.", UserWarning, stacklevel=2)
            enabled = False
        if enabled:  # torch's own checks, with its exception type
            if growth_factor <= 1.0:
                raise ScalerAssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise ScalerAssertionError("The backoff factor must be < 1.0.")
        checked_scale("init_scale", init_scale, ConfigError)
        self._amp_device = device
        self._amp_initialized = False  # torch sets its scale up in the first scale()
        self._unscale_guard_warned = False
        cfg = DLSConfig(
            loss_scale="dynamic" if enabled else None, initial_loss_scale=init_scale,
            steps_per_increase=growth_interval, growth_factor=growth_factor,
            backoff_factor=backoff_factor, policy="torch",
            min_loss_scale=FLOAT32_TINY,  # no floor: torch lets the scale decay
        )
        self._setup(cfg, None, process_group)

    # ---- torch.amp's lazy set-up and the private protocol fused optimizers use -------------
    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        if not self._amp_initialized:
            device = torch.device(dev)
            if self._lazy_device and self.state.loss_scale.device != device:
                self._move_state(device)
            self._amp_initialized = True

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Tensor, Tensor]:
        if not self._amp_initialized:
            raise ScalerAssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did "
                f"not use scaler.scale(loss or outputs) earlier in the iteration.")
        return self.state.loss_scale, self.state.steps_since_rescale

    def _get_scale_async(self) -> Tensor | None:
        return self.state.loss_scale if self._amp_initialized else None

    def _get_growth_tracker(self) -> int:
        return int(self.state.steps_since_rescale) if self.is_enabled() else 0

    def _record(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_opt.setdefault(id(optimizer), {
            "stage": None, "isfinite": None, "found_inf_per_device": {}, "guarded": False})

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        rec = self._record(optimizer)
        rec["found_inf_per_device"] = self._unscale_grads_(optimizer, dummy_inv_scale, found_inf,
                                                           True)
        return rec["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        return self._record(optimizer)["found_inf_per_device"]

    # ---- torch.amp API ------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs`` times the scale: a tensor, or an iterable of them (as torch.amp)."""
        if not self.is_enabled():
            return outputs
        if isinstance(outputs, Tensor):
            self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self.state.loss_scale.to(device=outputs.device, non_blocking=True)
        stash: list[Tensor] = []

        def apply_scale(val: Any) -> Any:
            if isinstance(val, Tensor):
                if not stash:
                    self._lazy_init_scale_growth_tracker(val.device)
                    stash.append(self.state.loss_scale)
                return val * stash[0].to(device=val.device, non_blocking=True)
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise InputValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record overflows.

        As torch.amp: float16 gradients raise ``ValueError``, sparse COO gradients have their
        values unscaled, and no host sync happens here.
        """
        if not self.is_enabled():
            self.backend_found_finite = None  # a disabled scaler ignores it (and has no update)
            return
        self._check_scale_growth_tracker("unscale_")
        rec = self._record(optimizer)
        if rec["stage"] == _UNSCALED:
            raise ScalerUsageError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        if rec["stage"] == _STEPPED:
            raise ScalerUsageError("unscale_() is being called after step().")
        rec["found_inf_per_device"] = self._found_infs(optimizer)
        rec["stage"] = _UNSCALED

    def _found_infs(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        scale = self.state.loss_scale
        flag = self.backend_found_finite
        group = distributed.resolve_group(self.process_group)
        if group is not None:
            _refuse_backend_flag_with_group(flag)
        if flag is not None:
            # a dlspass.make_backend graph already unscaled and checked these gradients
            return {scale.device: (~flag).to(device=scale.device, dtype=torch.float32)}
        if group is not None:  # a collective: the flag every rank shares
            isfinite = self._unscale_distributed(optimizer, group)
            return {scale.device: (~isfinite).to(device=scale.device, dtype=torch.float32)}
        # torch's arithmetic: the reciprocal in float64, then torch's own unscale helper
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        return self._unscale_grads_(optimizer, inv_scale, found_inf, False)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if not done yet, then ``optimizer.step(*args, **kwargs)`` unless an overflow
        was found; returns what ``optimizer.step`` returned (None when skipped)."""
        if not self.is_enabled():
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise ScalerUsageError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        rec = self._record(optimizer)
        if rec["stage"] == _STEPPED:
            raise ScalerUsageError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._amp_scaling_step(optimizer, rec, args, kwargs)
        if rec["stage"] is None:
            self.unscale_(optimizer)
        if not rec["found_inf_per_device"]:
            raise ScalerAssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, rec, *args, **kwargs)
        rec["stage"] = _STEPPED
        return retval

    def _amp_scaling_step(self, optimizer: torch.optim.Optimizer, rec: dict[str, Any],
                          args: tuple, kwargs: dict) -> Any:
        """torch's contract with optimizers that handle the scale themselves (fused ones)."""
        kwargs_ = dict(kwargs)
        has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
        if has_grad_scaler_kwarg:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.", FutureWarning, stacklevel=3)
            kwargs_["grad_scaler"] = self
        else:
            if rec["stage"] is None:
                self._check_inf_per_device(optimizer)
            scale = self.state.loss_scale
            found_inf = sum(t.to(scale.device, non_blocking=True)
                            for t in rec["found_inf_per_device"].values())
            # a grad_scale the user set on the optimizer is multiplied in, as torch does
            optimizer.grad_scale = (  # type: ignore[attr-defined]
                getattr(optimizer, "grad_scale", None) if rec["stage"] == _UNSCALED
                else scale * getattr(optimizer, "grad_scale", 1))
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        retval = optimizer.step(*args, **kwargs_)
        rec["stage"] = _STEPPED
        if not has_grad_scaler_kwarg:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        found = list(rec["found_inf_per_device"].values())
        if found:
            rec["isfinite"] = torch.stack([f.to(self.state.loss_scale.device) for f in found]
                                          ).sum() == 0
        return retval

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> Any:
        scale = self.state.loss_scale
        found = torch.stack([t.to(scale.device).reshape(()).float()
                             for t in optimizer_state["found_inf_per_device"].values()]).sum()
        found_any, current = torch.stack([found, scale]).tolist()  # the one host read, as torch
        ok = not found_any
        if ok and current < 1.0 and not _grads_finite(optimizer):
            # only below a scale of 1 can unscaling itself overflow a finite gradient
            ok = False
            optimizer_state["guarded"] = True
            if not self._unscale_guard_warned:
                self._unscale_guard_warned = True
                warnings.warn(
                    f"dlspass.TorchGradScaler: the gradients overflowed when divided by the "
                    f"scale {current!r} (below 1); the step is skipped so that no inf/NaN "
                    f"reaches the parameters (torch.amp.GradScaler would take it). The scale "
                    f"follows torch's rule unchanged", RuntimeWarning, stacklevel=3)
        optimizer_state["isfinite"] = torch.tensor(ok, device=scale.device)
        return optimizer.step(*args, **kwargs) if ok else None

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """torch.amp's update: back off on an overflow, grow after ``growth_interval`` clean
        iterations (``torch._amp_update_scale_``), or take ``new_scale`` (checked: a finite
        number > 0 that float32 holds, else `ScalerStateError`)."""
        if not self.is_enabled():
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        records = self._per_opt
        found_infs = [t.to(device=scale.device, non_blocking=True)
                      for r in records.values() for t in r["found_inf_per_device"].values()]
        if new_scale is not None:
            value = self._checked_new_scale(new_scale, scale)
            state = self.state._replace(loss_scale=value, non_clamped_scale=value.clone())
        else:
            if not found_infs:
                raise ScalerAssertionError("No inf checks were recorded prior to update.")
            found = found_infs[0].clone()
            for f in found_infs[1:]:
                found += f
            new_value, tracker32 = scale.clone(), tracker.to(torch.int32)
            cfg = self._active_config
            torch._amp_update_scale_(new_value, tracker32, found, cfg.growth, cfg.backoff,
                                     cfg.growth_interval)
            state = self.state._replace(loss_scale=new_value, non_clamped_scale=new_value.clone(),
                                        steps_since_rescale=tracker32.to(torch.int64))
        overflow = (torch.stack([f.reshape(()) for f in found_infs]).sum() > 0 if found_infs
                    else torch.zeros((), dtype=torch.bool, device=scale.device))
        skipped = overflow | any(r["guarded"] for r in records.values())
        self.state = state._replace(
            num_skipped_steps=state.num_skipped_steps + skipped.to(torch.int64))
        self._found_inf = overflow
        self._last_stepped = {k: r["isfinite"] for k, r in records.items()
                              if r["stage"] == _STEPPED and r["isfinite"] is not None}
        self._end_step()
        self._count_update()

    def _checked_new_scale(self, new_scale: float | Tensor, scale: Tensor) -> Tensor:
        if isinstance(new_scale, float):
            return torch.full((), checked_scale("new_scale", new_scale), dtype=torch.float32,
                              device=scale.device)
        reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                  "torch.FloatTensor with requires_grad=False.")
        if new_scale.device.type != self._amp_device:
            raise ScalerAssertionError(reason)
        if new_scale.numel() != 1:
            raise ScalerAssertionError(reason)
        if new_scale.requires_grad is True:
            raise ScalerAssertionError(reason)
        checked_scale("new_scale", new_scale)  # one host read, on this rare call
        return scale.clone().copy_(new_scale)

    def get_scale(self) -> float:  # type: ignore[override]
        """The current scale as a Python float (one host read; 1.0 when disabled)."""
        if not self.is_enabled():
            return 1.0
        return self.state.loss_scale.item()

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.amp's five entries (``{}`` when disabled): loads into torch.amp.GradScaler."""
        if not self.is_enabled():
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self.get_growth_factor(),
            "backoff_factor": self.get_backoff_factor(),
            "growth_interval": self.get_growth_interval(),
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load torch.amp's state_dict (or a `GradScaler` one); a no-op when disabled.

        An empty dict raises ``RuntimeError`` as torch does; a bad entry `ScalerStateError`,
        before anything changes.
        """
        if not self.is_enabled():
            return
        if isinstance(state_dict, Mapping) and len(state_dict) == 0:
            raise ScalerUsageError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        self._install(*self._plan_load(state_dict))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.is_enabled():
            if self._per_opt:
                raise ScalerAssertionError("A GradScaler instance may only be pickled at the beginning "
                                     "of an iteration, or at the end after scaler.update().")
            state["_amp_initialized"] = False  # as torch: set up again by the next scale()
        state["_buffers"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient of ``optimizer`` is finite (a host read)."""
    grads = [p.grad._values() if p.grad.is_sparse else p.grad
             for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return bool(scale_policy.all_finite(grads)) if grads else True


class HeldScheduler:
    """An LR scheduler that holds its position on skipped steps (Cerebras semantics).

    ``step()`` reads the scaler's per-optimizer "stepped" flag of the last finished iteration
    (one host read, here and nowhere else) and forwards to the wrapped scheduler only when the
    optimizer really stepped, so torch's "lr_scheduler.step() before optimizer.step()" warning
    cannot fire. Call it after ``scaler.update()``. Other attributes forward to the scheduler.
    """

    def __init__(self, scheduler: Any, scaler: GradScaler) -> None:
        self.scheduler = scheduler
        self.scaler = scaler
        self.held_steps = 0

    def step(self, *args: Any, **kwargs: Any) -> bool:
        """Advance the scheduler if its optimizer stepped; returns whether it advanced."""
        flag = self.scaler.stepped(self.scheduler.optimizer)
        if flag is None or not bool(flag):
            self.held_steps += 1
            return False
        self.scheduler.step(*args, **kwargs)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


def hold_scheduler_on_skip(scheduler: Any, scaler: GradScaler) -> HeldScheduler:
    """Wrap ``scheduler`` so that it does not advance on steps ``scaler`` skipped."""
    return HeldScheduler(scheduler, scaler)
