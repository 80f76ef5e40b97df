"""The step's own code between ``loss.backward()`` and ``optimizer.step()`` inside ``dlspass.compile``
(a clip by norm or by value, a logged gradient norm) sees the real, unscaled gradients, as after
torch.amp's ``scaler.unscale_(optimizer)``; and the overflow check covers both what backward
produced and what the optimizer finally reads.

The reference is the same step in eager PyTorch with ``torch.amp.GradScaler`` (``scale(loss)
.backward(); unscale_(opt); <the same code>; step(opt); update()``), against ``dlspass`` in the
``torch`` policy: the same skips, scales, returned values and weights. The overflow is a true
loss-scaling overflow: a loss term whose gradient is finite (1e36) but not once scaled, in one
parameter's gradient only, so a clip by value turns it into finite values; only the check of
what backward produced sees it (torch.amp skips that step too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import dlspass

INIT, INTERVAL = 2.0**10, 3
OVERFLOW_STEPS = (3, 7)  # the second one after a growth (scale 2**10 -> 2**9 -> 2**10)
HUGE = 1e36  # finite, but its gradient overflows float32 once scaled by 2**9 or more


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # k * bias: zero in a normal step; in an overflow step its gradient, k, overflows once scaled
    return F.mse_loss(model(x), y) + (model[0].bias * k).sum()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g) * 3, torch.randn(4, 4, generator=g),
             torch.tensor(HUGE if i in OVERFLOW_STEPS else 0.0)) for i in range(n)]


def clip_norm(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the norm before the clip


def clip_value(model: torch.nn.Module) -> torch.Tensor:
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])


def log_norm(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])


UserCode = Callable[[torch.nn.Module], torch.Tensor]


def _clip_norm_step() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable]:
    """A fresh model, its SGD and a plain step that clips by norm between backward and step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return model, opt, step


def _torch_amp_run(code: UserCode, opt_cls, opt_kw, batches):
    model = _model()
    opt = opt_cls(model.parameters(), **opt_kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    rows = []
    for x, y, k in batches:
        loss = _loss(model, x, y, k)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        logged = code(model)
        skipped = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rows.append((skipped, scaler.get_scale(), loss.detach(), logged.detach()))
    return model, rows


def _dlspass_run(code: UserCode, opt_cls, opt_kw, batches, **compile_kw):
    model = _model()
    opt = opt_cls(model.parameters(), **opt_kw)
    scaler = dlspass.GradScaler(policy="torch", init_scale=INIT, steps_per_increase=INTERVAL)

    def step(x, y, k):
        loss = _loss(model, x, y, k)
        loss.backward()
        logged = code(model)
        opt.step()
        opt.zero_grad()
        return loss.detach(), logged

    compile_kw.setdefault("backend_compiler", "eager")
    compiled = dlspass.compile(step, optimizer=opt, scaler=scaler, mixed_precision=False,
                               **compile_kw)
    rows = []
    for x, y, k in batches:
        loss, logged = compiled(x, y, k)
        rows.append((bool(scaler.found_inf), float(scaler.get_scale()), loss, logged))
    return model, rows


def _assert_same_runs(code: UserCode, opt_cls, opt_kw, n: int = 12, **kw) -> None:
    batches = _batches(n)
    ref_model, ref = _torch_amp_run(code, opt_cls, opt_kw, batches)
    model, got = _dlspass_run(code, opt_cls, opt_kw, batches, **kw)
    assert [r[0] for r in ref] == [i in OVERFLOW_STEPS for i in range(n)]  # the reference overflows
    assert [r[1] for r in ref] != [INIT] * n  # and its scale moves both ways
    assert [r[0] for r in got] == [r[0] for r in ref]
    assert [r[1] for r in got] == [r[1] for r in ref]
    for i, ((*_, loss, logged), (*_, ref_loss, ref_logged)) in enumerate(zip(got, ref, strict=True)):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"loss of step {i}")
        if i not in OVERFLOW_STEPS:
            torch.testing.assert_close(logged, ref_logged, rtol=1e-5, atol=1e-6,
                                       msg=f"logged gradient norm of step {i}")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("code", [clip_norm, clip_value, log_norm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("opt_cls,opt_kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                            (torch.optim.Adam, {"lr": 1e-2})],
                         ids=["SGD", "Adam"])
def test_user_code_after_backward_sees_unscaled_gradients_as_with_torch_amp(code, opt_cls, opt_kw):
    _assert_same_runs(code, opt_cls, opt_kw)


def test_user_clip_under_inductor_matches_torch_amp():
    """Inductor's decompositions would turn backward's ``empty_like(param)`` into a bare
    ``empty``; it stays whole through the trace, so the store into ``.grad`` is found."""
    _assert_same_runs(clip_norm, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, n=8,
                      backend_compiler="inductor")


def test_max_gradient_norm_clips_what_the_optimizer_reads_after_the_user_clip():
    """dlspass's own clip (``max_gradient_norm``) acts where torch.amp users put a second
    clip: on the gradients the optimizer reads, after the step's own code."""
    batches = _batches(10)

    def both_clips(model: torch.nn.Module) -> torch.Tensor:
        logged = clip_value(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        return logged

    ref_model, ref = _torch_amp_run(both_clips, torch.optim.SGD, {"lr": 0.1}, batches)
    model, got = _dlspass_run(clip_value, torch.optim.SGD, {"lr": 0.1}, batches,
                              max_gradient_norm=0.01)
    assert [r[:2] for r in got] == [r[:2] for r in ref]
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_the_gradients_backward_produced_are_unscaled_before_the_step_code_reads_them():
    """The graph: each parameter's gradient as backward stored it is tagged BACKWARD_GRAD and
    read only through its UNSCALE node; the user's clip reads the unscaled values (the pipeline
    verified the graph before it wrote the updates in place)."""
    from dlspass.graph import roles

    model, opt, step = _clip_norm_step()
    compiled = dlspass.compile(step, optimizer=opt, scaler=dlspass.GradScaler(policy="torch"),
                               model=model, mixed_precision=False, backend_compiler="eager")
    compiled(torch.randn(4, 8), torch.randn(4, 4))
    graph = compiled.graphs[0].graph
    raw = roles.nodes_with_role(graph, roles.BACKWARD_GRAD)
    assert sorted(roles.target_of(n) for n in raw) == sorted(n for n, _ in model.named_parameters())
    for n in raw:
        assert {roles.role_of(u) for u in n.users} == {roles.UNSCALE}, n.users
    (norm,) = [n for n in graph.nodes if n.target is torch.ops.aten._foreach_norm.Scalar]
    assert {roles.role_of(a) for a in norm.all_input_nodes} == {roles.UNSCALE}


def test_clip_by_value_of_an_overflow_still_skips_the_step():
    """The overflow step's bias gradient is inf once scaled and the clip makes it 0.02: the
    optimizer reads finite values, yet the step is skipped (what backward produced overflowed),
    as torch.amp's unscale_ found before the clip."""
    batches = _batches(OVERFLOW_STEPS[0] + 1)
    before, _ = _dlspass_run(clip_value, torch.optim.SGD, {"lr": 0.1}, batches[:-1])
    after, rows = _dlspass_run(clip_value, torch.optim.SGD, {"lr": 0.1}, batches)
    assert torch.isfinite(rows[-1][3])  # what the optimizer would read is finite
    assert rows[-1][0] is True and rows[-1][1] == rows[-2][1] / 2
    for (name, p), q in zip(after.named_parameters(), before.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_non_finite_values_made_by_the_step_code_skip_the_step():
    """Finite gradients that the step's own code turns into NaN: the optimizer would read NaN,
    so the step is skipped (torch.amp checks only before that code and would write NaN into
    the weights; dlspass keeps them)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dlspass.GradScaler(policy="torch", init_scale=INIT, steps_per_increase=INTERVAL)

    def step(x, y, factor):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.grad.mul_(factor)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled = dlspass.compile(step, optimizer=opt, scaler=scaler, mixed_precision=False,
                               backend_compiler="eager")
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    compiled(x, y, torch.tensor(1.0))
    assert not bool(scaler.found_inf)
    before = copy.deepcopy(model.state_dict())
    compiled(x, y, torch.tensor(float("nan")))
    assert bool(scaler.found_inf) and float(scaler.get_scale()) == INIT / 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    compiled(x, y, torch.tensor(1.0))
    assert not bool(scaler.found_inf)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_data_parallel_step_that_clips_itself_is_refused_at_the_first_call(tmp_path):
    """With process_group the gradients are averaged in the graph after the step's own code
    would read them (DDP averages before): refused in one line naming the fix."""
    import torch.distributed as dist

    from dlspass.capture.step_pipeline import StepCaptureError

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        _, opt, step = _clip_norm_step()
        compiled = dlspass.compile(step, optimizer=opt, scaler=dlspass.GradScaler(policy="torch"),
                                   process_group=True, backend_compiler="eager")
        with pytest.raises(StepCaptureError, match="max_gradient_norm=") as e:
            compiled(torch.randn(4, 8), torch.randn(4, 4))
        assert len(str(e.value).splitlines()) == 1
    finally:
        dist.destroy_process_group()
