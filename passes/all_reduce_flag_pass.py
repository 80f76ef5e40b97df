"""AllReduceFlagPass: the step's overflow flag ``ok`` is replaced, for every reader, by ``all_reduce(not ok, SUM) == 0`` (one 4-byte functional all-reduce), so all ranks skip together."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from dlspass.errors import InputRuntimeError, InternalValueError
from dlspass.graph import roles
from dlspass.graph.roles import FLAG_ALLREDUCE, GLOBAL, LOCAL, PASS_NAME
from dlspass.graph.splice import splice
from dlspass.passes.base import GraphPass, GraphPassResult, global_node


class AllReduceFlagPass(GraphPass):
    """Make the overflow flag of a DLS-rewritten step agree over ``group`` (run after apply_dls).

    The local flag keeps the ISFINITE role with target ``"local"``; the agreed one becomes the
    step's global flag and feeds every guard and the scale update. A graph without a flag
    (static scale, no scaling) is left unchanged.
    """

    name = "all_reduce_flag"

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def requires(self, gm: fx.GraphModule) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise InputRuntimeError(f"{self.name}: torch.distributed is not initialised")
        flag = global_node(gm.graph, roles.ISFINITE)
        if flag is not None and roles.pass_of(flag) == PASS_NAME:
            raise InternalValueError(f"{self.name}: the flag is already all-reduced")

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        group = self.group if self.group is not None else dist.group.WORLD
        graph = gm.graph
        flag = global_node(graph, roles.ISFINITE)
        if flag is None:
            return GraphPassResult(gm, False, {"flags": 0})

        def agree(ok: Tensor) -> Tensor:
            bad = funcol.all_reduce((~ok).to(torch.float32), "sum", group)
            return bad == 0

        agreed = splice(graph, agree, [flag], role=FLAG_ALLREDUCE, by_pass=PASS_NAME,
                        output_roles=[(roles.ISFINITE, GLOBAL)])
        reduction = set(agreed.inserted)
        flag.replace_all_uses_with(agreed[0], delete_user_cb=lambda u: u not in reduction)
        roles.set_role(flag, roles.ISFINITE, LOCAL)
        return GraphPassResult(gm, True, {"flags": 1})
