"""ScaleSeedPass: the backward seed ``s`` becomes ``mul(s, loss_scale)`` (SCALED_SEED)."""

from __future__ import annotations

import torch
import torch.fx as fx

from dlspass.graph import roles
from dlspass.graph.splice import insert_op
from dlspass.passes.base import DLSPass, PassContractError, scale_placeholder, scaling_off_reason


class ScaleSeedPass(DLSPass):
    """Multiply the seed of the backward pass by the loss-scale placeholder."""

    name = "scale_seed"

    def skip_reason(self, gm: fx.GraphModule) -> str | None:
        return scaling_off_reason(self.config)

    def check_preconditions(self, gm: fx.GraphModule) -> None:
        if len(roles.nodes_with_role(gm.graph, roles.SEED)) != 1:
            raise PassContractError("scale_seed: the graph needs exactly one backward_seed node")
        scale_placeholder(gm.graph)

    def rewrite(self, gm: fx.GraphModule) -> bool:
        graph = gm.graph
        seed = roles.the_node(graph, roles.SEED)
        scaled = insert_op(graph, torch.ops.aten.mul.Tensor, (seed, scale_placeholder(graph)),
                           before=seed.next, role=roles.SCALED_SEED, by_pass=self.name)
        seed.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
        return True

    def ensures(self, gm: fx.GraphModule) -> None:
        if scaling_off_reason(self.config) is not None:
            return
        seed = roles.the_node(gm.graph, roles.SEED)
        bad = [u.name for u in seed.users if roles.role_of(u) != roles.SCALED_SEED]
        if bad:
            raise PassContractError(f"scale_seed: the seed is still read unscaled by {bad}")
