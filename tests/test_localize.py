"""Overflow localisation: the first non-finite node / module / gradient, captured and eager."""

from __future__ import annotations

import math

import pytest
import torch

import dlspass
from dlspass.debug.faults import Fault, install_faults
from dlspass.debug.localize import OverflowReport, localize_overflow, nonfinite_grads
from dlspass.models import MLP, TinyGPT, gpt_loss, mse_loss


def batch(k: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(4, 8, generator=g) * scale, torch.randn(4, 4, generator=g)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def fp32_step():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dlspass.capture_step(model, mse_loss, opt, batch(),
                                config=dlspass.DLSConfig(mixed_precision=False))
    return model, step


@pytest.fixture(scope="module")
def fp16_step():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dlspass.capture_step(model, mse_loss, opt, batch(), config=dlspass.DLSConfig())
    return model, step


def test_clean_step_reports_nothing_and_changes_nothing(fp32_step) -> None:
    model, step = fp32_step
    before = params_of(model)
    calls, state = step.num_calls, step.scaler.state
    rep = localize_overflow(step, batch())
    assert not rep.overflowed and rep.origin is None and rep.loss_finite
    assert rep.nodes_checked > 50
    assert "no non-finite value" in str(rep)
    assert step.num_calls == calls and step.scaler.state is state
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(model), strict=True))


def test_float16_input_overflow_names_the_cast_in_fc1(fp16_step) -> None:
    """x = 1e5 is finite in fp32 but beyond float16: the rounding of fc1's input overflows."""
    model, step = fp16_step
    rep = localize_overflow(step, batch(1, scale=1e5))
    assert rep.overflowed and rep.phase == "forward"
    node = next(n for n in step.graph_module.graph.nodes if n.name == rep.origin)
    assert dlspass.graph.roles.role_of(node) == dlspass.graph.roles.CAST, rep
    assert rep.module == "fc1" and rep.module_source == "parameters"
    # the independent check: the same input rounded to float16 in eager is inf
    assert torch.isinf(batch(1, scale=1e5)[0].to(torch.float16)).any()
    assert set(rep.nonfinite_grads) <= {n for n, _ in model.named_parameters()}
    assert rep.nonfinite_grads and rep.loss_finite is False


def test_non_finite_batch_is_the_origin(fp32_step) -> None:
    _, step = fp32_step
    x, y = batch()
    x[2, 3] = math.nan
    rep = localize_overflow(step, (x, y))
    assert rep.phase == "input" and rep.op == "input" and rep.origin == "input__batch_0"


@pytest.mark.parametrize("fault, origin_module, grads", [
    (Fault(4, "grad", "fc2.weight", math.nan), "fc2", ["fc2.weight"]),
    (Fault(4, "activation", "relu_1", math.inf), "fc2", None),
    (Fault(4, "loss", value=math.inf), None, None),
])
def test_injected_faults_are_found(fp32_step, fault: Fault, origin_module, grads) -> None:
    _, step = fp32_step
    schedule = install_faults(step, [fault])
    try:
        clean = localize_overflow(schedule, batch(), step_index=3)
        assert not clean.overflowed
        rep = localize_overflow(schedule, batch(), step_index=4)
    finally:
        schedule.remove()
    node = next(n for n in schedule.graph_module.graph.nodes if n.name == rep.origin)
    # a node the injection made (a faulted gradient carries the GRAD role the DLS passes read)
    assert dlspass.graph.roles.pass_of(node) == "inject_faults"
    if origin_module:
        assert rep.module == origin_module
    if grads is not None:
        assert rep.nonfinite_grads == grads and rep.phase == "backward"
    else:
        assert len(rep.nonfinite_grads) >= 2
    if fault.kind == "loss":
        assert rep.loss_finite is False


def test_attention_mask_is_not_an_overflow() -> None:
    """TinyGPT's causal mask writes -inf on purpose: a clean step must report nothing."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=16, d=16, n_layer=1, n_head=2, block_size=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    b = (torch.randint(0, 16, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g))
    step = dlspass.capture_step(model, gpt_loss, opt, b,
                                config=dlspass.DLSConfig(mixed_precision=False))
    masked = [n for n in step.graph_module.graph.nodes
              if n.op == "call_function" and any(isinstance(a, float) and math.isinf(a) for a in n.args)]
    assert masked, "the graph should hold the -inf mask constant"
    assert not localize_overflow(step, b).overflowed
    # ... while a huge embedding row does overflow, and is found in the forward
    with torch.no_grad():
        model.tok.weight[b[0][0, 0]] = 3e38
    rep = localize_overflow(step, b)
    assert rep.overflowed and rep.phase == "forward", rep


# ---- eager --------------------------------------------------------------------------------------
def test_eager_names_the_module_and_restores_grads() -> None:
    torch.manual_seed(0)
    model = MLP()
    scaler = dlspass.GradScaler()
    loss = mse_loss(model, batch())
    scaler.scale(loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert not localize_overflow(model, batch(), mse_loss, scaler=scaler).overflowed
    with torch.no_grad():
        model.fc2.weight[0] = 3e38
    rep = localize_overflow(model, batch(), mse_loss, scaler=scaler)
    assert rep.origin == "fc2" and rep.op == "Linear" and rep.phase == "forward"
    assert rep.module_source == "eager"
    assert "fc1.weight" in rep.nonfinite_grads or "fc2.weight" in rep.nonfinite_grads
    # the eager check of .grad agrees: a real backward gives the same non-finite gradients
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), "localisation must restore the gradients"
    model.zero_grad()
    scaler.scale(mse_loss(model, batch())).backward()
    assert nonfinite_grads(model) == rep.nonfinite_grads


def test_eager_backward_only_overflow() -> None:
    """Forward finite, gradients not: the scale itself overflows the backward."""
    torch.manual_seed(0)
    model = MLP()
    rep = localize_overflow(model, batch(), mse_loss, scaler=None)
    assert not rep.overflowed
    from dlspass.debug.localize import localize_eager

    rep = localize_eager(model, batch(0, 100.0), mse_loss, scale=3e38)
    assert rep.origin is None and rep.phase == "backward" and rep.nonfinite_grads
    assert rep.loss_finite is True


def test_bad_argument_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="expected a CapturedStep"):
        localize_overflow(object(), batch())
    with pytest.raises(TypeError, match="needs loss_fn"):
        localize_overflow(MLP(), batch())
    assert isinstance(OverflowReport(), OverflowReport)
