"""The eager `dlspass.GradScaler` / `TorchGradScaler` against independent references.

The main reference: with a power-of-two scale, ``backward(S * loss)`` then ``* (1/S)`` gives
bit-exactly the gradients of ``backward(loss)`` on these small fp32 models, so a scaled run must
equal, bit for bit, a plain run that simply does not step on the iterations whose gradients we
poison. torch.amp.GradScaler itself is the reference for `TorchGradScaler`.
"""

from __future__ import annotations

import copy
import functools
import io
import warnings

import pytest
import torch
from tolerance import reordered_sum_atol

from dlspass.config import DLSConfig
from dlspass.models import MLP
from dlspass.scaler import (
    GradScaler,
    ScaleFloorError,
    ScaleFloorWarning,
    TorchGradScaler,
    hold_scheduler_on_skip,
)

STEPS = 22
POISON = {0: "inf", 4: "nan", 9: "inf", 10: "-inf", 15: "nan"}


def batches(n=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def make_model_opt(opt_name, variant, seed=0):
    torch.manual_seed(seed)
    m = MLP()
    groups = [
        {"params": [m.fc1.weight, m.fc1.bias], "lr": 1e-2},
        {"params": [*m.fc2.parameters(), *m.fc3.parameters()], "lr": 3e-3, "weight_decay": 0.01},
    ]
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True},
          "single": {"foreach": False}}[variant]
    if opt_name == "sgd":
        opt = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, **kw)
    elif opt_name == "adam":
        opt = torch.optim.Adam(groups, lr=1e-2, **kw)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, **kw)
    return m, opt


def poison(m, kind):
    m.fc2.weight.grad[1, 2] = float(kind)


def opt_snapshot(opt):
    return copy.deepcopy(opt.state_dict()["state"])


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].keys() == b[k].keys()
        for name in a[k]:
            x, y = a[k][name], b[k][name]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (k, name)


def params_of(m):
    return [p.detach().clone() for p in m.parameters()]


def reference_run(opt_name, variant, data, skip):
    m, opt = make_model_opt(opt_name, variant)
    traj = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        if i not in skip:
            opt.step()
        traj.append(params_of(m))
    return m, opt, traj


@pytest.mark.parametrize("variant", ["fused", "foreach", "single"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_skipped_steps_bit_identical(opt_name, variant):
    data = batches()
    m, opt = make_model_opt(opt_name, variant)
    scaler = GradScaler(init_scale=2.0**10, steps_per_increase=3)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
        if i in POISON:
            poison(m, POISON[i])
        before_p, before_s = params_of(m), opt_snapshot(opt)
        stepped = scaler.step(opt)
        scaler.update()
        assert bool(stepped) == (i not in POISON)
        if i in POISON:
            for a, b in zip(before_p, params_of(m), strict=True):
                assert torch.equal(a, b)
            assert_same_state(before_s, opt_snapshot(opt))
        assert all(torch.isfinite(p).all() for p in m.parameters())
    assert int(scaler.get_num_skipped_steps()) == len(POISON)
    # the first step was skipped: lazily created state must be absent or fresh-equivalent
    _, ref_opt, ref_traj = reference_run(opt_name, variant, data, set(POISON))
    for a, b in zip(ref_traj[-1], params_of(m), strict=True):
        assert torch.equal(a, b)
    assert_same_state(opt_snapshot(ref_opt), opt_snapshot(opt))


def test_skipped_first_step_leaves_no_state():
    m, opt = make_model_opt("sgd", "fused")
    scaler = GradScaler()
    scaler.scale(m(torch.randn(2, 8)).sum()).backward()
    poison(m, "inf")
    scaler.step(opt)
    scaler.update()
    assert len(opt.state) == 0  # torch's fused SGD would leave an uninitialised momentum buffer


def test_two_optimizers_one_update():
    torch.manual_seed(0)
    m = MLP()
    o1 = torch.optim.SGD(m.fc1.parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.Adam([*m.fc2.parameters(), *m.fc3.parameters()], lr=1e-2)
    scaler = GradScaler(init_scale=2.0**10)
    scaler.scale(m(torch.randn(4, 8)).pow(2).mean()).backward()
    m.fc3.weight.grad[0, 0] = float("nan")
    fc1_before, fc3_before = m.fc1.weight.detach().clone(), m.fc3.weight.detach().clone()
    s1, s2 = scaler.step(o1), scaler.step(o2)
    scaler.update()
    # torch semantics: an optimizer whose own gradients are finite steps; the other does not
    assert bool(s1) and not bool(s2)
    assert not torch.equal(fc1_before, m.fc1.weight) and torch.equal(fc3_before, m.fc3.weight)
    assert int(scaler.get_num_skipped_steps()) == 1  # once per iteration, not per optimizer
    assert float(scaler.get_scale()) == 2.0**9
    assert bool(scaler.found_inf)


def test_two_optimizers_match_torch_amp():
    def run(make_scaler):
        torch.manual_seed(0)
        m = MLP()
        o1 = torch.optim.SGD(m.fc1.parameters(), lr=0.1, momentum=0.9)
        o2 = torch.optim.Adam([*m.fc2.parameters(), *m.fc3.parameters()], lr=1e-2)
        sc = make_scaler()
        scales = []
        for i, (x, y) in enumerate(batches(12)):
            o1.zero_grad()
            o2.zero_grad()
            sc.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
            if i in (2, 7):
                m.fc3.weight.grad[0, 0] = float("inf")
            if i == 5:
                m.fc1.weight.grad[0, 0] = float("inf")
            sc.step(o1)
            sc.step(o2)
            sc.update()
            scales.append(float(sc.get_scale()))
        return scales, params_of(m)

    ref = run(lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3))
    mine = run(lambda: TorchGradScaler("cpu", init_scale=2.0**8, growth_interval=3))
    assert ref[0] == mine[0]
    for a, b in zip(ref[1], mine[1], strict=True):
        assert torch.equal(a, b)


def test_gradient_accumulation_equals_plain_accumulation():
    data = batches(9)
    m, opt = make_model_opt("adam", "foreach")
    scaler = GradScaler(init_scale=2.0**12)
    rm, ropt = make_model_opt("adam", "foreach")
    for k in range(3):
        opt.zero_grad()
        ropt.zero_grad()
        for x, y in data[3 * k: 3 * k + 3]:
            scaler.scale(torch.nn.functional.mse_loss(m(x), y) / 3).backward()
            (torch.nn.functional.mse_loss(rm(x), y) / 3).backward()
        scaler.step(opt)
        scaler.update()
        ropt.step()
    for a, b in zip(params_of(rm), params_of(m), strict=True):
        assert torch.equal(a, b)


def _one_backward(scaler, m):
    scaler.scale(m(torch.randn(2, 8)).sum()).backward()


def test_call_order_errors():
    m, opt = make_model_opt("sgd", "single")
    scaler = GradScaler()
    _one_backward(scaler, m)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="cerebras"):
        scaler.update(1024.0)
    scaler.update()
    with pytest.raises(RuntimeError, match="no optimizer"):
        scaler.update()


def test_constructor_errors():
    with pytest.raises(ValueError, match="initial_loss_scale"):
        GradScaler(init_scale=4.0, initial_loss_scale=4.0)
    # config= and keywords merge by DLSConfig.with_overrides (issue 34; they used to be refused)
    assert GradScaler(config=DLSConfig(), steps_per_increase=3).config == \
        DLSConfig().with_overrides(steps_per_increase=3)
    with pytest.raises(TypeError, match="config"):
        GradScaler(config={"steps_per_increase": 3})
    with pytest.raises(ValueError, match="initial_loss_scale"):
        GradScaler(init_scale=2.0**20)
    assert GradScaler(initial_loss_scale=8.0).get_scale().item() == 8.0


def test_fp16_gradients():
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(init_scale=2.0**10)
    g = torch.tensor([1.0, -3.0, 0.5, 20.0, 1e-3], dtype=torch.float64)
    p.grad = (g * 2.0**10).to(torch.float16)
    expected = (p.grad.double() / 2.0**10).to(torch.float16)
    scaler.unscale_(opt)
    assert p.grad.dtype == torch.float16 and torch.equal(p.grad, expected)
    assert bool(scaler.step(opt))
    scaler.update()
    assert torch.equal(p.detach(), -expected)
    p.grad = torch.tensor([1.0, float("inf"), 0, 0, 0], dtype=torch.float16)
    before = p.detach().clone()
    assert not bool(scaler.step(opt))
    scaler.update()
    assert torch.equal(before, p.detach())


def test_bfloat16_passes_through_with_one_warning():
    m, opt = make_model_opt("sgd", "single")
    scaler = GradScaler()
    with pytest.warns(UserWarning, match="bfloat16") as rec:
        loss = m(torch.randn(2, 8)).sum().to(torch.bfloat16)
        out = scaler.scale(loss)
        scaler.scale(loss)
    assert len([w for w in rec if "bfloat16" in str(w.message)]) == 1
    assert out is loss and float(scaler.get_scale()) == 1.0 and not scaler.is_enabled()
    out.float().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    assert bool(scaler.step(opt))
    scaler.update()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, m.parameters(), strict=True))
    with pytest.warns(UserWarning, match="bfloat16"):
        GradScaler(fp16_type="bfloat16")


def _drive_to_floor(scaler, n=4):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(n):
        scaler.scale(p.sum()).backward()
        p.grad.fill_(float("nan"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_floor_warns_once_lazily():
    scaler = GradScaler(init_scale=2.0**-13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing on the per-step path
        _drive_to_floor(scaler)
    assert float(scaler.get_non_clamped_scale()) == 2.0**-15
    with pytest.warns(ScaleFloorWarning, match="16-bit|float16 range"):
        assert float(scaler.get_scale()) == 2.0**-14
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.get_scale()


def test_floor_raise():
    scaler = GradScaler(init_scale=2.0**-13, on_scale_floor="raise")
    _drive_to_floor(scaler)
    with pytest.raises(ScaleFloorError, match="min_loss_scale"):
        scaler.get_scale()
    with pytest.raises(ScaleFloorError):
        scaler.state_dict()


def _train(m, opt, scaler, data, start=0):
    for i, (x, y) in enumerate(data, start=start):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
        if i in POISON:
            poison(m, POISON[i])
        scaler.step(opt)
        scaler.update()


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_roundtrip_and_scaler_swap():
    data = batches()
    m1, o1 = make_model_opt("adam", "foreach")
    s1 = GradScaler(init_scale=2.0**10, steps_per_increase=3)
    _train(m1, o1, s1, data)

    m2, o2 = make_model_opt("adam", "foreach")
    s2 = GradScaler(init_scale=2.0**10, steps_per_increase=3)
    _train(m2, o2, s2, data[:11])
    sd = roundtrip(s2.state_dict())
    assert {"loss_scale", "steps_since_rescale", "overflows_since_rescale", "num_skipped_steps",
            "format_version", "config"} <= sd.keys()
    s3 = GradScaler(init_scale=2.0**10, steps_per_increase=3)
    s3.load_state_dict(sd)
    _train(m2, o2, s3, data[11:], start=11)
    for a, b in zip(params_of(m1), params_of(m2), strict=True):
        assert torch.equal(a, b)
    for k, v in s1.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, s3.state_dict()[k]), k


def test_load_state_dict_variants():
    sc = GradScaler(init_scale=2.0**10)
    sc.load_state_dict({"grad_scaler.loss_scale": torch.tensor(256.0),
                        "grad_scaler.steps_since_rescale": torch.tensor(3),
                        "grad_scaler.overflows_since_rescale": torch.tensor(1),
                        "grad_scaler.num_skipped_steps": torch.tensor(7)})
    assert float(sc.get_scale()) == 256.0 and int(sc.get_num_skipped_steps()) == 7
    assert int(sc.state.overflows_since_rescale) == 1
    sc.load_state_dict({})
    assert float(sc.get_scale()) == 2.0**10 and int(sc.get_num_skipped_steps()) == 0
    sc.load_state_dict(None)
    static = roundtrip(GradScaler(loss_scale=128.0).state_dict())
    with pytest.raises(ValueError, match="static loss scale"):
        sc.load_state_dict(static)
    with pytest.raises(ValueError, match="missing key"):
        sc.load_state_dict({"steps_since_rescale": 1})
    with pytest.raises(ValueError, match="policy='torch'"):
        sc.load_state_dict(torch.amp.GradScaler("cpu").state_dict())


def test_torch_amp_state_dict_loads():
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=5)
    mine = TorchGradScaler("cpu")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    for i in range(3):
        opt.zero_grad()
        ref.scale(p.sum()).backward()
        if i == 0:
            p.grad.fill_(float("inf"))
        ref.step(opt)
        ref.update()
    mine.load_state_dict(roundtrip(ref.state_dict()))
    assert float(mine.get_scale()) == ref.get_scale() == 2.0**7
    assert int(mine.state.steps_since_rescale) == ref._growth_tracker.item() == 2
    assert mine.config.growth_interval == 5
    for i in range(8):  # continue both with the same overflows
        for sc in (ref, mine):
            opt.zero_grad()
            sc.scale(p.sum()).backward()
            if i == 4:
                p.grad.fill_(float("nan"))
            sc.step(opt)
            sc.update()
        assert float(mine.get_scale()) == ref.get_scale()


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize(("opt_name", "variant"), [("adam", "single"), ("adam", "fused"),
                                                   ("sgd", "foreach")])
def test_torch_grad_scaler_matches_torch_amp(opt_name, variant, enabled):
    data = batches(16)
    poison_at = {} if not enabled else {1: "inf", 6: "nan", 7: "inf"}

    def run(sc):
        m, opt = make_model_opt(opt_name, variant)
        scales = []
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            out = sc.scale(loss)
            if not enabled:
                assert out is loss
            out.backward()
            if i in poison_at:
                poison(m, poison_at[i])
            sc.step(opt)
            sc.update(2.0**9 if i == 10 and enabled else None)
            scales.append(float(sc.get_scale()))
        return scales, params_of(m)

    ref = run(torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3, enabled=enabled))
    mine = run(TorchGradScaler("cpu", init_scale=2.0**8, growth_interval=3, enabled=enabled))
    assert ref[0] == mine[0]
    for a, b in zip(ref[1], mine[1], strict=True):
        assert torch.equal(a, b)


def test_torch_grad_scaler_cuda_default_disables_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        sc = TorchGradScaler()
    assert not sc.is_enabled()


def test_clipping_equals_clip_grad_norm_after_unscale():
    x, y = batches(1)[0]
    m, opt = make_model_opt("sgd", "single")
    rm, _ = make_model_opt("sgd", "single")
    scaler = GradScaler(init_scale=2.0**10, max_gradient_norm=0.05)
    scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
    scaler.unscale_(opt)
    torch.nn.functional.mse_loss(rm(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(rm.parameters(), 0.05)
    assert total > 0.05  # clipping binds
    # the same eager autograd on both sides, the scale a power of two: equal gradients before
    # clipping; the two norms may sum the squares (>= 0, so a relative bound) in other orders, the
    # square root halves that, and the sqrt, the coefficient's division and the multiply round
    # once each per side: (n + 4) * u relative with u = eps / 2 (tests/tolerance.py)
    n_all = sum(p.numel() for p in rm.parameters())
    rtol = reordered_sum_atol(n_all + 4, 1.0) / 2
    for a, b in zip(rm.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=rtol, atol=0)


def test_scheduler_holds_on_skipped_steps_without_warning():
    m, opt = make_model_opt("adam", "single")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    scaler = GradScaler(init_scale=2.0**10)
    held = hold_scheduler_on_skip(sched, scaler)
    taken = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(batches(12)):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
            if i in POISON:
                poison(m, POISON[i])
            scaler.step(opt)
            scaler.update()
            taken += held.step()
            assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / (taken + 1), rel=1e-12)
    assert taken == 12 - len([k for k in POISON if k < 12])
    assert held.last_epoch == taken and held.held_steps == 12 - taken


def test_no_host_sync_in_steady_state(monkeypatch):
    # SGD: Adam reads its CPU step count with .item() itself, which is not the scaler's doing
    m, opt = make_model_opt("sgd", "foreach")
    scaler = GradScaler(init_scale=2.0**10, max_gradient_norm=1.0)
    data = batches(4)
    _train(m, opt, scaler, data[:1], start=1)  # first step creates optimizer state

    def boom(*_a, **_k):
        raise AssertionError("host sync")

    for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    _train(m, opt, scaler, data[1:], start=1)
    monkeypatch.undo()
    assert int(scaler.get_num_skipped_steps()) == 0


def test_static_scale_never_skips():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(loss_scale=128.0)
    loss = p.sum()
    assert float(scaler.scale(loss).detach()) == 256.0
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(2))
    assert bool(scaler.step(opt))
    scaler.update()
    assert float(scaler.get_scale()) == 128.0 and int(scaler.get_num_skipped_steps()) == 0
    assert set(scaler.state_dict()) == {"loss_scale", "format_version", "config"}


def test_nested_outputs_and_nested_checkpoint():
    scaler = GradScaler(init_scale=4.0)
    a, b = torch.ones(2), torch.full((3,), 2.0)
    out = scaler.scale({"x": a, "y": [b, (a,)]})
    assert torch.equal(out["x"], 4 * a) and torch.equal(out["y"][0], 4 * b)
    assert torch.equal(out["y"][1][0], 4 * a)
    with pytest.raises(TypeError, match="scale"):
        scaler.scale({"x": "loss"})
    scaler.load_state_dict({"grad_scaler": {"loss_scale": 2.0, "steps_since_rescale": 1,
                                            "overflows_since_rescale": 0, "num_skipped_steps": 3}})
    assert float(scaler.get_scale()) == 2.0 and int(scaler.get_num_skipped_steps()) == 3


# ---- TorchGradScaler against torch.amp.GradScaler: public behaviour, step for step -----------
def _amp_pair(**kw):
    return torch.amp.GradScaler("cpu", **kw), TorchGradScaler("cpu", **kw)


def _one_param(seed=0):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(4))
    return p, torch.optim.SGD([p], lr=0.1, momentum=0.9)


def _amp_steps(scaler, p, opt, bad, steps, start=0):
    """Run ``steps`` iterations; inject inf into the gradient on the iterations in ``bad``.

    Returns, per iteration, (scale, growth tracker, growth factor, backoff factor, interval)
    read through the public API, and the parameter after it.
    """
    out = []
    for i in range(start, start + steps):
        opt.zero_grad()
        scaler.scale((p * torch.arange(1.0, 5.0)).sum()).backward()
        if i in bad:
            p.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        sd = scaler.state_dict()
        out.append(((sd["scale"], sd["_growth_tracker"], scaler.get_growth_factor(),
                     scaler.get_backoff_factor(), scaler.get_growth_interval()),
                    p.detach().clone()))
    return out


def _assert_same_run(ref, mine):
    assert len(ref) == len(mine)
    for k, ((a, pa), (b, pb)) in enumerate(zip(ref, mine, strict=True)):
        assert a == b, f"iteration {k}: torch {a} dlspass {b}"
        assert torch.equal(pa, pb), f"iteration {k}: parameters differ"


@pytest.mark.parametrize(("init", "growth", "backoff", "interval", "bad", "steps"), [
    # the example: three overflows from 2**-13 reach 2**-16 (no 2**-14 floor)
    (2.0**-13, 2.0, 0.5, 2000, {0, 1, 2}, 3),
    # a long decay through float32's subnormals down to 0, where torch stays
    (1.0, 2.0, 0.5, 3, set(range(160)), 160),
    # factors that are not powers of two: torch computes scale * factor in float64
    (1000.0, 1.7, 0.3, 3, {1, 2, 7, 8, 9, 15, 30, 31}, 40),
    # growth refused when it would overflow float32
    (2.0**126, 4.0, 0.5, 1, {3}, 8),
])
def test_torch_grad_scaler_trajectory_identical_to_torch(init, growth, backoff, interval, bad,
                                                         steps):
    kw = {"init_scale": init, "growth_factor": growth, "backoff_factor": backoff,
          "growth_interval": interval}
    ref_scaler, mine_scaler = _amp_pair(**kw)
    ref = _amp_steps(ref_scaler, *_one_param(), bad, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no floor warning, nothing else either
        mine = _amp_steps(mine_scaler, *_one_param(), bad, steps)
    _assert_same_run(ref, mine)
    if init == 2.0**-13:
        assert mine[-1][0][0] == 2.0**-16
    # torch skipped where its parameters did not move (momentum SGD moves them otherwise)
    params = [_one_param()[0].detach()] + [q for _, q in ref]
    torch_skipped = sum(torch.equal(a, b) for a, b in zip(params, params[1:], strict=False))
    assert torch_skipped >= len(bad)
    assert int(mine_scaler.get_num_skipped_steps()) == torch_skipped


@pytest.mark.parametrize("direction", ["torch->dlspass->torch", "dlspass->torch->dlspass"])
def test_checkpoints_cross_both_ways(direction):
    """A run handed over twice through state_dict continues the uninterrupted torch run exactly:
    scale, growth tracker, growth factor, backoff factor and interval, and the parameters."""
    kw = {"init_scale": 2.0**10, "growth_factor": 4.0, "backoff_factor": 0.25,
          "growth_interval": 2}
    bad = {1, 5, 6, 11, 17}
    ref = _amp_steps(torch.amp.GradScaler("cpu", **kw), *_one_param(), bad, 24)

    first, second = ((torch.amp.GradScaler, TorchGradScaler) if direction.startswith("torch")
                     else (TorchGradScaler, torch.amp.GradScaler))
    p, opt = _one_param()
    start = first("cpu", **kw)
    run = _amp_steps(start, p, opt, bad, 7)
    # the next scalers are built with other settings: the checkpoint must bring them
    nxt = second("cpu", init_scale=3.0, growth_factor=1.5, backoff_factor=0.9, growth_interval=50)
    nxt.load_state_dict(roundtrip(start.state_dict()))
    run += _amp_steps(nxt, p, opt, bad, 8, start=7)
    back = first("cpu", init_scale=7.0, growth_factor=3.0, backoff_factor=0.75,
                 growth_interval=9)
    back.load_state_dict(roundtrip(nxt.state_dict()))
    run += _amp_steps(back, p, opt, bad, 9, start=15)
    _assert_same_run(ref, run)


def test_torch_grad_scaler_state_dict_like_torch():
    kw = {"init_scale": 3.0, "growth_factor": 4.0, "backoff_factor": 0.5, "growth_interval": 2}
    ref, mine = _amp_pair(**kw)
    for sc in (ref, mine):
        _amp_steps(sc, *_one_param(), {1}, 4)
    assert mine.state_dict() == ref.state_dict()
    assert set(mine.state_dict()) == set(TORCH_AMP_STATE_KEYS)
    assert isinstance(mine.get_scale(), float)
    # each loads the other's dict into a scaler built with other settings
    for src, dst in ((ref, TorchGradScaler("cpu", init_scale=6.0, growth_factor=7.0,
                                           backoff_factor=0.8, growth_interval=1)),
                     (mine, torch.amp.GradScaler("cpu", init_scale=6.0, growth_factor=7.0,
                                                 backoff_factor=0.8, growth_interval=1))):
        dst.load_state_dict(roundtrip(src.state_dict()))
        assert dst.state_dict() == src.state_dict()
        assert (dst.get_scale(), dst.get_growth_factor(), dst.get_backoff_factor(),
                dst.get_growth_interval()) == (src.get_scale(), 4.0, 0.5, 2)
    # disabled: {} out, no-op in; an empty dict into an enabled scaler raises as torch does
    off_ref, off_mine = _amp_pair(enabled=False)
    assert off_ref.state_dict() == off_mine.state_dict() == {}
    off_mine.load_state_dict({"scale": float("nan")})  # disabled: nothing is read
    for sc in (ref, mine):
        with pytest.raises(RuntimeError, match="The source state dict is empty"):
            sc.load_state_dict({})


TORCH_AMP_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                        "_growth_tracker")


def test_torch_grad_scaler_pickles_like_torch():
    import pickle

    ref, mine = _amp_pair(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5,
                          growth_interval=2)
    for sc in (ref, mine):
        sc.scale(torch.tensor([4.0]))
        b = pickle.loads(pickle.dumps(sc))
        assert (b.is_enabled(), b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(),
                b.get_growth_interval(), b.state_dict()["_growth_tracker"]) == (
                    True, 3.0, 4.0, 0.5, 2, 0)
        assert torch.equal(b.scale(torch.tensor([4.0])), torch.tensor([12.0]))
        # both refuse to be pickled mid-iteration
        p, opt = _one_param()
        sc.scale(p.sum()).backward()
        sc.unscale_(opt)
        with pytest.raises(AssertionError, match="only be pickled"):
            pickle.dumps(sc)


def test_torch_grad_scaler_refuses_growth_to_inf():
    kw = {"growth_interval": 1, "growth_factor": 2**4, "init_scale": 1e38}
    scales = []
    for sc in _amp_pair(**kw):
        model = torch.nn.Linear(5, 1)
        opt = torch.optim.Adam(model.parameters())
        torch.manual_seed(0)
        x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
        sc.scale(((model(x) - y) ** 2).mean()).backward()
        sc.step(opt)
        sc.update()
        scales.append(sc.get_scale())
    assert scales[0] == scales[1]
    assert scales[1] != float("inf") and scales[1] == scales[1]


def test_factor_setters_change_the_trajectory_like_torch():
    def run(sc):
        p, opt = _one_param()
        out = _amp_steps(sc, p, opt, {2}, 4)
        sc.set_growth_factor(3.0)
        sc.set_backoff_factor(0.125)
        sc.set_growth_interval(1)
        return out + _amp_steps(sc, p, opt, {6}, 5, start=4)

    _assert_same_run(run(torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)),
                     run(TorchGradScaler("cpu", init_scale=64.0, growth_interval=2)))
    sc = GradScaler(init_scale=64.0, steps_per_increase=2)
    sc.set_growth_factor(3.0)
    sc.set_backoff_factor(0.125)
    sc.set_growth_interval(1)
    assert (sc.get_growth_factor(), sc.get_backoff_factor(), sc.get_growth_interval()) == (
        3.0, 0.125, 1)
    assert (sc.config.growth, sc.config.backoff, sc.config.growth_interval) == (3.0, 0.125, 1)
    for setter, bad in ((sc.set_growth_factor, 1.0), (sc.set_backoff_factor, 1.5),
                        (sc.set_growth_interval, 0)):
        with pytest.raises(ValueError):
            setter(bad)
    assert (sc.get_growth_factor(), sc.get_backoff_factor(), sc.get_growth_interval()) == (
        3.0, 0.125, 1)


def test_grad_scaler_checkpoint_restores_factors_and_interval():
    """The growth 4 / interval 2 checkpoint resumes with growth 4 / interval 2, whatever the
    resuming scaler was built with (DCP keeps only tensors: the config then carries them)."""
    kw = {"initial_loss_scale": 2.0**10, "steps_per_increase": 2, "policy": "keras"}
    src = GradScaler(config=DLSConfig(growth_factor=4.0, backoff_factor=0.25, **kw))
    p, opt = _one_param()
    _train_param(src, p, opt, bad={1}, steps=3)
    for sd in (roundtrip(src.state_dict()),
               {k: v for k, v in src.state_dict().items() if isinstance(v, torch.Tensor)
                or k == "config"}):
        dst = GradScaler(config=DLSConfig(policy="keras", initial_loss_scale=8.0))
        dst.load_state_dict(sd)
        assert (dst.get_growth_factor(), dst.get_backoff_factor(), dst.get_growth_interval()) == (
            4.0, 0.25, 2)
        assert float(dst.get_scale()) == float(src.get_scale())
        # and it continues exactly as the source does
        a, b = copy.deepcopy(src), dst
        pa, oa = _one_param(1)
        pb, ob = _one_param(1)
        _train_param(a, pa, oa, bad={4}, steps=6)
        _train_param(b, pb, ob, bad={4}, steps=6)
        assert float(a.get_scale()) == float(b.get_scale())
        assert torch.equal(pa, pb)


def _train_param(scaler, p, opt, bad, steps):
    for i in range(steps):
        opt.zero_grad()
        scaler.scale((p * torch.arange(1.0, 5.0)).sum()).backward()
        if i in bad:
            p.grad[0] = float("nan")
        scaler.step(opt)
        scaler.update()


class _StepWithExtras(torch.optim.SGD):
    """An optimizer whose step takes extra arguments and returns a value."""

    tags: list = []

    def step(self, closure=None, *, tag=None):
        self.tags.append(tag)
        loss = super().step(closure)
        return ("stepped", tag, loss)


def test_torch_grad_scaler_step_returns_and_forwards_like_torch():
    for sc in _amp_pair(init_scale=8.0):
        p, _ = _one_param()
        opt = _StepWithExtras([p], lr=0.1)

        def closure():
            return torch.tensor(5.0)

        sc.scale(p.sum()).backward()
        out = sc.step(opt, closure, tag="x")
        assert out == ("stepped", "x", torch.tensor(5.0))
        sc.update()
        sc.scale(p.sum()).backward()
        p.grad[0] = float("inf")
        assert sc.step(opt, tag="y") is None  # skipped: optimizer.step is not called
        sc.update()
        assert sc.get_scale() == 4.0 and isinstance(sc.get_scale(), float)
        with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
            sc.step(opt, closure=closure)


def test_grad_scaler_step_forwards_arguments_and_refuses_closures():
    p, _ = _one_param()
    opt = _StepWithExtras([p], lr=0.1)
    opt.tags = []
    sc = GradScaler(init_scale=8.0)
    sc.scale(p.sum()).backward()
    assert bool(sc.step(opt, tag="kept"))
    sc.update()
    assert opt.tags == ["kept"]
    sc.scale(p.sum()).backward()
    with pytest.raises(RuntimeError, match="closures are not supported"):
        sc.step(opt, lambda: torch.tensor(1.0))


def test_torch_grad_scaler_call_order_errors_like_torch():
    for sc in _amp_pair():
        p, opt = _one_param()
        p.grad = torch.ones_like(p)
        for call in (functools.partial(sc.step, opt), functools.partial(sc.unscale_, opt),
                     sc.update):
            with pytest.raises(AssertionError, match="did not use scaler.scale"):
                call()
        sc.scale(p.sum())
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            sc.update()
        sc.unscale_(opt)
        with pytest.raises(RuntimeError, match="already been called on this optimizer"):
            sc.unscale_(opt)
        sc.step(opt)
        with pytest.raises(RuntimeError, match="after step"):
            sc.unscale_(opt)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
            sc.step(opt)
        with pytest.raises(AssertionError, match="new_scale should be"):
            sc.update(torch.ones(2))
        sc.update(16.0)
        assert sc.get_scale() == 16.0
    for bad in ((1.0, 0.5), (2.0, 1.0)):
        with pytest.raises(AssertionError, match="factor must be"):
            TorchGradScaler("cpu", growth_factor=bad[0], backoff_factor=bad[1])


def test_torch_grad_scaler_sparse_gradients_like_torch():
    def run(sc):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        for i in range(5):
            opt.zero_grad()
            sc.scale(emb(torch.tensor([1, 4, 4, 7])).pow(2).sum()).backward()
            assert emb.weight.grad.is_sparse
            if i == 2:
                emb.weight.grad._values()[0, 0] = float("inf")
            sc.step(opt)
            sc.update()
        return sc.get_scale(), emb.weight.detach().clone()

    (s_ref, w_ref), (s_mine, w_mine) = (run(sc) for sc in _amp_pair(init_scale=2.0**8,
                                                                       growth_interval=2))
    assert s_ref == s_mine and torch.equal(w_ref, w_mine)
    with pytest.raises(RuntimeError, match="sparse"):  # dlspass.GradScaler refuses them
        sc = GradScaler()
        emb = torch.nn.Embedding(4, 2, sparse=True)
        sc.scale(emb(torch.tensor([1])).sum()).backward()
        sc.unscale_(torch.optim.SGD(emb.parameters(), lr=0.1))


def test_torch_grad_scaler_fp16_gradients_raise_like_torch():
    for sc in _amp_pair():
        p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
        opt = torch.optim.SGD([p], lr=1.0)
        sc.scale(torch.ones(()))
        p.grad = torch.ones(3, dtype=torch.float16)
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            sc.unscale_(opt)


def test_torch_grad_scaler_guard_keeps_parameters_finite_where_torch_does_not():
    """The one deliberate difference: below a scale of 1 unscaling can overflow a finite
    gradient; torch steps with inf, TorchGradScaler skips that step (with a warning) and
    keeps torch's scale trajectory."""
    results = []
    for sc in _amp_pair(init_scale=2.0**-20, growth_interval=1):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=1.0)
        sc.scale(p.sum()).backward()
        p.grad = torch.tensor([2.0**110, 1.0])  # finite; times 2**20 it is inf in float32
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            out = sc.step(opt)
        sc.update()
        results.append((sc.get_scale(), sc.state_dict()["_growth_tracker"], p.detach().clone(),
                        out, [str(w.message) for w in rec]))
    (s_ref, t_ref, p_ref, _, _), (s_mine, t_mine, p_mine, out, msgs) = results
    assert (s_ref, t_ref) == (s_mine, t_mine) == (2.0**-19, 0)  # torch grew: no overflow seen
    assert not torch.isfinite(p_ref).all()  # torch wrote -inf into the parameter
    assert torch.equal(p_mine, torch.zeros(2)) and out is None
    assert any("no inf/NaN reaches the parameters" in m for m in msgs)


def test_torch_grad_scaler_sync_free_forms_and_held_scheduler():
    sc = TorchGradScaler("cpu", init_scale=8.0)
    p, opt = _one_param()
    sched = hold_scheduler_on_skip(torch.optim.lr_scheduler.StepLR(opt, step_size=1), sc)
    for bad in (True, False):
        sc.scale(p.sum()).backward()
        if bad:
            p.grad[0] = float("nan")
        sc.step(opt)
        sc.update()
        assert bool(sc.found_inf) == bad and bool(sc.stepped(opt)) == (not bad)
        assert sched.step() == (not bad)
        opt.zero_grad()
    t = sc.get_scale_tensor()
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and float(t) == 4.0
    assert int(sc.get_num_skipped_steps()) == 1 and sched.held_steps == 1


def test_torch_grad_scaler_documented_differences():
    """The rows of docs/TORCH_AMP_DIFFERENCES.md that are not shown elsewhere."""
    # get_scale() before the first scale(): the float32 value (torch: the number passed)
    ref, mine = _amp_pair(init_scale=0.1)
    assert ref.get_scale() == 0.1
    assert mine.get_scale() == float(torch.tensor(0.1, dtype=torch.float32)) != 0.1
    ref.scale(torch.ones(()))
    assert ref.get_scale() == mine.get_scale()  # equal once torch holds it in float32 too
    # invalid settings raise (torch accepts them silently)
    for setter, bad in ((mine.set_growth_factor, 1.0), (mine.set_backoff_factor, 0.0),
                        (mine.set_growth_interval, 0)):
        with pytest.raises(ValueError):
            setter(bad)
        getattr(ref, setter.__name__)(bad)  # torch: no check
    with pytest.raises(ValueError, match="steps_per_increase"):
        TorchGradScaler("cpu", growth_interval=0)
    # a disabled scaler still answers the getters (torch's raise AttributeError)
    off_ref, off_mine = _amp_pair(enabled=False, growth_factor=3.0)
    with pytest.raises(AttributeError):
        off_ref.get_growth_factor()
    assert off_mine.get_growth_factor() == 3.0
    # and it is a torch.amp.GradScaler for isinstance checks
    assert isinstance(mine, torch.amp.GradScaler)


def test_grad_scaler_documented_differences():
    """dlspass.GradScaler rows of docs/TORCH_AMP_DIFFERENCES.md not shown elsewhere."""
    import pickle

    p, opt = _one_param()
    sc = GradScaler(init_scale=8.0)
    p.grad = torch.ones_like(p)
    # no scale() needed first (torch raises AssertionError), and pickling works mid-iteration
    sc.unscale_(opt)
    assert torch.equal(p.grad, torch.full_like(p, 1 / 8))
    pickle.loads(pickle.dumps(sc))
    assert bool(sc.step(opt))
    sc.update()
    assert not isinstance(sc, torch.amp.GradScaler)
    assert isinstance(sc.get_scale(), torch.Tensor)
