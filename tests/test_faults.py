"""Fault injection: random inf/NaN faults over 1,000 steps, eager and captured (tiny MLP).

Every faulted step must be skipped, nothing non-finite may ever reach a parameter or the
optimizer state, and the clean steps must be bit-identical to a run that simply does not step
on the faulted batches. fp32 with power-of-two loss scales makes that exact: scaling the
backward by 2**k and unscaling by 2**-k changes no bit, so the reference needs no scaler.
"""

from __future__ import annotations

import math

import pytest
import torch

import dlspass
from dlspass.debug.faults import (
    EagerFaultInjector,
    Fault,
    FaultError,
    inject_faults,
    install_faults,
    loss_multiplier,
    parse_fault,
    random_faults,
)
from dlspass.graph.roles import FAULT
from dlspass.models import MLP, mse_loss

STEPS = 1000
RATE = 0.1
GRADS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc3.bias"]


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def fresh(seed: int = 0) -> tuple[MLP, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = MLP()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        out += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


def all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def reference_run(skip: set[int], steps: int) -> tuple[MLP, torch.optim.Adam]:
    """Plain fp32 Adam, no scaler, that does not step on the ``skip`` batches."""
    model, opt = fresh()
    for k in range(steps):
        if k in skip:
            continue
        opt.zero_grad(set_to_none=True)
        mse_loss(model, batch(k)).backward()
        opt.step()
    return model, opt


def assert_bit_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


# ---- the Fault type -----------------------------------------------------------------------------
def test_parse_fault_round_trips() -> None:
    f = parse_fault("12:grad:fc1.weight:nan")
    assert (f.step, f.kind, f.target) == (12, "grad", "fc1.weight") and math.isnan(f.value)
    assert parse_fault("5:loss") == Fault(5, "loss")
    assert parse_fault("3:activation:fc2:-inf") == Fault(3, "activation", "fc2", -math.inf)
    assert parse_fault(str(Fault(7, "grad", "fc3.bias", math.inf))) == Fault(7, "grad", "fc3.bias")


@pytest.mark.parametrize("bad, match", [
    ("x:loss", "not an integer"), ("1", "expected STEP:KIND"), ("1:weights:a", "fault kind"),
    ("-1:loss", "step"), ("1:grad", "needs a target"), ("1:loss:fc1", "takes no target"),
])
def test_parse_fault_rejects_bad_specs(bad: str, match: str) -> None:
    with pytest.raises(FaultError, match=match):
        parse_fault(bad)


def test_fault_value_must_be_non_finite() -> None:
    with pytest.raises(FaultError, match="inf, -inf or nan"):
        Fault(0, "loss", value=1e30)


def test_random_faults_rate_and_places() -> None:
    fs = random_faults(2000, 0.1, grads=["a"], activations=["b"], seed=3)
    assert 150 < len(fs) < 250
    assert {f.kind for f in fs} == {"grad", "activation", "loss"}
    assert all(not (f.kind == "activation" and f.value == -math.inf) for f in fs)
    assert random_faults(2000, 0.1, grads=["a"], activations=["b"], seed=3) == fs


def test_unknown_targets_are_clear_errors() -> None:
    model, _ = fresh()
    with pytest.raises(FaultError, match="no parameter 'fc9.weight'"):
        EagerFaultInjector(model, [Fault(0, "grad", "fc9.weight")])
    with pytest.raises(FaultError, match="no module 'fc9'"):
        EagerFaultInjector(model, [Fault(0, "activation", "fc9")])


# ---- eager --------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["cerebras", "torch"])
def test_eager_random_faults_1000_steps(policy: str) -> None:
    faults = random_faults(STEPS, RATE, grads=GRADS, activations=["fc1", "fc2", "fc3"], seed=7)
    model, opt = fresh()
    scaler = dlspass.GradScaler(policy=policy, steps_per_increase=5)
    skipped = set()
    with EagerFaultInjector(model, faults) as inj:
        for k in range(STEPS):
            inj.step = k
            before = [t.clone() for t in state_tensors(model, opt)]
            opt.zero_grad(set_to_none=True)
            scaler.scale(inj.loss(mse_loss(model, batch(k)))).backward()
            stepped = scaler.step(opt)
            scaler.update()
            now = state_tensors(model, opt)
            assert all_finite(now), f"non-finite parameter or optimizer state at step {k}"
            if not bool(stepped):
                skipped.add(k)
                assert_bit_identical(now, before)  # a skipped step changes nothing
    fired = {f.step for f in inj.fired}
    assert fired == {f.step for f in faults}
    assert skipped == fired, "every faulted step skipped, and only those"
    assert int(scaler.get_num_skipped_steps()) == len(fired)
    ref_model, ref_opt = reference_run(skipped, STEPS)
    assert_bit_identical(state_tensors(model, opt), state_tensors(ref_model, ref_opt))


def test_eager_injector_removes_its_hooks() -> None:
    model, opt = fresh()
    inj = EagerFaultInjector(model, [Fault(0, "grad", "fc1.weight"), Fault(0, "activation", "fc2")])
    inj.remove()
    mse_loss(model, batch(0)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ---- captured -----------------------------------------------------------------------------------
CONFIG = dlspass.DLSConfig(mixed_precision=False, steps_per_increase=5)


def captured(seed: int = 0):
    model, opt = fresh(seed)
    return model, opt, dlspass.capture_step(model, mse_loss, opt, batch(0), config=CONFIG)


@pytest.fixture(scope="module")
def activation_nodes() -> list[str]:
    _, _, step = captured()
    # forward activations: the matmul outputs and ReLUs before the loss
    names = []
    for n in step.graph_module.graph.nodes:
        if n.op == "call_function" and dlspass.graph.roles.role_of(n) == "loss":
            break
        if n.op == "call_function" and n.target in (torch.ops.aten.addmm.default,
                                                     torch.ops.aten.relu.default):
            names.append(n.name)
    assert len(names) == 5
    return names


def test_captured_random_faults_1000_steps(activation_nodes: list[str]) -> None:
    faults = random_faults(STEPS, RATE, grads=GRADS, activations=activation_nodes, seed=11)
    model, opt, step = captured()
    schedule = install_faults(step, faults)
    assert sum(dlspass.graph.roles.role_of(n) == FAULT for n in schedule.graph_module.graph.nodes) >= 2 * len(faults)
    loss_faults = {f.step for f in faults if f.kind == "loss"}
    skipped = set()
    for k in range(STEPS):
        before_skips = int(step.scaler.state.num_skipped_steps)
        before = [t.clone() for t in state_tensors(model, opt)]
        loss = step(batch(k))
        now = state_tensors(model, opt)
        assert all_finite(now), f"non-finite parameter or optimizer state at step {k}"
        if int(step.scaler.state.num_skipped_steps) > before_skips:
            skipped.add(k)
            assert_bit_identical(now, before)
        if k in loss_faults:
            assert not math.isfinite(float(loss))  # the returned loss shows the fault too
    assert skipped == schedule.faulted_steps
    # the reference: the same captured graph, fault-free, not called on the faulted batches
    ref_model, ref_opt, ref_step = captured()
    for k in range(STEPS):
        if k not in skipped:
            ref_step(batch(k))
    assert_bit_identical(state_tensors(model, opt), state_tensors(ref_model, ref_opt))
    schedule.remove()
    assert step._runner is step.graph_module


def test_inject_faults_twice_is_an_error() -> None:
    import copy

    _, _, step = captured()
    gm = inject_faults(copy.deepcopy(step.graph_module), [Fault(1, "loss")])
    with pytest.raises(FaultError, match="already has faults"):
        inject_faults(gm, [Fault(2, "loss")])
    with pytest.raises(FaultError, match="no gradient of 'nope'"):
        inject_faults(copy.deepcopy(step.graph_module), [Fault(1, "grad", "nope")])
    with pytest.raises(FaultError, match="no computed node named 'nope'"):
        inject_faults(copy.deepcopy(step.graph_module), [Fault(1, "activation", "nope")])


@pytest.mark.slow
def test_compiled_faults_skip_and_match_fault_free_kernels() -> None:
    """Inductor (~45 s to compile on a shared CPU): the same kernels with faults disabled
    are the reference."""
    steps = 60
    faults = random_faults(steps, 0.2, grads=GRADS, seed=5)
    model, opt, step = captured()
    schedule = install_faults(step, faults, compile=True)
    skipped = set()
    for k in range(steps):
        n0 = int(step.scaler.state.num_skipped_steps)
        step(batch(k))
        assert all_finite(state_tensors(model, opt))
        if int(step.scaler.state.num_skipped_steps) > n0:
            skipped.add(k)
    assert skipped == schedule.faulted_steps
    got = [t.clone() for t in state_tensors(model, opt)]
    # rerun from the start with the same compiled code and faults switched off
    model2, opt2, step2 = captured()
    schedule.enabled = False
    step2._runner = step._runner
    for k in range(steps):
        if k not in skipped:
            step2(batch(k))
    assert_bit_identical(got, state_tensors(model2, opt2))


def test_dlspass_compile_loss_faults_through_a_tensor_input() -> None:
    """``dlspass.compile`` (AOT graph, eager backend): loss faults as a 0-d tensor argument."""
    import torch.nn.functional as F

    steps = 120
    faults = random_faults(steps, 0.15, seed=2)  # loss faults only (no grads/activations given)
    assert faults and {f.kind for f in faults} == {"loss"}

    def compiled():
        model, opt = fresh()
        scaler = dlspass.GradScaler(steps_per_increase=5)

        def train_step(x, y, mult):
            loss = F.mse_loss(model(x), y) * mult
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = dlspass.compile(train_step, optimizer=opt, scaler=scaler, mixed_precision=False,
                               backend_compiler="eager")
        return model, opt, scaler, step

    torch._dynamo.reset()
    model, opt, scaler, step = compiled()
    skipped = set()
    for k in range(steps):
        n0 = int(scaler.state.num_skipped_steps)
        step(*batch(k), loss_multiplier(faults, k))
        assert all_finite(state_tensors(model, opt)), k
        if int(scaler.state.num_skipped_steps) > n0:
            skipped.add(k)
    assert skipped == {f.step for f in faults}
    ref_model, ref_opt, _, ref_step = compiled()
    for k in range(steps):
        if k not in skipped:
            ref_step(*batch(k), torch.tensor(1.0))
    assert_bit_identical(state_tensors(model, opt), state_tensors(ref_model, ref_opt))
