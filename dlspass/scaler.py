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
optimizer; with one optimizer it is the global norm of SPEC.md §1.)

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
uninitialised momentum buffer there). After the first successful step this never happens again.

Distributed training (``dlspass.distributed``): once ``torch.distributed`` is initialised the
scaler agrees over the default process group (``process_group=`` overrides) with one on-device
``all_reduce`` per optimizer and iteration, which gives both the global gradient norm (FSDP2
shards summed, DDP replicas counted once) and an overflow flag every rank shares; DTensor
gradients and parameters are handled through their local shards.

The scale-floor signal (`ScaleFloorWarning`, or `ScaleFloorError` with
``on_scale_floor="raise"``) reads the floor counter lazily: in ``get_scale()``, in
``state_dict()`` and once every ``FLOOR_CHECK_EVERY`` updates - never once per step.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from . import distributed, scale_policy
from .config import DLSConfig
from .errors import DLSPassError
from .scale_policy import (
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
# SPEC.md §1: the keys a dynamic checkpoint must carry (the others have safe defaults).
REQUIRED_DYNAMIC_KEYS = ("loss_scale", "steps_since_rescale", "overflows_since_rescale",
                         "num_skipped_steps")
TORCH_AMP_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
# How often update() looks at the floor counter on its own (one host read per this many updates).
FLOOR_CHECK_EVERY = 1000

_UNSCALED, _STEPPED = "unscaled", "stepped"


class ScaleFloorWarning(RuntimeWarning):
    """The loss scale keeps hitting ``min_loss_scale`` while gradients still overflow."""


class ScaleFloorError(DLSPassError, RuntimeError):
    """Raised instead of `ScaleFloorWarning` when ``on_scale_floor="raise"``."""


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
    raise TypeError(f"scale(): expected a tensor or a (nested) list/tuple/dict of tensors, "
                    f"got {type(obj).__name__}")


def _params_with_grad(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError("dlspass.GradScaler: sparse gradients are not supported")
                out.append(p)
    return out


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
            ``torch.distributed`` is initialised; nothing is communicated with one rank).

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
            raise ValueError("init_scale and initial_loss_scale are aliases: give only one")
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
                raise ValueError(f"config= and keyword settings are alternatives; got both "
                                 f"(config and {', '.join(both)})")
            if not isinstance(config, DLSConfig):
                raise TypeError(f"config: expected a DLSConfig, got {type(config).__name__}")
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
        self.config = config
        self.process_group = process_group
        self._cfg = config  # the active config: bfloat16 pass-through replaces it
        # set by a dlspass.make_backend graph that unscaled and checked the gradients itself
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
        c = self._cfg
        return c.enabled or c.max_gradient_norm is not None or c.max_gradient_value is not None

    def _move_state(self, device: torch.device) -> None:
        self.state = ScalerState(*(t.to(device) for t in self.state))
        self._found_inf = self._found_inf.to(device)
        self._lazy_device = False

    def _check_floor(self) -> None:
        """The lazy floor signal: one host read, never on the per-step path."""
        if not self._cfg.dynamic or (self._floor_reported and self._cfg.on_scale_floor == "warn"):
            return
        n = int(self.state.floor_overflows)
        if n <= 0:
            return
        msg = (f"dlspass: gradients overflowed {n} time(s) with the loss scale already at its "
               f"floor (min_loss_scale={self._cfg.min_scale!r}); the steps are being skipped. "
               f"Likely cause: weights or activations beyond the {self._cfg.fp16_type} range "
               f"(e.g. a bfloat16-pretrained model run in float16) or a diverging run; consider "
               f"bfloat16, a lower learning rate, or finding the first inf/NaN in the forward")
        if self._cfg.on_scale_floor == "raise":
            raise ScaleFloorError(msg)
        self._floor_reported = True
        warnings.warn(msg, ScaleFloorWarning, stacklevel=3)

    # ---- torch.amp API ------------------------------------------------------------------------
    def is_enabled(self) -> bool:
        """True when the scaler scales (dynamic or static scale other than 1)."""
        return self._cfg.enabled

    def scale(self, outputs: Any) -> Any:
        """``outputs`` times the current scale (a tensor or nested list/tuple/dict of them)."""
        tensors = list(_walk_tensors(outputs))
        if any(t.dtype == torch.bfloat16 for t in tensors) and self._cfg.enabled:
            self._warn_bf16("the loss is bfloat16")
            self._cfg = dataclasses.replace(self.config, fp16_type="bfloat16")
        if not self._cfg.enabled:
            _map_tensors(outputs, lambda t: t)  # still reject non-tensors
            return outputs
        if tensors and self._lazy_device and tensors[0].device != self.state.loss_scale.device:
            self._move_state(tensors[0].device)
        scale = self.state.loss_scale
        return _map_tensors(outputs, lambda t: t * scale.to(t.device))

    def _record(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_opt.setdefault(id(optimizer), {"stage": None, "isfinite": None})

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place, check and clip them.

        fp16 gradients are accepted: the math runs in float32 and the result is written back
        in the gradient's dtype.
        """
        rec = self._record(optimizer)
        if rec["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update()")
        if rec["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call it before "
                               "step(), once per optimizer per iteration")
        rec["stage"] = _UNSCALED
        device = self.state.loss_scale.device
        if not self._needs_grad_work():
            rec["isfinite"] = torch.ones((), dtype=torch.bool, device=device)
            return
        group = distributed.resolve_group(self.process_group)
        if group is not None:
            # a collective: every rank runs it, also one with no gradients
            rec["isfinite"] = self._unscale_distributed(optimizer, group).to(device)
            return
        grads = [p.grad for p in _params_with_grad(optimizer)]
        if not grads:
            rec["isfinite"] = torch.ones((), dtype=torch.bool, device=device)
            return
        backend_flag = getattr(self, "backend_found_finite", None)
        if backend_flag is not None:
            # A dlspass.make_backend graph already unscaled and checked these gradients in its
            # backward; only clipping is left to do here.
            self.backend_found_finite = None
            cfg = self._cfg
            if cfg.max_gradient_norm is not None or cfg.max_gradient_value is not None:
                unscaled = [g.to(torch.float32) for g in grads]
                norm = scale_policy.global_norm(unscaled) if cfg.max_gradient_norm is not None else None
                torch._foreach_copy_(grads, clip(unscaled, norm, cfg))
            rec["isfinite"] = backend_flag.to(device)
            return
        scale = self.state.loss_scale.to(grads[0].device)
        cfg = self._cfg
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
        cfg = self._cfg
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

        Returns a 0-d bool tensor, True when the optimizer stepped (no host sync).
        """
        if "closure" in kwargs or args:
            if self._cfg.dynamic:
                raise RuntimeError("dlspass.GradScaler.step: closures are not supported with "
                                   "dynamic loss scaling")
        rec = self._record(optimizer)
        if rec["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last "
                               "update()")
        if rec["stage"] is None:
            self.unscale_(optimizer)
        rec["stage"] = _STEPPED
        ok = rec["isfinite"]
        if not self._cfg.dynamic:
            optimizer.step(*args, **kwargs)
            return ok
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            self._fused_step(optimizer, ok)
        else:
            self._masked_step(optimizer, ok)
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

    def _fused_step(self, optimizer: torch.optim.Optimizer, ok: Tensor) -> None:
        params = _params_with_grad(optimizer)
        before = self._state_keys(optimizer, params)
        # Gradients are already unscaled (and clipped): grad_scale None, found_inf as a float.
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = (~ok).to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        self._drop_new_state(optimizer, params, before, [], ok)

    def _snapshot(self, optimizer: torch.optim.Optimizer, live: list[Tensor]) -> list[Tensor]:
        # The snapshot buffers are reused across iterations (one foreach copy, no fresh
        # allocation and page faults per step); they hold no information between steps, so a
        # fresh scaler that loaded a state_dict behaves the same.
        sig = tuple((t.shape, t.dtype, t.device) for t in live)
        cached = self._buffers.get(id(optimizer))
        if cached is None or cached[0] != sig:
            cached = (sig, [torch.empty_like(t) for t in live])
            self._buffers[id(optimizer)] = cached
        torch._foreach_copy_(cached[1], live)
        return cached[1]

    def _masked_step(self, optimizer: torch.optim.Optimizer, ok: Tensor) -> None:
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
        optimizer.step()
        for new, old in zip(live, saved, strict=True):
            torch.where(ok.to(new.device), new, old, out=new)  # in place: exact on both branches
        self._drop_new_state(optimizer, params, before, scalars, ok)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Advance the scale once for the iteration (all optimizers stepped since the last one)."""
        if new_scale is not None and self._cfg.policy == "cerebras":
            raise RuntimeError("update(new_scale) is not supported in the cerebras policy: the "
                               "scale follows the policy (construct with loss_scale=<number> "
                               "for a static scale)")
        flags = [r["isfinite"] for r in self._per_opt.values() if r["isfinite"] is not None]
        self._last_stepped = {k: r["isfinite"] for k, r in self._per_opt.items()
                              if r["stage"] == _STEPPED}
        self._per_opt = {}
        if not self._cfg.enabled:
            return
        if not flags:
            raise RuntimeError("update(): no optimizer was unscaled or stepped since the last "
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
            self.state = update_state(self.state, ok, self._cfg)
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
        if not self._cfg.enabled:
            return torch.ones((), dtype=torch.float32, device=self.state.loss_scale.device)
        return self.state.loss_scale

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
        """Tensors and plain values only (``torch.load(weights_only=True)`` loads it)."""
        self._check_floor()
        cfg = {k: v for k, v in self.config.to_dict().items() if k != "extras"}
        if self.config.dynamic:
            out: dict[str, Any] = {f: getattr(self.state, f).detach().clone() for f in STATE_FIELDS}
        else:
            out = {"loss_scale": self.state.loss_scale.detach().clone()}
        out["format_version"] = FORMAT_VERSION
        out["config"] = cfg
        return out

    def _from_torch_amp(self, sd: dict[str, Any]) -> dict[str, Any]:
        if self.config.policy != "torch":
            raise ValueError("load_state_dict: this is a torch.amp.GradScaler state_dict; it "
                             "loads into policy='torch' (dlspass.TorchGradScaler) only")
        cfg = dataclasses.replace(
            self.config, growth_factor=float(sd["growth_factor"]),
            backoff_factor=float(sd["backoff_factor"]),
            steps_per_increase=int(sd["growth_interval"]))
        self.config = cfg
        self._cfg = cfg if self._cfg.fp16_type == cfg.fp16_type else dataclasses.replace(
            cfg, fp16_type=self._cfg.fp16_type)
        return {"loss_scale": sd["scale"], "steps_since_rescale": sd["_growth_tracker"],
                "overflows_since_rescale": 0, "num_skipped_steps": 0}

    def load_state_dict(self, state_dict: dict[str, Any] | None) -> None:
        """Restore a checkpoint; ``None``/``{}`` restarts from the configuration.

        Accepts this class's own dicts, cstorch's flattened ``grad_scaler.*`` keys, a nested
        ``{"grad_scaler": {...}}`` and (policy ``torch``) a torch.amp.GradScaler state_dict.
        """
        device = self.state.loss_scale.device
        self._per_opt = {}
        if not state_dict:
            self.state = init_state(self.config, device)
            self._found_inf = torch.zeros((), dtype=torch.bool, device=device)
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        sd = dict(state_dict)
        if isinstance(sd.get("grad_scaler"), dict):
            sd = dict(sd["grad_scaler"])
        sd = {k[len("grad_scaler."):] if k.startswith("grad_scaler.") else k: v
              for k, v in sd.items()}
        if "scale" in sd and "_growth_tracker" in sd:
            sd = self._from_torch_amp(sd)
        version = sd.get("format_version", FORMAT_VERSION)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(f"load_state_dict: format_version {version!r} is newer than this "
                             f"dlspass understands ({FORMAT_VERSION})")
        if not self.config.dynamic:
            return  # a static/disabled scaler's scale is its configuration
        ck_cfg = sd.get("config") or {}
        missing = [k for k in REQUIRED_DYNAMIC_KEYS if k not in sd]
        static = (isinstance(ck_cfg, dict) and "loss_scale" in ck_cfg
                  and ck_cfg["loss_scale"] != "dynamic")
        if static or (missing and "loss_scale" in sd):
            raise ValueError(
                f"load_state_dict: the checkpoint holds a static loss scale (no "
                f"{', '.join(missing) or 'dynamic state'}); it cannot resume a dynamic scaler. "
                f"Pass load_state_dict({{}}) to restart DLS from the configuration instead")
        if missing:
            raise ValueError(f"load_state_dict: missing key(s) {', '.join(missing)}")
        vals = {}
        for f in STATE_FIELDS:
            if f in sd:
                v = sd[f]
            elif f == "hysteresis":
                v = self.config.hysteresis_steps
            elif f == "non_clamped_scale":
                v = sd["loss_scale"]
            else:
                v = 0
            t = torch.as_tensor(v).detach().to(device=device, dtype=STATE_DTYPES[f]).reshape(())
            vals[f] = t.clone()
        self.state = ScalerState(**vals)
        self._floor_reported = False


class TorchGradScaler(GradScaler):
    """torch.amp.GradScaler's signature and defaults, running the ``torch`` preset.

    Differences from torch: the scale never goes below 2**-14 (so 1/scale stays finite) and
    overflow is tested on the unscaled gradients. ``enabled=False`` passes straight through.
    As torch, ``device="cuda"`` without CUDA warns and disables the scaler.
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
        self._amp_device = device
        cfg = DLSConfig(
            loss_scale="dynamic" if enabled else None, initial_loss_scale=float(init_scale),
            steps_per_increase=growth_interval, growth_factor=growth_factor,
            backoff_factor=backoff_factor, policy="torch",
        )
        self._setup(cfg, None, process_group)


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
