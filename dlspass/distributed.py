"""Dynamic loss scaling under data parallelism (DDP) and sharding (FSDP2), on torch.distributed.

Two places need ranks to agree:

**Eager scaler** (`dlspass.GradScaler`, ``process_group=``; ``None`` means the default group
once ``torch.distributed`` is initialised with more than one rank). Per optimizer and
iteration, `check_overflow_distributed` runs ONE on-device ``all_reduce(SUM)`` of a 2-element
float32 vector ``[sum of squares of the sharded gradients on this rank, non-finite flag of this
rank]``:

- sharded gradients (DTensor with a ``Shard`` placement: FSDP2) are the pieces of one global
  tensor, so their squared norms add up over the ranks to the global squared norm;
- replicated gradients (plain tensors under DDP, which already averaged them, or ``Replicate``
  DTensors) are the same on every rank: summing their squares over ranks would multiply the
  norm by the world size, so their squared norm stays local (identical on all ranks);
- the flag: every rank adds 1 when something it holds is not finite (a NaN or inf in any local
  gradient, in the cerebras policy also a local squared norm that overflows). A rank that saw
  an inf no other rank saw (injected after DDP's reduction, or in its own shard) makes the sum
  non-zero on all ranks, so all ranks skip together. SUM of 0/1 flags carries the same
  information as MAX and lets one collective serve both the norm and the flag.

Then ``norm = sqrt(local replicated squares + reduced sharded squares)`` (cerebras also requires
``norm < inf``) and ``isfinite = (reduced flag == 0)``: both are computed from all-reduced values
and from identical local values only, so every rank takes the same decision and keeps an
identical scaler state. No host read: the collective is an ordinary in-place ``all_reduce``.

**Captured step** (``dlspass.capture_step_distributed``, or ``capture_step(...,
process_group=)``, or the two graph passes on any role-tagged step graph):
`dlspass.passes.all_reduce_grads_pass.AllReduceGradsPass` averages the gradients over the
group with functional collectives inside the graph (one bucketed ``all_reduce`` per dtype, as
DDP does), before DLS unscales them; `dlspass.passes.all_reduce_flag_pass.AllReduceFlagPass`
adds one 4-byte ``all_reduce`` on the overflow flag after the DLS passes (both run by
``dlspass.capture.step_pipeline``; this module holds their role names and errors). Averaged
gradients are bit-identical on every rank and inf/NaN propagate through the sum, so the flag
all-reduce is insurance (``agree_flag=False`` drops it).

Scaler checkpoints, DCP folders included (`save_scaler` / `load_scaler`), are in
``dlspass.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor

from dlspass.config import DLSConfig
from dlspass.errors import InputRuntimeError, InputValueError, InternalValueError
from dlspass.scale_policy import sum_squares

# ``torch.distributed`` is not set up as the call needs (e.g. not initialised)
DistributedSetupError = InputRuntimeError


# a gradient's distributed layout cannot be unscaled (e.g. a pending ``Partial`` reduction)
GradientLayoutError = InputValueError


class UnsupportedLayoutError(GradientLayoutError, NotImplementedError):
    """A gradient layout dlspass does not support yet (sharding over a multi-dimensional mesh)."""


# a caller inside dlspass broke a contract of this module (mismatched lists, a graph pass run on
# a graph it cannot take or twice)
DistributedContractError = InternalValueError


# ---- eager ---------------------------------------------------------------------------------------
def resolve_group(process_group: Any = None) -> Any:
    """The group the scaler agrees over, or None when there is nothing to agree with.

    ``None`` means the default group when ``torch.distributed`` is initialised; a group of one
    rank (or no initialised process group) needs no communication.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise DistributedSetupError("process_group was given but torch.distributed is not initialised")
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) <= 1:
        return None
    return group


def is_dtensor(t: Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's piece of ``t`` (``to_local()`` for a DTensor; in-place ops write through)."""
    return t.to_local() if is_dtensor(t) else t


def is_sharded(t: Tensor) -> bool:
    """True when ``t`` is a DTensor sharded over the ranks (its squares add up over them).

    A ``Partial`` placement (a pending reduction) has no meaningful squared norm and is refused.
    """
    if not is_dtensor(t):
        return False
    placements = t.placements  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):
        raise GradientLayoutError("dlspass: a gradient DTensor has a Partial placement (an "
                                  "unreduced gradient); reduce it before the scaler unscales it")
    if t.device_mesh.ndim != 1 and any(p.is_shard() for p in placements):  # type: ignore[attr-defined]
        raise UnsupportedLayoutError("dlspass: gradients sharded over a multi-dimensional device "
                                     "mesh (HSDP) are not supported; use a 1-D FSDP2 mesh")
    return any(p.is_shard() for p in placements)


def check_overflow_distributed(
    unscaled: Sequence[Tensor],
    sharded: Sequence[bool],
    config: DLSConfig,
    group: Any,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(isfinite, norm)`` agreed over ``group`` with one ``all_reduce(SUM)`` of 2 floats.

    ``unscaled`` are this rank's local (unscaled) gradients; ``sharded[i]`` says whether the
    i-th is a shard of a larger tensor (its squares are summed over ranks) or a replica (kept
    local). ``norm`` is the global gradient norm when the policy or clipping needs it. With a
    static scale no flag is needed: the collective then only runs for global-norm clipping.
    Every rank must call this (also with no gradients): it is a collective.
    """
    if len(unscaled) != len(sharded):
        raise DistributedContractError(f"{len(unscaled)} gradients but {len(sharded)} sharded flags")
    dev = torch.device(device) if device is not None else (
        unscaled[0].device if unscaled else torch.device("cpu"))
    need_norm = config.max_gradient_norm is not None or (
        config.dynamic and config.overflow_check == "global_norm")
    if not config.dynamic and not need_norm:
        return torch.ones((), dtype=torch.bool, device=dev), None
    rep = [g for g, s in zip(unscaled, sharded, strict=True) if not s]
    shd = [g for g, s in zip(unscaled, sharded, strict=True) if s]
    rep_sq = sum_squares(rep, dev)
    shd_sq = sum_squares(shd, dev)
    if not config.dynamic:
        bad = torch.zeros((), dtype=torch.float32, device=dev)
    elif config.overflow_check == "global_norm":
        bad = (~((rep_sq + shd_sq) < float("inf"))).float()  # NaN counts too
    else:
        bad = (~torch.stack([torch.isfinite(g).all() for g in unscaled]).all()).float() \
            if unscaled else torch.zeros((), dtype=torch.float32, device=dev)
    vec = torch.stack([shd_sq, bad])
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
    norm = torch.sqrt(rep_sq + vec[0]) if need_norm else None
    if not config.dynamic:
        return torch.ones((), dtype=torch.bool, device=dev), norm
    isfinite = vec[1] == 0
    if config.overflow_check == "global_norm":
        assert norm is not None
        isfinite = isfinite & (norm < float("inf"))
    return isfinite, norm


# ---- captured step ------------------------------------------------------------------------------
def collective_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The functional-collective nodes of a graph (``_c10d_functional`` ops other than waits)."""
    # only call nodes have an OpOverload target (the others name attributes or methods)
    return [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "_c10d_functional" and "wait" not in n.target.__name__]
