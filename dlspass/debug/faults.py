"""Fault injection: force inf/NaN into a named gradient, activation or the loss at chosen steps.

A `Fault` says *when* (the 0-based step index), *where* (``kind`` and ``target``) and *what*
(a non-finite ``value``). The same schedule drives three kinds of step:

- eager training: `EagerFaultInjector` puts hooks on the model (a tensor hook on a parameter
  for its gradient, a forward hook on a module for its output) and multiplies the loss by the
  value through ``injector.loss(loss)``; the step index is a host int, so no sync is added;
- step graphs: `inject_faults` runs the graph pass
  `dlspass.passes.inject_faults_pass.InjectFaultsPass` on a role-tagged step graph. It adds
  one placeholder, the step counter (0-d int64, role ``input``, target ``fault_step``), and for
  each faulted node inserts ``where(fault_step == k, value, x)`` and re-points every user of
  ``x`` at it. Gradients are the ``grad`` nodes of the parameter; the loss is the backward seed
  (the captured backward starts from ``ones_like(loss)``, so faulting the loss value alone would
  change nothing downstream; faulting the seed is what ``loss * inf`` does in eager);
  activations are nodes named as in the step's graph;
- captured and compiled steps (`dlspass.capture_step`, ``dlspass.compile``):
  `install_faults(step, faults)` adds `compiled_fault_pass` to the step's ``graph_passes``
  (the same injection, before ``apply_dls``) and feeds its ``fault_step`` placeholder from
  ``step.extra_inputs`` (the step's call count) at every call: the step counter is an ordinary
  graph input, so there is no recompilation per step (``compile=True`` compiles a captured
  step's injected graph with inductor). A ``dlspass.compile`` step takes it before its first
  call. Gradient targets are the step's graph names (the model's parameter names, or
  ``group0.param1`` for a ``dlspass.compile`` step without ``model=``) or, with ``model=``, the
  model's parameter names; activation targets are node names of the step's graph (see
  ``step.graph_module`` or ``step.graphs``). A faulted gradient's last ``where`` takes over its
  GRAD role, so the DLS passes unscale and check the faulted value. Loss faults can also go
  through a tensor argument (`loss_multiplier`).

A fault whose value cannot reach the gradients is not an overflow (``-inf`` into the input of
a ReLU becomes 0); use ``inf`` or ``nan`` for activations.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from dlspass.errors import InputValueError
from dlspass.graph.roles import FAULT_STEP
from dlspass.passes.inject_faults_pass import InjectFaultsPass

KINDS = ("grad", "activation", "loss")
VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


# a fault names something that does not exist or is not a fault (the message says which)
FaultError = InputValueError


@dataclass(frozen=True)
class Fault:
    """Force ``value`` into ``target`` at step ``step`` (0-based).

    ``kind``: ``"grad"`` (target: a parameter name), ``"activation"`` (target: a module name in
    eager, a node name in a captured graph) or ``"loss"`` (no target).
    """

    step: int
    kind: str
    target: str | None = None
    value: float = math.inf

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise FaultError(f"fault step: expected an integer >= 0, got {self.step!r}")
        if self.kind not in KINDS:
            raise FaultError(f"fault kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "loss" and self.target is not None:
            raise FaultError(f"a loss fault takes no target, got {self.target!r}")
        if self.kind != "loss" and not self.target:
            raise FaultError(f"a {self.kind} fault needs a target name")
        if not isinstance(self.value, (int, float)) or math.isfinite(self.value):
            raise FaultError(f"fault value: expected inf, -inf or nan, got {self.value!r}")

    def __str__(self) -> str:
        v = "nan" if math.isnan(self.value) else ("inf" if self.value > 0 else "-inf")
        return f"{self.step}:{self.kind}:{self.target or ''}:{v}"


def parse_fault(spec: str) -> Fault:
    """``"STEP:KIND[:TARGET][:VALUE]"``, e.g. ``"12:grad:fc1.weight:nan"``, ``"5:loss"``."""
    parts = spec.split(":")
    if len(parts) < 2:
        raise FaultError(f"fault {spec!r}: expected STEP:KIND[:TARGET][:VALUE]")
    try:
        step = int(parts[0])
    except ValueError:
        raise FaultError(f"fault {spec!r}: step {parts[0]!r} is not an integer") from None
    kind, rest = parts[1], parts[2:]
    value = math.inf
    if rest and rest[-1] in VALUES:
        value = VALUES[rest.pop()]
    target = ":".join(rest) or None
    return Fault(step, kind, target, value)


def random_faults(steps: int, rate: float, grads: Sequence[str] = (),
                  activations: Sequence[str] = (), loss: bool = True,
                  seed: int = 0) -> list[Fault]:
    """A random schedule: each step is faulted with probability ``rate``, at one random place.

    Gradient and loss faults take inf, -inf or NaN; activation faults inf or NaN (see the
    module docstring).
    """
    if not 0.0 <= rate <= 1.0:
        raise FaultError(f"rate: expected a probability in [0, 1], got {rate!r}")
    places: list[tuple[str, str | None]] = [("grad", g) for g in grads]
    places += [("activation", a) for a in activations]
    if loss:
        places.append(("loss", None))
    if not places:
        raise FaultError("random_faults: nothing to fault (no gradients, activations or loss)")
    rng = random.Random(seed)
    out = []
    for k in range(steps):
        if rng.random() < rate:
            kind, target = rng.choice(places)
            vals = [math.inf, math.nan] if kind == "activation" else [math.inf, -math.inf, math.nan]
            out.append(Fault(k, kind, target, rng.choice(vals)))
    return out


def faulted_steps(faults: Iterable[Fault]) -> set[int]:
    """The step indices at which at least one fault fires."""
    return {f.step for f in faults}


def loss_multiplier(faults: Iterable[Fault], step: int) -> Tensor:
    """A 0-d float32 tensor: the value of the loss fault at ``step``, else 1.0.

    For steps that take it as an input and return ``loss * multiplier`` - the way to fault a
    step compiled by ``dlspass.compile`` without a hook (the tensor is a graph input, so
    changing it does not recompile).
    """
    for f in faults:
        if f.kind == "loss" and f.step == step:
            return torch.tensor(f.value, dtype=torch.float32)
    return torch.tensor(1.0, dtype=torch.float32)


# ---- eager ------------------------------------------------------------------------------------
class EagerFaultInjector:
    """Hooks that fire ``faults`` on ``model`` in eager training.

    Set ``injector.step`` (or call ``next_step()``) once per iteration and route the loss
    through ``injector.loss(loss)`` before scaling it. Use as a context manager, or call
    ``remove()``, to take the hooks off.

    Example:
        >>> inj = EagerFaultInjector(model, [Fault(3, "grad", "fc1.weight")])  # doctest: +SKIP
        >>> for k, batch in enumerate(data):                                     # doctest: +SKIP
        ...     inj.step = k
        ...     scaler.scale(inj.loss(loss_fn(model, batch))).backward()
    """

    def __init__(self, model: nn.Module, faults: Iterable[Fault]) -> None:
        self.faults = list(faults)
        self.step = 0
        self.fired: list[Fault] = []
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        self._by_place: dict[tuple[str, str | None], dict[int, float]] = {}
        for f in self.faults:
            if f.kind == "grad" and f.target not in params:
                raise FaultError(f"grad fault: model has no parameter {f.target!r}")
            if f.kind == "activation" and f.target not in modules:
                raise FaultError(f"activation fault: model has no module {f.target!r}")
            self._by_place.setdefault((f.kind, f.target), {})[f.step] = f.value
        self._handles: list[Any] = []
        for (kind, target), _ in self._by_place.items():
            if kind == "grad":
                self._handles.append(params[target].register_hook(self._grad_hook(target)))
            elif kind == "activation":
                self._handles.append(modules[target].register_forward_hook(self._act_hook(target)))

    def _value(self, kind: str, target: str | None) -> float | None:
        return self._by_place.get((kind, target), {}).get(self.step)

    def _fire(self, kind: str, target: str | None, value: float) -> None:
        self.fired.append(Fault(self.step, kind, target, value))

    def _grad_hook(self, name: str) -> Any:
        def hook(grad: Tensor) -> Tensor | None:
            v = self._value("grad", name)
            if v is None:
                return None
            self._fire("grad", name, v)
            return torch.full_like(grad, v)

        return hook

    def _act_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            v = self._value("activation", name)
            if v is None:
                return None
            if not isinstance(output, Tensor):
                raise FaultError(f"activation fault: module {name!r} does not return one tensor")
            self._fire("activation", name, v)
            # the value becomes v, the backward sees the layer as if it had produced v (as in
            # a captured graph, whose backward reads the faulted activation)
            return output + (torch.full_like(output, v) - output).detach()

        return hook

    def loss(self, loss: Tensor) -> Tensor:
        """``loss`` times the fault value at a faulted step (so its gradients are inf/NaN too)."""
        v = self._value("loss", None)
        if v is None:
            return loss
        self._fire("loss", None, v)
        return loss * v

    def next_step(self) -> None:
        """Advance the step index by one."""
        self.step += 1

    def remove(self) -> None:
        """Take every hook off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> EagerFaultInjector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


# ---- captured graphs --------------------------------------------------------------------------
def inject_faults(gm: fx.GraphModule, faults: Iterable[Fault]) -> fx.GraphModule:
    """Rewrite the step graph ``gm`` in place so that ``faults`` fire; returns ``gm``.

    Runs `dlspass.passes.inject_faults_pass.InjectFaultsPass`: adds the step-counter placeholder
    (0-d int64, appended after every other input) and, per faulted node,
    ``where(fault_step == k, value, x)`` for each of its faulted steps. The graph then takes one
    input more: the index of the step being run.
    """
    InjectFaultsPass(faults)(gm)
    return gm


class FaultSchedule:
    """What `install_faults` returns: the faults, the injected graph and a way to undo them.

    ``enabled = False`` runs the same (possibly compiled) code with a step counter of -1, which
    no fault matches: the fault-free reference of exactly the same kernels. ``graph_module``
    is the injected graph of a `dlspass.CapturedStep` (a ``dlspass.compile`` step keeps its
    graphs in ``step.graphs``, made at its first call).
    """

    def __init__(self, step: Any, faults: list[Fault], fault_pass: Callable[[fx.GraphModule], None],
                 previous_compile: bool | None) -> None:
        self.step = step
        self.faults = faults
        self.graph_module: fx.GraphModule | None = None
        self.enabled = True
        self._pass = fault_pass
        self._previous_compile = previous_compile

    @property
    def faulted_steps(self) -> set[int]:
        return faulted_steps(self.faults)

    def remove(self) -> None:
        """Take the faults out: a captured step runs its un-faulted graph again; a
        ``dlspass.compile`` step keeps its one graph and runs it with the faults disabled."""
        if self._previous_compile is None:
            self.enabled = False
            return
        self.step.graph_passes.remove(self._pass)
        del self.step.extra_inputs[FAULT_STEP]
        self.step.compile = self._previous_compile
        self.step.rebuild()


def install_faults(step: Any, faults: Iterable[Fault], *, compile: bool = False,
                   model: nn.Module | None = None) -> FaultSchedule:
    """Make a `dlspass.CapturedStep` or a ``dlspass.compile`` step fire ``faults``.

    Both steps take the injection through their ``graph_passes`` hook (`compiled_fault_pass`,
    on the role-tagged step graph before ``apply_dls``) and feed its ``fault_step`` input from
    their ``extra_inputs``: the step index is the step's call count (0 for its first call).
    ``model`` lets gradient faults name the model's parameters where the step's graph names
    them otherwise (``step.graph_targets``).

    CapturedStep: rebuilt at once, with inductor when ``compile=True``; the graph it ran before
    is kept, and ``schedule.remove()`` brings it back. ``dlspass.compile`` step (`CompiledStep`):
    install before its first call (the injection becomes part of its one graph); ``compile`` is
    ignored (the step has its own backend), ``schedule.remove()`` disables the faults.
    """
    # late: the compile path (dynamo, inductor) loads only where a step is installed, not for
    # every eager user of FaultSchedule and localize (tests/test_layout.py names it)
    from dlspass.capture.compiled_step import CompiledStep

    faults = list(faults)
    compiled = isinstance(step, CompiledStep)
    if compiled and step.graphs:
        raise FaultError("install_faults: this dlspass.compile step was already called (and "
                         "compiled); install faults before its first call")
    if FAULT_STEP in step.extra_inputs:
        raise FaultError("install_faults: this step already has faults installed")
    names = step.graph_targets(model)
    for f in faults:
        if f.kind == "grad" and f.target not in names:
            raise FaultError(f"grad fault: the step has no parameter {f.target!r} "
                             f"(parameters: {', '.join(sorted(names))})")
    device = next((p.device for g in step.optimizer.param_groups for p in g["params"]),
                  torch.device("cpu"))
    fault_pass = compiled_fault_pass(faults, names)
    schedule = FaultSchedule(step, faults, fault_pass, None if compiled else step.compile)

    def fault_step() -> Tensor:
        # num_calls is advanced before the graph runs: a step's first call is 0
        k = step.num_calls - 1 if schedule.enabled else -1
        return torch.tensor(k, dtype=torch.int64, device=device)

    step.extra_inputs[FAULT_STEP] = fault_step
    step.graph_passes.append(fault_pass)
    if not compiled:
        step.compile = compile
        try:
            step.rebuild()
        except BaseException:
            schedule.remove()
            raise
        schedule.graph_module = step.graph_module
    return schedule


# ---- dlspass.compile steps ---------------------------------------------------------------------
def compiled_fault_pass(faults: Iterable[Fault],
                        names: dict[str, str] | None = None) -> Callable[[fx.GraphModule], None]:
    """A ``dlspass.compile`` graph pass (``graph_passes=``) that injects ``faults``.

    Runs `InjectFaultsPass` on the role-tagged AOT graph (before ``apply_dls``), so the graph
    gets a ``fault_step`` input the step must provide (``step.extra_inputs["fault_step"]``; see
    `install_faults`, which does both). ``names`` maps gradient fault targets to graph GRAD
    targets. Each faulted gradient's last ``where`` becomes the GRAD node, its original node is
    re-tagged ``pre_fault_grad``: the overflow check then sees the fault.
    """
    faults = [dataclasses.replace(f, target=names.get(f.target, f.target))
              if f.kind == "grad" and names else f for f in faults]
    # the step feeds fault_step on the device of its parameters, the graph's first inputs
    rewrite = InjectFaultsPass(faults, move_roles=True, counter_device=None)

    def run(gm: fx.GraphModule) -> None:
        rewrite(gm)

    return run
