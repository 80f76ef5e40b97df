"""Gradient underflow in 16 bits, and dynamic loss scaling recovering fp32 training.

The small-scale version of Micikevicius et al. (2018): an MLP regresses a fixed teacher MLP
with a mean-squared-error loss multiplied by ``STRESS`` = 2**-20 (what a very large mean
reduction does to gradients). In fp32 that factor changes nothing (Adam is invariant to it;
``eps`` is set far below the gradients). In emulated float16 (``capture_step`` with
``mixed_precision=True``: every matmul input and output of the forward and the backward is
rounded) most gradients flush to zero, and training stalls; dlspass's dynamic loss scaling
(initial scale 2**15) brings them back into range and matches fp32.

References are independent of dlspass's rounding: the underflow fractions are checked against
the float64 thresholds (half the minimum subnormal: 2**-25 for float16, 2**-40 for cbfloat16)
and against torch's native float16 cast; training is compared with fp32 runs of the same seeds.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import dlspass
from dlspass.cli.demo import emulate_format
from dlspass.formats import CBFLOAT16, FLOAT16, round_to_format
from dlspass.models import MLP, mse_loss

STRESS = 2.0**-20
SEEDS = (0, 1, 2)
STEPS = 40
LR = 1e-2
EPS = 1e-16  # far below the stressed gradients (~2**-30), so fp32 Adam ignores the stress


def stressed_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return mse_loss(model, batch) * STRESS


@pytest.fixture(scope="module")
def batch() -> tuple[Tensor, Tensor]:
    """A fixed full batch: 256 inputs and the outputs of a seeded teacher MLP."""
    g = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)
    teacher = MLP(8, 16, 4)
    x = torch.randn(256, 8, generator=g)
    with torch.no_grad():
        return x, teacher(x) * 4.0


def _student(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(8, 16, 4)


def _train(config: dlspass.DLSConfig, batch: tuple[Tensor, Tensor]) -> dict[int, tuple[float, int, float]]:
    """Per seed: (fp32 eval loss after STEPS steps, skipped steps, final scale).

    One capture per config; each seed resets parameters, Adam state and scaler in place."""
    model = _student(0)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    step = dlspass.capture_step(model, stressed_loss, opt, batch, config=config)
    out = {}
    for seed in SEEDS:
        with torch.no_grad():
            model.load_state_dict(_student(seed).state_dict())
        opt.state.clear()
        step.scaler = dlspass.GradScaler(config=config)
        for _ in range(STEPS):
            step(batch)
        with torch.no_grad():
            final = float(mse_loss(model, batch))
        out[seed] = (final, int(step.scaler.get_num_skipped_steps()), float(step.scaler.get_scale()))
    return out


@pytest.fixture(scope="module")
def runs(batch: tuple[Tensor, Tensor]) -> dict[str, dict[int, tuple[float, int, float]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            "fp32": _train(dlspass.DLSConfig(mixed_precision=False, loss_scale=None), batch),
            "fp16": _train(dlspass.DLSConfig(fp16_type="float16", loss_scale=None), batch),
            "fp16_dls": _train(dlspass.DLSConfig(fp16_type="float16", loss_scale="dynamic"), batch),
        }
    finally:
        torch.set_num_threads(threads)


def _weight_grads(model: nn.Module, batch: tuple[Tensor, Tensor], scale: float = 1.0,
                  fmt: str | None = None) -> Tensor:
    """Flat weight gradients of ``stressed_loss * scale`` (16-bit backward with ``fmt``), unscaled."""
    model.zero_grad(set_to_none=True)
    if fmt is None:
        (stressed_loss(model, batch) * scale).backward()
    else:
        with emulate_format(model, fmt):
            (stressed_loss(model, batch) * scale).backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters()]) / scale
    model.zero_grad(set_to_none=True)
    return g


def _zero(t: Tensor) -> float:
    return float((t == 0).double().mean())


def test_float16_gradients_underflow_without_scaling(batch, record_property) -> None:
    model = _student(0)
    g32 = _weight_grads(model, batch)
    zero32 = _zero(g32)
    mag = g32.double().abs()
    # independent references: a value flushes to zero iff |g| <= min_subnormal / 2 (the tie at
    # exactly half goes to the even zero), and torch's own float16 cast agrees
    ref16 = float(((mag <= FLOAT16.min_subnormal / 2)).double().mean())
    rounded16 = round_to_format(g32, "float16")
    assert _zero(rounded16) == pytest.approx(ref16, abs=0)
    assert _zero(g32.half()) == pytest.approx(ref16, abs=0)
    # the 16-bit backward (zeros propagate through the chain) loses at least as much
    zero_bwd16 = _zero(_weight_grads(model, batch, fmt="float16"))
    scale = dlspass.DLSConfig(fp16_type="float16").init_scale
    zero_bwd16_dls = _zero(_weight_grads(model, batch, scale, fmt="float16"))
    record_property("zero_fp32", zero32)
    record_property("zero_fp16_round", ref16)
    record_property("zero_fp16_backward", zero_bwd16)
    record_property("zero_fp16_backward_dls", zero_bwd16_dls)
    print(f"\nweight-gradient zeros: fp32 {zero32:.1%}, fp16 rounded {ref16:.1%}, "
          f"fp16 backward {zero_bwd16:.1%}, fp16 backward x2^15 {zero_bwd16_dls:.1%}")
    assert zero32 < 0.05, "the fp32 gradients themselves should be almost all non-zero"
    assert ref16 > 0.5 and zero_bwd16 > 0.5, "the stress setting should flush most fp16 gradients"
    # with the DLS scale nothing beyond fp32's own zeros is lost
    assert zero_bwd16_dls <= zero32 + 0.01


def test_cbfloat16_underflow_with_and_without_scaling(batch, record_property) -> None:
    model = _student(0)
    g32 = _weight_grads(model, batch)
    mag = g32.double().abs()
    ref = float((mag <= CBFLOAT16.min_subnormal / 2).double().mean())
    zero_cb = _zero(round_to_format(g32, "cbfloat16"))
    scale = dlspass.DLSConfig(fp16_type="cbfloat16").init_scale  # 2**31
    scaled = round_to_format(g32 * scale, "cbfloat16")
    zero_cb_scaled = _zero(scaled)
    zero_bwd = _zero(_weight_grads(model, batch, fmt="cbfloat16"))
    zero_bwd_scaled = _zero(_weight_grads(model, batch, scale, fmt="cbfloat16"))
    record_property("zero_cb16_round", zero_cb)
    record_property("zero_cb16_round_dls", zero_cb_scaled)
    record_property("zero_cb16_backward", zero_bwd)
    record_property("zero_cb16_backward_dls", zero_bwd_scaled)
    print(f"\ncbfloat16 weight-gradient zeros: rounded {zero_cb:.2%} (x2^31: {zero_cb_scaled:.2%}), "
          f"16-bit backward {zero_bwd:.2%} (x2^31: {zero_bwd_scaled:.2%}); fp16 rounded "
          f"{_zero(round_to_format(g32, 'float16')):.1%}")
    assert zero_cb == pytest.approx(ref, abs=0)
    assert float((mag * scale).max()) < CBFLOAT16.max, "2**31 must not overflow cbfloat16 here"
    assert bool(torch.isfinite(scaled).all())
    assert zero_cb_scaled == pytest.approx(_zero(g32), abs=0)
    # cbfloat16's 6 exponent bits reach 2**-39: far fewer zeros than float16 at the same stress
    assert zero_cb < _zero(round_to_format(g32, "float16")) / 2
    assert zero_bwd_scaled <= zero_bwd


def test_fp32_training_learns_despite_the_stress(runs, batch) -> None:
    with torch.no_grad():
        start = [float(mse_loss(_student(seed), batch)) for seed in SEEDS]
    finals = [runs["fp32"][s][0] for s in SEEDS]
    for s0, f in zip(start, finals, strict=True):
        assert f < 0.5 * s0, f"fp32 training should halve the loss (start {s0:.4f}, final {f:.4f})"


def test_unscaled_float16_is_worse_than_the_fp32_spread(runs, record_property) -> None:
    fp32 = [runs["fp32"][s][0] for s in SEEDS]
    fp16 = [runs["fp16"][s][0] for s in SEEDS]
    mean16 = sum(fp16) / len(fp16)
    record_property("fp32_final", fp32)
    record_property("fp16_final", fp16)
    print(f"\nfinal loss fp32 {fp32}, fp16 without scaling {fp16}")
    assert mean16 > max(fp32), f"fp16 without scaling {fp16} is not worse than fp32 {fp32}"


def test_dls_matches_fp32_within_two_percent(runs, record_property) -> None:
    fp32 = runs["fp32"]
    dls = runs["fp16_dls"]
    record_property("dls_final", [dls[s] for s in SEEDS])
    print(f"\nfinal loss fp32 {[fp32[s][0] for s in SEEDS]}, fp16 DLS {[dls[s] for s in SEEDS]}")
    for seed in SEEDS:
        loss32, loss_dls = fp32[seed][0], dls[seed][0]
        assert loss_dls == pytest.approx(loss32, rel=0.02), f"seed {seed}: DLS {loss_dls} vs fp32 {loss32}"
    mean32 = sum(fp32[s][0] for s in SEEDS) / 3
    mean_dls = sum(dls[s][0] for s in SEEDS) / 3
    assert abs(mean_dls / mean32 - 1) <= 0.02
    # at 2**15 the stressed gradients stay far from float16's max: DLS never had to skip
    assert all(dls[s][1] == 0 for s in SEEDS)
    assert all(dls[s][2] == 2.0**15 for s in SEEDS)
