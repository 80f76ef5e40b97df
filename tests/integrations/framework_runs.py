"""What the framework tests share: a tiny model, fixed batches, the step whose loss is made
infinite, and the per-step record each run is compared by."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

import dlspass
from dlspass.integrations import SkipVisibleGradScaler

STEPS = 8
OVERFLOW_STEP = 2  # 0-based: the third step's loss is multiplied by inf
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2
LR = 0.05
HALF = STEPS // 2  # where the resumed runs save and resume
MAX_NORM = 0.5


def torch_amp_scaler() -> torch.amp.GradScaler:
    """The reference: torch.amp's scaler with the runs' scale settings."""
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def torch_grad_scaler() -> dlspass.TorchGradScaler:
    return dlspass.TorchGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def skip_visible_scaler() -> SkipVisibleGradScaler:
    return SkipVisibleGradScaler(init_scale=INIT_SCALE, steps_per_increase=GROWTH_INTERVAL,
                                 policy="torch")


@functools.cache
def batches(n: int = STEPS, seed: int = 1) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g))
                 for _ in range(n))


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(seed: int = 0) -> tuple[TinyNet, torch.optim.SGD]:
    torch.manual_seed(seed)
    model = TinyNet()
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


@dataclass
class Record:
    """One run, step by step: the scale after the step, the LR the next step uses, the
    parameters after it; and the skip count at the end."""

    scales: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    skipped: int = 0

    def add(self, scale: float, lr: float, params: torch.Tensor) -> None:
        self.scales.append(float(scale))
        self.lrs.append(float(lr))
        self.params.append(params)


def assert_same_run(got: Record, ref: Record) -> None:
    """Same scales, LRs and skips; parameters bit for bit (power-of-two scales make the fp32
    unscaled gradients exact)."""
    assert got.scales == ref.scales
    assert got.lrs == ref.lrs
    assert got.skipped == ref.skipped
    assert len(got.params) == len(ref.params)
    for i, (a, b) in enumerate(zip(got.params, ref.params, strict=True)):
        assert torch.equal(a, b), f"parameters differ after step {i}"


def skipped_steps(params: list[torch.Tensor], before: torch.Tensor) -> int:
    """Steps that left every parameter unchanged."""
    prev, n = before, 0
    for p in params:
        n += int(torch.equal(p, prev))
        prev = p
    return n
