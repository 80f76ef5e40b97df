"""`TorchGradScaler`: torch.amp.GradScaler's contract, step for step, on dlspass's scaler state."""

from __future__ import annotations

import inspect
import warnings
from collections import abc
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dlspass import distributed, scale_policy
from dlspass.config import FLOAT32_MAX, ConfigError, DLSConfig
from dlspass.errors import InputValueError
from dlspass.scaler.eager import STEPPED, UNSCALED, GradScaler, refuse_backend_flag_with_group
from dlspass.scaler.errors import ScalerAssertionError, ScalerUsageError
from dlspass.scaler.state_dict import FLOAT32_TINY, checked_scale


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
    (`ScalerStateError`); agreement over ``process_group`` under ``torch.distributed``
    (as `GradScaler`'s: one all-reduce whose flag and norm read every gradient's DTensor
    placements, where torch.amp reduces ``found_inf`` by the first gradient of each group); and
    one guard: below a scale of 1, where unscaling can turn finite gradients into inf, a
    step whose unscaled gradients are not finite is skipped with a warning instead of writing
    inf/NaN into the parameters (the scale trajectory stays torch's). As torch,
    ``device="cuda"`` without CUDA warns and disables the scaler.
    docs/TORCH_AMP_DIFFERENCES.md lists every difference and the test that shows it.
    """

    _divide_below_normal = False  # torch's arithmetic: times the reciprocal (and its guard)

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
        summary_writer: Any = None,
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
            max_loss_scale=FLOAT32_MAX,  # no cap: torch only refuses a growth to inf
        )
        self._setup(cfg, None, process_group, summary_writer)

    # ---- torch.amp's lazy set-up and the private protocol fused optimizers use -------------
    @property
    def _device(self) -> str:
        return self._amp_device

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
        if rec["stage"] == UNSCALED:
            raise ScalerUsageError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        if rec["stage"] == STEPPED:
            raise ScalerUsageError("unscale_() is being called after step().")
        rec["found_inf_per_device"] = self._found_infs(optimizer)
        rec["stage"] = UNSCALED

    def _found_infs(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        scale = self.state.loss_scale
        flag = self.backend_found_finite
        group = distributed.resolve_group(self.process_group)
        if group is not None:
            refuse_backend_flag_with_group(flag)
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
        if rec["stage"] == STEPPED:
            raise ScalerUsageError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._amp_scaling_step(optimizer, rec, args, kwargs)
        if rec["stage"] is None:
            self.unscale_(optimizer)
        if not rec["found_inf_per_device"]:
            raise ScalerAssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, rec, *args, **kwargs)
        rec["stage"] = STEPPED
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
                getattr(optimizer, "grad_scale", None) if rec["stage"] == UNSCALED
                else scale * getattr(optimizer, "grad_scale", 1))
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        retval = optimizer.step(*args, **kwargs_)
        rec["stage"] = STEPPED
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
                              if r["stage"] == STEPPED and r["isfinite"] is not None}
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
        self._load_checked(state_dict)

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

