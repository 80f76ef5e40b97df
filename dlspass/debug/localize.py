"""Overflow localisation: which node, module or gradient first became non-finite.

Nothing here runs on the training path: a step that overflowed is only counted on the device
(no host sync). On request, `localize_overflow` re-runs the step for one batch, looking at every
value, and returns an `OverflowReport`:

- captured steps (`dlspass.CapturedStep`, or the `FaultSchedule` of `dlspass.debug.faults`): the step
  graph runs node by node under an FX ``Interpreter``. The *origin* is the first node (in
  execution order) whose output holds inf/NaN although none of its tensor inputs do and no
  non-finite constant is among its arguments (so the ``-inf`` of an attention mask is not an
  overflow, while a matmul that overflows float16, a non-finite input batch or an injected
  fault is). Nothing is written back: the graph is pure, so the model, the optimizer and the
  scaler are untouched. The node is mapped to a module through ``nn_module_stack`` /
  ``stack_trace`` when the graph has them (dynamo and export graphs), otherwise through the
  parameters it reads (``make_fx`` graphs carry no module metadata);
- eager models: the forward runs with a hook on every module; the origin is the first module
  whose output is non-finite while its inputs are finite. The backward (of the loss times the
  scaler's scale, as in training) then names every parameter whose gradient is non-finite.
  Gradients and buffers (BatchNorm statistics) are restored afterwards.

`nonfinite_grads` is the cheap eager check: the parameters whose ``.grad`` holds inf/NaN.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor, nn

from dlspass.debug.faults import FaultSchedule
from dlspass.errors import InputTypeError
from dlspass.graph import roles


@dataclass
class OverflowReport:
    """Where a step's non-finite values came from (``origin is None``: none were found)."""
    origin: str | None = None  # graph node name, or module name in eager
    op: str | None = None  # the ATen op or the module class
    role: str | None = None  # the dlspass role of the origin node, if any
    module: str | None = None  # the module the origin belongs to, when known
    module_source: str | None = None  # "nn_module_stack", "stack_trace", "parameters", "eager"
    stack_trace: str | None = None  # the last user frame of the origin, when recorded
    phase: str | None = None  # "input", "forward", "backward", "update" (graph) or eager's
    nonfinite_grads: list[str] = field(default_factory=list)  # parameter names
    loss_finite: bool | None = None
    nodes_checked: int = 0

    @property
    def overflowed(self) -> bool:
        return self.origin is not None or bool(self.nonfinite_grads)

    def __str__(self) -> str:
        if not self.overflowed:
            return f"no non-finite value found ({self.nodes_checked} values checked)"
        where = f"{self.origin} ({self.op})" if self.origin else "unknown origin"
        if self.module:
            where += f" in module {self.module}"
        grads = ", ".join(self.nonfinite_grads[:6]) + (" ..." if len(self.nonfinite_grads) > 6 else "")
        return (f"first non-finite value: {where}, {self.phase or 'unknown'} phase; "
                f"non-finite gradients: {grads or 'none'}; loss finite: {self.loss_finite}")


def _tensors(x: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, Tensor)]


def _has_nonfinite(x: Any) -> bool:
    return any(t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())
               for t in _tensors(x))


def _nonfinite_literal(args: Any) -> bool:
    return any(isinstance(a, float) and not math.isfinite(a) for a in pytree.tree_leaves(args))


def nonfinite_grads(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters whose ``.grad`` holds inf or NaN (one host read each)."""
    return [name for name, p in model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())]


# ---- graphs -------------------------------------------------------------------------------------
def _module_of(node: fx.Node) -> tuple[str | None, str | None]:
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        path = path[0] if isinstance(path, tuple) else path
        return str(path), "nn_module_stack"
    # make_fx graphs carry no module metadata: the owner of the nearest parameter the node
    # reads; failing that, searching both ways (the rounding of a layer's input reads no
    # parameter, its consumer does)
    for both_ways in (False, True):
        found = _nearest_param(node, both_ways)
        if found is not None:
            return (found.rsplit(".", 1)[0] if "." in found else found), "parameters"
    return None, None


def _nearest_param(node: fx.Node, both_ways: bool, max_depth: int = 4) -> str | None:
    seen, queue = {node}, deque([(node, 0)])
    while queue:
        cur, depth = queue.popleft()
        if cur.op == "placeholder" and roles.role_of(cur) == roles.PARAM:
            return roles.target_of(cur) or ""
        if depth >= max_depth:
            continue
        for nxt in (*cur.all_input_nodes, *(cur.users if both_ways else ())):
            if nxt not in seen and nxt.op != "output":
                seen.add(nxt)
                queue.append((nxt, depth + 1))
    return None


def _last_frame(node: fx.Node) -> str | None:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln.strip() for ln in str(trace).strip().splitlines() if ln.strip()]
    return " | ".join(lines[-2:]) if lines else None


def _phases(graph: fx.Graph) -> dict[fx.Node, str]:
    """forward before the backward seed, backward up to the last gradient, update after."""
    out: dict[fx.Node, str] = {}
    phase = "forward"
    grads = set(roles.nodes_with_role(graph, roles.GRAD))
    for n in graph.nodes:
        if n.op == "placeholder":
            out[n] = "input"
            continue
        if roles.role_of(n) in (roles.SEED, roles.SCALED_SEED):
            phase = "backward"
        out[n] = phase
        if n in grads:
            grads.discard(n)
            if not grads:
                phase = "update"
    return out


class _Watcher(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.graph = gm.graph
        self.bad: set[fx.Node] = set()
        self.origin: fx.Node | None = None
        self.grads: list[str] = []
        self.loss_finite: bool | None = None
        self.checked = 0
        self.params = {roles.target_of(n) for n in gm.graph.find_nodes(op="placeholder")
                       if roles.role_of(n) == roles.PARAM}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op == "output":
            for i, (role, _) in enumerate(roles.output_roles(self.graph)):
                if role == roles.LOSS:
                    self.loss_finite = not _has_nonfinite(pytree.tree_leaves(result)[i])
            return result
        self.checked += 1
        if _has_nonfinite(result):
            self.bad.add(n)
            injected = _injected(n)
            fresh = not any(i in self.bad for i in n.all_input_nodes)
            if self.origin is None and (injected or (fresh and not _nonfinite_literal(n.args))):
                self.origin = n
            # the gradient as the optimizer sees it: backward's own, unscaled or faulted
            if roles.role_of(n) in (roles.GRAD, roles.UNSCALE, "fault") and roles.target_of(n) in self.params:
                target = str(roles.target_of(n))
                if target not in self.grads:
                    self.grads.append(target)
        if roles.role_of(n) == roles.LOSS and self.loss_finite is None:
            self.loss_finite = not _has_nonfinite(result)
        return result


def _injected(n: fx.Node) -> bool:
    """A node fault injection made: role ``fault``, or a faulted gradient that took over the
    GRAD role (``InjectFaultsPass(move_roles=True)``, as the steps' ``graph_passes`` run it)."""
    return roles.role_of(n) == "fault" or roles.pass_of(n) == "inject_faults"


def localize_graph(gm: fx.GraphModule, inputs: Iterable[Tensor]) -> OverflowReport:
    """Run ``gm`` on ``inputs`` value by value and report the first non-finite origin."""
    w = _Watcher(gm)
    with torch.no_grad():
        w.run(*inputs)
    rep = OverflowReport(nonfinite_grads=w.grads, loss_finite=w.loss_finite, nodes_checked=w.checked)
    n = w.origin
    if n is not None:
        rep.origin = n.name
        rep.op = str(n.target) if n.op != "placeholder" else "input"
        rep.role = roles.role_of(n)
        rep.phase = _phases(gm.graph).get(n)
        rep.module, rep.module_source = _module_of(n)
        rep.stack_trace = _last_frame(n)
        target = roles.target_of(n)
        if _injected(n) and target in w.params:
            rep.module, rep.module_source = str(target).rsplit(".", 1)[0], "parameters"
    return rep


# ---- eager --------------------------------------------------------------------------------------
def localize_eager(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Tensor],
                   scale: float | Tensor = 1.0) -> OverflowReport:
    """Forward with a hook on every module, then backward of ``loss * scale``.

    The model's gradients and buffers are restored afterwards, so calling this between a
    failed step and the next one changes nothing.
    """
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rep = OverflowReport(module_source="eager")
    order: list[str] = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            rep.nodes_checked += 1
            order.append(name)
            if rep.origin is None and _has_nonfinite(output) and not _has_nonfinite(args):
                rep.origin = name or "<model>"
                rep.module = name or "<model>"
                rep.op = type(module).__name__
                rep.phase = "forward"

        return hook

    handles = [m.register_forward_hook(hook_for(name)) for name, m in model.named_modules()]
    try:
        for p in model.parameters():
            p.grad = None
        if _has_nonfinite(batch):
            rep.origin, rep.op, rep.phase = "batch", "input", "input"
        loss = loss_fn(model, batch)
        rep.loss_finite = not _has_nonfinite(loss)
        if rep.origin is None and not rep.loss_finite:
            rep.origin, rep.op, rep.phase = "loss_fn", "loss", "forward"
        for h in handles:
            h.remove()
        handles = []
        if loss.requires_grad:
            s = scale if isinstance(scale, Tensor) else torch.tensor(float(scale))
            (loss * s.to(loss.device, loss.dtype)).backward()
            rep.nonfinite_grads = nonfinite_grads(model)
            if rep.origin is None and rep.nonfinite_grads:
                rep.phase = "backward"
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.grad = grads[n]
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
    return rep


# ---- one entry point ----------------------------------------------------------------------------
def localize_overflow(step_or_model: Any, batch: Any,
                      loss_fn: Callable[[nn.Module, Any], Tensor] | None = None, *,
                      scaler: Any = None, step_index: int | None = None) -> OverflowReport:
    """Re-run one step on ``batch`` and report where its first non-finite value came from.

    ``step_or_model``: a `dlspass.CapturedStep`, a `dlspass.debug.faults.FaultSchedule` (the faulted
    graph, at ``step_index`` or at the step's current call count) or an ``nn.Module`` (eager:
    give ``loss_fn`` and, to reproduce a scaled backward, the ``scaler``).

    Example:
        >>> if not bool(scaler.step(opt)):                                 # doctest: +SKIP
        ...     print(localize_overflow(model, batch, loss_fn, scaler=scaler))
    """
    if isinstance(step_or_model, FaultSchedule):
        step = step_or_model.step
        k = step.num_calls if step_index is None else step_index
        inputs = step._inputs_for(step._batch_leaves(batch))
        return localize_graph(step_or_model.graph_module,
                              [*inputs, torch.tensor(k, dtype=torch.int64)])
    if hasattr(step_or_model, "graph_module") and hasattr(step_or_model, "_inputs_for"):
        step = step_or_model
        return localize_graph(step.graph_module, step._inputs_for(step._batch_leaves(batch)))
    if isinstance(step_or_model, nn.Module):
        if loss_fn is None:
            raise InputTypeError("localize_overflow: an eager model needs loss_fn(model, batch)")
        scale = scaler.state.loss_scale if scaler is not None and scaler.is_enabled() else 1.0
        return localize_eager(step_or_model, batch, loss_fn, scale)
    raise InputTypeError(f"localize_overflow: expected a CapturedStep, a FaultSchedule or an "
                    f"nn.Module, got {type(step_or_model).__name__}")
