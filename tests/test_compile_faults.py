"""Fault injection in ``dlspass.compile`` steps: graph_passes + extra_inputs, one graph, no breaks.

A tiny MLP with Adam, eager backend: faults on a named gradient (the model's parameter name),
on an AOT-graph activation node and on the loss fire at chosen steps; those steps are skipped
with parameters and Adam state bit-identical, every other step equals a fault-free compiled run
that simply never sees the faulted batches, and the scale halves exactly at the faulted steps.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters

import dlspass
from dlspass.capture.compiled_step import CompileError
from dlspass.debug.faults import Fault, FaultError, install_faults
from dlspass.graph import roles
from dlspass.graph.roles import FAULT_STEP, PRE_FAULT_GRAD
from dlspass.models import MLP, mse_train_step

STEPS = 12
FAULTS = [
    Fault(2, "grad", "fc2.weight"),
    Fault(5, "activation", "relu", math.nan),  # the first ReLU of the AOT graph
    Fault(6, "grad", "fc3.bias", -math.inf),
    Fault(9, "loss"),
    Fault(10, "grad", "fc2.weight", math.nan),
]
FAULTED = {f.step for f in FAULTS}


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _make(backend_compiler: str = "eager"):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=3)

    train_step = mse_train_step(model, opt)

    step = dlspass.compile(train_step, optimizer=opt, scaler=scaler, mixed_precision=False,
                           backend_compiler=backend_compiler)
    return model, opt, scaler, step


def _state(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for _, v in sorted(opt.state[p].items())]
    return out


def _bit_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.int32), y.view(-1).view(torch.int32))
        for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def faulted_run():
    torch._dynamo.reset()
    counters.clear()
    model, opt, scaler, step = _make()
    schedule = install_faults(step, FAULTS, model=model)
    rec = {"losses": [], "scales": [], "skipped": [], "unchanged": []}
    for k in range(STEPS):
        before = _state(model, opt)
        n0 = int(scaler.state.num_skipped_steps)
        rec["losses"].append(float(step(*_batch(k))))
        rec["scales"].append(float(scaler.state.loss_scale))
        rec["skipped"].append(int(scaler.state.num_skipped_steps) > n0)
        rec["unchanged"].append(_bit_identical(before, _state(model, opt)))
    rec["graph_breaks"] = sum(counters["graph_break"].values())
    rec["unique_graphs"] = counters["stats"]["unique_graphs"]
    return model, opt, scaler, step, schedule, rec


def test_faulted_steps_are_skipped_with_state_bit_identical(faulted_run):
    model, opt, scaler, step, _, rec = faulted_run
    assert {k for k in range(STEPS) if rec["skipped"][k]} == FAULTED
    assert {k for k in range(STEPS) if rec["unchanged"][k]} == FAULTED
    assert int(scaler.state.num_skipped_steps) == len(FAULTED)
    assert all(torch.isfinite(t).all() for t in _state(model, opt))
    # the loss fault shows in the returned loss as it would in eager (loss * inf)
    assert rec["losses"][9] == math.inf
    assert all(math.isfinite(v) for k, v in enumerate(rec["losses"]) if k not in (5, 9))


def test_scale_backs_off_exactly_at_the_faults(faulted_run):
    *_, rec = faulted_run
    # hand-worked (torch-style growth every 3 clean steps, x0.5 per overflow) from 1024:
    # 0,1 clean | 2 fault 512 | 3,4 clean | 5 fault 256 | 6 fault 128 | 7,8 clean |
    # 9 fault 64 | 10 fault 32 | 11 clean
    assert rec["scales"] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0, 128.0, 128.0, 128.0,
                             64.0, 32.0, 32.0]


def test_one_graph_no_breaks_and_fault_step_is_an_input(faulted_run):
    model, _, _, step, _, rec = faulted_run
    assert rec["graph_breaks"] == 0
    assert rec["unique_graphs"] == 1  # the step index changes every call: no recompilation
    (gm,) = step.graphs
    phs = gm.graph.find_nodes(op="placeholder")
    assert roles.target_of(phs[-1]) == FAULT_STEP
    assert step.graph_targets(model)["fc2.weight"] == "group0.param2"
    # the faulted gradient's where is what DLS unscales; the raw one is re-tagged
    pre = {roles.target_of(n) for n in roles.nodes_with_role(gm.graph, PRE_FAULT_GRAD)}
    assert pre == {"group0.param2", "group0.param5"}
    for n in roles.nodes_with_role(gm.graph, roles.GRAD):
        if roles.target_of(n) in pre:
            assert n.target is torch.ops.aten.where.ScalarSelf


def test_clean_steps_equal_a_fault_free_run_skipping_the_same_batches(faulted_run):
    model, opt, *_ = faulted_run
    torch._dynamo.reset()
    ref_model, ref_opt, ref_scaler, ref_step = _make()
    for k in range(STEPS):
        if k not in FAULTED:
            ref_step(*_batch(k))
    assert int(ref_scaler.state.num_skipped_steps) == 0
    # the scale differs (the faulted run backed off) but it is a power of two in fp32: exact
    assert _bit_identical(_state(model, opt), _state(ref_model, ref_opt))


@pytest.mark.slow
def test_inductor_fires_the_same_faults(faulted_run):
    """Inductor (~25 s): the fault_step input is fed to the compiled kernels as well."""
    *_, rec = faulted_run
    torch._dynamo.reset()
    counters.clear()
    model, opt, scaler, step = _make("inductor")
    install_faults(step, FAULTS, model=model)
    scales = []
    for k in range(STEPS):
        step(*_batch(k))
        scales.append(float(scaler.state.loss_scale))
    assert scales == rec["scales"]
    assert sum(counters["graph_break"].values()) == 0
    assert all(torch.isfinite(t).all() for t in _state(model, opt))


def test_fault_free_reference_matches_eager_torch_adam():
    """Independent check of the reference run itself: plain eager fp32 Adam, no scaler."""
    torch._dynamo.reset()
    model, opt, _, step = _make()
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-2)
    for k in range(4):
        step(*_batch(k))
        x, y = _batch(k)
        F.mse_loss(eager(x), y).backward()
        eager_opt.step()
        eager_opt.zero_grad()
    # bit equality: backend_compiler="eager" runs the captured ATen ops eager autograd and Adam
    # dispatch, in the same order; the loss scale is a power of two, exact
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_remove_disables_faults():
    torch._dynamo.reset()
    model, opt, scaler, step = _make()
    schedule = install_faults(step, [Fault(0, "grad", "fc1.weight"), Fault(1, "loss")], model=model)
    step(*_batch(0))
    assert int(scaler.state.num_skipped_steps) == 1
    schedule.remove()
    step(*_batch(1))
    assert int(scaler.state.num_skipped_steps) == 1


def test_bad_faults_are_clear_errors():
    model, _, _, step = _make()
    with pytest.raises(FaultError, match="no parameter 'fc9.weight'"):
        install_faults(step, [Fault(0, "grad", "fc9.weight")], model=model)
    with pytest.raises(FaultError, match="no parameter 'fc1.weight'"):
        install_faults(step, [Fault(0, "grad", "fc1.weight")])  # graph names without model=
    torch._dynamo.reset()
    install_faults(step, [Fault(0, "activation", "no_such_node")])
    with pytest.raises(FaultError, match="no computed node named 'no_such_node'"):
        step(*_batch(0))

    torch._dynamo.reset()
    model, _, _, step = _make()
    step(*_batch(0))
    with pytest.raises(FaultError, match="before its first call"):
        install_faults(step, [Fault(3, "loss")])


def test_graph_pass_input_without_provider_is_a_clear_error():
    def add_input(gm: fx.GraphModule) -> None:
        last = gm.graph.find_nodes(op="placeholder")[-1]
        with gm.graph.inserting_after(last):
            ph = gm.graph.placeholder("unprovided")
        roles.set_role(ph, roles.INPUT, "unprovided")
        gm.recompile()

    torch._dynamo.reset()
    model, opt, _, step = _make()
    step.graph_passes.append(add_input)
    with pytest.raises(CompileError, match="does not provide"):
        step(*_batch(0))


def test_graph_passes_must_be_callable():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(dlspass.config.ConfigError, match="graph_passes"):
        dlspass.compile(lambda: None, optimizer=opt, graph_passes=[42], backend_compiler="eager")
