"""Telemetry as a ``graph_passes`` hook: under ``dlspass.compile`` it adds no graph break, the
counts of the scaled gradients equal counting them in eager, and the buffer is fed, not
recompiled, at every step; ``capture_step`` feeds it the same way."""

from __future__ import annotations

import pytest
import torch
from numerics_reference import reference_counts
from torch import nn
from torch._dynamo.utils import counters

import dlspass
from dlspass.debug.telemetry import Telemetry
from dlspass.format_ranges import COUNT_FIELDS


def _by_name(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, dict[str, float]]:
    return {n: dict(zip(COUNT_FIELDS, reference_counts(t, fmt), strict=True)) for n, t in tensors.items()}


def test_compiled_step_counts_its_scaled_gradients_without_graph_breaks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    # a scale below 1: some float16 gradients flush to zero, some land subnormal
    scale = 2.0**-14
    scaler = dlspass.GradScaler(loss_scale="dynamic", initial_loss_scale=scale, min_loss_scale=2.0**-20)
    telemetry = Telemetry("float16")

    def train_step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    counters.clear()
    step = dlspass.compile(train_step, optimizer=opt, scaler=scaler, mixed_precision=False,
                           backend_compiler="eager", graph_passes=[telemetry])
    step(x, y)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    # eager: the gradients of the loss times the scale the step used, counted by rounding
    (nn.functional.mse_loss(reference(x), y) * scale).backward()
    # a compiled step names a gradient by its place in the optimizer (group0.param<i>)
    want = {f"grad:group0.param{i}": p.grad for i, p in enumerate(reference.parameters())}
    got = telemetry.read()
    assert sorted(got) == sorted(want)
    assert got == _by_name(want, "float16")
    assert sum(row["flushed"] for row in got.values()) > 0
    assert sum(row["subnormal"] for row in got.values()) > 0
    # a second step writes the second step's counts into the same buffer, without recompiling
    buffer = telemetry.buffer
    step(x, y)
    assert telemetry.buffer is buffer and counters["stats"]["unique_graphs"] == 1


def test_captured_step_feeds_the_buffer_and_counts_its_scaled_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    scale = 2.0**-14
    config = dlspass.DLSConfig(mixed_precision=False, initial_loss_scale=scale, min_loss_scale=2.0**-20)
    telemetry = Telemetry("float16")
    step = dlspass.capture_step(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), opt, (x, y),
                                config, graph_passes=[telemetry])
    step((x, y))
    (nn.functional.mse_loss(reference(x), y) * scale).backward()
    want = {f"grad:{n}": p.grad for n, p in reference.named_parameters()}
    got = telemetry.read()
    assert sorted(got) == sorted(want)
    assert got == _by_name(want, "float16")
    assert sum(row["flushed"] for row in got.values()) > 0


def test_gradient_amax_agrees_with_graphcore_unit_scaling_track_scales() -> None:
    """The outside reference: unit-scaling's ``track_scales`` records each parameter's gradient
    ``abs_max`` (reading every tensor back to the host); the telemetry's amax of the scaled
    gradient, over the scale (a power of two, so the division is exact), is the same number."""
    pytest.importorskip("unit_scaling")
    from unit_scaling.transforms import track_scales

    class Loss(nn.Module):
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, x, y):
            return nn.functional.mse_loss(self.m(x), y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    tracked = track_scales(Loss(reference))
    tracked(x, y).backward()
    # dynamo names a parameter placeholder by its path, e.g. l_self_modules_m_modules_0_parameters_bias_
    theirs = {n.name.split("_modules_m_modules_")[1]: n.meta["metrics"].bwd.abs_max
              for n in tracked.scales_graph().nodes if n.op == "placeholder" and "_parameters_" in n.name}

    scale = 2.0**10
    telemetry = Telemetry("float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = dlspass.DLSConfig(mixed_precision=False, initial_loss_scale=scale)
    step = dlspass.capture_step(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), opt, (x, y),
                                config, graph_passes=[telemetry])
    step((x, y))
    ours = {f"{name.replace('.', '_parameters_')}_": row["amax"] / scale
            for name, row in ((k.removeprefix("grad:"), v) for k, v in telemetry.read().items())}
    assert sorted(ours) == sorted(theirs) and len(ours) == 4
    for name, amax in theirs.items():
        assert ours[name] == pytest.approx(amax, rel=1e-6), name
