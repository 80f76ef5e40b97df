"""What every DLS pass shares: the template (skip or rewrite, then record), role look-ups on the step graph."""

from __future__ import annotations

import json
from typing import final

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.config import DLSConfig
from dlspass.errors import GraphContractError
from dlspass.graph import roles
from dlspass.graph.roles import APPLIED_KEY, SKIPPED_KEY

GLOBAL = "global"  # target of the one overflow flag and the one gradient norm of a step


class PassContractError(GraphContractError):
    """A pass's precondition or postcondition does not hold; the message names the node."""


class DLSPass(PassBase):
    """A pass that either skips, saying why, or rewrites and records itself on the output node.

    Subclasses write ``skip_reason`` (None to run) and ``rewrite`` (True when the graph changed);
    ``call`` is the same for all of them, so running a pass twice changes nothing and a skipped
    pass leaves its reason where ``dlspass inspect`` finds it.
    """

    name = "dls_pass"

    def __init__(self, config: DLSConfig | None) -> None:
        self.config = config

    @final
    def call(self, gm: fx.GraphModule) -> PassResult:
        if self.applied(gm):
            return PassResult(gm, False)
        why = self.skip_reason(gm)
        if why is not None:
            record_skip(gm.graph, self.name, why)
            return PassResult(gm, False)
        modified = self.rewrite(gm)
        self.mark_applied(gm)
        return PassResult(gm, modified)

    def skip_reason(self, gm: fx.GraphModule) -> str | None:
        """Why this pass leaves ``gm`` alone (e.g. "static scale: no overflow check"), or None."""
        return None

    def rewrite(self, gm: fx.GraphModule) -> bool:
        """Rewrite ``gm`` in place; True when the graph changed."""
        raise NotImplementedError(f"{type(self).__name__} must implement rewrite()")

    def will_run(self, gm: fx.GraphModule) -> bool:
        """True when ``call`` would rewrite ``gm`` (what ``requires`` checks preconditions for)."""
        return not self.applied(gm) and self.skip_reason(gm) is None

    def applied(self, gm: fx.GraphModule) -> bool:
        return self.name in applied_passes(gm.graph)

    def mark_applied(self, gm: fx.GraphModule) -> None:
        custom = gm.graph.output_node().meta.setdefault("custom", {})
        custom[APPLIED_KEY] = [*custom.get(APPLIED_KEY, []), self.name]


def scaling_off_reason(config: DLSConfig | None) -> str | None:
    """Why ``config`` scales nothing (no config, bfloat16, loss_scale None or 1), or None."""
    if config is None:
        return "no DLS config"
    if config.fp16_type == "bfloat16":
        return "bfloat16: scaling off"
    if not config.enabled:
        return f"loss_scale {config.loss_scale!r}: scaling off"
    return None


def no_check_reason(config: DLSConfig | None) -> str | None:
    """Why ``config`` has no overflow check (scaling off, or a static scale), or None."""
    off = scaling_off_reason(config)
    if off is not None or (config is not None and config.dynamic):
        return off
    return "static scale: no overflow check"


class FlagConsumerPass(DLSPass):
    """A pass that only acts under dynamic DLS and reads the step's one overflow flag."""

    def skip_reason(self, gm: fx.GraphModule) -> str | None:
        return no_check_reason(self.config)

    def requires(self, gm: fx.GraphModule) -> None:
        if self.will_run(gm) and global_node(gm.graph, roles.ISFINITE) is None:
            raise PassContractError(f"{self.name}: no isfinite node; run unscale_grads first")


def record_skip(graph: fx.Graph, name: str, why: str) -> None:
    """Record ``why`` pass ``name`` skipped, on the output node and the seed node (which
    torch.export keeps), as a JSON object ``{pass: reason}``."""
    reasons = {**skip_reasons(graph), name: why}
    text = json.dumps(reasons, sort_keys=True)
    for node in (graph.output_node(), *roles.nodes_with_role(graph, roles.SEED)):
        node.meta.setdefault("custom", {})[SKIPPED_KEY] = text


def skip_reasons(graph: fx.Graph) -> dict[str, str]:
    """``{pass name: why it skipped}`` as recorded on ``graph`` (empty when none skipped)."""
    raw = roles.recorded(graph, SKIPPED_KEY)
    return json.loads(raw) if raw else {}


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


def outputs(graph: fx.Graph) -> list[tuple[int, str, str | None, fx.Node]]:
    """``(position, role, target, value)`` of every output of the step graph."""
    vals = roles.output_values(graph)
    return [(i, role, target, vals[i]) for i, (role, target) in enumerate(roles.output_roles(graph))]


def set_outputs(graph: fx.Graph, replacements: dict[int, fx.Node]) -> None:
    """Replace output values by position (one node may be returned at several positions)."""
    out = graph.output_node()
    vals = list(roles.output_values(graph))
    for i, node in replacements.items():
        vals[i] = node
    out.args = (tuple(vals),)
