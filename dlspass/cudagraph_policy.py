"""Whether a compiled training step can be recorded as one CUDA graph, and if not, why (policy).

A CUDA graph replays a fixed sequence of kernels on fixed memory: it saves the host the launch
of every kernel, which is what a launch-bound step (small batch, many small kernels: the
optimizer and DLS tail) pays for. dlspass's step can be recorded whole because it never reads a
value on the host (the overflow check, the guarded update and the scale update are tensor
math). It cannot when:

- the step is not on CUDA (``not CUDA``);
- a shape is symbolic (``dynamic shapes``: a graph is recorded for one shape);
- a tensor the step reads or makes lives on the CPU (``CPU tensors in the step``: a host copy in
  the middle of a graph, or a hyperparameter the replay would not see change; hyperparameters
  and scaler state must be device tensors);
- the user's code syncs (``user code that syncs``: ``.item()``, ``.nonzero()``, ``.tolist()``,
  a data-dependent shape: the host waits for the device inside the step).

`cudagraph_decision` is the pure rule over `StepFacts`; `step_facts` reads the facts from a
traced step graph (its fake values). The first reason found is the one reported, in the order
above: it is the one a user must fix first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

aten = torch.ops.aten

# ops (every overload) whose result the host must read (a sync): a scalar out of a tensor, or
# an output whose shape depends on the values
SYNC_OPS = frozenset(op for op in (
    getattr(aten, "_local_scalar_dense", None), getattr(aten, "item", None),
    getattr(aten, "nonzero", None), getattr(aten, "masked_select", None),
    getattr(aten, "unique", None), getattr(aten, "_unique2", None),
    getattr(aten, "unique_consecutive", None), getattr(aten, "repeat_interleave", None),
    getattr(aten, "_assert_async", None),
) if op is not None)

NOT_CUDA = "not CUDA"
DYNAMIC_SHAPES = "dynamic shapes"
CPU_TENSORS = "CPU tensors in the step"
USER_SYNC = "user code that syncs"


@dataclass(frozen=True)
class StepFacts:
    """What the decision needs to know about one compiled step.

    ``devices``: the device types of the tensors the step reads and makes (``{"cuda"}`` for a
    step entirely on the GPU); ``cpu_tensors``: names of the CPU tensors in a step that also has
    CUDA tensors; ``symbolic``: names of the values with a symbolic shape; ``syncs``: names of
    the nodes that make the host wait for the device.
    """

    devices: frozenset[str]
    cpu_tensors: tuple[str, ...] = ()
    symbolic: tuple[str, ...] = ()
    syncs: tuple[str, ...] = ()


@dataclass(frozen=True)
class CudaGraphDecision:
    """``record``: record the step as one CUDA graph; else ``reason`` says why not, in one line."""

    record: bool
    reason: str | None = None

    def __str__(self) -> str:
        return "recorded as one CUDA graph" if self.record else f"no CUDA graph: {self.reason}"

    @property
    def on_cuda(self) -> bool:
        """Whether the step runs on CUDA at all (a CPU step has nothing to record or warn about)."""
        return self.record or not (self.reason or "").startswith(NOT_CUDA)


def cudagraph_decision(facts: StepFacts) -> CudaGraphDecision:
    """The rule: record when the step is all CUDA, static, and never syncs; else the first
    reason, naming (up to three of) the values behind it."""
    if "cuda" not in facts.devices:
        return CudaGraphDecision(False, f"{NOT_CUDA} (the step runs on {_names(sorted(facts.devices)) or 'no device'})")
    if facts.symbolic:
        return CudaGraphDecision(False, f"{DYNAMIC_SHAPES} ({_names(facts.symbolic)})")
    if facts.cpu_tensors or "cpu" in facts.devices:
        return CudaGraphDecision(False, f"{CPU_TENSORS} ({_names(facts.cpu_tensors) or 'cpu'})")
    if facts.syncs:
        return CudaGraphDecision(False, f"{USER_SYNC} ({_names(facts.syncs)})")
    return CudaGraphDecision(True)


def step_facts(graph: fx.Graph) -> StepFacts:
    """The facts of a traced step graph, read from its nodes' fake values (``meta["val"]``)."""
    devices: set[str] = set()
    cpu: list[str] = []
    symbolic: list[str] = []
    syncs: list[str] = []
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in SYNC_OPS:
            syncs.append(node.name)
        for v in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
                symbolic.append(node.name)
                continue
            if not isinstance(v, torch.Tensor):
                continue
            devices.add(v.device.type)
            if v.device.type == "cpu":
                cpu.append(node.name)
            if any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride())):
                symbolic.append(node.name)
    return StepFacts(frozenset(devices), tuple(cpu) if "cuda" in devices else (),
                     tuple(dict.fromkeys(symbolic)), tuple(syncs))


def _names(names: Iterable[str]) -> str:
    names = list(names)
    more = f", +{len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def inductor_options(decision: CudaGraphDecision) -> dict[str, object]:
    """The inductor settings that carry out ``decision`` for a step compiled whole: CUDA graphs
    (inductor's cudagraph trees) on when it records, off otherwise; on CUDA, horizontal fusion
    of the many small per-parameter kernels of the optimizer and DLS tail (combo kernels) too.
    (torch 2.11 and 2.13 have both settings.)"""
    if not decision.record:
        return {"triton.cudagraphs": False}
    return {"triton.cudagraphs": True, "triton.cudagraph_trees": True, "combo_kernels": True}
