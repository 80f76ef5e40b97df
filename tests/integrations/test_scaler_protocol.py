"""The parts of torch.amp.GradScaler's interface that training frameworks call directly.

Each test runs the same code on ``torch.amp.GradScaler("cpu")`` and on a dlspass scaler and
compares the scales, skip counts and parameters step by step (powers-of-two scales keep the
unscaled fp32 gradients bit-identical). No framework is imported here: the calls are the ones
the frameworks make (quoted from their source where it matters).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from framework_runs import OVERFLOW_STEP, batches, make_model

from dlspass.config import DLSConfig
from dlspass.scaler import GradScaler, TorchGradScaler

INIT = 2.0**10
INTERVAL = 2


def _torch_amp() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)


def _dls_torch_policy() -> GradScaler:
    return GradScaler(config=DLSConfig(policy="torch", initial_loss_scale=INIT,
                                       steps_per_increase=INTERVAL))


def _dls_torch() -> TorchGradScaler:
    return TorchGradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)


DLS_SCALERS = {"TorchGradScaler": _dls_torch, "GradScaler-policy-torch": _dls_torch_policy}


def _scale_of(scaler) -> float:
    return float(scaler.get_scale())


def _train(model, opt, scaler, steps: range) -> list[tuple[float, torch.Tensor]]:
    out = []
    for i in steps:
        x, y = batches()[i]
        loss = torch.nn.functional.mse_loss(model(x), y)
        if i == OVERFLOW_STEP:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        out.append((_scale_of(scaler), torch.cat([p.detach().reshape(-1).clone()
                                                  for p in model.parameters()])))
    return out


def _fsdp2_load_state(scaler, opt, state: dict) -> None:
    """What accelerate's ``Accelerator.load_state`` does with the scaler under FSDP2 (1.15):

        self.scaler.load_state_dict(scaler_state)
        self.scaler._lazy_init_scale_growth_tracker(self.scaler._device)

    and then ``set_optimizer_state_dict`` initialises a fresh optimizer's state with one step on
    zero gradients at lr 0, through the scaler of accelerate's wrapped optimizer (``scaler.step``
    then ``scaler.update``), before any ``scaler.scale(loss)``."""
    scaler.load_state_dict(state)
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    scaler.step(opt)
    scaler.update()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("make", DLS_SCALERS.values(), ids=DLS_SCALERS.keys())
def test_accelerate_fsdp2_load_state_sequence_like_torch(make):
    runs = {}
    for name, factory in (("torch", _torch_amp), ("dlspass", make)):
        model, opt = make_model()
        first = factory()
        _train(model, opt, first, range(0, 4))
        state = first.state_dict()
        resumed, (model2, opt2) = factory(), make_model()
        model2.load_state_dict(model.state_dict())
        _fsdp2_load_state(resumed, opt2, state)
        opt2.load_state_dict(opt.state_dict())
        runs[name] = _train(model2, opt2, resumed, range(4, 8))
    assert [s for s, _ in runs["dlspass"]] == [s for s, _ in runs["torch"]]
    for (_, a), (_, b) in zip(runs["dlspass"], runs["torch"], strict=True):
        assert torch.equal(a, b)


def test_grad_scaler_state_dict_loads_into_torch_amp():
    """A dlspass.GradScaler checkpoint resumes torch.amp.GradScaler exactly where an
    uninterrupted torch run is (and still resumes dlspass's own scalers)."""
    model, opt = make_model()
    ref_model, ref_opt = make_model()
    ref = _train(ref_model, ref_opt, _torch_amp(), range(0, 8))
    dls = _dls_torch_policy()
    first = _train(model, opt, dls, range(0, 5))
    buf = io.BytesIO()
    torch.save(dls.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    into_torch, into_dls = _torch_amp(), _dls_torch_policy()
    into_torch.load_state_dict(state)  # KeyError: 'scale' before torch's keys were written
    into_dls.load_state_dict(state)
    assert into_torch.get_scale() == float(into_dls.get_scale()) == first[-1][0]
    assert into_torch._get_growth_tracker() == int(into_dls.state.steps_since_rescale)
    assert int(into_dls.get_num_skipped_steps()) == int(dls.get_num_skipped_steps()) == 1
    snapshot = copy.deepcopy((model.state_dict(), opt.state_dict()))
    rest_torch = _train(model, opt, into_torch, range(5, 8))
    model.load_state_dict(snapshot[0])
    opt.load_state_dict(snapshot[1])
    rest_dls = _train(model, opt, into_dls, range(5, 8))
    for (s, p), (s_t, p_t), (s_d, p_d) in zip(ref[5:], rest_torch, rest_dls, strict=True):
        assert s == s_t == s_d
        assert torch.equal(p, p_t) and torch.equal(p, p_d)


def test_cerebras_state_dict_loads_into_torch_amp_and_still_grows():
    """The cerebras rule grows after steps_per_increase + 1 clean steps, so its counter can
    equal the interval, where torch's rule (grow when the tracker reaches the interval) would
    never grow again; the tracker written for torch stays below the interval."""
    sc = GradScaler(init_scale=INIT, steps_per_increase=INTERVAL)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    for _ in range(INTERVAL):
        sc.scale(p.sum()).backward()
        sc.step(opt)
        sc.update()
    assert int(sc.state.steps_since_rescale) == INTERVAL and float(sc.get_scale()) == INIT
    into = _torch_amp()
    into.load_state_dict(sc.state_dict())
    assert into.get_scale() == INIT and into._get_growth_tracker() == INTERVAL - 1
    into.scale(p.sum()).backward()
    into.step(opt)
    into.update()
    assert into.get_scale() == 2 * INIT


def test_skip_visible_grad_scaler_runs_optimizer_step_only_when_it_steps():
    """What accelerate watches (whether ``optimizer.step`` ran), with everything else equal to
    `GradScaler`'s run: parameters, Adam's state (created on the first step, which overflows
    here) and the scaler state, in the cerebras policy."""
    from dlspass.integrations import SkipVisibleGradScaler

    runs = {}
    for cls in (GradScaler, SkipVisibleGradScaler):
        model, _ = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        calls = []
        step = opt.step

        def counted(*args, _step=step, _calls=calls, **kwargs):
            _calls.append(1)
            return _step(*args, **kwargs)

        opt.step = counted
        scaler = cls(init_scale=INIT, steps_per_increase=INTERVAL)
        stepped = []
        for i in range(6):
            x, y = batches()[i]
            loss = torch.nn.functional.mse_loss(model(x), y)
            if i in (0, 3):
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            stepped.append(bool(scaler.step(opt)))
            scaler.update()
            opt.zero_grad(set_to_none=True)
        runs[cls] = (calls, stepped, torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                     copy.deepcopy(opt.state_dict()["state"]), scaler.state)
    (c0, s0, p0, o0, st0), (c1, s1, p1, o1, st1) = runs.values()
    assert s0 == s1 == [False, True, True, False, True, True]
    assert len(c0) == 6 and len(c1) == 4
    assert torch.equal(p0, p1)
    assert o0.keys() == o1.keys() and all(
        torch.equal(o0[k][n], o1[k][n]) for k in o0 for n in o0[k])
    assert all(torch.equal(a, b) for a, b in zip(st0, st1, strict=True))
