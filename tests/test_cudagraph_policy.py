"""The CUDA-graph decision: record the whole step, or one line saying why not, for every reason.

The graphs are traced with fake CUDA tensors (``FakeTensorMode`` makes them on a CPU-only
torch), so the decision is checked where no GPU is: what it reads is the fake values' devices,
shapes and the ops, never a kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.cudagraph_policy import (
    CPU_TENSORS,
    DYNAMIC_SHAPES,
    NOT_CUDA,
    USER_SYNC,
    CudaGraphDecision,
    StepFacts,
    cudagraph_decision,
    step_facts,
)


def _sgd(p, g, lr):
    return p - lr * g


def sgd_on_fake(*specs: tuple[tuple[int, ...], str]) -> fx.GraphModule:
    """``_sgd`` traced on fake tensors of the given (shape, device) (also tests/test_step_cudagraph.py's)."""
    with FakeTensorMode():
        return make_fx(_sgd)(*(torch.empty(shape, device=dev) for shape, dev in specs))


def test_an_all_cuda_static_step_is_recorded():
    d = cudagraph_decision(step_facts(sgd_on_fake(((4, 3), "cuda"), ((4, 3), "cuda"), ((), "cuda")).graph))
    assert d == CudaGraphDecision(True)
    assert str(d) == "recorded as one CUDA graph"


def test_a_cpu_step_is_not_cuda():
    d = cudagraph_decision(step_facts(sgd_on_fake(((4, 3), "cpu"), ((4, 3), "cpu"), ((), "cpu")).graph))
    assert not d.record
    assert d.reason == f"{NOT_CUDA} (the step runs on cpu)"


def test_a_cpu_hyperparameter_in_a_cuda_step_is_named():
    # the learning rate as a 0-d CPU tensor: a replay would never see a scheduler change it
    graph = sgd_on_fake(((4, 3), "cuda"), ((4, 3), "cuda"), ((), "cpu")).graph
    d = cudagraph_decision(step_facts(graph))
    lr = [n for n in graph.nodes if n.op == "placeholder"][2].name
    assert not d.record
    assert d.reason.startswith(CPU_TENSORS) and lr in d.reason
    assert "\n" not in str(d)


def test_dynamic_shapes_are_named():
    # a symbolic trace (CPU here: the rule reads the shapes before the device's other tensors)
    gm = make_fx(_sgd, tracing_mode="symbolic")(torch.ones(4, 3), torch.ones(4, 3), torch.tensor(0.1))
    facts = step_facts(gm.graph)
    p = next(n for n in gm.graph.nodes if n.op == "placeholder").name
    assert p in facts.symbolic
    d = cudagraph_decision(StepFacts(frozenset({"cuda"}), symbolic=facts.symbolic))
    assert not d.record and d.reason.startswith(DYNAMIC_SHAPES) and p in d.reason


def test_user_code_that_syncs_is_named():
    # x.sum().item() in the step: aten._local_scalar_dense, the host waits for the device
    graph = fx.Graph()
    with FakeTensorMode():
        xv = torch.empty(4, device="cuda")
        sv = xv.sum()
    x = graph.placeholder("x")
    x.meta["val"] = xv
    s = graph.call_function(torch.ops.aten.sum.default, (x,))
    s.meta["val"] = sv
    item = graph.call_function(torch.ops.aten._local_scalar_dense.default, (s,))
    item.meta["val"] = 1.0
    graph.output((s,))
    d = cudagraph_decision(step_facts(graph))
    assert not d.record
    assert d.reason == f"{USER_SYNC} ({item.name})"


@pytest.mark.parametrize(("facts", "first"), [
    (StepFacts(frozenset({"cpu"}), symbolic=("a",), syncs=("b",)), NOT_CUDA),
    (StepFacts(frozenset({"cuda", "cpu"}), cpu_tensors=("lr",), symbolic=("a",), syncs=("b",)),
     DYNAMIC_SHAPES),
    (StepFacts(frozenset({"cuda", "cpu"}), cpu_tensors=("lr",), syncs=("b",)), CPU_TENSORS),
    (StepFacts(frozenset({"cuda"}), syncs=("b",)), USER_SYNC),
])
def test_the_first_reason_is_the_one_reported(facts, first):
    d = cudagraph_decision(facts)
    assert not d.record and d.reason.startswith(first)


def test_long_lists_are_cut_to_one_line():
    d = cudagraph_decision(StepFacts(frozenset({"cuda"}), syncs=tuple(f"n{i}" for i in range(7))))
    assert d.reason == f"{USER_SYNC} (n0, n1, n2, +4 more)"


@pytest.mark.parametrize("decision", [CudaGraphDecision(True), CudaGraphDecision(False, NOT_CUDA)])
def test_inductor_options_are_settings_this_torch_has(decision):
    from torch._inductor import config as inductor_config

    from dlspass.cudagraph_policy import inductor_options

    opts = inductor_options(decision)
    assert opts["triton.cudagraphs"] is decision.record
    with inductor_config.patch(opts):  # an unknown key raises here
        assert inductor_config.triton.cudagraphs is decision.record
