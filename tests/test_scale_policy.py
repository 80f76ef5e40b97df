"""The scale policy (`dlspass.scale_policy.update_state`) against independent references.

References: the worked traces of docs/SEMANTICS.md §1.4 and §3, committed with their derivation in
``tests/traces/policies.json``, float64/float32 arithmetic, and the real torch.amp.GradScaler.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.config import POLICIES, ConfigError, DLSConfig
from dlspass.scale_policy import STATE_FIELDS, init_state, update_state

TRACES = json.loads((Path(__file__).parent / "traces" / "policies.json").read_text())["traces"]


def run_policy(cfg: DLSConfig, overflows: list[bool]):
    state = init_state(cfg)
    out = []
    for ovf in overflows:
        state = update_state(state, torch.tensor(not ovf), cfg)
        out.append(state)
    return out


@pytest.mark.parametrize("trace", TRACES, ids=[t["name"] for t in TRACES])
def test_hand_worked_traces(trace):
    cfg = DLSConfig(**trace["config"])
    n = len(trace["scale_after"])
    overflows = [i + 1 in trace["overflow_steps"] for i in range(n)]
    states = run_policy(cfg, overflows)
    assert [float(s.loss_scale) for s in states] == trace["scale_after"]
    assert [int(s.num_skipped_steps) for s in states] == trace["skipped_after"]
    if "hysteresis_after" in trace:
        assert [int(s.hysteresis) for s in states] == trace["hysteresis_after"]


def test_float32_tolerance_differs_from_float64():
    # The committed trace relies on this: float64 0.1 < float32(1/10) but not float32 0.1.
    ratio32 = np.float32(1) / np.float32(10)
    assert not (np.float32(0.1) < ratio32)
    assert 0.1 < float(ratio32)


def test_cerebras_defaults_and_floor():
    cfg = DLSConfig()
    s = init_state(cfg)
    assert float(s.loss_scale) == 2.0**15
    assert float(init_state(DLSConfig(fp16_type="cbfloat16")).loss_scale) == 2.0**31
    cfg = DLSConfig(initial_loss_scale=2.0**-13)
    states = run_policy(cfg, [True] * 4)
    assert [float(x.loss_scale) for x in states] == [2.0**-14] * 4
    assert [float(x.non_clamped_scale) for x in states] == [2.0**-14, 2.0**-15, 2.0**-15, 2.0**-15]
    assert [int(x.floor_overflows) for x in states] == [0, 1, 2, 3]


def _torch_amp_trajectory(overflows, init, interval):
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    out = []
    for ovf in overflows:
        opt.zero_grad()
        scaler.scale((p * 1.0).sum()).backward()
        if ovf:
            p.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), scaler._growth_tracker.item()))
    return out


@settings(max_examples=25, deadline=None)
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=30),
    init_exp=st.integers(-10, 20),
    interval=st.integers(1, 4),
)
def test_torch_preset_matches_torch_amp(overflows, init_exp, interval):
    init = 2.0**init_exp
    ref = _torch_amp_trajectory(overflows, init, interval)
    cfg = DLSConfig(policy="torch", initial_loss_scale=init, steps_per_increase=interval)
    mine = run_policy(cfg, overflows)
    floor = cfg.min_scale
    for (t_scale, t_tracker), s in zip(ref, mine, strict=True):
        if t_scale >= floor:
            assert float(s.loss_scale) == t_scale
            assert int(s.steps_since_rescale) == t_tracker
        else:  # torch decays below; dlspass holds the floor and counts it
            assert float(s.loss_scale) == floor
            assert int(s.floor_overflows) > 0
            break


def test_torch_preset_floors_where_torch_decays():
    overflows = [True] * 6
    ref = _torch_amp_trajectory(overflows, 2.0**-12, 2000)
    assert ref[-1][0] == 2.0**-18  # torch keeps halving
    cfg = DLSConfig(policy="torch", initial_loss_scale=2.0**-12)
    mine = run_policy(cfg, overflows)
    assert [float(s.loss_scale) for s in mine] == [2.0**-13, 2.0**-14, 2.0**-14, 2.0**-14,
                                                   2.0**-14, 2.0**-14]
    assert int(mine[-1].floor_overflows) == 4
    # and the eager scaler turns that counter into a warning naming the cause
    from dlspass.scaler import GradScaler, ScaleFloorWarning

    sc = GradScaler(config=cfg)
    sc.state = mine[-1]
    with pytest.warns(ScaleFloorWarning, match="min_loss_scale"):
        sc.get_scale()


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=15, deadline=None)
@given(overflows=st.lists(st.booleans(), min_size=1, max_size=60), interval=st.integers(1, 5))
def test_invariants(policy, overflows, interval):
    cfg = DLSConfig(policy=policy, initial_loss_scale=4.0, steps_per_increase=interval,
                    min_loss_scale=1.0, max_loss_scale=64.0)
    for s in run_policy(cfg, overflows):
        scale = float(s.loss_scale)
        assert 1.0 <= scale <= 64.0
        assert math.isfinite(float(torch.reciprocal(s.loss_scale)))
        for name in ("steps_since_rescale", "overflows_since_rescale", "num_skipped_steps",
                     "floor_overflows"):
            assert int(getattr(s, name)) >= 0, name
        assert int(s.hysteresis) <= cfg.hysteresis_steps
    assert int(s.num_skipped_steps) == sum(overflows)


@pytest.mark.parametrize("policy", POLICIES)
def test_update_state_traces_without_branching(policy):
    cfg = DLSConfig(policy=policy, initial_loss_scale=8.0, steps_per_increase=2,
                    min_loss_scale=1.0, max_loss_scale=64.0)

    def fn(isfinite, *state):
        return tuple(update_state(type(init_state(cfg))(*state), isfinite, cfg))

    start = init_state(cfg)
    gm = make_fx(fn)(torch.tensor(True), *start)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("_local_scalar_dense" in t or "item" in t for t in targets)
    state = start
    for flag in [True, False, True, True, False, False, True]:
        f = torch.tensor(flag)
        eager = update_state(state, f, cfg)
        graph = gm(f, *state)
        for name, a, b in zip(STATE_FIELDS, eager, graph, strict=True):
            assert torch.equal(a, b), name
        state = eager


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"initial_loss_scale": 2.0**20}, "initial_loss_scale"),
        ({"initial_loss_scale": 2.0**-20}, "initial_loss_scale"),
        ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, "min_loss_scale"),
        ({"steps_per_increase": 0}, "steps_per_increase"),
        ({"steps_per_increase": -3}, "steps_per_increase"),
        ({"steps_per_increase": 2.5}, "steps_per_increase"),
        ({"overflow_tolerance": 1.0}, "overflow_tolerance"),
        ({"overflow_tolerance": -0.1}, "overflow_tolerance"),
        ({"policy": "apex"}, "policy"),
        ({"fp16_type": "float8"}, "fp16_type"),
        ({"max_gradient_norm": 1.0, "max_gradient_value": 1.0}, "max_gradient_value"),
        ({"loss_scale": "auto"}, "loss_scale"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key) as info:
        DLSConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_static_scale_state_never_changes():
    cfg = DLSConfig(loss_scale=128.0)
    states = run_policy(cfg, [True, False, True])
    assert all(float(s.loss_scale) == 128.0 and int(s.num_skipped_steps) == 0 for s in states)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert init_state(DLSConfig(loss_scale=None)).loss_scale.item() == 1.0
