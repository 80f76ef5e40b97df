"""torch.amp.GradScaler's behaviours, with torch.amp.GradScaler as the control in every test.

Each test runs one scenario twice from the same seed: once with ``torch.amp.GradScaler("cpu")``
(the control) and once with the scaler under test, built by one of `FACTORIES`: the control's
own class (the scenario must hold for torch itself), ``dlspass.TorchGradScaler`` and
``dlspass.GradScaler(config=DLSConfig(policy="torch", ...))``. Only public API is read (scales
via ``get_scale()``, the growth tracker via ``state_dict()``), so no case has to be skipped for
a scaler that lacks torch.amp's private attributes; where a dlspass scaler differs from torch by
design (docs/TORCH_AMP_DIFFERENCES.md), the test asserts that documented behaviour instead.

Tolerances. All scales here are powers of two, so ``g * (1/S)``, ``g / S`` and a backward of
``S * loss`` round exactly as their unscaled counterparts (no result is subnormal or
overflows). Both sides of every control comparison therefore run the same floating-point ops on
the same values in the same order, whichever way each scaler unscales, and are compared bit for
bit (`assert_bit_equal`: zero tolerance, NaN positions included). The only comparison across
different kernels (a fused optimizer against its for-loop implementation) has its bound derived
next to it.

Helpers that the installed torch wheel ships in ``torch.testing._internal`` are imported (the
optimizer database `optim_db`), not copied.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import dlspass
from dlspass.config import DLSConfig


def _policy_torch(device: str = "cpu", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                  backoff_factor: float = 0.5, growth_interval: int = 2000,
                  enabled: bool = True) -> dlspass.GradScaler:
    """``dlspass.GradScaler`` with the torch policy, behind torch.amp's constructor arguments
    (``device`` is unused: the state follows the first scaled loss)."""
    return dlspass.GradScaler(config=DLSConfig(
        policy="torch", loss_scale="dynamic" if enabled else None, initial_loss_scale=init_scale,
        growth_factor=growth_factor, backoff_factor=backoff_factor,
        steps_per_increase=growth_interval))


FACTORIES: dict[str, Callable[..., Any]] = {
    "torch.amp": torch.amp.GradScaler,
    "TorchGradScaler": dlspass.TorchGradScaler,
    "GradScaler-policy-torch": _policy_torch,
}
POLICY_TORCH = "GradScaler-policy-torch"

# The scenario's settings: a growth every clean iteration, so that any slip in the growth or
# backoff bookkeeping shows in the scale after a few iterations.
KW = {"init_scale": 128.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1}
ITERS = 5
POISONED = 2  # the iteration whose gradients get an inf after backward
# 128 doubled on the clean iterations 0, 1, 3, 4 and halved on 2
SCALES_AFTER = [256.0, 512.0, 256.0, 512.0, 1024.0]


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """One intra-op thread while this module runs: its tensors are far below torch's parallel
    grain size, so a second thread only adds hand-offs, which on a loaded CPU cost a fused
    optimizer step or a float16 matmul about 100 times its work. Control and subject run under
    the same setting; the previous count is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=list(FACTORIES))
def factory(request: pytest.FixtureRequest) -> tuple[str, Callable[..., Any]]:
    """(name, constructor) of the scaler under test."""
    return request.param, FACTORIES[request.param]


# ---- helpers -------------------------------------------------------------------------------------
def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Zero-tolerance equality (same dtype, same bits up to NaN payloads, NaNs where NaNs)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def scale_of(scaler: Any) -> float:
    """The scale as a float: torch.amp and TorchGradScaler return one, GradScaler a 0-d tensor."""
    return float(scaler.get_scale())


def net(seed: int = 0) -> torch.nn.Sequential:
    """A small two-layer net; ``[2]`` is the layer whose gradient gets poisoned."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def batches(n: int = ITERS, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x).float(), y)


def poison(model: torch.nn.Sequential) -> None:
    with torch.no_grad():
        model[2].weight.grad[0, 1] = float("inf")


def finish_iteration(scaler: Any, model: torch.nn.Sequential, opt: torch.optim.Optimizer,
                     poisoned: bool, skip: bool) -> None:
    """An iteration's end after backward: plain training (no scaler) steps unless ``skip``;
    with a scaler, the gradient is poisoned on the poisoned iteration, then step and update."""
    if scaler is None:
        if not skip:
            opt.step()
        return
    if poisoned:
        poison(model)
    scaler.step(opt)
    scaler.update()


def snapshot(models: list[torch.nn.Module], opts: list[torch.optim.Optimizer]) -> list[Any]:
    """Parameters, gradients and optimizer state, copied (tensors kept as tensors)."""
    out: list[Any] = []
    for m in models:
        for p in m.parameters():
            out.append(p.detach().clone())
            out.append(None if p.grad is None else p.grad.detach().clone())
    for o in opts:
        out.append(copy.deepcopy(o.state_dict()["state"]))
    return out


def assert_same_snapshot(a: list[Any], b: list[Any], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if isinstance(x, dict):  # optimizer state: {param index: {name: value}}
            assert x.keys() == y.keys(), (what, i)
            for k in x:
                assert x[k].keys() == y[k].keys(), (what, i, k)
                for name in x[k]:
                    u, v = x[k][name], y[k][name]
                    if isinstance(u, torch.Tensor):
                        # a fused optimizer keeps `step` as a 1-element tensor, others 0-d
                        assert_bit_equal(u.reshape(-1), v.reshape(-1), f"{what} state {k}.{name}")
                    else:
                        assert u == v, (what, i, k, name)
        elif x is None or y is None:
            assert x is None and y is None, (what, i)
        else:
            assert_bit_equal(x, y, f"{what} tensor {i}")


Recipe = Callable[..., None]
"""One training iteration: ``recipe(scaler, models, opts, x, y, poisoned)`` with ``scaler``
None for the plain run (no scaling; the caller skips the step of a poisoned iteration)."""


def run_recipe(recipe: Recipe, scaler: Any, n_models: int = 1,
               opt_ctor: Callable[..., torch.optim.Optimizer] | None = None
               ) -> tuple[list[Any], list[float]]:
    """Train fresh models with ``recipe``; returns the final snapshot and the scale after each
    iteration (empty for the plain run)."""
    models = [net(seed) for seed in range(n_models)]
    ctor = opt_ctor or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    opts = [ctor(m.parameters()) for m in models]
    scales = []
    for i, (x, y) in enumerate(batches()):
        poisoned = i == POISONED and scaler is not None and scaler.is_enabled()
        recipe(scaler, models, opts, x, y, poisoned, skip=i == POISONED)
        if scaler is not None:
            scales.append(scale_of(scaler))
    return snapshot(models, opts), scales


def check_against_control(factory: tuple[str, Callable[..., Any]], recipe: Recipe, *,
                          enabled: bool, n_models: int = 1, plain_is_exact: bool = True,
                          opt_ctor: Callable[..., torch.optim.Optimizer] | None = None) -> None:
    """The scenario with the control and with the scaler under test: the same parameters,
    gradients, optimizer state and scale after every iteration, bit for bit, and the scale
    trajectory of torch's rule. With ``plain_is_exact`` (no autocast, no op whose result
    depends on the scale beyond a power-of-two factor), also the same as plain training that
    skips the poisoned iteration (or steps every iteration when the scaler is disabled)."""
    _, make = factory
    ref, ref_scales = run_recipe(recipe, torch.amp.GradScaler("cpu", enabled=enabled, **KW),
                                 n_models, opt_ctor)
    mine, mine_scales = run_recipe(recipe, make("cpu", enabled=enabled, **KW), n_models, opt_ctor)
    assert_same_snapshot(ref, mine, "scaler under test vs torch.amp")
    assert mine_scales == ref_scales == (SCALES_AFTER if enabled else [1.0] * ITERS)
    if plain_is_exact:
        plain, _ = run_recipe(recipe if enabled else _plain_steps_all(recipe), None, n_models,
                              opt_ctor)
        assert_same_snapshot(ref, plain, "torch.amp vs plain training")


def _plain_steps_all(recipe: Recipe) -> Recipe:
    def steps_all(scaler, models, opts, x, y, poisoned, skip):
        recipe(scaler, models, opts, x, y, poisoned, skip=False)
    return steps_all


# ---- pickling --------------------------------------------------------------------------------
def test_pickled_scaler_keeps_its_settings_and_trajectory(factory):
    """A scaler pickled before its first scale(), after it, and between iterations comes back
    with its scale, factors and interval, and carries on exactly as the control does."""
    name, make = factory
    settings = {"init_scale": 4.0, "growth_factor": 8.0, "backoff_factor": 0.25,
                "growth_interval": 2}
    control, mine = torch.amp.GradScaler("cpu", **settings), make("cpu", **settings)
    mine = pickle.loads(pickle.dumps(mine))  # before any scale(): nothing set up yet
    assert (scale_of(mine), mine.get_growth_factor(), mine.get_backoff_factor(),
            mine.get_growth_interval(), mine.is_enabled()) == (4.0, 8.0, 0.25, 2, True)
    pa, pb = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    oa, ob = torch.optim.SGD([pa], lr=0.5), torch.optim.SGD([pb], lr=0.5)
    w = torch.tensor([1.0, -2.0, 3.0, 0.5])
    for i in range(7):
        for sc, p, o in ((control, pa, oa), (mine, pb, ob)):
            o.zero_grad()
            sc.scale((p * w).sum()).backward()
            if i in (1, 4):
                p.grad[2] = float("nan")
            sc.step(o)
            sc.update()
        mine = pickle.loads(pickle.dumps(mine))  # between iterations, as a checkpoint would
        assert scale_of(mine) == scale_of(control), i
        assert mine.state_dict()["_growth_tracker"] == control.state_dict()["_growth_tracker"], i
        assert_bit_equal(pb, pa, f"parameter after iteration {i}")
    # 4 -> nan: 1 -> 2 clean: 8 (grow after 2) -> clean, nan: 2 -> 2 clean: 16
    assert scale_of(control) == 16.0
    # and the unpickled scaler scales with its value
    assert_bit_equal(mine.scale(torch.tensor([3.0])), torch.tensor([48.0]), "scaled after pickle")


# ---- unscaling ---------------------------------------------------------------------------------
def _grads_of_layouts(dtypes: list[torch.dtype], scale: float, seed: int) -> list[torch.Tensor]:
    """Scaled gradients of shape (4, 6), one per dtype, in three layouts: contiguous, a
    transpose (dense, not contiguous) and a strided slice (not dense). torch.amp sends dense
    ones to a multi-tensor kernel and the others to a per-tensor one."""
    g = torch.Generator().manual_seed(seed)
    vals = [(torch.randn(4, 6, generator=g, dtype=torch.float64) * scale).to(dt)
            for dt in dtypes]
    out = [vals[0], vals[1].t().contiguous().t(), torch.cat([vals[2], vals[2]], dim=1)[:, ::2]]
    assert not out[1].is_contiguous() and not out[2].is_contiguous()
    return out


UNSCALE_DTYPES = {
    "float32": [torch.float32] * 3,
    "float64": [torch.float64] * 3,
    # one optimizer, gradients of two dtypes: torch.amp groups them per dtype
    "mixed": [torch.float32, torch.float64, torch.float32],
}


@pytest.mark.parametrize("dtypes", list(UNSCALE_DTYPES))
def test_unscale_finds_inf_and_nan_in_any_gradient(factory, dtypes):
    """unscale_ divides every gradient by the scale and records an inf or NaN in any one of
    them (or in none): the unscaled gradients, the step taken or skipped and the scale after
    update() are the control's."""
    _, make = factory
    scale = 2.0**10
    shapes_dtypes = UNSCALE_DTYPES[dtypes]
    for bad_at in (None, 0, 1, 2):
        for bad in ("inf", "-inf", "nan"):
            results = []
            for sc in (torch.amp.GradScaler("cpu", init_scale=scale),
                       make("cpu", init_scale=scale)):
                params = [torch.nn.Parameter(torch.zeros(4, 6, dtype=dt))
                          for dt in shapes_dtypes]
                opt = torch.optim.SGD(params, lr=1.0)
                sc.scale(torch.ones(()))
                for p, g in zip(params, _grads_of_layouts(shapes_dtypes, scale, seed=3),
                                strict=True):
                    p.grad = g
                assert [p.grad.stride() for p in params] == [(6, 1), (1, 4), (12, 2)]
                if bad_at is not None:
                    params[bad_at].grad[1, 2] = float(bad)
                sc.unscale_(opt)
                unscaled = [p.grad.clone() for p in params]
                sc.step(opt)
                sc.update()
                results.append((unscaled, [p.detach().clone() for p in params], scale_of(sc)))
            (g_ref, p_ref, s_ref), (g_mine, p_mine, s_mine) = results
            what = f"{bad} in gradient {bad_at}"
            for a, b in zip(g_ref, g_mine, strict=True):
                assert_bit_equal(a, b, f"unscaled gradients, {what}")
            for a, b in zip(p_ref, p_mine, strict=True):
                assert_bit_equal(a, b, f"parameters, {what}")
            assert s_mine == s_ref == (scale / 2 if bad_at is not None else scale), what
            if bad_at is None:
                # an independent check of the control: the exact quotient (a power-of-two scale)
                for g, ref in zip(g_ref, _grads_of_layouts(shapes_dtypes, scale, seed=3),
                                  strict=True):
                    assert_bit_equal(g, ref / scale, "control's unscaled gradient")
            else:
                # skipped: the parameters are untouched
                assert all(torch.equal(p, torch.zeros_like(p)) for p in p_ref), what


def test_float64_gradients_beyond_float32_range_step_as_torch(factory):
    """A float64 gradient whose unscaled value float32 cannot hold (1e40) is finite: torch.amp
    unscales it in float64 and steps; so must every scaler (a float32 round trip made it inf
    and skipped the step). Power-of-two scale: the quotient is exact, compared bit for bit."""
    _, make = factory
    scale = 2.0**10
    grad = torch.tensor([1e40, -3e-300, 1.0 + 2.0**-40], dtype=torch.float64)
    results = []
    for sc in (torch.amp.GradScaler("cpu", init_scale=scale), make("cpu", init_scale=scale)):
        p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        opt = torch.optim.SGD([p], lr=1.0)
        sc.scale(torch.ones((), dtype=torch.float64))
        p.grad = grad * scale
        sc.unscale_(opt)
        unscaled = p.grad.clone()
        sc.step(opt)
        sc.update()
        results.append((unscaled, p.detach().clone(), scale_of(sc)))
    (g_ref, p_ref, s_ref), (g_mine, p_mine, s_mine) = results
    assert_bit_equal(g_ref, grad, "control's unscaled gradient")
    assert_bit_equal(g_mine, g_ref, "unscaled float64 gradient")
    assert_bit_equal(p_mine, p_ref, "parameters after the step")
    assert torch.equal(p_ref, -grad) and s_mine == s_ref == scale


def test_unscale_of_float16_gradients(factory):
    """float16 gradients: torch.amp refuses them in unscale_ (ValueError) and TorchGradScaler
    with it; dlspass.GradScaler unscales them in float32 and writes float16 back (documented)."""
    name, make = factory
    for sc in (torch.amp.GradScaler("cpu", init_scale=8.0), make("cpu", init_scale=8.0)):
        p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float16))
        opt = torch.optim.SGD([p], lr=1.0)
        sc.scale(torch.ones(()))
        p.grad = torch.tensor([8.0, -24.0, 0.5, 6e4, 2.0**-20], dtype=torch.float16)
        if isinstance(sc, torch.amp.GradScaler):
            with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
                sc.unscale_(opt)
        else:
            assert name == POLICY_TORCH
            sc.unscale_(opt)
            expect = torch.tensor([1.0, -3.0, 0.0625, 7500.0, 2.0**-23], dtype=torch.float16)
            assert_bit_equal(p.grad, expect, "float16 gradient unscaled by 8")


# ---- the update kernel ---------------------------------------------------------------------
def _update_rule(scale: float, tracker: int, found_inf: bool, growth: float, backoff: float,
                 interval: int) -> tuple[float, int]:
    """torch.amp's update rule written out: back off and reset on an overflow; otherwise count
    the clean iteration and grow (resetting the count) once it reaches the interval."""
    if found_inf:
        return scale * backoff, 0
    tracker += 1
    if tracker == interval:
        return scale * growth, 0
    return scale, tracker


def test_update_scale_kernel_follows_the_rule():
    """torch._amp_update_scale_ alone (TorchGradScaler.update calls it) against the rule written
    out, over a pattern of clean and overflowing iterations; powers of two keep every product
    exact in float32, so the comparison is exact."""
    growth, backoff, interval = 4.0, 0.125, 3
    scale = torch.full((1,), 2.0**6)
    tracker = torch.zeros((1,), dtype=torch.int32)
    expect_scale, expect_tracker = 2.0**6, 0
    pattern = [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    for i, bad in enumerate(pattern):
        found_inf = torch.full((1,), float(bad))
        torch._amp_update_scale_(scale, tracker, found_inf, growth, backoff, interval)
        expect_scale, expect_tracker = _update_rule(expect_scale, expect_tracker, bool(bad),
                                                    growth, backoff, interval)
        assert (scale.item(), tracker.item()) == (expect_scale, expect_tracker), i
    assert expect_scale == 2.0**6 * 4**3 * 0.125**4  # three growths, four backoffs


def test_scale_trajectory_follows_the_update_rule(factory):
    """The scaler under test moves its scale and growth tracker as the rule does."""
    _, make = factory
    growth, backoff, interval = 2.0, 0.25, 2
    sc = make("cpu", init_scale=2.0**8, growth_factor=growth, backoff_factor=backoff,
              growth_interval=interval)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    expect_scale, expect_tracker = 2.0**8, 0
    for i, bad in enumerate([0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]):
        opt.zero_grad()
        sc.scale(p.sum()).backward()
        if bad:
            p.grad[1] = float("inf")
        sc.step(opt)
        sc.update()
        expect_scale, expect_tracker = _update_rule(expect_scale, expect_tracker, bool(bad),
                                                    growth, backoff, interval)
        assert scale_of(sc) == expect_scale, i
        assert sc.state_dict()["_growth_tracker"] == expect_tracker, i


# ---- sparse gradients -------------------------------------------------------------------------
def _sparse_grad(values: list[float], dtype: torch.dtype, scale: float) -> torch.Tensor:
    """An uncoalesced COO gradient of shape (3, 4): indices (0, 1) and (2, 3) appear twice."""
    idx = torch.tensor([[0, 2, 0, 1, 2], [1, 3, 1, 0, 3]])
    return torch.sparse_coo_tensor(idx, torch.tensor(values) * scale, (3, 4), dtype=dtype,
                                   check_invariants=True)


SPARSE_CASES = {
    "finite": ([1.0, -2.0, 0.5, 4.0, 3.0], False),
    "inf": ([1.0, float("inf"), 0.5, 4.0, 3.0], True),
    "nan": ([1.0, -2.0, float("nan"), 4.0, 3.0], True),
}


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_unscale_of_sparse_gradients(factory, case):
    """Sparse COO gradients are unscaled on their values and an inf/NaN among them is found,
    as the control does; dlspass.GradScaler refuses sparse gradients (documented)."""
    name, make = factory
    values, has_bad = SPARSE_CASES[case]
    scale = 16.0
    if name == POLICY_TORCH:
        sc = make("cpu", init_scale=scale)
        p = torch.nn.Parameter(torch.zeros(3, 4))
        sc.scale(torch.ones(()))
        p.grad = _sparse_grad(values, torch.float32, scale)
        with pytest.raises(RuntimeError, match="sparse gradients are not supported"):
            sc.unscale_(torch.optim.SGD([p], lr=1.0))
        return
    results = []
    for sc in (torch.amp.GradScaler("cpu", init_scale=scale), make("cpu", init_scale=scale)):
        p = torch.nn.Parameter(torch.zeros(3, 4))
        opt = torch.optim.SGD([p], lr=1.0)
        sc.scale(torch.ones(()))
        p.grad = _sparse_grad(values, torch.float32, scale)
        sc.unscale_(opt)
        unscaled = p.grad.clone()
        sc.step(opt)
        sc.update()
        results.append((unscaled, p.detach().clone(), scale_of(sc)))
    (g_ref, p_ref, s_ref), (g_mine, p_mine, s_mine) = results
    assert g_mine.is_sparse and not g_mine.is_coalesced()  # unscaled where it is
    assert_bit_equal(g_mine._indices(), g_ref._indices(), "indices")
    assert_bit_equal(g_mine._values(), g_ref._values(), "unscaled values")
    assert_bit_equal(p_mine, p_ref, "parameter")
    assert s_mine == s_ref == (scale / 2 if has_bad else scale)
    if not has_bad:
        assert_bit_equal(g_ref._values(), torch.tensor(values), "control: values / scale")
        dense = torch.zeros(3, 4)
        dense[0, 1], dense[2, 3], dense[1, 0] = 1.5, 1.0, 4.0  # duplicates summed
        assert_bit_equal(p_ref, -dense, "control: one SGD step, lr 1")


@pytest.mark.parametrize("name", ["torch.amp", "TorchGradScaler"])
def test_float16_sparse_duplicates_overflow_only_coalesced(name):
    """A float16 sparse gradient whose duplicated entries sum past float16's maximum (65504)
    overflows only once coalesced: torch.amp's unscaling coalesces float16 sparse gradients
    first and so finds it. Reached through the private ``_unscale_grads_`` (the one path that
    takes float16 gradients), which TorchGradScaler inherits from torch; dlspass.GradScaler
    refuses sparse gradients in any dtype (`test_unscale_of_sparse_gradients` asserts it), so
    it is not run here."""
    make = FACTORIES[name]
    for values, expect in (([4e4, 1.0, 4e4, 2.0, 3.0], 1.0), ([1e4, 1.0, 1e4, 2.0, 3.0], 0.0)):
        found = []
        for sc in (torch.amp.GradScaler("cpu"), make("cpu")):
            p = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.float16))
            opt = torch.optim.SGD([p], lr=1.0)
            p.grad = _sparse_grad(values, torch.float16, 1.0)
            assert torch.isfinite(p.grad._values()).all()  # finite before coalescing
            per_device = sc._unscale_grads_(opt, torch.full((), 1.0), torch.zeros(()), True)
            found.append(float(sum(v.sum() for v in per_device.values())))
        assert found == [expect, expect], values


# ---- state_dict ----------------------------------------------------------------------------
@pytest.mark.parametrize("touch_first", [False, True])
def test_state_dict_round_trip(factory, touch_first):
    """A scaler with other settings (already used, or not yet) that loads another's state_dict
    takes its scale, tracker, factors and interval and continues as the control does; the dicts
    cross between the control and the scaler under test both ways."""
    _, make = factory
    src_kw = {"init_scale": 2.0**5, "growth_factor": 4.0, "backoff_factor": 0.5,
              "growth_interval": 3}
    other_kw = {"init_scale": 6.0, "growth_factor": 7.0, "backoff_factor": 0.8,
                "growth_interval": 1}
    control, src = torch.amp.GradScaler("cpu", **src_kw), make("cpu", **src_kw)
    pattern = [0, 1, 0, 0, 0, 0, 1, 0, 0]

    def advance(sc, bads):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        for bad in bads:
            opt.zero_grad()
            sc.scale(p.sum()).backward()
            if bad:
                p.grad[0] = float("nan")
            sc.step(opt)
            sc.update()

    advance(control, pattern[:4])
    advance(src, pattern[:4])
    assert control.state_dict()["_growth_tracker"] == 2  # mid-interval: the tracker matters
    for dst, from_ in ((make("cpu", **other_kw), src), (make("cpu", **other_kw), control),
                       (torch.amp.GradScaler("cpu", **other_kw), src)):
        if touch_first:
            dst.scale(torch.ones(()))  # the scale already set up before loading
        dst.load_state_dict(pickle.loads(pickle.dumps(from_.state_dict())))
        assert (scale_of(dst), dst.get_growth_factor(), dst.get_backoff_factor(),
                dst.get_growth_interval()) == (scale_of(control), 4.0, 0.5, 3)
        assert dst.state_dict()["_growth_tracker"] == 2
        ref = copy.deepcopy(control)
        advance(ref, pattern[4:])
        advance(dst, pattern[4:])
        assert scale_of(dst) == scale_of(ref) == 2.0**5 * 0.5 * 4.0 * 0.5, type(dst)


# ---- training loops against the control ---------------------------------------------------
def _opt_variants() -> Iterator[Any]:
    """Every optimizer of torch's optimizer database that a scaler can drive on dense CPU
    parameters, in each implementation it has on CPU. Left out: LBFGS (its step needs a
    closure, which a dynamic scaler refuses), SparseAdam (sparse gradients only) and Muon
    (2-D parameters only)."""
    for info in optim_db:
        if info.step_requires_closure or info.only_supports_sparse_grads:
            continue
        if info.optim_cls.__name__ == "Muon":
            continue
        impls = ["for-loop"]
        if "foreach" in info.supported_impls:
            impls.append("foreach")
        if "fused" in info.supported_impls and "cpu" in info.supports_fused_on:
            impls.append("fused")
        for impl in impls:
            yield pytest.param(info, impl, id=f"{info.optim_cls.__name__}-{impl}")


IMPL_KW = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _optim_kwargs(info: Any, impl: str) -> list[dict[str, Any]]:
    """The database's CPU configurations of ``info`` (weight decay, momentum, maximize, ...)
    with the implementation chosen; ``lr`` small enough that no run diverges."""
    out = []
    for inp in info.optim_inputs_func(device="cpu"):
        kw = {k: v for k, v in inp.kwargs.items()
              if k not in ("foreach", "fused", "differentiable", "capturable")}
        kw.update(IMPL_KW[impl])
        kw.setdefault("lr", 0.01)
        out.append(kw)
    return out


def forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output under float16 autocast (checked)."""
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert out.dtype == torch.float16  # the forward really ran in float16
    return out


def _autocast_recipe(scaler, models, opts, x, y, poisoned, skip):
    (model,), (opt,) = models, opts
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(forward(model, x).float(), y)
    scaler.scale(loss).backward()
    finish_iteration(scaler, model, opt, poisoned, skip)


@pytest.mark.parametrize(("info", "impl"), list(_opt_variants()))
def test_autocast_training_with_every_optimizer(factory, info, impl):
    """Mixed-precision training (float16 autocast) with an overflow on one iteration, for every
    optimizer
    configuration of torch's database: parameters, gradients, optimizer state and scale equal
    the control's bit for bit (same ops in the same order on both sides), and the poisoned
    iteration leaves parameters and state untouched."""
    for kw in _optim_kwargs(info, impl):
        def ctor(ps, kw=kw):
            return info.optim_cls(ps, **kw)

        def recipe(scaler, models, opts, x, y, poisoned, skip, kw=kw):
            before = snapshot(models, opts)
            _autocast_recipe(scaler, models, opts, x, y, poisoned, skip)
            if poisoned:
                after = snapshot(models, opts)
                # parameters (even slots) and optimizer state (last) are as before the step
                assert_same_snapshot(before[0::2], after[0::2], f"skipped step, {kw}")

        try:
            check_against_control(factory, recipe, enabled=True, plain_is_exact=False,
                                  opt_ctor=ctor)
        except AssertionError as e:
            raise AssertionError(f"{info.optim_cls.__name__}({kw}): {e}") from e


@pytest.mark.parametrize("enabled", [True, False])
def test_autocast_training_disabled_scaler_changes_nothing(factory, enabled):
    """enabled=False: the same user code trains as if no scaler were there (scale 1, every
    iteration steps), for the control and the scaler under test alike."""
    check_against_control(factory, _autocast_recipe, enabled=enabled, plain_is_exact=False)
    if not enabled:
        ref, _ = run_recipe(_autocast_recipe, torch.amp.GradScaler("cpu", enabled=False))
        plain, _ = run_recipe(_plain_steps_all(_autocast_plain), None)
        assert_same_snapshot(ref, plain, "disabled scaler vs no scaler")


def _autocast_plain(scaler, models, opts, x, y, poisoned, skip):
    (model,), (opt,) = models, opts
    opt.zero_grad()
    torch.nn.functional.mse_loss(forward(model, x).float(), y).backward()
    if not skip:
        opt.step()


@pytest.mark.parametrize(("opt_name", "impl", "graph_partition"), [
    *((o, i, False) for o in ("SGD", "Adam", "AdamW") for i in ("for-loop", "foreach", "fused")),
    ("SGD", "for-loop", True), ("Adam", "fused", True)])
def test_gradients_broken_after_unscale_reach_the_parameters(factory, opt_name, impl,
                                                             graph_partition):
    """Gradients checked finite by unscale_ and then overwritten with inf/NaN before step():
    the overflow check already ran, so the optimizer steps and the parameters turn non-finite,
    exactly as under the control. ``graph_partition`` sets inductor's option of that name, which
    must not change eager training."""
    import torch._inductor.config as inductor_config

    ctor = getattr(torch.optim, opt_name)

    def recipe(scaler, models, opts, x, y, poisoned, skip):
        (model,), (opt,) = models, opts
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(forward(model, x).float(), y)).backward()
        scaler.unscale_(opt)
        for j, p in enumerate(model.parameters()):
            p.grad.fill_(float("nan") if j % 2 else float("inf"))
        scaler.step(opt)
        scaler.update()

    _, make = factory
    with inductor_config.patch("graph_partition", graph_partition):
        results = [run_recipe(recipe, sc, opt_ctor=lambda ps: ctor(ps, lr=0.01, **IMPL_KW[impl]))
                   for sc in (torch.amp.GradScaler("cpu", init_scale=128.0),
                              make("cpu", init_scale=128.0))]
    (ref, ref_scales), (mine, mine_scales) = results
    assert_same_snapshot(ref, mine, "scaler under test vs torch.amp")
    params = ref[0::2][:4]
    assert all(not torch.isfinite(p).all() for p in params)
    # the first step is taken (its overflow check ran before the gradients broke); from then on
    # the parameters are non-finite, so is every scaled gradient: back off on each iteration
    assert mine_scales == ref_scales == [128.0, 64.0, 32.0, 16.0, 8.0]


def test_growth_never_overflows_the_scale(factory):
    """A scale near float32's maximum is not grown to inf: the control keeps it, and so does the
    scaler under test, after a clean step."""
    _, make = factory
    kw = {"init_scale": 2.0**125, "growth_factor": 2.0**4, "growth_interval": 1}
    scales = []
    for sc in (torch.amp.GradScaler("cpu", **kw), make("cpu", **kw)):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # a loss small enough that its scaled gradients stay finite
        sc.scale(1e-36 * model(torch.ones(1, 3)).sum()).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        sc.step(opt)
        sc.update()
        scales.append(scale_of(sc))
    assert scales == [2.0**125, 2.0**125]


# ---- clipping, penalty, accumulation, several models -------------------------------------------
MAX_NORM = 0.25  # below the gradients' norm on most iterations: clipping acts


def _clip_recipe(separate_unscale: bool) -> Recipe:
    """Clip the gradients' norm to `MAX_NORM`: after ``unscale_``, or (without it) the still
    scaled gradients to the threshold times the scale."""
    def recipe(scaler, models, opts, x, y, poisoned, skip):
        (model,), (opt,) = models, opts
        opt.zero_grad()
        loss = loss_of(model, x, y)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if not skip:
                opt.step()
            return
        scaler.scale(loss).backward()
        if poisoned:
            poison(model)
        if separate_unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM,
                                           error_if_nonfinite=False)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM * scale_of(scaler),
                                           error_if_nonfinite=False)
        scaler.step(opt)
        scaler.update()
    return recipe


@pytest.mark.parametrize("enabled", [True, False])
def test_clipping_scaled_gradients(factory, enabled):
    """Clip before unscaling: equal to the control bit for bit. Not compared with plain
    training: clip_grad_norm_'s 1e-6 added to the norm does not scale with the loss scale."""
    check_against_control(factory, _clip_recipe(separate_unscale=False), enabled=enabled,
                          plain_is_exact=False)


@pytest.mark.parametrize("enabled", [True, False])
def test_clipping_after_separate_unscale(factory, enabled):
    """unscale_, clip, step: equal to the control and to plain clipped training bit for bit."""
    check_against_control(factory, _clip_recipe(separate_unscale=True), enabled=enabled)


def _penalty_recipe(scaler, models, opts, x, y, poisoned, skip):
    """A gradient-norm penalty: gradients of the scaled loss with create_graph, unscaled by hand
    with 1/scale, their norm added to the loss, then the scaled total backpropagated."""
    (model,), (opt,) = models, opts
    opt.zero_grad()
    loss = loss_of(model, x, y)
    params = list(model.parameters())
    if scaler is None:
        grads = torch.autograd.grad(loss, params, create_graph=True)
    else:
        inv = 1.0 / scale_of(scaler)
        grads = [g * inv for g in torch.autograd.grad(scaler.scale(loss), params,
                                                      create_graph=True)]
    total = loss + torch.sqrt(sum(g.pow(2).sum() for g in grads))
    (total if scaler is None else scaler.scale(total)).backward()
    finish_iteration(scaler, model, opt, poisoned, skip)


@pytest.mark.parametrize("enabled", [True, False])
def test_gradient_penalty(factory, enabled):
    check_against_control(factory, _penalty_recipe, enabled=enabled)


def _accumulation_recipe(scaler, models, opts, x, y, poisoned, skip):
    """Two micro-batches per iteration (halves of the batch, loss / 2 each), one step."""
    (model,), (opt,) = models, opts
    opt.zero_grad()
    for xs, ys in ((x[:3], y[:3]), (x[3:], y[3:])):
        loss = loss_of(model, xs, ys) / 2
        (loss if scaler is None else scaler.scale(loss)).backward()
    finish_iteration(scaler, model, opt, poisoned, skip)


@pytest.mark.parametrize("enabled", [True, False])
def test_gradient_accumulation(factory, enabled):
    check_against_control(factory, _accumulation_recipe, enabled=enabled)


def _two_models_recipe(scaler, models, opts, x, y, poisoned, skip):
    """Two models, two losses that each depend on both, one optimizer per model; only the
    second model's gradient overflows, and the first optimizer is unscaled separately."""
    (m0, m1), (o0, o1) = models, opts
    o0.zero_grad()
    o1.zero_grad()
    a, b = m0(x), m1(x)
    losses = [torch.nn.functional.mse_loss(0.25 * a + 0.75 * b, y),
              torch.nn.functional.mse_loss(0.5 * a - 0.5 * b, y)]
    if scaler is None:
        losses[0].backward(retain_graph=True)
        losses[1].backward()
        o0.step()  # torch.amp checks each optimizer on its own gradients: m0's stay finite
        if not skip:
            o1.step()
        return
    scaler.scale(losses[0]).backward(retain_graph=True)
    scaler.scale(losses[1]).backward()
    if poisoned:
        poison(m1)
    scaler.unscale_(o0)
    scaler.step(o0)
    scaler.step(o1)
    scaler.update()  # one backoff for the iteration


@pytest.mark.parametrize("enabled", [True, False])
def test_two_models_two_losses_two_optimizers(factory, enabled):
    check_against_control(factory, _two_models_recipe, enabled=enabled, n_models=2)


# ---- optimizers that take the scale themselves -------------------------------------------------
class _ProtocolOptimizer(torch.optim.Optimizer):
    """Plain SGD that declares ``_step_supports_amp_scaling``: it divides the gradients by the
    ``grad_scale`` it is handed (if any) and does nothing when ``found_inf`` is set, and records
    what it was given."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True
        self.seen: list[dict[str, Any]] = []

    def _apply(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor) -> None:
        if found_inf.item():
            return
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad if grad_scale is None else p.grad / grad_scale
                p.data.add_(g, alpha=-group["lr"])

    def step(self, closure: Any = None) -> None:
        self.seen.append({"grad_scale": getattr(self, "grad_scale", None),
                          "found_inf": getattr(self, "found_inf", None)})
        self._apply(self.seen[-1]["grad_scale"], self.seen[-1]["found_inf"])


class _KwargProtocolOptimizer(_ProtocolOptimizer):
    """The older protocol: ``step(grad_scaler=...)``; the optimizer asks the scaler itself for
    the scale and the per-device overflow flags. Handed no scaler, it falls back to the
    attributes, as an optimizer supporting both protocols does."""

    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
        self.seen.append({"grad_scaler": grad_scaler,
                          "grad_scale": getattr(self, "grad_scale", None),
                          "found_inf": getattr(self, "found_inf", None)})
        if grad_scaler is None:
            self._apply(self.seen[-1]["grad_scale"], self.seen[-1]["found_inf"])
            return
        found = sum(v.sum() for v in grad_scaler._check_inf_per_device(self).values())
        self._apply(grad_scaler._get_scale_async(), found)


@pytest.mark.parametrize("protocol", ["grad_scaler-kwarg", "attributes"])
def test_optimizer_that_handles_the_scale_itself(factory, protocol):
    """An optimizer with ``_step_supports_amp_scaling`` ends with the control's parameters.
    torch.amp (and TorchGradScaler, a torch.amp.GradScaler) hand such an optimizer themselves
    as ``grad_scaler=`` with a FutureWarning, or else ``grad_scale``/``found_inf`` attributes
    removed after the step; dlspass.GradScaler unscales and checks first and hands only
    ``found_inf`` (``grad_scale`` None), never itself (documented)."""
    name, make = factory
    cls = _KwargProtocolOptimizer if protocol == "grad_scaler-kwarg" else _ProtocolOptimizer
    outcomes = []
    control = torch.amp.GradScaler("cpu", init_scale=16.0)
    for sc in (control, make("cpu", init_scale=16.0)):
        p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        opt = cls([p], lr=0.5)
        for i in range(3):
            opt.zero_grad()
            sc.scale((p * torch.tensor([1.0, -1.0, 2.0])).sum()).backward()
            if i == 1:
                p.grad[0] = float("inf")
            is_amp = isinstance(sc, torch.amp.GradScaler)
            # TorchGradScaler is a torch.amp.GradScaler for isinstance; dlspass.GradScaler is not
            assert is_amp == (sc is control or name != POLICY_TORCH)
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                sc.step(opt)
            future = [w for w in rec if issubclass(w.category, FutureWarning)]
            assert len(future) == (1 if is_amp and protocol == "grad_scaler-kwarg" else 0)
            sc.update()
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        assert len(opt.seen) == 3  # also called on the overflow: the optimizer skips itself
        for seen in opt.seen:
            if protocol == "grad_scaler-kwarg" and is_amp:
                assert seen["grad_scaler"] is sc
                assert seen["grad_scale"] is None and seen["found_inf"] is None
            elif is_amp:
                assert isinstance(seen["grad_scale"], torch.Tensor)
                assert isinstance(seen["found_inf"], torch.Tensor)
            else:
                assert seen.get("grad_scaler") is None and seen["grad_scale"] is None
                assert isinstance(seen["found_inf"], torch.Tensor)
        outcomes.append((p.detach().clone(), scale_of(sc)))
    (p_ref, s_ref), (p_mine, s_mine) = outcomes
    assert_bit_equal(p_mine, p_ref, "parameters")
    # two clean SGD steps of 0.5 * [1, -1, 2]; the poisoned one skipped
    assert_bit_equal(p_ref, torch.tensor([0.0, 3.0, 1.0]), "control's parameters")
    assert s_mine == s_ref == 8.0


def test_deprecated_cpu_alias_warns_and_is_torch_amp():
    """torch.cpu.amp.GradScaler(...) warns that it is deprecated and builds a
    torch.amp.GradScaler for the CPU (no scaler under test: the alias is torch's)."""
    with pytest.warns(FutureWarning, match=r"torch\.cpu\.amp\.GradScaler\(args\.\.\.\)` is "
                                           r"deprecated"):
        sc = torch.cpu.amp.GradScaler(init_scale=4.0)
    assert isinstance(sc, torch.amp.GradScaler) and sc.is_enabled()
    assert_bit_equal(sc.scale(torch.tensor(3.0)), torch.tensor(12.0), "alias scales")


FUSED = [pytest.param(info, id=info.optim_cls.__name__) for info in optim_db
         if "fused" in info.supported_impls and "cpu" in info.supports_fused_on]


@pytest.mark.parametrize("separate_unscale", [False, True])
@pytest.mark.parametrize("info", FUSED)
def test_fused_optimizers_under_autocast(factory, info, separate_unscale):
    """Each fused CPU optimizer in every database configuration, under float16 autocast, with
    and without a separate unscale_: bit for bit the control's with the same fused optimizer,
    and within a derived bound of the control's with the for-loop implementation."""
    name, make = factory

    def recipe(scaler, models, opts, x, y, poisoned, skip):
        (model,), (opt,) = models, opts
        opt.zero_grad()
        out = forward(model, x)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        if poisoned:
            poison(model)
        if separate_unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    for fused_kw in _optim_kwargs(info, "fused"):
        loop_kw = {**fused_kw, "fused": None, "foreach": False}

        def fused(ps, kw=fused_kw):
            return info.optim_cls(ps, **kw)

        def loop(ps, kw=loop_kw):
            return info.optim_cls(ps, **kw)

        ref, ref_scales = run_recipe(recipe, torch.amp.GradScaler("cpu", **KW), opt_ctor=fused)
        mine, mine_scales = run_recipe(recipe, make("cpu", **KW), opt_ctor=fused)
        assert_same_snapshot(ref, mine, f"fused {fused_kw}")
        assert mine_scales == ref_scales == SCALES_AFTER
        loop_ref, _ = run_recipe(recipe, torch.amp.GradScaler("cpu", **KW), opt_ctor=loop)
        # The fused kernel and the for-loop implementation do the same math in another order
        # (fused multiply-adds, other groupings), each op rounding to float32 (eps 2**-24
        # relative). Four steps (one skipped) of about ten ops each feed into parameters of
        # magnitude <= 1: 4 * 10 ops * 2 ulps, i.e. 2**-24 * 80 * |value| plus the same
        # absolute amount near zero, bounds the parameters; the state (moments, sums of
        # squares) the same way relative to its own size.
        for a, b in zip(_tensors(loop_ref), _tensors(ref), strict=True):
            bound = 80 * 2.0**-24 * (1.0 + a.abs())
            diff = (a.reshape(-1).double() - b.reshape(-1).double()).abs()
            assert bool((diff <= bound.reshape(-1)).all()), (fused_kw, float(diff.max()))


def _tensors(snap: list[Any]) -> Iterator[torch.Tensor]:
    for x in snap:
        if isinstance(x, dict):
            for k in sorted(x):
                for name in sorted(x[k]):
                    if isinstance(x[k][name], torch.Tensor):
                        yield x[k][name].float()
        elif x is not None:
            yield x


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("info", FUSED)
def test_fused_optimizer_with_user_grad_scale(factory, info, unscale_first):
    """A ``grad_scale`` the user sets on a fused optimizer is honoured: the kernel divides the
    gradient by it on top of the loss scale (torch.amp multiplies the two; dlspass unscales
    first and hands the user's value alone); after the step the gradient is the true one,
    with the control's parameters."""
    _, make = factory
    outcomes = []
    for sc in (torch.amp.GradScaler("cpu", init_scale=4.0), make("cpu", init_scale=4.0)):
        w = torch.nn.Parameter(torch.ones(3, 3))
        w.grad = torch.full_like(w, 24.0)  # true gradient 3: loss scale 4, user scale 2
        opt = info.optim_cls([w], lr=0.1, fused=True)
        sc.scale(torch.ones(()))
        if unscale_first:
            sc.unscale_(opt)
            assert_bit_equal(w.grad, torch.full_like(w, 6.0), "after unscale_")
        opt.grad_scale = torch.tensor(2.0)
        sc.step(opt)
        assert_bit_equal(w.grad, torch.full_like(w, 3.0), "gradient seen by the kernel")
        outcomes.append(w.detach().clone())
    assert_bit_equal(outcomes[1], outcomes[0], "parameters")
    assert not torch.equal(outcomes[0], torch.ones(3, 3))  # the step was taken
