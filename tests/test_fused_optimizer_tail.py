"""``dlspass.compile`` with an optimizer built ``fused=True`` (torch's best practice) updates each
param group with torch's own fused multi-tensor kernel (``aten._fused_adam``/``_fused_adamw``,
`dlspass.capture.optim.fused_group_update`): one library call for the whole optimizer update,
so inductor generates no code for it, and the numerics are that optimizer's.

The reference is eager PyTorch with the same fused optimizer and ``torch.amp.GradScaler``
(float32 model, loss scaling on): torch checks the scaled gradients and its fused kernel divides
them by the scale; dlspass multiplies them by the scale's float32 reciprocal before the same
kernel. Both scales are powers of two and no gradient here is subnormal, so both unscalings are
exact and the two runs are the same ops on the same values in the same order: bit-equal
(``backend_compiler="eager"``, which runs the traced aten ops as they are).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dlspass
from dlspass.capture.fused_optimizer import fused_constants, fused_kernel_problem
from dlspass.capture.optim import GroupPlan
from dlspass.graph import roles
from dlspass.scale_policy import STATE_FIELDS

INIT, INTERVAL = 2.0**10, 3
OVERFLOW_STEPS = (2, 6)  # the second one after a growth
HUGE = 1e36  # finite, but its gradient overflows float32 once scaled by 2**9 or more
N_STEPS = 9


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # k * bias: zero in a normal step; in an overflow step its gradient, k, overflows once scaled
    return F.mse_loss(model(x), y) + (model[0].bias * k).sum()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g),
             torch.tensor(HUGE if i in OVERFLOW_STEPS else 0.0)) for i in range(N_STEPS)]


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.detach().clone() for _, v in sorted(opt.state.get(p, {}).items())]
    return out


def _torch_run(opt_cls, opt_kw):
    model = _model()
    opt = opt_cls(model.parameters(), fused=True, **opt_kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    rows, snaps = [], []
    for x, y, k in _batches():
        loss = _loss(model, x, y, k)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rows.append((scaler.get_scale(), loss.detach()))
        snaps.append(_snapshot(model, opt))
    return rows, snaps


def _compiled(model, opt, scaler, **compile_kw):
    """``dlspass.compile`` of the plain step (forward, backward, ``opt.step()``, zero_grad) on
    float32 weights with loss scaling, as torch.amp scales a float32 model."""
    def step(x, y, k):
        loss = _loss(model, x, y, k)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return dlspass.compile(step, optimizer=opt, scaler=scaler, mixed_precision=False, **compile_kw)


def _dlspass_run(opt_cls, opt_kw, **compile_kw):
    model = _model()
    opt = opt_cls(model.parameters(), fused=True, **opt_kw)
    scaler = dlspass.GradScaler(policy="torch", init_scale=INIT, steps_per_increase=INTERVAL)
    compiled = _compiled(model, opt, scaler, **compile_kw)
    rows, snaps, skipped = [], [], []
    for x, y, k in _batches():
        loss = compiled(x, y, k)
        skipped.append(bool(scaler.found_inf))
        rows.append((float(scaler.get_scale()), loss))
        snaps.append(_snapshot(model, opt))
    return rows, snaps, skipped, compiled


def compiled_targets(compiled) -> list[str]:
    """The graph targets of the parameters the compiled step updates."""
    graph = compiled.graphs[-1].graph
    return [roles.target_of(n) for n in graph.find_nodes(op="placeholder")
            if roles.role_of(n) == roles.PARAM]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("opt_cls,opt_kw", [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "amsgrad": True}),
], ids=["AdamW", "Adam-amsgrad"])
def test_fused_optimizer_step_is_bit_equal_to_torch_fused_with_grad_scaler(opt_cls, opt_kw):
    ref_rows, ref_snaps = _torch_run(opt_cls, opt_kw)
    rows, snaps, skipped, compiled = _dlspass_run(opt_cls, opt_kw, backend_compiler="eager")
    assert skipped == [i in OVERFLOW_STEPS for i in range(N_STEPS)]
    assert [r[0] for r in rows] == [r[0] for r in ref_rows]
    assert len({r[0] for r in ref_rows}) > 1  # the scale moves both ways
    # the same ops on the same values in the same order (module docstring): bit-equal
    for i, ((loss, ref_loss), snap, ref_snap) in enumerate(
            zip([(r[1], q[1]) for r, q in zip(rows, ref_rows, strict=True)], snaps, ref_snaps,
                strict=True)):
        assert torch.equal(loss, ref_loss), i
        assert _equal(snap, ref_snap), f"parameters or optimizer state after step {i}"
    # a skipped step leaves parameters and optimizer state (step counts included) bit-identical
    for i in OVERFLOW_STEPS:
        assert _equal(snaps[i], snaps[i - 1]), i
    # the update is torch's fused kernel, once for the whole group, not per-parameter math
    graph = compiled.graphs[-1].graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    # in place, as torch.optim calls it (ReinplaceFusedKernelPass): no functional kernel left
    fused = torch.ops.aten._fused_adamw_.tensor_lr if opt_cls is torch.optim.AdamW \
        else torch.ops.aten._fused_adam_.tensor_lr
    assert targets.count(fused) == 1, targets
    assert not {torch.ops.aten._fused_adamw.tensor_lr, torch.ops.aten._fused_adam.tensor_lr} & set(targets)
    # and nothing copies the parameters or their moments back: the kernel wrote them
    copied = {roles.target_of(n) for n in graph.nodes if n.target is torch.ops.aten.copy_.default}
    assert not {t for t in copied if t and not t.endswith(".step")} - set(STATE_FIELDS), copied
    # it skips an overflow step by itself (found_inf, GuardFusedUpdatesPass): the only where()
    # guards left are the step counts', computed outside the kernel
    (kernel,) = [n for n in graph.nodes if n.target is fused]
    assert kernel.kwargs["found_inf"] is not None
    guarded = [roles.target_of(n) for n in graph.nodes if roles.role_of(n) == roles.GUARD]
    assert sorted(guarded) == sorted(f"{t}.step" for t in compiled_targets(compiled)), guarded
    assert torch.ops.aten.addcdiv.default not in targets
    assert torch.ops.aten.lerp.Scalar not in targets and torch.ops.aten.lerp.Tensor not in targets


def test_changing_a_constant_of_the_fused_kernel_recompiles_and_takes_effect():
    """beta1 is a constant of the fused kernel: changed between calls (as OneCycleLR cycles it),
    the step is compiled again and the next update uses the new value, as torch's does."""
    batches = _batches()[:2]
    results = []
    for change in (False, True):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        compiled = _compiled(model, opt, None, backend_compiler="eager")
        compiled(*batches[0])
        if change:
            opt.param_groups[0]["betas"] = (0.5, 0.999)
        compiled(*batches[1])
        results.append(([p.detach().clone() for p in model.parameters()], len(compiled.graphs)))
    (same, n_same), (changed, n_changed) = results
    assert n_same == 1 and n_changed == 2
    assert not _equal(same, changed)


def test_the_policy_gives_the_fused_kernel_only_to_fused_adam_groups():
    plan = GroupPlan(index=0, names=("w",))
    assert fused_kernel_problem("Adam", plan) == "the optimizer was not built with fused=True"
    fused = GroupPlan(index=0, names=("w",), fused=True)
    assert fused_kernel_problem("Adam", fused) is None
    assert "first-step flag" in fused_kernel_problem("SGD", fused)
    assert "CPU only" in fused_kernel_problem("Adam", fused, "cuda")
    group = {"betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.0}
    assert fused_constants(group) == {"beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.0}
    # a tensor beta is no constant: that group keeps the per-parameter form
    assert fused_constants({**group, "betas": (torch.tensor(0.9), 0.99)}) is None


def test_under_inductor_the_update_is_one_library_call_and_a_skip_changes_nothing():
    """The compile the kernel is for: inductor runs the fused kernel as a library (extern)
    call given the overflow flag, and generates no C++ for the update; an overflow step leaves
    parameters and optimizer state bit-identical (the kernel returns them untouched)."""
    from torch._inductor.utils import run_and_get_code

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = dlspass.GradScaler(policy="torch", init_scale=INIT, steps_per_increase=INTERVAL)
    compiled = _compiled(model, opt, scaler)
    batches = _batches()[:OVERFLOW_STEPS[0] + 1]
    _, codes = run_and_get_code(compiled, *batches[0])
    code = "\n".join(codes)
    calls = [line for line in code.splitlines() if "torch.ops.aten._fused_adamw_." in line
             and "found_inf=" in line and "found_inf=None" not in line]  # in place, flag given
    assert len(calls) == 1, code[-3000:]
    kernels = [line.split(" = ")[0] for line in code.splitlines() if "async_compile.cpp_pybinding" in line]
    assert kernels and not [k for k in kernels if "addcdiv" in k or "lerp" in k], kernels
    snaps = [_snapshot(model, opt)]
    for batch in batches[1:]:
        compiled(*batch)
        snaps.append(_snapshot(model, opt))
    assert not _equal(snaps[1], snaps[0])  # a normal step moves them
    skipped = OVERFLOW_STEPS[0]
    assert bool(scaler.found_inf) and _equal(snaps[skipped], snaps[skipped - 1])


def test_fused_step_launches_no_more_kernels_than_torch_best_practice():
    """tests/test_kernel_launches.py's count, with dlspass's AdamW built fused=True as torch's
    is: the update is one library call in the graph, the DLS math fused around it."""
    import test_kernel_launches as tkl

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, tkl.VOCAB, (tkl.BATCH, tkl.SEQ + 1), generator=g)
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    torch._dynamo.reset()
    theirs, their_eager = tkl._launches(tkl._torch_step(tkl._model()), batch)
    torch._dynamo.reset()
    model = tkl._model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = dlspass.GradScaler(config=dlspass.DLSConfig(fp16_type="float16"))

    def step(idx, targets):
        loss = tkl._loss(model, idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    ours, our_eager = tkl._launches(dlspass.compile(step, optimizer=opt, scaler=scaler), batch)
    # the fused kernel runs inside the compiled graph, never eagerly
    assert not {"aten::_fused_adamw_", "aten::_amp_foreach_non_finite_check_and_unscale_"} \
        & set(our_eager), our_eager
    assert ours <= theirs, (ours, theirs, our_eager, their_eager)
