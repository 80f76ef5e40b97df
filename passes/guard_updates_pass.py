"""GuardUpdatesPass: every param / optimizer-state output becomes ``where(isfinite, new, old)``."""

from __future__ import annotations

import torch
import torch.fx as fx

from dlspass.graph import roles
from dlspass.graph.splice import splice
from dlspass.passes.base import (
    FlagConsumerPass,
    PassContractError,
    global_node,
    no_check_reason,
    outputs,
    placeholders_by_role,
    set_outputs,
)


class GuardUpdatesPass(FlagConsumerPass):
    """Select the old parameter / optimizer state on overflow, without cloning anything."""

    name = "guard_updates"

    def rewrite(self, gm: fx.GraphModule) -> bool:
        graph = gm.graph
        isfinite = global_node(graph, roles.ISFINITE)
        # roles.GUARDED_UPDATES says why buffers and scaler state are not guarded
        olds_by_role = {r: placeholders_by_role(graph, r) for r in roles.GUARDED_UPDATES.values()}
        positions, news, olds, targets = [], [], [], []
        for i, role, target, value in outputs(graph):
            if role not in roles.GUARDED_UPDATES:
                continue
            want = roles.GUARDED_UPDATES[role]
            old = olds_by_role[want].get(target)
            if old is None:
                raise PassContractError(f"guard_updates: output {i} ({role} {target!r}) has no "
                                        f"matching {want} placeholder")
            if value is old:  # passed through unchanged: nothing to roll back
                continue
            positions.append(i)
            news.append(value)
            olds.append(old)
            targets.append(target)
        if positions:
            n = len(news)
            guarded = splice(
                graph, lambda c, *xs: [torch.where(c, a, b) for a, b in zip(xs[:n], xs[n:], strict=True)],
                [isfinite, *news, *olds], role=roles.GUARD, by_pass=self.name,
                before=graph.output_node(), output_roles=[(roles.GUARD, t) for t in targets])
            set_outputs(graph, dict(zip(positions, guarded, strict=True)))
        return True

    def ensures(self, gm: fx.GraphModule) -> None:
        if no_check_reason(self.config) is not None:
            return
        for i, role, target, value in outputs(gm.graph):
            if (role in roles.GUARDED_UPDATES and value.op != "placeholder"
                    and roles.role_of(value) != roles.GUARD):
                raise PassContractError(f"guard_updates: output {i} ({target!r}) is not guarded")
