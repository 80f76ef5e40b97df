"""What every DLS pass shares: the applied-pass record and role look-ups on the step graph."""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase

from dlspass.config import DLSConfig
from dlspass.errors import DLSInternalError
from dlspass.graph import roles

APPLIED_KEY = roles.APPLIED_KEY
GLOBAL = "global"  # target of the one overflow flag and the one gradient norm of a step


class PassContractError(DLSInternalError, RuntimeError):
    """A pass's precondition or postcondition does not hold; the message names the node."""


class DLSPass(PassBase):
    """A pass that records itself on the output node, so running it twice changes nothing."""

    name = "dls_pass"

    def applied(self, gm: fx.GraphModule) -> bool:
        return self.name in applied_passes(gm.graph)

    def mark_applied(self, gm: fx.GraphModule) -> None:
        custom = gm.graph.output_node().meta.setdefault("custom", {})
        custom[APPLIED_KEY] = [*custom.get(APPLIED_KEY, []), self.name]


class FlagConsumerPass(DLSPass):
    """A pass that only acts under dynamic DLS and reads the step's one overflow flag."""

    def __init__(self, config: DLSConfig | None) -> None:
        self.config = config

    def _active(self, gm: fx.GraphModule) -> bool:
        return self.config is not None and self.config.dynamic and not self.applied(gm)

    def requires(self, gm: fx.GraphModule) -> None:
        if self._active(gm) and global_node(gm.graph, roles.ISFINITE) is None:
            raise PassContractError(f"{self.name}: no isfinite node; run unscale_grads first")


def applied_passes(graph: fx.Graph) -> list[str]:
    """Names of the passes already applied to ``graph``, in order."""
    return list(graph.output_node().meta.get("custom", {}).get(APPLIED_KEY, []))


def placeholder(graph: fx.Graph, role: str, target: str) -> fx.Node:
    """The placeholder with ``role`` and ``target``; a clear error when it is missing."""
    for node in graph.nodes:
        if node.op != "placeholder":
            break
        if roles.role_of(node) == role and roles.target_of(node) == target:
            return node
    raise PassContractError(f"the graph has no {role} placeholder for {target!r}")


def placeholders_by_role(graph: fx.Graph, role: str) -> dict[str, fx.Node]:
    """``{target: placeholder}`` of every placeholder with ``role``."""
    return {roles.target_of(n): n for n in graph.find_nodes(op="placeholder")
            if roles.role_of(n) == role}


def scale_placeholder(graph: fx.Graph) -> fx.Node:
    """The ``loss_scale`` scaler-state placeholder: the one scale the seed and unscale share."""
    return placeholder(graph, roles.SCALER_STATE, "loss_scale")


def effective_grad(node: fx.Node) -> fx.Node:
    """The gradient as its consumers see it: past the casts a precision pass put after it."""
    while len(node.users) == 1:
        (user,) = node.users
        if roles.role_of(user) != roles.CAST:
            break
        node = user
    return node


def grads(graph: fx.Graph) -> list[tuple[str, fx.Node]]:
    """``(parameter name, gradient node as the optimizer reads it)`` for every GRAD node."""
    found = [(roles.target_of(n), effective_grad(n)) for n in roles.nodes_with_role(graph, roles.GRAD)]
    if any(t is None for t, _ in found):
        raise PassContractError("a GRAD node carries no parameter name (dlspass_target)")
    return found


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Every node some GRAD node depends on (the forward and the backward), GRAD nodes included.

    A gradient may also feed the backward itself (BatchNorm's bias gradient is a sum that its
    input gradient reuses); those uses must keep reading the scaled value, as torch.amp's
    backward does, and only the optimizer's reads move to the unscaled or clipped one.
    """
    return roles.ancestors(roles.nodes_with_role(graph, roles.GRAD))


def global_node(graph: fx.Graph, role: str) -> fx.Node | None:
    """The step's one node with ``role`` and target ``"global"`` (overflow flag, norm)."""
    for node in roles.nodes_with_role(graph, role):
        if roles.target_of(node) == GLOBAL:
            return node
    return None


def replace_uses(old: fx.Node, new: fx.Node, keep: set[fx.Node]) -> None:
    """Route every user of ``old`` except ``new`` and the nodes in ``keep`` to ``new``."""
    old.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new and u not in keep)


def set_outputs(graph: fx.Graph, replacements: dict[int, fx.Node]) -> None:
    """Replace output values by position (one node may be returned at several positions)."""
    out = graph.output_node()
    vals = list(roles.output_values(graph))
    for i, node in replacements.items():
        vals[i] = node
    out.args = (tuple(vals),)
