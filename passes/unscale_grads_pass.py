"""UnscaleGradsPass: every GRAD ``g`` is read as ``g * (1/loss_scale)`` in fp32, and one overflow flag is computed."""

from __future__ import annotations

import torch.fx as fx

from dlspass import scale_policy
from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.graph.roles import GLOBAL
from dlspass.graph.splice import splice
from dlspass.passes.base import (
    DLSPass,
    PassContractError,
    backward_nodes,
    grads,
    replace_uses,
    scale_placeholder,
    scaling_off_reason,
)


class UnscaleGradsPass(DLSPass):
    """Unscale the gradients with the seed's scale; check them by the policy's method."""

    name = "unscale_grads"

    def skip_reason(self, gm: fx.GraphModule) -> str | None:
        return scaling_off_reason(self.config)

    def requires(self, gm: fx.GraphModule) -> None:
        if not self.will_run(gm):
            return
        if not grads(gm.graph):
            raise PassContractError("unscale_grads: the graph has no grad node")
        scale_placeholder(gm.graph)

    def rewrite(self, gm: fx.GraphModule) -> bool:
        config = self.config
        assert config is not None
        graph = gm.graph
        found = grads(graph)
        names = [t for t, _ in found]
        gnodes = [g for _, g in found]
        backward = backward_nodes(graph) | _observers(graph)
        unscaled = splice(
            graph, lambda s, *gs: scale_policy.unscale(gs, s), [scale_placeholder(graph), *gnodes],
            role=roles.UNSCALE, by_pass=self.name, output_roles=[(roles.UNSCALE, t) for t in names])
        for g, u in zip(gnodes, unscaled, strict=True):
            replace_uses(g, u, set(unscaled.inserted) | backward)  # the backward keeps the scaled gradient
        if config.dynamic:
            # the check reads the unscaled values: a scale large enough to overflow fp32 after
            # unscaling is caught here, not silently passed on (torch #99640's failure mode)
            internal = roles.GRAD_NORM if config.overflow_check == "global_norm" else roles.ISFINITE
            splice(
                graph, lambda *us: _check(list(us), config), unscaled, role=internal,
                by_pass=self.name,
                output_roles=[(roles.ISFINITE, GLOBAL), (roles.GRAD_NORM, GLOBAL)])
        return True

    def ensures(self, gm: fx.GraphModule) -> None:
        if scaling_off_reason(self.config) is not None:
            return
        backward = backward_nodes(gm.graph) | _observers(gm.graph)
        for name, g in grads(gm.graph):
            bad = [u.name for u in g.users if roles.role_of(u) != roles.UNSCALE and u not in backward]
            if bad:
                raise PassContractError(f"unscale_grads: grad of {name!r} is read unscaled by {bad}")


def _observers(graph: fx.Graph) -> set[fx.Node]:
    """Telemetry nodes: they measure the gradient as backward produced it (scaled)."""
    return set(roles.nodes_with_role(graph, roles.TELEMETRY))


def _check(unscaled: list, config: DLSConfig) -> list:
    isfinite, norm = scale_policy.check_overflow(unscaled, config)
    return [isfinite] if norm is None else [isfinite, norm]
