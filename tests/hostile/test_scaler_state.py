"""Hostile scaler state: every bad value is refused with a `DLSInputError` naming the key, and
nothing is restored (the scaler is exactly as before the call).

Covers `GradScaler.load_state_dict` (dlspass and cstorch layouts, and a torch.amp dict into
policy ``torch``), `TorchGradScaler.load_state_dict` (torch.amp's layout), ``update(new_scale)``
and the constructors' float32 check (DLSConfig compares scales in float64, where 1e39 and
1e-50 are fine; the scaler keeps them in float32, where they become inf and 0).
"""

from __future__ import annotations

import pytest
import torch

from dlspass.config import ConfigError, DLSConfig
from dlspass.errors import DLSInputError
from dlspass.scaler import GradScaler, ScalerStateError, TorchGradScaler

NON_SCALES = [float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 1e39, 1e-50, 10**400,
              "65536", [1.0], None, True, 1 + 2j, torch.tensor([1.0, 2.0]), torch.tensor(True),
              torch.tensor(float("nan")), torch.tensor(1e-46)]
NON_COUNTS = [-1, 2.5, float("nan"), float("inf"), "3", True, None, 2**63, 10**30, [0],
              torch.tensor(-1), torch.tensor(1.5), torch.tensor([1, 2])]
BAD_GROWTH = [1.0, 0.5, -2.0, float("nan"), float("inf"), "2", None]
BAD_BACKOFF = [1.0, 0.0, -0.5, 1.5, float("nan"), "0.5", None]
BAD_INTERVAL = [0, -3, 2.5, float("nan"), "2", True, None]


def _trained(scaler):
    """A scaler with some history (a skipped step, a grown scale) to load into."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for i in range(5):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if i == 1:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return scaler


def _snapshot(scaler):
    return ([t.clone() for t in scaler.state], scaler.config, scaler._active_config,
            scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())


def _assert_unchanged(scaler, before):
    after = _snapshot(scaler)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before[0], after[0],
                                                                         strict=True))
    assert after[1:] == before[1:]


def _refused(scaler, sd, key):
    before = _snapshot(scaler)
    with pytest.raises(ScalerStateError) as info:
        scaler.load_state_dict(sd)
    assert isinstance(info.value, DLSInputError) and isinstance(info.value, ValueError)
    msg = str(info.value)
    assert key in msg and "\n" not in msg and len(msg) < 400, msg
    _assert_unchanged(scaler, before)


def _dls():
    return _trained(GradScaler(init_scale=2.0**10, steps_per_increase=2))


def _torch():
    return _trained(TorchGradScaler("cpu", init_scale=2.0**10, growth_interval=2))


@pytest.mark.parametrize("value", NON_SCALES, ids=repr)
@pytest.mark.parametrize("key", ["loss_scale", "non_clamped_scale"])
def test_dlspass_state_dict_bad_scale(key, value):
    sc = _dls()
    sd = sc.state_dict()
    sd[key] = value
    _refused(sc, sd, key)


@pytest.mark.parametrize("value", NON_COUNTS, ids=repr)
@pytest.mark.parametrize("key", ["steps_since_rescale", "overflows_since_rescale",
                                 "num_skipped_steps", "hysteresis", "floor_overflows"])
def test_dlspass_state_dict_bad_counter(key, value):
    sc = _dls()
    sd = sc.state_dict()
    sd[key] = value
    _refused(sc, sd, key)


@pytest.mark.parametrize(("key", "values"), [("growth_factor", BAD_GROWTH),
                                             ("backoff_factor", BAD_BACKOFF),
                                             ("growth_interval", BAD_INTERVAL)])
def test_dlspass_state_dict_bad_factor(key, values):
    for value in values:
        sc = _dls()
        sd = sc.state_dict()
        sd[key] = value
        _refused(sc, sd, key)


def test_dlspass_state_dict_bad_structure():
    sc = _dls()
    sd = sc.state_dict()
    for bad, key in (({**sd, "format_version": 99}, "format_version"),
                     ({**sd, "format_version": "1"}, "format_version"),
                     ({**sd, "config": [1, 2]}, "config"),
                     ({**sd, "config": {**sd["config"], "growth_factor": 0.5},
                       "growth_factor": None}, "growth_factor"),
                     ([("loss_scale", 1.0)], "expected a dict"),
                     ({"grad_scaler.loss_scale": float("nan"),
                       "grad_scaler.steps_since_rescale": 0,
                       "grad_scaler.overflows_since_rescale": 0,
                       "grad_scaler.num_skipped_steps": 0}, "loss_scale")):
        _refused(sc, bad, key)


def test_nothing_is_restored_when_the_last_entry_is_bad():
    """A dict whose scale, counters and factors are all fine but for one late entry changes
    nothing: not the scale, not the factors, not the interval."""
    sc = _dls()
    good = GradScaler(config=DLSConfig(initial_loss_scale=8.0, growth_factor=4.0,
                                       backoff_factor=0.25, steps_per_increase=7,
                                       policy="keras"))
    sd = good.state_dict()
    sd["floor_overflows"] = -5
    _refused(sc, sd, "floor_overflows")
    del sd["floor_overflows"]
    sc.load_state_dict(sd)  # the same dict without the bad entry loads
    assert (float(sc.get_scale()), sc.get_growth_factor(), sc.get_growth_interval()) == (
        8.0, 4.0, 7)


@pytest.mark.parametrize("make", [_torch, lambda: _trained(GradScaler(
    config=DLSConfig(policy="torch", initial_loss_scale=2.0**10, steps_per_increase=2)))],
    ids=["TorchGradScaler", "GradScaler-policy-torch"])
def test_torch_amp_state_dict_bad_values(make):
    base = torch.amp.GradScaler("cpu", init_scale=4.0).state_dict()
    cases = ([("scale", v) for v in NON_SCALES]
             + [("_growth_tracker", v) for v in NON_COUNTS]
             + [("growth_factor", v) for v in BAD_GROWTH]
             + [("backoff_factor", v) for v in BAD_BACKOFF]
             + [("growth_interval", v) for v in BAD_INTERVAL])
    for key, value in cases:
        sc = make()
        _refused(sc, {**base, key: value}, key)
    sc = make()
    _refused(sc, {k: v for k, v in base.items() if k != "backoff_factor"}, "backoff_factor")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -4.0, 1e39, 1e-50,
                                   torch.tensor(float("inf")), torch.tensor([0.0])],
                         ids=repr)
def test_torch_grad_scaler_update_new_scale_refused(value):
    sc = _torch()
    p = torch.nn.Parameter(torch.ones(2))
    sc.scale(p.sum()).backward()
    before = _snapshot(sc)
    with pytest.raises(ScalerStateError, match="new_scale"):
        sc.update(value)
    _assert_unchanged(sc, before)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"loss_scale": 1e39}, "loss_scale"),
    ({"loss_scale": 1e-50}, "loss_scale"),
    ({"init_scale": 1e39, "max_loss_scale": 1e39}, "initial_loss_scale"),
    ({"min_loss_scale": 1e-46}, "min_loss_scale"),
    ({"init_scale": 1e-46, "min_loss_scale": 1e-46}, "initial_loss_scale"),
    ({"config": lambda: DLSConfig(loss_scale=1e39)}, "loss_scale"),
    ({"config": lambda: DLSConfig(policy="torch", max_loss_scale=1e39)}, "max_loss_scale"),
])
def test_grad_scaler_refuses_scales_float32_cannot_hold(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        # A config is built inside the check: DLSConfig itself refuses these values.
        GradScaler(**{k: v() if callable(v) else v for k, v in kwargs.items()})


@pytest.mark.parametrize("init_scale", [1e39, 1e-50, 0.0, -1.0, float("nan"), float("inf")])
def test_torch_grad_scaler_refuses_init_scales_float32_cannot_hold(init_scale):
    with pytest.raises(ConfigError, match="init_scale"):
        TorchGradScaler("cpu", init_scale=init_scale)


def test_a_good_dict_still_loads_after_a_refused_one():
    sc = _dls()
    sd = sc.state_dict()
    _refused(sc, {**sd, "loss_scale": float("nan")}, "loss_scale")
    sd2 = {**sd, "loss_scale": torch.tensor(64.0), "growth_factor": 3.0}
    sc.load_state_dict(sd2)
    assert float(sc.get_scale()) == 64.0 and sc.get_growth_factor() == 3.0
    assert (sc.get_backoff_factor(), sc.get_growth_interval()) == (0.5, 2)
