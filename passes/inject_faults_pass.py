"""InjectFaultsPass: a ``fault_step`` input is added and each faulted node ``x`` is read as ``where(fault_step == k, value, x)`` for each of its fault steps ``k``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from dlspass.errors import InputValueError
from dlspass.graph import roles
from dlspass.graph.roles import FAULT, FAULT_STEP, PRE_FAULT_GRAD
from dlspass.graph.splice import add_input, insert_op
from dlspass.passes.base import GraphPass, GraphPassResult


class FaultSpec(Protocol):
    """What the pass reads of a fault (``dlspass.debug.faults.Fault`` is one): the 0-based
    ``step`` it fires at, its ``kind`` (``"grad"``, ``"activation"``, ``"loss"``), the
    ``target`` it hits (a parameter or node name; None for the loss) and the ``value`` forced."""

    @property
    def step(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def target(self) -> str | None: ...
    @property
    def value(self) -> float: ...


class InjectFaultsPass(GraphPass):
    """Make ``faults`` fire in a role-tagged step graph, at the step the new input names.

    The step-counter placeholder (0-d int64, role ``input``, target ``fault_step``) goes after
    every other input; ``counter_device`` is where the caller will feed it (None: on the
    device of the graph's first tensor input). Gradients are the
    GRAD nodes of the parameter; a loss fault hits the backward seed (the captured backward
    starts from ``ones_like(loss)``, so faulting the loss value alone would change nothing
    downstream) and the LOSS node (so the returned loss shows it). Activations are nodes by
    name. With ``move_roles`` (graphs the DLS passes run on next): the last ``where`` of a
    faulted gradient takes over its GRAD role (the original becomes ``pre_fault_grad``), so
    the overflow check sees the fault, and a graph that records the loss only as an output
    gets its LOSS role on the returned value. A fault naming nothing in the graph is an input
    error (``dlspass.debug.faults.FaultError``). ``stats["faulted"]``: the nodes faulted.
    """

    name = "inject_faults"

    def __init__(self, faults: Iterable[FaultSpec], *, move_roles: bool = False,
                 counter_device: torch.device | str | None = "cpu") -> None:
        self.faults = list(faults)
        self.move_roles = move_roles
        self.counter_device = None if counter_device is None else torch.device(counter_device)

    def requires(self, gm: fx.GraphModule) -> None:
        if _counter(gm.graph) is not None:
            raise InputValueError(f"{self.name}: this graph already has faults injected")

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        if self.move_roles and any(f.kind == "loss" for f in self.faults):
            _tag_returned_loss(graph)
        by_node: dict[fx.Node, list[FaultSpec]] = {}
        for f in self.faults:  # every target is looked up before the graph changes
            for node in _fault_nodes(graph, f):
                by_node.setdefault(node, []).append(f)
        counter = self._add_counter(graph)
        # a graph without fake values (e.g. symbolic_trace) gets none on the new nodes either;
        # each faulted value keeps its value meta
        fake = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")]) is not None
        for node, fs in by_node.items():
            users = list(node.users)
            cur = node
            for f in sorted(fs, key=lambda f: f.step):
                target = f.target or "loss"
                eq = insert_op(graph, torch.ops.aten.eq.Scalar, (counter, f.step),
                               before=cur.next, role=FAULT, by_pass=self.name,
                               target_name=target, source=node, fake=fake)
                cur = insert_op(graph, torch.ops.aten.where.ScalarSelf, (eq, f.value, cur),
                                before=eq.next, role=FAULT, by_pass=self.name,
                                target_name=target, source=node, fake=fake)
                if not fake:
                    cur.meta["val"] = node.meta.get("val")
            for u in users:
                u.replace_input_with(node, cur)
            if self.move_roles and any(f.kind == "grad" for f in fs):
                grad = roles.target_of(node)
                roles.set_role(node, PRE_FAULT_GRAD, grad)
                roles.set_role(cur, roles.GRAD, grad)
        return GraphPassResult(gm, True, {"faulted": len(by_node)})

    def _add_counter(self, graph: fx.Graph) -> fx.Node:
        vals = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        device = self.counter_device or next(
            (v.device for v in vals if isinstance(v, torch.Tensor)), torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return add_input(graph, FAULT_STEP, zero, role=roles.INPUT, target=FAULT_STEP)


def _counter(graph: fx.Graph) -> fx.Node | None:
    return next((n for n in graph.find_nodes(op="placeholder")
                 if roles.role_of(n) == roles.INPUT and roles.target_of(n) == FAULT_STEP), None)


def _fault_nodes(graph: fx.Graph, fault: FaultSpec) -> list[fx.Node]:
    if fault.kind == "loss":
        # the seed drives the backward; the loss node only makes the returned loss show it
        return [roles.the_node(graph, roles.SEED), roles.the_node(graph, roles.LOSS)]
    if fault.kind == "grad":
        found = [n for n in roles.nodes_with_role(graph, roles.GRAD)
                 if roles.target_of(n) == fault.target]
        if len(found) != 1:
            names = sorted(str(roles.target_of(n)) for n in roles.nodes_with_role(graph, roles.GRAD))
            raise InputValueError(f"grad fault: the graph has no gradient of {fault.target!r} "
                                  f"(gradients: {', '.join(names)})")
        return found
    for n in graph.nodes:
        if n.name == fault.target and n.op == "call_function":
            return [n]
    raise InputValueError(f"activation fault: the graph has no computed node named {fault.target!r}")


def _tag_returned_loss(graph: fx.Graph) -> None:
    """Give the returned loss the LOSS role when the graph records it only as an output position
    (the AOT graph of ``dlspass.compile``), so a loss fault also shows in the returned loss."""
    if roles.nodes_with_role(graph, roles.LOSS):
        return
    _, loss = roles.output_value(graph, roles.LOSS)
    if loss.op != "call_function" or roles.role_of(loss) is not None:
        raise InputValueError("loss fault: the step's returned loss is not a computed node")
    roles.set_role(loss, roles.LOSS)
