"""Property-based tests of the scale policies (hypothesis) against independent references.

- cerebras: a plain-Python reimplementation of docs/SEMANTICS.md §1.2 in numpy float32;
- torch: ``torch.amp.GradScaler`` itself, run on a one-parameter model, compared while torch's
  scale stays >= dlspass's floor (below it the floor is the intended difference);
- every preset: the scale stays in [min, max], 1/scale is finite, counters never go negative;
- the eager ``dlspass.GradScaler`` and a captured step agree over random overflow sequences.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dlspass
from dlspass.config import POLICIES, DLSConfig
from dlspass.scale_policy import init_state, update_state

f32 = np.float32
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

overflow_seqs = st.lists(st.booleans(), min_size=1, max_size=60)
# overflows come in bursts in real runs: mostly clean with runs of overflows
bursty_seqs = st.lists(st.tuples(st.booleans(), st.integers(1, 12)), min_size=1, max_size=12).map(
    lambda runs: [finite for finite, n in runs for _ in range(n)])


def run_policy(cfg: DLSConfig, finite_seq: list[bool]) -> list[tuple]:
    state = init_state(cfg)
    out = []
    for finite in finite_seq:
        state = update_state(state, torch.tensor(finite), cfg)
        out.append(state)
    return out


# ---- cerebras: docs/SEMANTICS.md §1.2 written out again in numpy float32 ------------------------
def cerebras_reference(seq: list[bool], init: float, interval: int, tol: float, mn: float,
                       mx: float) -> list[tuple[float, int, int, int]]:
    scale = min(f32(mx), f32(init))
    steps = overflows = skipped = 0
    out = []
    for finite in seq:
        f = 1 if finite else 0
        steps += 1
        overflows += 1 - f
        if f32(tol) < f32(overflows) / f32(steps):
            scale = f32(scale / f32(2))
            steps = overflows = 0
        if interval < steps:
            scale = f32(scale * f32(2))
            steps = overflows = 0
        scale = min(scale, f32(mx))
        scale = max(scale, f32(mn))
        skipped += 1 - f
        out.append((float(scale), steps, overflows, skipped))
    return out


@st.composite
def cerebras_configs(draw: st.DrawFn) -> tuple[DLSConfig, float]:
    lo = draw(st.integers(-14, 10))
    hi = draw(st.integers(lo, 31))
    mn, mx = 2.0**lo, 2.0**hi
    init = draw(st.one_of(st.integers(lo, hi).map(lambda e: 2.0**e),
                          st.floats(mn, mx, allow_nan=False, width=32)))
    tol = draw(st.one_of(st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.5]),
                         st.floats(0.0, 0.99)))
    interval = draw(st.integers(1, 6))
    cfg = DLSConfig(initial_loss_scale=init, steps_per_increase=interval, overflow_tolerance=tol,
                    min_loss_scale=mn, max_loss_scale=mx, mixed_precision=False)
    return cfg, init


@SETTINGS
@given(cerebras_configs(), st.one_of(overflow_seqs, bursty_seqs))
def test_cerebras_matches_spec_reference(case: tuple[DLSConfig, float], seq: list[bool]) -> None:
    cfg, init = case
    got = [(float(s.loss_scale), int(s.steps_since_rescale), int(s.overflows_since_rescale),
            int(s.num_skipped_steps)) for s in run_policy(cfg, seq)]
    want = cerebras_reference(seq, init, cfg.growth_interval, cfg.tolerance, cfg.min_scale,
                              cfg.max_scale)
    assert got == want


def test_cerebras_reference_reproduces_the_spec_trace() -> None:
    """The reference itself against docs/SEMANTICS.md §1.4's worked trace (so it cannot agree by chance)."""
    seq = [k not in (5, 10, 11) for k in range(1, 16)]
    scales = [s for s, *_ in cerebras_reference(seq, 1024, 3, 0.0, 2.0**-14, 2.0**15)]
    assert scales[:3] == [1024] * 3 and scales[3] == 2048 and scales[4] == 1024
    assert scales[8] == 2048 and scales[9] == 1024 and scales[10] == 512 and scales[14] == 1024


# ---- torch preset against torch.amp.GradScaler ---------------------------------------------------
def torch_amp_trajectory(seq: list[bool], init: float, interval: int) -> list[tuple[float, int]]:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    out = []
    for finite in seq:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if not finite:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), int(scaler._get_growth_tracker())))
    return out


@SETTINGS
@given(st.integers(-10, 40).map(lambda e: 2.0**e), st.integers(1, 6),
       st.one_of(overflow_seqs, bursty_seqs))
def test_torch_preset_matches_torch_amp(init: float, interval: int, seq: list[bool]) -> None:
    cfg = DLSConfig(policy="torch", initial_loss_scale=init, steps_per_increase=interval,
                    mixed_precision=False)
    ours = [(float(s.loss_scale), int(s.steps_since_rescale)) for s in run_policy(cfg, seq)]
    theirs = torch_amp_trajectory(seq, init, interval)
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if b[0] < cfg.min_scale:  # torch went below the floor dlspass keeps: stop comparing
            assert a[0] == cfg.min_scale, k
            break
        assert a == b, f"step {k}: dlspass {a} torch {b}"


# ---- keras, deepspeed, megatron: docs/SEMANTICS.md §3.2-3.4 written out in plain Python ---------
def keras_reference(seq: list[bool], init: float, interval: int, hyst: int, mn: float):
    s, counter, out = init, 0, []
    for finite in seq:
        if finite:
            if counter == interval - 1:
                s, counter = s * 2, 0
            else:
                counter += 1
        else:
            s, counter = s * 0.5, 0
        out.append((max(s, mn), counter, None))
    return out


def deepspeed_reference(seq: list[bool], init: float, interval: int, hyst: int, mn: float):
    """DeepSpeed DynamicLossScaler, consecutive_hysteresis=False, no raise at the floor."""
    s, h, last_overflow, out = init, hyst, -1, []
    for it, finite in enumerate(seq):
        if not finite:
            if hyst == 1 or h == 1:
                s = max(s / 2, mn)
            else:
                h -= 1
            last_overflow = it
        elif (it - last_overflow) % interval == 0:
            h = hyst
            s *= 2
        out.append((s, it - last_overflow if last_overflow < it else 0, h))
    return out


def megatron_reference(seq: list[bool], init: float, interval: int, hyst: int, mn: float):
    s, t, h, out = init, 0, hyst, []
    for finite in seq:
        if not finite:
            t = 0
            h -= 1
            if h <= 0:
                s = max(s * 0.5, mn)
        else:
            t += 1
            if t == interval:
                t, h, s = 0, hyst, s * 2
        out.append((s, t, max(h, 0)))  # dlspass clamps the tracker at 0 (same backoffs)
    return out


REFERENCES = {"keras": keras_reference, "deepspeed-0.17.0": deepspeed_reference,
              "megatron": megatron_reference}


@SETTINGS
@given(st.sampled_from(sorted(REFERENCES)), st.integers(0, 40).map(lambda e: 2.0**e),
       st.integers(1, 6), st.integers(1, 3), st.one_of(overflow_seqs, bursty_seqs))
def test_other_presets_match_their_references(policy: str, init: float, interval: int,
                                              hyst: int, seq: list[bool]) -> None:
    kw = {"hysteresis": hyst} if policy != "keras" else {}
    cfg = DLSConfig(policy=policy, initial_loss_scale=init, steps_per_increase=interval,
                    mixed_precision=False, **kw)
    want = REFERENCES[policy](seq, init, interval, cfg.hysteresis_steps, cfg.min_scale)
    for k, (s, (ws, wsteps, wh)) in enumerate(zip(run_policy(cfg, seq), want, strict=True)):
        if policy == "keras" and ws <= cfg.min_scale:
            break  # Keras 3 has no floor: dlspass's floor is the intended difference
        got_steps = int(s.steps_since_rescale)
        if policy == "deepspeed-0.17.0":
            # DeepSpeed counts iterations since the last overflow and grows on multiples of
            # the window; dlspass counts since the last rescale: equal modulo the window
            wsteps, got_steps = wsteps % interval, got_steps % interval
        assert (float(s.loss_scale), got_steps) == (ws, wsteps), f"step {k}"
        if wh is not None:
            assert int(s.hysteresis) == wh, f"step {k}"


# ---- invariants of every preset ------------------------------------------------------------------
@SETTINGS
@given(st.sampled_from(POLICIES), st.integers(1, 5), st.one_of(overflow_seqs, bursty_seqs),
       st.booleans())
def test_invariants_every_preset(policy: str, interval: int, seq: list[bool],
                                 near_floor: bool) -> None:
    kw = {}
    if near_floor:  # start a few backoffs above the floor, so the floor is exercised
        kw["initial_loss_scale"] = 8.0 if policy.startswith(("deepspeed", "megatron")) else 2.0**-12
    cfg = DLSConfig(policy=policy, steps_per_increase=interval, mixed_precision=False, **kw)
    prev_skipped = 0
    for finite, s in zip(seq, run_policy(cfg, seq), strict=True):
        scale = float(s.loss_scale)
        assert cfg.min_scale <= scale <= cfg.max_scale
        assert math.isfinite(1.0 / np.float32(scale))
        assert torch.isfinite(torch.reciprocal(s.loss_scale))
        for name in ("steps_since_rescale", "overflows_since_rescale", "num_skipped_steps",
                     "hysteresis", "floor_overflows"):
            assert int(getattr(s, name)) >= 0, name
        assert int(s.num_skipped_steps) == prev_skipped + (0 if finite else 1)
        prev_skipped = int(s.num_skipped_steps)


# ---- eager GradScaler against a captured step ----------------------------------------------------
def _loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, y, mult = batch
    return torch.nn.functional.mse_loss(model(x), y) * mult


def _batch(k: int, finite: bool) -> tuple:
    g = torch.Generator().manual_seed(k)
    return (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g),
            torch.tensor(1.0 if finite else float("inf")))


CAPTURE_CFG = DLSConfig(mixed_precision=False, steps_per_increase=2, initial_loss_scale=2.0**10,
                        max_loss_scale=2.0**12)


@pytest.fixture(scope="module")
def captured_case():
    from dlspass.models import MLP

    torch.manual_seed(0)
    model = MLP()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = dlspass.capture_step(model, _loss, opt, _batch(0, True), config=CAPTURE_CFG)
    return model, init, step


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.booleans(), min_size=1, max_size=25))
def test_eager_and_captured_agree(captured_case, seq: list[bool]) -> None:
    model, init, step = captured_case
    model.load_state_dict(init)
    step.scaler.load_state_dict({})  # a fresh DLS state
    from dlspass.models import MLP

    eager_model = MLP()
    eager_model.load_state_dict(init)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.05)
    scaler = dlspass.GradScaler(config=CAPTURE_CFG)
    for k, finite in enumerate(seq):
        b = _batch(k, finite)
        step(b)
        eager_opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(eager_model, b)).backward()
        stepped = scaler.step(eager_opt)
        scaler.update()
        assert bool(stepped) == finite
        for f in ("loss_scale", "steps_since_rescale", "overflows_since_rescale",
                  "num_skipped_steps"):
            assert torch.equal(getattr(step.scaler.state, f), getattr(scaler.state, f)), (k, f)
    for a, b in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert torch.isfinite(a).all()
        # bit equality: the captured step runs, without compiling, the ATen ops eager autograd
        # and torch.optim.SGD dispatch, in the same order, with the same power-of-two scale
        torch.testing.assert_close(a, b, rtol=0, atol=0)
