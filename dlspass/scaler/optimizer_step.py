"""An optimizer step that an overflow turns into a no-op, without a host sync.

`GradScaler.step` runs ``optimizer.step`` whatever the overflow flag says and makes a step on
non-finite gradients leave no trace:

- fused optimizers (``fused=True``, torch's ``_step_supports_amp_scaling``, `fused_step`): the
  already unscaled gradients go in with ``found_inf`` as the kernel argument, so the kernel
  itself is a no-op on overflow and rolls its step count back (no snapshot). ``grad_scale``
  stays None: the overflow test and clipping need the unscaled gradients before the kernel
  runs anyway;
- other optimizers (`masked_step`): parameters and tensor state are snapshotted before
  ``opt.step()`` and put back in place with ``torch.where(isfinite, new, old)`` (bit-exact on
  both branches). This costs one copy of the parameters and of the optimizer state, as
  cstorch's clones do.

The one host read: when ``opt.step()`` just created state that did not exist before (an
optimizer's first step: Adam's moments, SGD's momentum buffer) or changed a non-tensor state
value, the flag is read once so that, on overflow, that state can be removed again - a skipped
first step then leaves the optimizer exactly as a fresh one (torch's own fused SGD leaves an
uninitialized momentum buffer there). After the first successful step this never happens again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlspass import distributed
from dlspass.scaler.errors import ScalerUsageError

SnapshotBuffers = dict[int, tuple[tuple, list[Tensor]]]
"""Per optimizer (by ``id``): the signature of its live tensors and their snapshot copies."""


def params_with_grad(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """``optimizer``'s parameters that have a gradient (a sparse gradient is refused)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise ScalerUsageError("dlspass.GradScaler: sparse gradients are not supported")
                out.append(p)
    return out


def fused_step(optimizer: torch.optim.Optimizer, ok: Tensor, args: tuple, kwargs: dict) -> None:
    """``optimizer.step`` of a fused optimizer, a no-op in its kernel unless ``ok``."""
    params = params_with_grad(optimizer)
    before = _state_keys(optimizer, params)
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
    _drop_new_state(optimizer, params, before, [], ok)


def masked_step(optimizer: torch.optim.Optimizer, ok: Tensor, args: tuple, kwargs: dict,
                buffers: SnapshotBuffers) -> None:
    """``optimizer.step``, then parameters and tensor state put back where ``ok`` is False.

    ``buffers`` keeps the snapshot copies between calls (the caller owns it).
    """
    params = params_with_grad(optimizer)
    before = _state_keys(optimizer, params)
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
    saved = _snapshot(optimizer, live, buffers)
    optimizer.step(*args, **kwargs)
    for new, old in zip(live, saved, strict=True):
        torch.where(ok.to(new.device), new, old, out=new)  # in place: exact on both branches
    _drop_new_state(optimizer, params, before, scalars, ok)


def _state_keys(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> list[set]:
    return [set(optimizer.state[p].keys()) if p in optimizer.state else set() for p in params]


def _drop_new_state(optimizer: torch.optim.Optimizer, params: list[Tensor], before: list[set],
                    scalars: list[tuple], ok: Tensor) -> None:
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


def _snapshot(optimizer: torch.optim.Optimizer, live: list[Tensor],
              buffers: SnapshotBuffers) -> list[Tensor]:
    # The snapshot buffers are reused across iterations (one foreach copy, no fresh
    # allocation and page faults per step); they hold no information between steps, so a
    # fresh scaler that loaded a state_dict behaves the same.
    if not live:  # an optimizer none of whose parameters got a gradient this step
        return []
    sig = tuple((t.shape, t.dtype, t.device) for t in live)
    cached = buffers.get(id(optimizer))
    if cached is None or cached[0] != sig:
        cached = (sig, [torch.empty_like(t) for t in live])
        buffers[id(optimizer)] = cached
    torch._foreach_copy_(cached[1], live)
    return cached[1]
