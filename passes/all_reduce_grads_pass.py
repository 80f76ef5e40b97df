"""AllReduceGradsPass: the GRAD nodes of each dtype are flattened into one bucket, all-reduced (functional collective) and divided by the world size; the reduced values take over the GRAD role."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from dlspass.errors import InputRuntimeError, InternalValueError
from dlspass.graph import roles
from dlspass.graph.roles import GRAD_ALLREDUCE, LOCAL_GRAD, PASS_NAME
from dlspass.graph.splice import splice
from dlspass.passes.base import GraphPass, GraphPassResult


class AllReduceGradsPass(GraphPass):
    """Average (``average=False``: sum) every gradient over ``group`` inside the step graph.

    Runs before the DLS passes, so they unscale and check the reduced gradients: one bucketed
    functional ``all_reduce`` plus its ``wait_tensor`` per dtype (as DDP buckets), then split
    back to the gradients' shapes. The rank-local gradients are re-tagged ``local_grad`` and
    keep only the bucket as user; the reduced ones carry the GRAD role and parameter name.
    """

    name = "all_reduce_grads"

    def __init__(self, group: Any = None, *, average: bool = True) -> None:
        self.group = group
        self.average = average

    def requires(self, gm: fx.GraphModule) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise InputRuntimeError(f"{self.name}: torch.distributed is not initialised")
        found = roles.nodes_with_role(gm.graph, roles.GRAD)
        if not found:
            raise InternalValueError(f"{self.name}: the graph has no grad node (roles.GRAD)")
        if any(roles.pass_of(n) == PASS_NAME for n in found):
            raise InternalValueError(f"{self.name}: the gradients are already all-reduced")

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        group = self.group if self.group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        average = self.average
        graph = gm.graph
        by_dtype: dict[torch.dtype, list[fx.Node]] = {}
        for n in roles.nodes_with_role(graph, roles.GRAD):
            by_dtype.setdefault(n.meta["val"].dtype, []).append(n)
        for nodes in by_dtype.values():
            shapes = [n.meta["val"].shape for n in nodes]

            def reduce_bucket(*gs: Tensor, shapes: list = shapes) -> list[Tensor]:
                flat = torch.cat([g.reshape(-1) for g in gs])
                red = funcol.all_reduce(flat, "sum", group)
                if average:
                    red = red / world
                parts = torch.split(red, [s.numel() for s in shapes])
                return [p.view(s) for p, s in zip(parts, shapes, strict=True)]

            reduced = splice(graph, reduce_bucket, nodes, role=GRAD_ALLREDUCE, by_pass=PASS_NAME,
                             output_roles=[(roles.GRAD, roles.target_of(n)) for n in nodes])
            bucket = set(reduced.inserted)
            for old, red in zip(nodes, reduced, strict=True):
                old.replace_all_uses_with(red, delete_user_cb=lambda u, bucket=bucket: u not in bucket)
                roles.set_role(old, LOCAL_GRAD, roles.target_of(old))
        return GraphPassResult(gm, True, {"buckets": len(by_dtype)})
