"""InjectFaultsPass: the injected step equals the plain step except at the fault's step, where the
faulted value is the fault (checked against eager SGD and eager DLS)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
from stepgraph import (
    MLP_GRAD_SUMS,
    eager_grads,
    mlp_step,
    node_values,
    reference_step,
    run,
    sgd_momentum,
)
from tolerance import reordered_sum_atol, sgd_update_atol
from torch._subclasses.fake_tensor import FakeTensor

from dlspass.config import DLSConfig
from dlspass.debug.faults import Fault, FaultError
from dlspass.graph import roles
from dlspass.graph.roles import FAULT, FAULT_STEP, PRE_FAULT_GRAD
from dlspass.passes import apply_dls
from dlspass.passes.inject_faults_pass import InjectFaultsPass

DLS = DLSConfig(mixed_precision=False, initial_loss_scale=1024.0)


def run_at(step, gm: fx.GraphModule, k: int) -> dict:
    """Run the injected graph at step ``k`` (the counter is the graph's last input)."""
    with torch.no_grad():
        out = list(gm(*step.inputs(), torch.tensor(k, dtype=torch.int64)))
    grouped: dict = {r: {} for r in roles.OUTPUT_ROLES}
    for (role, target), v in zip(roles.output_roles(gm.graph), out, strict=True):
        grouped[role][target] = v
    return grouped


def test_grad_fault_fires_at_its_step_only() -> None:
    step = mlp_step()
    plain = run(step)
    gm = step.gm
    InjectFaultsPass([Fault(3, "grad", "fc1.weight", math.inf)])(gm)
    counter = list(gm.graph.find_nodes(op="placeholder"))[-1]
    assert (roles.role_of(counter), roles.target_of(counter)) == (roles.INPUT, FAULT_STEP)
    for k in (0, 2, 4):
        out = run_at(step, gm, k)
        for role in (roles.PARAM_UPDATE, roles.OPT_STATE_UPDATE):
            for name, v in plain[role].items():
                assert torch.equal(out[role][name], v), (k, role, name)
    out = run_at(step, gm, 3)
    # eager SGD with momentum on an all-inf gradient of fc1.weight; the others untouched
    p, buf, lr = step.params["fc1.weight"], step.opt_state["fc1.weight.momentum_buffer"], step.hyper["group0.lr"]
    want_p, want_buf = sgd_momentum(p, torch.full_like(p, math.inf), buf, lr)
    assert torch.equal(out[roles.PARAM_UPDATE]["fc1.weight"], want_p)
    assert torch.equal(out[roles.OPT_STATE_UPDATE]["fc1.weight.momentum_buffer"], want_buf)
    for name in ("fc1.bias", "fc2.weight", "fc3.bias"):
        assert torch.equal(out[roles.PARAM_UPDATE][name], plain[roles.PARAM_UPDATE][name])


def test_new_nodes_carry_fake_values_roles_and_provenance() -> None:
    step = mlp_step()
    gm = step.gm
    grad = next(n for n in roles.nodes_with_role(gm.graph, roles.GRAD) if roles.target_of(n) == "fc2.bias")
    grad.meta["stack_trace"] = "model.py:22"
    before = set(gm.graph.nodes)
    InjectFaultsPass([Fault(1, "grad", "fc2.bias", math.nan), Fault(5, "grad", "fc2.bias")])(gm)
    new = [n for n in gm.graph.nodes if n not in before]
    counter, *inserted = new
    assert counter.op == "placeholder" and counter.meta["val"].device == torch.device("cpu")
    assert len(inserted) == 4  # eq + where per fault, chained
    for n in [counter, *inserted]:
        assert isinstance(n.meta["val"], FakeTensor), n
    for n in inserted:
        assert roles.role_of(n) == FAULT and roles.target_of(n) == "fc2.bias"
        assert roles.pass_of(n) == "inject_faults" and n.meta["stack_trace"] == "model.py:22"
    assert inserted[-1].meta["val"].shape == grad.meta["val"].shape
    # without move_roles the GRAD role stays on the gradient as backward made it
    assert roles.role_of(grad) == roles.GRAD
    vals = node_values(gm, [*step.inputs(), torch.tensor(1)], [inserted[-1]])
    assert torch.isnan(vals[0]).all()


def test_move_roles_lets_the_dls_check_see_a_grad_fault() -> None:
    step = mlp_step(DLS)
    gm = step.gm
    InjectFaultsPass([Fault(2, "grad", "fc3.bias")], move_roles=True)(gm)
    (pre,) = [n for n in gm.graph.nodes if roles.role_of(n) == PRE_FAULT_GRAD]
    (grad,) = [n for n in roles.nodes_with_role(gm.graph, roles.GRAD) if roles.target_of(n) == "fc3.bias"]
    assert roles.target_of(pre) == "fc3.bias" and grad.target is torch.ops.aten.where.ScalarSelf
    apply_dls(gm, DLS)
    ref = reference_step(step, DLS)
    clean = run_at(step, gm, 0)
    grads = eager_grads(step)
    for name, v in ref[roles.PARAM_UPDATE].items():
        # the traced step's gradients and eager autograd's sum in other orders (other kernels);
        # the SGD tail may round in another order (tests/tolerance.py)
        atol = sgd_update_atol(reordered_sum_atol(MLP_GRAD_SUMS, float(grads[name].abs().max())),
                               float(step.hyper["group0.lr"]), float(step.params[name].abs().max()))
        torch.testing.assert_close(clean[roles.PARAM_UPDATE][name], v, rtol=0, atol=atol)
    assert clean[roles.SCALER_STATE_UPDATE]["loss_scale"] == ref["state"].loss_scale
    faulted = run_at(step, gm, 2)
    # the step is skipped: every parameter keeps its value, the scale backs off
    for name, v in step.params.items():
        assert torch.equal(faulted[roles.PARAM_UPDATE][name], v)
    assert float(faulted[roles.SCALER_STATE_UPDATE]["loss_scale"]) < float(step.state.loss_scale)


def test_loss_fault_hits_the_seed_and_the_returned_loss() -> None:
    step = mlp_step()
    gm = step.gm
    plain = run(step)
    InjectFaultsPass([Fault(0, "loss", None, -math.inf)])(gm)
    out = run_at(step, gm, 0)
    assert float(out[roles.LOSS][None]) == -math.inf
    for name in step.params:
        assert not torch.isfinite(out[roles.PARAM_UPDATE][name]).all()
    later = run_at(step, gm, 1)
    assert torch.equal(later[roles.LOSS][None], plain["loss"])


def test_activation_fault_by_node_name_and_counter_device() -> None:
    step = mlp_step()
    gm = step.gm
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    InjectFaultsPass([Fault(7, "activation", relu.name)], counter_device=None)(gm)
    (where,) = [n for n in relu.users if n.target is torch.ops.aten.where.ScalarSelf]
    assert all(u is where or roles.role_of(u) == FAULT for u in relu.users)
    x7, x6 = (node_values(gm, [*step.inputs(), torch.tensor(k)], [relu, where]) for k in (7, 6))
    assert torch.equal(x6[1], x6[0]) and torch.isinf(x7[1]).all()
    counter = list(gm.graph.find_nodes(op="placeholder"))[-1]
    assert counter.meta["val"].device == next(iter(step.params.values())).device


def test_graph_without_fake_values() -> None:
    gm = fx.symbolic_trace(lambda x: torch.sin(x) * 2.0)
    sin = next(n for n in gm.graph.nodes if n.op == "call_function")
    InjectFaultsPass([Fault(1, "activation", sin.name, math.nan)])(gm)
    x = torch.randn(4)
    assert torch.equal(gm(x, torch.tensor(0)), torch.sin(x) * 2.0)
    assert torch.isnan(gm(x, torch.tensor(1))).all()


def test_refusals() -> None:
    step = mlp_step()
    gm = step.gm
    with pytest.raises(FaultError, match="no gradient of 'nope'"):
        InjectFaultsPass([Fault(1, "grad", "nope")])(gm)
    with pytest.raises(FaultError, match="no computed node named 'nope'"):
        InjectFaultsPass([Fault(1, "activation", "nope")])(gm)
    assert not [n for n in gm.graph.find_nodes(op="placeholder") if roles.target_of(n) == FAULT_STEP]
    InjectFaultsPass([Fault(1, "loss")])(gm)
    with pytest.raises(FaultError, match="already has faults injected"):
        InjectFaultsPass([Fault(2, "loss")])(gm)
