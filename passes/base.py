"""What every pass shares: `GraphPass` (a name, one lint and recompile, a log line, a result with
counts), the `DLSPass` template on top of it (skip or rewrite, then record), and the role look-ups
of the step graph."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import ClassVar, cast, final

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from dlspass.config import DLSConfig
from dlspass.errors import GraphContractError
from dlspass.graph import roles
from dlspass.graph.roles import APPLIED_KEY, GLOBAL, SKIPPED_KEY

# the pipeline's logger since it was one loop in dlspass.passes: DEBUG lines per pass
log = logging.getLogger("dlspass.passes")


class PassContractError(GraphContractError):
    """A pass's precondition or postcondition does not hold; the message names the node."""


class GraphPassResult(PassResult):
    """What calling a `GraphPass` returns: torch's ``PassResult`` (``graph_module``, ``modified``)
    plus ``stats``, counts of what the pass did (e.g. ``{"moved": 3}``), and ``skipped``, why the
    pass left the graph alone when it says (a `DLSPass` skip reason), else None."""

    stats: dict[str, int]
    skipped: str | None

    def __new__(cls, graph_module: fx.GraphModule, modified: bool,
                stats: Mapping[str, int] | None = None, skipped: str | None = None) -> GraphPassResult:
        self = super().__new__(cls, graph_module, modified)
        self.stats = dict(stats or {})
        self.skipped = skipped
        return self


BEFORE_DLS = "before_dls"
AFTER_DLS = "after_dls"
PIPELINE_PHASES = (BEFORE_DLS, AFTER_DLS)
"""Where a step's graph pass runs (its ``pipeline_phase``; a plain callable without one: `BEFORE_DLS`)."""


class GraphPass(PassBase):
    """An FX rewrite with a ``name`` (its id in logs, provenance and ``dlspass_pass``).

    Subclasses write ``run`` (rewrite ``gm`` in place, return a `GraphPassResult`) and may write
    torch's ``requires``/``ensures``; ``call`` is the same for all of them: it lints and
    recompiles the graph once when it changed and logs, at DEBUG, the nodes it added and removed
    (or why it skipped). Results leave through the returned value, never through attributes of
    the pass, so one pass object can run on many graphs.
    """

    name: ClassVar[str] = ""
    # where the step pipeline runs the pass when it is a step's graph pass (`PIPELINE_PHASES`):
    # before the DLS passes (the default), or after them, on the lowered graph (the telemetry)
    pipeline_phase: ClassVar[str] = BEFORE_DLS

    def __call__(self, graph_module: fx.GraphModule) -> GraphPassResult:
        return cast(GraphPassResult, super().__call__(graph_module))

    @final
    def call(self, graph_module: fx.GraphModule) -> GraphPassResult:
        before = set(graph_module.graph.nodes) if log.isEnabledFor(logging.DEBUG) else None
        result = self.run(graph_module)
        gm = result.graph_module
        if result.modified:
            gm.graph.lint()
            gm.recompile()
        if before is not None:
            _log_result(self.name, result, before)
        return result

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        """Rewrite ``gm`` in place; the result says whether it changed and counts what."""
        raise NotImplementedError(f"{type(self).__name__} must implement run()")


def _log_result(name: str, result: GraphPassResult, before: set[fx.Node]) -> None:
    if result.skipped is not None:
        log.debug("%s: skipped (%s)", name, result.skipped)
        return
    after = set(result.graph_module.graph.nodes)
    added = sorted(n.name for n in after - before)
    removed = sorted(n.name for n in before - after)
    log.debug("%s: added %d nodes %s, removed %d nodes %s", name, len(added), added,
              len(removed), removed)


class DLSPass(GraphPass):
    """A pass that either skips, saying why, or rewrites and records itself on the output node.

    Subclasses write ``skip_reason`` (None to run) and ``rewrite`` (True when the graph changed);
    ``run`` is the same for all of them, so running a pass twice changes nothing and a skipped
    pass leaves its reason where ``dlspass inspect`` finds it.
    """

    name = "dls_pass"

    def __init__(self, config: DLSConfig | None) -> None:
        self.config = config

    @final
    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        if self.applied(gm):
            return GraphPassResult(gm, False, skipped="already applied")
        why = self.skip_reason(gm)
        if why is not None:
            record_skip(gm.graph, self.name, why)
            return GraphPassResult(gm, False, skipped=why)
        modified = self.rewrite(gm)
        self.mark_applied(gm)
        return GraphPassResult(gm, modified)

    def skip_reason(self, gm: fx.GraphModule) -> str | None:
        """Why this pass leaves ``gm`` alone (e.g. "static scale: no overflow check"), or None."""
        return None

    def rewrite(self, gm: fx.GraphModule) -> bool:
        """Rewrite ``gm`` in place; True when the graph changed."""
        raise NotImplementedError(f"{type(self).__name__} must implement rewrite()")

    def will_run(self, gm: fx.GraphModule) -> bool:
        """True when ``call`` would rewrite ``gm`` (what ``requires`` checks preconditions for)."""
        return not self.applied(gm) and self.skip_reason(gm) is None

    @final
    def requires(self, gm: fx.GraphModule) -> None:
        """torch's precondition hook: `check_preconditions`, only for a pass that will rewrite
        ``gm`` (a skipped pass needs nothing). Decided here, so that a pass's hooks never call
        back into this template (control runs down: tests/test_compile_path.py)."""
        if self.will_run(gm):
            self.check_preconditions(gm)

    def check_preconditions(self, gm: fx.GraphModule) -> None:
        """What ``rewrite`` needs of ``gm``; raise `PassContractError` naming what is missing."""

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

    def check_preconditions(self, gm: fx.GraphModule) -> None:
        if global_node(gm.graph, roles.ISFINITE) is None:
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


def backward_grads(graph: fx.Graph) -> list[tuple[str, fx.Node]]:
    """``(parameter name, the gradient as backward produced it)`` for every GRAD node: its
    BACKWARD_GRAD node where the step's own code changed it before the optimizer read it (a
    user's clip inside ``dlspass.compile``), else the gradient `grads` gives."""
    raw = {roles.target_of(n): n for n in roles.nodes_with_role(graph, roles.BACKWARD_GRAD)}
    return [(t, effective_grad(raw[t]) if t in raw else g) for t, g in grads(graph)]


def optimizer_grads(graph: fx.Graph) -> list[tuple[str, fx.Node]]:
    """``(parameter name, the gradient the optimizer reads)``, unscaled once DLS unscaled it:
    its UNSCALE node, or its GRAD node where the step's own code computed that from the
    unscaled BACKWARD_GRAD (or where nothing was unscaled)."""
    raw = {roles.target_of(n) for n in roles.nodes_with_role(graph, roles.BACKWARD_GRAD)}
    unscaled = {roles.target_of(n): n for n in roles.nodes_with_role(graph, roles.UNSCALE)
                if roles.target_of(n)}
    return [(t, g if t in raw or t not in unscaled else unscaled[t]) for t, g in grads(graph)]


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Every node the gradients as backward produced them depend on (the forward and the
    backward), those gradients included; not the step's own code after backward.

    A gradient may also feed the backward itself (BatchNorm's bias gradient is a sum that its
    input gradient reuses); those uses must keep reading the scaled value, as torch.amp's
    backward does, and only the reads after backward move to the unscaled or clipped one.
    """
    raw = roles.nodes_with_role(graph, roles.BACKWARD_GRAD)
    tagged = {roles.target_of(n) for n in raw}
    return roles.ancestors([*raw, *(n for n in roles.nodes_with_role(graph, roles.GRAD)
                                    if roles.target_of(n) not in tagged)])


def is_float(node: object, dtype: torch.dtype | None = None) -> bool:
    """True when ``node`` is a node whose fake value is a floating-point tensor (of ``dtype``)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.is_floating_point()
            and (dtype is None or val.dtype == dtype))


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
    # the output node's arguments: splice adds computed nodes, the passes choose what is returned
    out.args = (tuple(vals),)
