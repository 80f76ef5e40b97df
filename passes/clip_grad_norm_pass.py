"""ClipGradNormPass: the (unscaled) gradients the optimizer reads are clipped by global norm or value."""

from __future__ import annotations

import torch.fx as fx

from dlspass import scale_policy
from dlspass.graph import roles
from dlspass.graph.roles import GLOBAL
from dlspass.graph.splice import insertion_point, splice
from dlspass.passes.base import (
    DLSPass,
    PassContractError,
    backward_nodes,
    global_node,
    grads,
    optimizer_grads,
    outputs,
    replace_uses,
    scaling_off_reason,
)

# DLS bookkeeping that must keep reading the unclipped gradients (the check comes first)
_CHECK_ROLES = {roles.UNSCALE, roles.GRAD_NORM, roles.ISFINITE, roles.CLIP}


def _step_code_reads(graph: fx.Graph) -> set[fx.Node]:
    """The gradients' readers that the step's own code added and no update depends on (a norm
    it logs or returns). torch.amp's and cstorch's loops run that code before the scaler clips
    in its step, so it must read the unclipped values; only the optimizer's reads are clipped.
    A graph that updates nothing (an exported gradient graph) has no such reads: what it
    returns is what the optimizer reads."""
    updates = [v for _, role, _, v in outputs(graph) if role in roles.GUARDED_UPDATES]
    if not updates:
        return set()
    feeding = roles.ancestors(updates)
    return {u for _, g in grads(graph) for u in g.users if u.op != "output" and u not in feeding}


class ClipGradNormPass(DLSPass):
    """Apply ``scale_policy.clip`` after the overflow check, reusing the check's global norm."""

    name = "clip_grad_norm"

    def skip_reason(self, gm: fx.GraphModule) -> str | None:
        c = self.config
        if c is None:
            return "no DLS config"
        if c.max_gradient_norm is None and c.max_gradient_value is None:
            return "no max_gradient_norm or max_gradient_value: no clipping"
        return None

    def check_preconditions(self, gm: fx.GraphModule) -> None:
        graph = gm.graph
        if not roles.nodes_with_role(graph, roles.UNSCALE) and not grads(graph):
            raise PassContractError("clip_grad_norm: the graph has no grad or unscale node to clip")
        if scaling_off_reason(self.config) is None and not roles.nodes_with_role(graph, roles.UNSCALE):
            # clipping the scaled gradients would clip at max_gradient_norm * loss_scale
            raise PassContractError("clip_grad_norm: the config scales but the graph has no unscale "
                                    "node; run unscale_grads first")

    def rewrite(self, gm: fx.GraphModule) -> bool:
        config = self.config
        assert config is not None
        graph = gm.graph
        step_reads = _step_code_reads(graph)  # before the clip's own nodes read the gradients
        found = optimizer_grads(graph)  # unscaled; without scaling, as the optimizer reads them
        names = [t for t, _ in found]
        gnodes = [g for _, g in found]
        norm = global_node(graph, roles.GRAD_NORM)
        if config.max_gradient_norm is not None and norm is None:
            (norm,) = splice(graph, lambda *gs: [scale_policy.global_norm(gs)], gnodes,
                             role=roles.GRAD_NORM, by_pass=self.name,
                             output_roles=[(roles.GRAD_NORM, GLOBAL)])
        flag = global_node(graph, roles.ISFINITE)
        # after the overflow check, so clipping can never feed the check (Lightning #9599)
        anchor = insertion_point(graph, [*gnodes, *[n for n in (norm, flag) if n is not None]])
        if norm is not None and config.max_gradient_norm is not None:
            clipped = splice(graph, lambda n, *gs: scale_policy.clip(gs, n, config), [norm, *gnodes],
                             role=roles.CLIP, by_pass=self.name, before=anchor,
                             output_roles=[(roles.CLIP, t) for t in names])
        else:
            clipped = splice(graph, lambda *gs: scale_policy.clip(gs, None, config), gnodes,
                             role=roles.CLIP, by_pass=self.name, before=anchor,
                             output_roles=[(roles.CLIP, t) for t in names])
        # reads inside the backward, and the step code's own, stay unclipped
        backward = backward_nodes(graph) | step_reads
        for g, c in zip(gnodes, clipped, strict=True):
            keep = {u for u in g.users if roles.role_of(u) in _CHECK_ROLES} | backward
            replace_uses(g, c, keep)
        return True

    def ensures(self, gm: fx.GraphModule) -> None:
        backward = backward_nodes(gm.graph) | _step_code_reads(gm.graph)
        for node in roles.nodes_with_role(gm.graph, roles.CLIP):
            src = node.args[0] if node.args else None
            if roles.target_of(node) and isinstance(src, fx.Node):
                leaks = [u.name for u in src.users
                         if roles.role_of(u) not in _CHECK_ROLES and u not in backward]
                if leaks:
                    raise PassContractError(f"clip_grad_norm: {leaks} read the unclipped "
                                            f"gradient {src.name!r}")
