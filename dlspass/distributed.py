"""Dynamic loss scaling under data parallelism (DDP), sharding (FSDP2, HSDP) and tensor
parallelism on device meshes, on torch.distributed.

Two places need ranks to agree:

**Eager scaler** (`dlspass.GradScaler` and `dlspass.TorchGradScaler`, ``process_group=``;
``None`` means the default group once ``torch.distributed`` is initialised with more than one
rank; a ``DeviceMesh`` means the group over its ranks). Per optimizer and iteration,
`check_overflow_distributed` runs ONE on-device ``all_reduce(SUM)`` of a 2-element float32
vector ``[weighted sum of squares of this rank's gradient pieces, non-finite flag of this rank]``.
The weights (`grad_weights`) come from the DTensor placements of every gradient:

- a shard (``Shard`` on a mesh dimension) weighs 1: the shards' squared norms add up over the
  ranks to the whole tensor's;
- a replica (``Replicate`` on a mesh dimension of size n) weighs 1/n, so its n copies add up to
  one. A gradient on a sub-mesh (under FSDP + tensor parallelism, the parameters left out of
  the TP plan live on the data-parallel mesh only) is replicated over the dimensions that the
  other gradients' meshes span and its own does not, and is weighted so as well. On a 2x2
  (dp, tp) mesh: ``(Shard, Shard)`` 1, ``(Shard, Replicate)`` 1/2, a dp-only shard 1/2; under
  HSDP ``(Replicate, Shard)`` 1/2;
- a gradient identical on every rank of the group (plain tensors under DDP, which already
  averaged them, or DTensors replicated over the whole group) stays out of the sum: its
  squared norm is added locally (the same on all ranks);
- the flag: every rank adds 1 when something it holds is not finite (a NaN or inf in any local
  gradient, in the cerebras policy also a local squared norm that overflows). A rank that saw
  an inf no other rank saw (injected after the gradient reduction, or in its own shard, or in
  its copy of a replicated gradient) makes the sum non-zero on all ranks, so all ranks skip
  together. SUM of 0/1 flags carries the same information as MAX and lets one collective serve
  both the norm and the flag.

Then ``norm = sqrt(local replicated squares + reduced weighted squares)`` (cerebras also
requires ``norm < inf``) and ``isfinite = (reduced flag == 0)``: both are computed from
all-reduced values and from identical local values only, so every rank takes the same decision
and keeps an identical scaler state. No host read: the collective is an ordinary in-place
``all_reduce``. With only shards of a 1-D mesh (FSDP2) or only plain tensors (DDP) the weights
are 1 and None, and the arithmetic is the plain sum it always was. Refused, in one line:
``Partial`` placements (`GradientLayoutError`), a gradient sharded over mesh ranks outside the
group and meshes that do not nest (`UnsupportedLayoutError`).

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

import dataclasses
import functools
import importlib
import warnings
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


class UnsupportedLayoutError(GradientLayoutError):
    """A gradient layout the scaler cannot agree on over its group (e.g. a gradient sharded over
    a device-mesh dimension whose ranks are outside ``process_group``); the message names it."""


# a caller inside dlspass broke a contract of this module (mismatched lists, a graph pass run on
# a graph it cannot take or twice)
DistributedContractError = InternalValueError


# ---- eager ---------------------------------------------------------------------------------------
def resolve_group(process_group: Any = None) -> Any:
    """The group the scaler agrees over, or None when there is nothing to agree with.

    ``None`` means the default group when ``torch.distributed`` is initialised; a
    ``DeviceMesh`` means the group over its ranks (a 1-D mesh's own group, or the default group
    for a mesh over the whole world). A group of one rank (or no initialised process group)
    needs no communication.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise DistributedSetupError("process_group was given but torch.distributed is not initialised")
        return None
    group = dist.group.WORLD if process_group is None else _group_of_mesh(process_group)
    if dist.get_world_size(group) <= 1:
        return None
    return group


def _group_of_mesh(process_group: Any) -> Any:
    """``process_group`` itself, or the process group over a DeviceMesh's ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(process_group, DeviceMesh):
        return process_group
    mesh = process_group
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.mesh.numel() == dist.get_world_size():
        return dist.group.WORLD
    raise UnsupportedLayoutError(
        f"dlspass: process_group is a {mesh.ndim}-D device mesh over {mesh.mesh.numel()} of the "
        f"{dist.get_world_size()} ranks; pass a 1-D (sub-)mesh or a ProcessGroup over its ranks "
        f"(torch.distributed.new_group({sorted(mesh.mesh.flatten().tolist())}))")


def is_dtensor(t: Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's piece of ``t`` (``to_local()`` for a DTensor; in-place ops write through)."""
    return t.to_local() if is_dtensor(t) else t


@dataclasses.dataclass(frozen=True)
class _Span:
    """Where one DTensor layout's pieces lie inside the agreement group, seen from this rank.

    ``ranks``: the ranks of the group along the mesh dimensions that lie inside it (together
    they hold one whole copy of the tensor, maybe several times over); ``replicas``: how many
    times over (the product of the sizes of those dimensions whose placement is Replicate).
    """

    ranks: frozenset[int]
    replicas: int


def _is_shard(placement: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    # FSDP2 over tensor parallelism shards dim 0 twice: its dp placement is a _StridedShard,
    # which is not ``is_shard()`` but splits the tensor all the same
    return bool(placement.is_shard()) or isinstance(placement, _StridedShard)


@functools.lru_cache(maxsize=256)
def _span(mesh: Any, placements: tuple[Any, ...], group_ranks: frozenset[int]) -> _Span:
    """The `_Span` of a DTensor on ``mesh`` with ``placements`` in the group ``group_ranks``."""
    if any(p.is_partial() for p in placements):
        raise GradientLayoutError("dlspass: a gradient DTensor has a Partial placement (an "
                                  "unreduced gradient); reduce it before the scaler unscales it")
    me = dist.get_rank()
    coord = mesh.get_coordinate()
    if coord is None:
        raise DistributedContractError(f"rank {me} holds a DTensor on a mesh it is not part of")
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    inside: list[int] = []
    replicas = 1
    for dim, p in enumerate(placements):
        if not (p.is_replicate() or _is_shard(p)):
            raise UnsupportedLayoutError(f"dlspass: a gradient DTensor has the placement {p} on "
                                         f"device-mesh dimension {names[dim]!r}; the scaler "
                                         f"supports Shard and Replicate")
        index: list[Any] = list(coord)
        index[dim] = slice(None)
        line = frozenset(mesh.mesh[tuple(index)].flatten().tolist())
        if line <= group_ranks:
            inside.append(dim)
            if p.is_replicate():
                replicas *= mesh.size(dim)
        elif line & group_ranks != {me} or _is_shard(p):
            what = "sharded over" if _is_shard(p) else "replicated over"
            raise UnsupportedLayoutError(
                f"dlspass: a gradient is {what} device-mesh dimension {names[dim]!r} (ranks "
                f"{sorted(line)}), which the scaler's process_group (ranks {sorted(group_ranks)}) "
                f"does not cover, so the overflow flag and the norm cannot be agreed over it; pass "
                f"a process_group over the whole mesh (the default group covers the world)")
    index = [slice(None) if dim in inside else c for dim, c in enumerate(coord)]
    return _Span(frozenset(mesh.mesh[tuple(index)].flatten().tolist()), replicas)


def grad_weights(grads: Sequence[Tensor], group: Any) -> list[float | None]:
    """Per gradient, the factor its local squared norm gets before the sum over ``group``, or
    None for a gradient identical on every rank of the group (its squares stay local).

    Derived from each gradient's own DTensor placements (every one, not one per group):

    - plain tensors are replicas over the group (DDP averaged them): None;
    - a DTensor: 1 / (product of the sizes of its Replicate mesh dimensions), so that shards add
      up to the whole and replicas to one copy. A DTensor on a sub-mesh (under FSDP + tensor
      parallelism, the parameters left out of the TP plan live on the data-parallel mesh only)
      is replicated over the dimensions the others' meshes span and it does not: its factor
      also divides by that. Ranks of the group outside every gradient's mesh hold other
      tensors (pipeline stages): their squares add up.

    Raises `GradientLayoutError` for a ``Partial`` placement and `UnsupportedLayoutError` for a
    gradient sharded over mesh ranks outside ``group`` or meshes that do not nest.
    """
    group_ranks = frozenset(dist.get_process_group_ranks(group))
    spans: list[_Span | None] = [_span(g.device_mesh, tuple(g.placements), group_ranks)  # type: ignore[attr-defined]
                                 if is_dtensor(g) else None for g in grads]
    present = [s for s in spans if s is not None]
    if not present:
        return [None] * len(grads)
    # the ranks that hold one copy of every gradient together (this rank's model replica)
    whole = max((s.ranks for s in present), key=len)
    for s in present:
        if not s.ranks <= whole:
            raise UnsupportedLayoutError(
                f"dlspass: the gradients' device meshes do not nest (ranks {sorted(s.ranks)} and "
                f"{sorted(whole)}); pass process_group= (the group whose ranks train this model)")
    weights: list[float | None] = []
    for s in spans:
        if s is None or (s.replicas == len(s.ranks) and whole == group_ranks):
            weights.append(None)
        else:
            weights.append(len(s.ranks) / (len(whole) * s.replicas))
    return weights


def check_overflow_distributed(
    unscaled: Sequence[Tensor],
    weights: Sequence[float | None],
    config: DLSConfig,
    group: Any,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(isfinite, norm)`` agreed over ``group`` with one ``all_reduce(SUM)`` of 2 floats.

    ``unscaled`` are this rank's local (unscaled) gradients; ``weights[i]`` (`grad_weights`)
    is the factor the i-th one's squared norm gets before it is summed over the ranks (1 for a
    shard), or None for a gradient identical on every rank (its squares are kept local).
    ``norm`` is the global gradient norm when the policy or clipping needs it. With a static
    scale no flag is needed: the collective then only runs for global-norm clipping. Every
    rank must call this (also with no gradients): it is a collective.
    """
    if len(unscaled) != len(weights):
        raise DistributedContractError(f"{len(unscaled)} gradients but {len(weights)} weights")
    dev = torch.device(device) if device is not None else (
        unscaled[0].device if unscaled else torch.device("cpu"))
    need_norm = config.max_gradient_norm is not None or (
        config.dynamic and config.overflow_check == "global_norm")
    if not config.dynamic and not need_norm:
        return torch.ones((), dtype=torch.bool, device=dev), None
    rep_sq = sum_squares([g for g, w in zip(unscaled, weights, strict=True) if w is None], dev)
    shd_sq = _weighted_sum_squares(unscaled, weights, dev)
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


def _weighted_sum_squares(grads: Sequence[Tensor], weights: Sequence[float | None],
                          device: torch.device) -> Tensor:
    """``sum of weight * sum(g*g)`` over the gradients with a weight (0 for none).

    Grouped by weight, and a weight of 1 multiplies nothing, so that shards alone (1-D FSDP2)
    give the bits `sum_squares` gives.
    """
    by_weight: dict[float, list[Tensor]] = {}
    for g, w in zip(grads, weights, strict=True):
        if w is not None:
            by_weight.setdefault(w, []).append(g)
    parts = [sum_squares(gs, device) if w == 1 else sum_squares(gs, device) * w
             for w, gs in by_weight.items()]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


# ---- captured step ------------------------------------------------------------------------------
def collective_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The functional-collective nodes of a graph (``_c10d_functional`` ops other than waits)."""
    # only call nodes have an OpOverload target (the others name attributes or methods)
    return [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "_c10d_functional" and "wait" not in n.target.__name__]


# Names that moved to dlspass.checkpoint (scaler persistence has one home there): code written
# against the release that had them here keeps working, with a DeprecationWarning naming the
# new home. dlspass.checkpoint imports the scaler, which imports this module, so the name is
# resolved at first access, by module name (an import at the top would be a cycle).
MOVED_TO_CHECKPOINT = ("dcp_state_dict", "load_dcp_state_dict", "load_scaler", "save_scaler",
                       "DCP_KEY")


def __getattr__(name: str) -> Any:
    if name in MOVED_TO_CHECKPOINT:
        warnings.warn(f"dlspass.distributed.{name} moved to dlspass.checkpoint.{name}; "
                      f"import it from dlspass.checkpoint", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("dlspass.checkpoint"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
