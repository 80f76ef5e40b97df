"""dlspass.compile: one graph for the whole step, eager-GradScaler parity, fusion, clear errors."""

from __future__ import annotations

import copy
import functools
import inspect
import logging

import pytest
import torch
import torch.nn.functional as F
from tolerance import (
    adam_first_step_atol,
    assert_within,
    gpt_grad_sums,
    grad_term_sums,
    mlp_grad_sums,
    reordered_sum_atol,
    sgd_update_atol,
)
from torch._dynamo.utils import counters

import dlspass
from dlspass.capture.compiled_step import CompileError
from dlspass.config import ConfigError
from dlspass.debug.kernel_count import KernelCount, count_kernels
from dlspass.graph import roles
from dlspass.models import MLP, TinyGPT, copy_task_batch, gpt_loss, gpt_train_step, mse_train_step

OVERFLOW_STEPS = (4, 9, 10)


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        if i in OVERFLOW_STEPS:
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def _scaler(**kw) -> dlspass.GradScaler:
    return dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=3, **kw)


def _compiled_mlp(opt_cls, opt_kw, scaler, module=MLP, **compile_kw):
    torch.manual_seed(0)
    model = module()
    reference = copy.deepcopy(model)
    opt = opt_cls(model.parameters(), **opt_kw)

    train_step = mse_train_step(model, opt)

    compile_kw.setdefault("backend_compiler", "eager")
    step = dlspass.compile(train_step, optimizer=opt, scaler=scaler, **compile_kw)
    return model, reference, opt, step


def _train_both(step, reference, ref_opt, ref_scaler, batches) -> None:
    """The compiled step and the eager dlspass GradScaler loop, side by side."""
    for x, y in batches:
        step(x, y)
        _eager_step(reference, ref_opt, ref_scaler, x, y)


# Bit equality (EXACT) between a step compiled with backend_compiler="eager" and the eager
# GradScaler loop: the compiled graphs run the ATen ops eager autograd and torch.optim dispatch,
# in the same order, on the same values, and the loss scale is a power of two (exact), so both
# sides round identically whatever kernels the CPU's ISA selects.
EXACT = {"rtol": 0.0, "atol": 0.0}


def _assert_same_params(model, reference) -> None:
    """The eager-backend step's parameters against the eager loop's: bit-equal (EXACT)."""
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    for p, q in zip(params, reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **EXACT)


def _eager_step(model, opt, scaler, x, y) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss.detach()


OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("opt_cls,opt_kw", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_one_graph_and_eager_parity_with_overflows(opt_cls, opt_kw):
    torch._dynamo.reset()
    counters.clear()
    scaler = _scaler()
    model, reference, opt, step = _compiled_mlp(opt_cls, opt_kw, scaler, mixed_precision=False)
    ref_opt = opt_cls(reference.parameters(), **opt_kw)
    ref_scaler = _scaler()
    scales, ref_scales = [], []
    for x, y in _batches(20):
        loss = step(x, y)
        ref_loss = _eager_step(reference, ref_opt, ref_scaler, x, y)
        scales.append(float(scaler.state.loss_scale))
        ref_scales.append(float(ref_scaler.state.loss_scale))
        assert bool(scaler.found_inf) == bool(ref_scaler.found_inf)
        if torch.isfinite(ref_loss):
            torch.testing.assert_close(loss, ref_loss, **EXACT)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert scales == ref_scales
    assert 2048.0 in scales and 512.0 in scales  # both growth and backoff happened
    assert int(scaler.state.num_skipped_steps) == len(OVERFLOW_STEPS)
    assert int(ref_scaler.state.num_skipped_steps) == len(OVERFLOW_STEPS)
    _assert_same_params(model, reference)
    for p, q in zip(opt.param_groups[0]["params"], ref_opt.param_groups[0]["params"], strict=True):
        for k, v in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][k], v, **EXACT)


@pytest.fixture(scope="module")
def adam_step():
    torch._dynamo.reset()
    scaler = _scaler()
    model, _, opt, step = _compiled_mlp(torch.optim.Adam, {"lr": 1e-2}, scaler, mixed_precision=False)
    return model, opt, scaler, step


def test_seed_is_scaled_in_the_graph(adam_step):
    model, opt, scaler, step = adam_step
    x, y = _batches(1)[0]
    step(x, y)
    gm = step.graphs[-1]
    (scaled,) = roles.nodes_with_role(gm.graph, roles.SCALED_SEED)
    seed, scale = scaled.args
    assert seed.target is torch.ops.aten.ones_like.default and roles.role_of(seed) == roles.SEED
    assert scale.op == "placeholder"
    grads = roles.nodes_with_role(gm.graph, roles.GRAD)
    assert len(grads) == len(list(model.parameters()))
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.dlspass.mark.default]
    # apply_dls ran on the AOT graph: every parameter update is guarded, the state is updated
    from dlspass.passes import applied_passes

    assert {"scale_seed", "unscale_grads", "guard_updates", "update_scale"} <= set(applied_passes(gm.graph))
    updates = [t for r, t in roles.output_roles(gm.graph) if r == roles.PARAM_UPDATE]
    assert sorted(updates) == sorted(roles.target_of(g) for g in grads)


def test_overflow_leaves_params_and_adam_state_bit_identical(adam_step):
    model, opt, scaler, step = adam_step
    x, y = _batches(1)[0]
    step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for p in model.parameters() for k, v in opt.state[p].items()
                    for k in [f"{id(p)}.{k}"]}
    skipped, scale = int(scaler.state.num_skipped_steps), float(scaler.state.loss_scale)
    x = x.clone()
    x[1, 2] = float("nan")
    step(x, y)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, state_before[f"{id(p)}.{k}"]), k
    assert int(scaler.state.num_skipped_steps) == skipped + 1
    assert float(scaler.state.loss_scale) == scale / 2


def test_lr_change_is_a_graph_input(adam_step):
    model, opt, scaler, step = adam_step
    x, y = _batches(1, seed=7)[0]
    step(x, y)
    frames = counters["stats"]["unique_graphs"]
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.0
    step(x, y)
    opt.param_groups[0]["lr"] = 1e-2
    assert counters["stats"]["unique_graphs"] == frames  # no recompile
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)  # lr 0 really reached the update


def test_hyperparameter_changes_are_graph_inputs(adam_step):
    model, opt, scaler, step = adam_step
    x, y = _batches(1, seed=8)[0]
    step(x, y)
    frames = counters["stats"]["unique_graphs"]
    group = opt.param_groups[0]
    old = dict(group)
    reference = copy.deepcopy((model, opt))
    group["betas"], group["eps"] = (0.5, 0.9), 1e-3
    reference[1].param_groups[0]["betas"], reference[1].param_groups[0]["eps"] = (0.5, 0.9), 1e-3
    step(x, y)
    assert counters["stats"]["unique_graphs"] == frames  # no recompile
    group["betas"], group["eps"] = old["betas"], old["eps"]
    # the new betas/eps reached the update: the step equals torch's Adam with them
    ref_model, ref_opt = reference
    F.mse_loss(ref_model(x), y).backward()
    ref_opt.step()
    _assert_same_params(model, ref_model)


@pytest.mark.parametrize("first_overflows", [False, True])
def test_sgd_dampening_matches_torch_including_a_skipped_first_step(first_overflows):
    torch._dynamo.reset()
    kw = {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-3, "nesterov": False}
    scaler = _scaler()
    model, reference, opt, step = _compiled_mlp(torch.optim.SGD, kw, scaler, mixed_precision=False)
    ref_opt = torch.optim.SGD(reference.parameters(), **kw)
    ref_scaler = _scaler()
    batches = _batches(6, seed=4)
    if first_overflows:
        batches[0][0][0, 0] = float("inf")
    for x, y in batches:
        step(x, y)
        _eager_step(reference, ref_opt, ref_scaler, x, y)
    assert int(scaler.state.num_skipped_steps) == int(ref_scaler.state.num_skipped_steps)
    assert int(scaler.state.num_skipped_steps) == (1 if first_overflows else 0) + sum(
        i in OVERFLOW_STEPS for i in range(6))
    _assert_same_params(model, reference)
    for p, q in zip(opt.param_groups[0]["params"], ref_opt.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                                   **EXACT)


def test_max_gradient_norm_matches_eager_scaler():
    torch._dynamo.reset()
    scaler = _scaler(max_gradient_norm=0.05)
    model, reference, opt, step = _compiled_mlp(torch.optim.SGD, {"lr": 0.1}, scaler,
                                                mixed_precision=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_scaler = _scaler(max_gradient_norm=0.05)
    _train_both(step, reference, ref_opt, ref_scaler, _batches(6))
    _assert_same_params(model, reference)


def test_static_scale_and_no_scaler_match_eager():
    torch._dynamo.reset()
    batches = _batches(4, seed=3)[:3] + _batches(1, seed=5)  # finite batches only
    for scaler, ref_scaler in ((dlspass.GradScaler(loss_scale=128.0), dlspass.GradScaler(loss_scale=128.0)),
                               (None, dlspass.GradScaler(loss_scale=None))):
        torch._dynamo.reset()
        model, reference, opt, step = _compiled_mlp(torch.optim.SGD, {"lr": 0.1}, scaler,
                                                    mixed_precision=False)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for x, y in batches:
            step(x, y)
            _eager_step(reference, ref_opt, ref_scaler, x, y)
        _assert_same_params(model, reference)
        seeds = roles.nodes_with_role(step.graphs[-1].graph, roles.SCALED_SEED)
        assert len(seeds) == (1 if scaler is not None else 0)


def _gpt_step(model, scaler, **compile_kw):
    """The GPT training step with AdamW, through dlspass.compile."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return dlspass.compile(gpt_train_step(model, opt), optimizer=opt, scaler=scaler, **compile_kw)


@pytest.mark.parametrize("fp16_type", ["float16", "cbfloat16"])
def test_emulated_16bit_trains_tinygpt(fp16_type):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(vocab=16, d=16, n_layer=1, n_head=2, block_size=8)
    scaler = dlspass.GradScaler(loss_scale="dynamic", fp16_type=fp16_type)
    step = _gpt_step(model, scaler, backend_compiler="eager", precision_mode="emulate")
    batch = copy_task_batch(16, 8, 8, torch.Generator().manual_seed(0))
    losses = [float(step(*batch)) for _ in range(30)]  # one batch: the model must fit it
    assert losses[-1] < 0.6 * losses[0], losses
    assert int(scaler.state.num_skipped_steps) < 5
    gm = step.graphs[-1]
    rounds = [n for n in gm.graph.nodes if n.target is torch.ops.dlspass.round_to_format.default]
    assert rounds and all(n.args[1] == fp16_type for n in rounds)


def _compiled_gpt(scaler):
    """The benchmark's anchor step (tools/bench/bench_compile.py): compile time is that of any
    2-block GPT, and inductor's fusion choices depend on the shapes, so the bound is checked at
    the anchor's own (at d=32, seq 16 DLS adds 5 launches; tools/bench/RESULTS.md has both)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=128, n_layer=2, n_head=2, block_size=64)
    step = _gpt_step(model, scaler, mixed_precision=False)
    return model, step, copy_task_batch(64, 16, 64, torch.Generator().manual_seed(0))


def _compiled_mlp_adam(scaler):
    model, _, _, step = _compiled_mlp(torch.optim.Adam, {"lr": 1e-2}, scaler,
                                      mixed_precision=False, backend_compiler="inductor")
    return model, step, _batches(1)[0]


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


# build, the loss it trains, the longest chain of sums behind a gradient (tests/tolerance.py)
FUSE_CASES = {
    "mlp-adam": (_compiled_mlp_adam, _mse, mlp_grad_sums([8, 16, 16, 4], batch=4)),
    "gpt-adamw": (_compiled_gpt, gpt_loss, gpt_grad_sums(d=128, n_layer=2, vocab=64, seq=64, tokens=16 * 64)),
}


# the anchor GPT compiles for about 100 s: behind `slow` (tools/run_slow.sh); the MLP runs by default
@pytest.mark.parametrize("case", [
    pytest.param("mlp-adam"),
    pytest.param("gpt-adamw", marks=pytest.mark.slow),
])
def test_inductor_fuses_the_dls_tail(case):
    from torch._inductor.utils import run_and_get_code

    build, loss_fn, n_sums = FUSE_CASES[case]
    counts, params = {}, {}
    for name, scaler in (("plain", None), ("dls", _scaler())):
        torch._dynamo.reset()
        model, step, batch = build(scaler)
        if name == "plain":  # eager gradients at the starting point, for the bound below
            start = [p.detach().clone() for p in model.parameters()]
            ref = copy.deepcopy(model)
            grads = torch.autograd.grad(loss_fn(ref, batch), list(ref.parameters()))
            terms = grad_term_sums(model, lambda m, batch=batch: loss_fn(m, batch))
            group = step._ctx.optimizer.param_groups[0]
        _, codes = run_and_get_code(step, *batch)
        counts[name] = count_kernels(codes)
        params[name] = [p.detach().clone() for p in model.parameters()]
    assert counts["plain"].launches > 0 and counts["plain"].definitions > 0
    # the DLS tail (unscale, check, scale update, guarded update) costs at most 4 kernel launches
    assert counts["dls"].launches - counts["plain"].launches <= 4, counts
    assert counts["dls"].extern_launches == counts["plain"].extern_launches, counts
    # with a finite batch the DLS step must land where the plain step lands. The two graphs fuse
    # differently, so their gradients differ in summation order (n_sums terms, S each
    # gradient's terms' magnitudes; the scale is a power of two, exact), and Adam's first step
    # carries that through g / (|g| + eps): per element, by the slope at that gradient
    # (tests/tolerance.py). A skipped or wrong update is off by about lr where |g| is large.
    for (k, _), a, b, g, p0 in zip(ref.named_parameters(), params["dls"], params["plain"], grads, start,
                                   strict=True):
        atol = adam_first_step_atol(g, reordered_sum_atol(n_sums, terms[k]), group["lr"], group["eps"], p0)
        assert_within(a, b, atol, k)


def test_inductor_step_updates_in_place_and_skips_bit_identically():
    torch._dynamo.reset()
    scaler = _scaler()
    model, _, opt, step = _compiled_mlp(torch.optim.Adam, {"lr": 1e-2}, scaler,
                                        mixed_precision=False, backend_compiler="inductor")
    x, y = _batches(1)[0]
    step(x, y)
    ptrs = [p.data_ptr() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for p in model.parameters() for v in opt.state[p].values()]
    bad = x.clone()
    bad[0, 1] = float("inf")
    step(bad, y)
    assert bool(scaler.found_inf)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    assert all(torch.equal(a, b) for a, b in zip(
        [v for p in model.parameters() for v in opt.state[p].values()], state, strict=True))
    step(x, y)
    assert not bool(scaler.found_inf)
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # written in place
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    # the graph ends with one copy_ into each parameter and optimizer-state input
    gm = step.graphs[-1]
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    dests = {roles.role_of(n.args[0]) for n in copies}
    assert dests == {roles.PARAM, roles.OPT_STATE, roles.SCALER_STATE}
    assert len([n for n in copies if roles.role_of(n.args[0]) == roles.PARAM]) == len(list(model.parameters()))


def test_count_kernels_reads_launches_in_call_only():
    code = (
        "cpp_fused_a_0 = async_compile.cpp_pybinding(['float*'], r\'\'\'...\'\'\')\n"
        "cpp_fused_b_1 = async_compile.cpp_pybinding(['float*'], r\'\'\'...\'\'\')\n"
        "class Runner:\n"
        "    def call(self, args):\n"
        "        cpp_fused_a_0(buf0)\n"
        "        extern_kernels.mm(buf0, buf1, out=buf2)\n"
        "        cpp_fused_a_0(buf2)\n"
        "        cpp_fused_b_1(buf2)\n"
        "def benchmark_compiled_module(args):\n"
        "    cpp_fused_a_0(buf0)\n"
    )
    assert count_kernels(code) == KernelCount(launches=3, definitions=2, extern_launches=1)
    assert count_kernels([code, code]).launches == 6


def test_unsupported_optimizer_is_a_clear_error():
    model = MLP()
    opt = torch.optim.RMSprop(model.parameters())
    with pytest.raises(CompileError, match=r"RMSprop.*supported: torch.optim.SGD, torch.optim.Adam"):
        dlspass.compile(lambda x: x, optimizer=opt, scaler=_scaler())


class _PlainSGD(torch.optim.SGD):
    """A subclass that keeps torch's step: capture_step accepts it, so dlspass.compile does."""


class _OwnStepSGD(torch.optim.SGD):
    def step(self, closure=None):  # its own math: no functional twin
        return super().step(closure)


def test_optimizer_subclass_is_accepted_as_capture_step_accepts_it():
    from dlspass.capture.optim import functionalize

    torch._dynamo.reset()
    kw = {"lr": 0.05, "momentum": 0.9}
    scaler, ref_scaler = _scaler(), _scaler()
    model, reference, opt, step = _compiled_mlp(_PlainSGD, kw, scaler, mixed_precision=False)
    ref_opt = torch.optim.SGD(reference.parameters(), **kw)
    functionalize(opt, {id(p): str(i) for i, p in enumerate(model.parameters())})  # capture's rule
    _train_both(step, reference, ref_opt, ref_scaler, _batches(6))
    _assert_same_params(model, reference)
    assert int(scaler.state.num_skipped_steps) == int(ref_scaler.state.num_skipped_steps) == 1

    own = _OwnStepSGD(MLP().parameters(), lr=0.1)
    with pytest.raises(CompileError, match=r"_OwnStepSGD.*supported: torch.optim.SGD, torch.optim.Adam"):
        dlspass.compile(lambda x: x, optimizer=own, scaler=_scaler())


def test_data_dependent_control_flow_is_a_clear_error():
    torch._dynamo.reset()
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        if loss > 1.0:  # depends on a tensor value: no single graph can hold this
            loss = loss * 0.5
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = dlspass.compile(train_step, optimizer=opt, scaler=_scaler(), backend_compiler="eager")
    with pytest.raises(CompileError, match="not one graph"):
        step(*_batches(1)[0])
    assert "step" not in opt.__dict__  # the interception is undone after a failure


def test_config_conflicts_and_bad_options():
    opt = torch.optim.SGD(MLP().parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="max_gradient_norm=2.0 conflicts"):
        dlspass.compile(lambda: None, optimizer=opt, scaler=_scaler(max_gradient_norm=1.0),
                        max_gradient_norm=2.0)
    with pytest.raises(ConfigError, match="fp16_type='cbfloat16' conflicts"):
        dlspass.compile(lambda: None, optimizer=opt, scaler=dlspass.GradScaler(), fp16_type="cbfloat16")
    with pytest.raises(ConfigError, match="backend_compiler"):
        dlspass.compile(lambda: None, optimizer=opt, backend_compiler="tvm")
    with pytest.raises(CompileError, match="torch.optim optimizer"):
        dlspass.compile(lambda: None, optimizer=object())
    # an input TypeError (one builtin base per error class), no longer also a CompileError
    with pytest.raises(dlspass.DLSInputError, match="fn must be callable") as info:
        dlspass.compile(42, optimizer=opt)
    assert isinstance(info.value, TypeError)  # the builtin type it always had
    # no conflict: the same format, and a norm the scaler leaves open
    def train_step(x, y, *, scale=1.0):
        return None

    step = dlspass.compile(train_step, optimizer=opt, scaler=dlspass.GradScaler(),
                           fp16_type="float16", max_gradient_norm=1.0)
    assert step.config.max_gradient_norm == 1.0 and step.config.fp16_type == "float16"
    assert inspect.signature(step) == inspect.signature(train_step)


def test_held_scheduler_follows_compiled_skips_without_warning():
    import warnings

    torch._dynamo.reset()
    scaler = _scaler()
    model, _, opt, step = _compiled_mlp(torch.optim.SGD, {"lr": 0.1}, scaler, mixed_precision=False)
    held = dlspass.hold_scheduler_on_skip(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), scaler)
    advanced = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on lr_scheduler.step() before optimizer.step()
        for i, (x, y) in enumerate(_batches(6)):
            step(x, y)
            assert held.step() == (i not in OVERFLOW_STEPS)
            advanced += i not in OVERFLOW_STEPS
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**advanced)


def _sgd_pair(kw):
    scaler = _scaler()
    model, reference, opt, step = _compiled_mlp(torch.optim.SGD, kw, scaler, mixed_precision=False)
    return model, reference, opt, step, torch.optim.SGD(reference.parameters(), **kw), _scaler()


def test_sgd_state_loaded_after_compile_is_used():
    torch._dynamo.reset()
    kw = {"lr": 0.05, "momentum": 0.9, "dampening": 0.3}
    model, reference, opt, step, ref_opt, ref_scaler = _sgd_pair(kw)
    # the reference takes two eager steps; the compiled step then resumes from its checkpoint
    for x, y in _batches(2, seed=11):
        _eager_step(reference, ref_opt, ref_scaler, x, y)
    # state_dict() hands out the live tensors and load_state_dict keeps them when dtype and
    # device agree: copies, or the compiled step's in-place update would move the reference too
    model.load_state_dict(reference.state_dict())
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    step.scaler.load_state_dict(copy.deepcopy(ref_scaler.state_dict()))
    _train_both(step, reference, ref_opt, ref_scaler, _batches(3, seed=12))
    _assert_same_params(model, reference)


def test_momentum_switched_on_after_compile_recompiles_and_matches_torch():
    torch._dynamo.reset()
    model, reference, opt, step, ref_opt, ref_scaler = _sgd_pair({"lr": 0.05, "dampening": 0.2})
    batches = _batches(5, seed=13)
    for i, (x, y) in enumerate(batches):
        if i == 2:
            for g in (opt.param_groups[0], ref_opt.param_groups[0]):
                g["momentum"] = 0.9
        _train_both(step, reference, ref_opt, ref_scaler, [(x, y)])
    _assert_same_params(model, reference)


@pytest.mark.parametrize("opt_cls,opt_kw", [(torch.optim.Adam, {"lr": 1e-2}),
                                            (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9,
                                                               "dampening": 0.3})],
                         ids=["adam", "sgd"])
def test_state_reset_by_a_fresh_checkpoint_mid_training(opt_cls, opt_kw):
    torch._dynamo.reset()
    scaler = _scaler()
    model, reference, opt, step = _compiled_mlp(opt_cls, opt_kw, scaler, mixed_precision=False)
    ref_opt, ref_scaler = opt_cls(reference.parameters(), **opt_kw), _scaler()
    # a checkpoint taken before any step holds no state: loading it mid-run resets the optimizer
    fresh = copy.deepcopy(opt_cls(copy.deepcopy(model).parameters(), **opt_kw).state_dict())
    batches = _batches(4, seed=21)
    _train_both(step, reference, ref_opt, ref_scaler, batches[:2])
    opt.load_state_dict(copy.deepcopy(fresh))
    ref_opt.load_state_dict(copy.deepcopy(fresh))
    _train_both(step, reference, ref_opt, ref_scaler, batches[2:])
    _assert_same_params(model, reference)


class _OnesLikeMLP(torch.nn.Module):
    """An MLP whose forward multiplies by ``ones_like`` of a non-scalar: model arithmetic that
    every gradient depends on, but not the backward seed (T5's layer norm does the like)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * torch.ones_like(x)) * torch.full_like(x[:, :4], 1.0)


class _LoggingMLP(torch.nn.Module):
    """An MLP that logs in every forward through a logger method a library added to
    ``logging.Logger`` (transformers 5 adds ``warning_once``, an lru_cache'd function)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.logger = logging.getLogger("dlspass.tests.logging_mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.logger.warning_once("forward called")
        self.logger.info("plain logging call")
        return self.net(x)


@pytest.fixture
def logger_warning_once(monkeypatch):
    @functools.lru_cache(None)
    def warning_once(self, *args, **kwargs):
        self.warning(*args, **kwargs)

    monkeypatch.setattr(logging.Logger, "warning_once", warning_once, raising=False)


@pytest.mark.parametrize("module", [_OnesLikeMLP, _LoggingMLP], ids=["ones_like", "logging"])
def test_steps_that_were_not_one_graph_match_eager(module, request):
    """``x * ones_like(x)`` is not taken for a seed; logger calls (also ``warning_once``) are
    skipped inside the step instead of breaking the graph; one graph, eager parity."""
    if module is _LoggingMLP:
        request.getfixturevalue("logger_warning_once")
    torch._dynamo.reset()
    counters.clear()
    scaler, ref_scaler = _scaler(), _scaler()
    _, reference, _, step = _compiled_mlp(torch.optim.SGD, {"lr": 0.05}, scaler, module=module,
                                          mixed_precision=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    _train_both(step, reference, ref_opt, ref_scaler, _batches(6))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert int(scaler.state.num_skipped_steps) == int(ref_scaler.state.num_skipped_steps) == 1
    assert float(scaler.state.loss_scale) == float(ref_scaler.state.loss_scale)
    _assert_same_params(step._ctx.optimizer.param_groups[0]["params"], reference)
    if module is _LoggingMLP:  # the logging functions are dynamo's to ignore only while the step runs
        assert logging.Logger.warning_once not in torch._dynamo.config.ignore_logging_functions


def test_float64_parameters_are_a_clear_error_at_the_first_call():
    torch._dynamo.reset()
    model, _, _, step = _compiled_mlp(torch.optim.SGD, {"lr": 0.1}, _scaler(),
                                      module=lambda: MLP().double())
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(1)[0]
    with pytest.raises(dlspass.DLSInputError, match=r"float32 master weights, found torch.float64"):
        step(x.double(), y.double())
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))


def test_two_backward_calls_are_refused_at_the_first_call_with_the_workaround():
    """dlspass.compile scales one seed: a step accumulating two micro-batches is refused at the
    first call (one line, saying how to accumulate) and no parameter moves."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())

    def step(x, y):
        for xs, ys in ((x[:4], y[:4]), (x[4:], y[4:])):
            F.mse_loss(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()

    cstep = dlspass.compile(step, optimizer=opt, scaler=dlspass.GradScaler(loss_scale="dynamic"),
                            mixed_precision=False, backend_compiler="eager")
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with pytest.raises(CompileError, match="found 2: call loss.backward.. exactly once") as info:
        cstep(x, y)
    assert "\n" not in str(info.value) and "sum their losses" in str(info.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class _LayoutSeen(Exception):
    pass


def test_cpu_step_keeps_convolutions_in_the_parameters_layout(monkeypatch):
    """On CPU inductor turns every convolution channels-last (an inference heuristic); in a
    training step that holds the optimizer update this cost a ResNet-18 step 1.8x. dlspass.compile
    turns it off on CPU, while torch.compile of the same model keeps inductor's choice (so the
    probe would see a step compiled with inductor's default)."""
    from torch._inductor.graph import GraphLowering

    seen: list[bool] = []
    decide = GraphLowering.decide_layout_opt

    def probe(gm, *, is_inference):
        seen.append(decide(gm, is_inference=is_inference))
        raise _LayoutSeen  # stop before code generation: the decision is all this test needs

    monkeypatch.setattr(GraphLowering, "decide_layout_opt", staticmethod(probe))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    x = torch.randn(2, 3, 8, 8)
    model(x)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt, scaler=dlspass.GradScaler(),
                           mixed_precision=False)
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    with pytest.raises(InductorError, match="_LayoutSeen"):  # inductor wraps what it raises
        step(x, torch.zeros(2, 2))
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed):
        torch.compile(model)(x)
    assert seen == [False, True]



def test_a_sweep_compiles_the_same_step_code_as_often_as_asked():
    """dynamo counts recompiles per code object (recompile_limit 8): ten dlspass.compile of the
    same step code, as a sweep or k-fold does, each compile and train as eager torch does (the
    ninth raised FailOnRecompileLimitHit); each run is compared with eager SGD."""
    torch._dynamo.reset()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for i in range(10):
        torch.manual_seed(i)
        model = torch.nn.Linear(8, 4)
        reference = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01 * (i + 1))
        step = dlspass.compile(mse_train_step(model, opt), optimizer=opt,
                               scaler=_scaler(policy="torch"), mixed_precision=False,
                               backend_compiler="eager")
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01 * (i + 1))
        delta = 0.0  # how far apart the two runs' parameters may be (tests/tolerance.py)
        for _ in range(2):
            want = F.mse_loss(reference(x), y)
            want.backward()
            grads = [p.grad for p in reference.parameters()]
            # the traced step's kernels sum in other orders than eager's: the loss's chain is
            # Linear's 8-term dot products then the mean of 4 x 4 squares (terms >= 0, S = loss),
            # plus, to first order, what the parameters' difference moves it: ||grad||_1 * delta
            atol = (reordered_sum_atol(8 + 16, float(want))
                    + sum(float(g.abs().sum()) for g in grads) * delta)
            torch.testing.assert_close(step(x, y), want.detach(), rtol=0, atol=atol)
            # a gradient: the forward's 8 terms, then the sum over the batch of 4
            g_atol = max(reordered_sum_atol(8 + 4, float(g.abs().max())) for g in grads)
            delta += sgd_update_atol(g_atol, 0.01 * (i + 1),
                                     max(float(p.abs().max()) for p in reference.parameters()))
            ref_opt.step()
            ref_opt.zero_grad()
        _assert_same_params(model, reference)
