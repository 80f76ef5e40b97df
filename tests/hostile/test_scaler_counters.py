"""Scaler counters at the top of what ``load_state_dict`` accepts, growth trackers torch.amp
refuses, and scaler state on an unusual device.

A counter the scaler accepts must keep the scaler working for a long run: it must not wrap
around a few steps later (the scale would then never grow, and the scaler would refuse its
own ``state_dict``). ``TorchGradScaler`` must refuse what ``torch.amp.GradScaler`` refuses
rather than truncate it.
"""

from __future__ import annotations

import pytest
import torch

from dlspass.errors import DLSInputError
from dlspass.scaler import GradScaler, ScalerStateError, TorchGradScaler

pytestmark = pytest.mark.filterwarnings("ignore:dlspass. gradients overflowed")

# The top of the first round's range, and values near the top of int64 and int32.
TOPS = [2**63 - 1, 2**63 - 5, 2**62, 2**31 - 1]
COUNTERS = ["steps_since_rescale", "overflows_since_rescale", "num_skipped_steps", "floor_overflows"]


def _steps(scaler, n: int, *, overflow_at: int | None = None) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    for i in range(n):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if i == overflow_at:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()


def _make(policy: str):
    return GradScaler(init_scale=2.0**10, steps_per_increase=4, policy=policy)


@pytest.mark.parametrize("policy", ["cerebras", "torch", "keras", "deepspeed", "megatron"])
@pytest.mark.parametrize("counter", COUNTERS)
@pytest.mark.parametrize("top", TOPS)
def test_an_accepted_counter_does_not_wrap_and_the_state_reloads(policy, counter, top):
    scaler = _make(policy)
    _steps(scaler, 1)
    sd = scaler.state_dict()
    sd[counter] = torch.tensor(top)
    try:
        scaler.load_state_dict(sd)
    except ScalerStateError:
        return  # refused: nothing to run
    scale0 = scaler.get_scale()
    _steps(scaler, 12, overflow_at=0)  # one overflow, then 11 clean steps: 4-step intervals
    state = scaler.state_dict()
    for f in COUNTERS:
        assert int(state[f]) >= 0, f"{policy}: {counter}={top} wrapped {f} to {int(state[f])}"
    assert scaler.get_scale() > scale0 / 2, f"{policy}: {counter}={top}: the scale never grew again"
    fresh = _make(policy)
    fresh.load_state_dict(state)  # the scaler accepts its own state
    assert fresh.get_scale() == scaler.get_scale()


def _torch_amp_refuses(tracker: object) -> bool:
    s = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2000)
    _steps(s, 1)  # the tracker tensor exists: load_state_dict fills it
    sd = s.state_dict()
    sd["_growth_tracker"] = tracker
    try:
        s.load_state_dict(sd)
        _steps(s, 1)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("tracker", [2**31, 2**31 + 7, 2**32, 2**40, 2**62, 2**63 - 1])
def test_torch_grad_scaler_refuses_trackers_torch_amp_refuses(tracker):
    assert _torch_amp_refuses(tracker), "the reference accepts it: the case proves nothing"
    scaler = TorchGradScaler("cpu", init_scale=2.0**10, growth_interval=2000)
    _steps(scaler, 1)
    sd = scaler.state_dict()
    sd["_growth_tracker"] = tracker
    with pytest.raises(ScalerStateError, match="_growth_tracker"):
        scaler.load_state_dict(sd)


@pytest.mark.parametrize("tracker", [0, 1, 1999])
def test_torch_grad_scaler_keeps_a_tracker_torch_accepts_exactly(tracker):
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2000)
    ours = TorchGradScaler("cpu", init_scale=2.0**10, growth_interval=2000)
    for s in (ref, ours):
        _steps(s, 1)
        sd = s.state_dict()
        sd["_growth_tracker"] = tracker
        s.load_state_dict(sd)
        _steps(s, 3)
    assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]
    assert ours.get_scale() == ref.get_scale()


def test_a_tracker_past_the_interval_is_refused_where_torch_would_never_grow():
    """torch grows when the tracker *equals* the interval: one past it counts up to int32's
    wrap. torch.amp accepts it (and its scale stops growing); dlspass refuses it."""
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    _steps(ref, 1)
    sd = ref.state_dict()
    sd["_growth_tracker"] = 5
    ref.load_state_dict(sd)
    _steps(ref, 20)
    assert ref.get_scale() == 2.0**10  # the reference never grows again
    scaler = TorchGradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    _steps(scaler, 1)
    with pytest.raises(ScalerStateError, match="growth_interval"):
        scaler.load_state_dict(sd)


@pytest.mark.parametrize("key", ["loss_scale", "steps_since_rescale", "num_skipped_steps"])
def test_meta_tensors_in_a_scaler_state_are_a_checkpoint_error(key):
    scaler = _make("cerebras")
    _steps(scaler, 2)
    sd = scaler.state_dict()
    sd[key] = torch.empty((), dtype=sd[key].dtype, device="meta")
    with pytest.raises(ScalerStateError, match=key) as info:
        scaler.load_state_dict(sd)
    assert isinstance(info.value, DLSInputError)


def test_meta_tensor_in_a_torch_amp_state_is_a_checkpoint_error():
    scaler = TorchGradScaler("cpu", init_scale=2.0**10)
    _steps(scaler, 1)
    sd = scaler.state_dict()
    sd["scale"] = torch.empty((), device="meta")
    with pytest.raises(ScalerStateError, match="scale"):
        scaler.load_state_dict(sd)
