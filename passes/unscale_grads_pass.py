"""UnscaleGradsPass: every gradient ``g`` is read as ``g * (1/loss_scale)`` in fp32 from where backward produced it, and one overflow flag is computed."""

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
    backward_grads,
    backward_nodes,
    grads,
    replace_uses,
    scale_placeholder,
    scaling_off_reason,
)


class UnscaleGradsPass(DLSPass):
    """Unscale the gradients with the seed's scale; check them by the policy's method.

    A gradient is unscaled where backward produced it: its GRAD node, or its BACKWARD_GRAD node
    where the step's own code (a user's clip) reads it before the optimizer does, so that code
    sees unscaled values as after torch.amp's ``unscale_``. The overflow check then covers both
    what backward produced and what the optimizer reads: an inf that the user's clip turned
    into a finite value, and a non-finite value the user's code made, both skip the step.
    """

    name = "unscale_grads"

    def skip_reason(self, gm: fx.GraphModule) -> str | None:
        return scaling_off_reason(self.config)

    def check_preconditions(self, gm: fx.GraphModule) -> None:
        if not grads(gm.graph):
            raise PassContractError("unscale_grads: the graph has no grad node")
        scale_placeholder(gm.graph)

    def rewrite(self, gm: fx.GraphModule) -> bool:
        config = self.config
        assert config is not None
        graph = gm.graph
        backward = backward_nodes(graph) | _observers(graph)
        raw = {roles.target_of(n) for n in roles.nodes_with_role(graph, roles.BACKWARD_GRAD)}
        sources = backward_grads(graph)
        # read by the optimizer as backward produced them / changed by the step's code first
        direct = [(t, g) for t, g in sources if t not in raw]
        changed = [(t, g) for t, g in sources if t in raw]
        unscaled: dict[str, fx.Node] = {}
        for group in (direct, changed):  # each right after its gradients, before any reader
            if group:
                unscaled.update(zip([t for t, _ in group], self._unscale(graph, group, backward),
                                    strict=True))
        if config.dynamic:
            # the check reads the unscaled values: a scale large enough to overflow fp32 after
            # unscaling is caught here, not silently passed on (torch #99640's failure mode)
            final = [g if t in raw else unscaled[t] for t, g in grads(graph)]
            first = [unscaled[t] for t, _ in changed]
            internal = roles.GRAD_NORM if config.overflow_check == "global_norm" else roles.ISFINITE
            splice(
                graph, lambda *us: _check(list(us[:len(final)]), list(us[len(final):]), config),
                [*final, *first], role=internal, by_pass=self.name,
                output_roles=[(roles.ISFINITE, GLOBAL), (roles.GRAD_NORM, GLOBAL)])
        return True

    def _unscale(self, graph: fx.Graph, found: list[tuple[str, fx.Node]],
                 backward: set[fx.Node]) -> list[fx.Node]:
        names = [t for t, _ in found]
        gnodes = [g for _, g in found]
        unscaled = splice(
            graph, lambda s, *gs: scale_policy.unscale(gs, s, self.config), [scale_placeholder(graph), *gnodes],
            role=roles.UNSCALE, by_pass=self.name, output_roles=[(roles.UNSCALE, t) for t in names])
        for g, u in zip(gnodes, unscaled, strict=True):
            replace_uses(g, u, set(unscaled.inserted) | backward)  # the backward keeps the scaled gradient
        return list(unscaled)

    def ensures(self, gm: fx.GraphModule) -> None:
        if scaling_off_reason(self.config) is not None:
            return
        backward = backward_nodes(gm.graph) | _observers(gm.graph)
        for name, g in backward_grads(gm.graph):
            bad = [u.name for u in g.users if roles.role_of(u) != roles.UNSCALE and u not in backward]
            if bad:
                raise PassContractError(f"unscale_grads: grad of {name!r} is read unscaled by {bad}")


def _observers(graph: fx.Graph) -> set[fx.Node]:
    """Telemetry nodes: they measure the gradient as backward produced it (scaled)."""
    return set(roles.nodes_with_role(graph, roles.TELEMETRY))


def _check(final: list, first: list, config: DLSConfig) -> list:
    """The flag and norm of what the optimizer reads (``final``), the flag also over the
    unscaled gradients the step's own code read first (``first``, e.g. before a clip)."""
    isfinite, norm = scale_policy.check_overflow(final, config)
    if first:
        isfinite = isfinite & scale_policy.check_overflow(first, config)[0]
    return [isfinite] if norm is None else [isfinite, norm]
