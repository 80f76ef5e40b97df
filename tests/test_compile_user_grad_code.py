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
from tolerance import (
    assert_close_reordered,
    clip_norm_atols,
    grad_term_sums,
    reordered_sum_atol,
    sgd_update_atol,
)

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


def _torch_amp_step(code: UserCode, model, opt, scaler, x, y, k) -> tuple:
    """One step of the eager torch.amp loop: (skipped, scale, loss, logged)."""
    loss = _loss(model, x, y, k)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    logged = code(model)
    skipped = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return skipped, scaler.get_scale(), loss.detach(), logged.detach()


def _torch_amp(opt_cls, opt_kw) -> tuple:
    model = _model()
    opt = opt_cls(model.parameters(), **opt_kw)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)


def _torch_amp_run(code: UserCode, opt_cls, opt_kw, batches):
    model, opt, scaler = _torch_amp(opt_cls, opt_kw)
    return model, [_torch_amp_step(code, model, opt, scaler, x, y, k) for x, y, k in batches]


def _dlspass_compiled(code: UserCode, opt_cls, opt_kw, **compile_kw) -> tuple:
    """(model, optimizer, scaler, the compiled step returning (loss, logged))."""
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
    return model, opt, scaler, compiled


def _dlspass_run(code: UserCode, opt_cls, opt_kw, batches, **compile_kw):
    model, _, scaler, compiled = _dlspass_compiled(code, opt_cls, opt_kw, **compile_kw)
    rows = []
    for x, y, k in batches:
        loss, logged = compiled(x, y, k)
        rows.append((bool(scaler.found_inf), float(scaler.get_scale()), loss, logged))
    return model, rows


# Bit equality (EXACT) of a step compiled with backend_compiler="eager" and the eager torch.amp
# loop: the same ATen ops in the same order on the same values; the scale is a power of two, so
# scaling and unscaling (by its reciprocal, also a power of two) are exact on both sides.
EXACT = {"rtol": 0.0, "atol": 0.0}


def _assert_same_runs(code: UserCode, opt_cls, opt_kw, n: int = 12) -> None:
    batches = _batches(n)
    ref_model, ref = _torch_amp_run(code, opt_cls, opt_kw, batches)
    model, got = _dlspass_run(code, opt_cls, opt_kw, batches)
    assert [r[0] for r in ref] == [i in OVERFLOW_STEPS for i in range(n)]  # the reference overflows
    assert [r[1] for r in ref] != [INIT] * n  # and its scale moves both ways
    assert [r[0] for r in got] == [r[0] for r in ref]
    assert [r[1] for r in got] == [r[1] for r in ref]
    for i, ((*_, loss, logged), (*_, ref_loss, ref_logged)) in enumerate(zip(got, ref, strict=True)):
        torch.testing.assert_close(loss, ref_loss, **EXACT, msg=f"loss of step {i}")
        if i not in OVERFLOW_STEPS:
            torch.testing.assert_close(logged, ref_logged, **EXACT, msg=f"logged gradient norm of step {i}")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, **EXACT, msg=name)


@pytest.mark.parametrize("code", [clip_norm, clip_value, log_norm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("opt_cls,opt_kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                            (torch.optim.Adam, {"lr": 1e-2})],
                         ids=["SGD", "Adam"])
def test_user_code_after_backward_sees_unscaled_gradients_as_with_torch_amp(code, opt_cls, opt_kw):
    _assert_same_runs(code, opt_cls, opt_kw)


# The longest chain of sums behind _model()'s loss (Linear's 8 terms, tanh's roundings on
# either side, Linear's 16, the mean of 4 x 4 squares: terms >= 0, S = the loss) and behind one
# of its gradients (the forward up to the mean, then back through the second Linear's 4
# outputs, tanh's derivative's roundings, and the sum over the batch of 4) (tests/tolerance.py).
LOSS_SUMS = 8 + 2 + 16 + 16
GRAD_SUMS = 8 + 2 + 16 + 4 + 2 + 4


def _synced_steps(code: UserCode, ref_code: UserCode, kw: dict, n: int, **compile_kw):
    """The compiled step (running ``code``) and the eager torch.amp loop (running
    ``ref_code``) under SGD(``kw``), side by side over ``_batches(n)``, each step starting the
    reference from the compiled run's parameters and momentum buffers: where the two sides sum
    in other orders, a run's differences would grow with the steps, one step's are bounded.
    Checks that both skip the same steps (keeping the parameters bit for bit) with the same
    scales, and yields, per step that ran, ``(i, grads, terms, got, ref, pairs)``: the eager
    unscaled gradients and their terms' magnitudes at the shared start (tests/tolerance.py),
    the (loss, logged) of each side, and (parameter, reference parameter, start) triples."""
    model, opt, scaler, compiled = _dlspass_compiled(code, torch.optim.SGD, kw, **compile_kw)
    ref_model, ref_opt, ref_scaler = _torch_amp(torch.optim.SGD, kw)
    names = [name for name, _ in ref_model.named_parameters()]
    for i, (x, y, k) in enumerate(_batches(n)):
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                q.copy_(p)
                if "momentum_buffer" in opt.state[p]:
                    ref_opt.state[q]["momentum_buffer"] = opt.state[p]["momentum_buffer"].clone()
        start = [p.detach().clone() for p in model.parameters()]
        grads = dict(zip(names, torch.autograd.grad(_loss(ref_model, x, y, k), list(ref_model.parameters())),
                         strict=True))
        terms = grad_term_sums(ref_model, lambda m, x=x, y=y, k=k: _loss(m, x, y, k))
        skipped, scale, ref_loss, ref_logged = _torch_amp_step(ref_code, ref_model, ref_opt, ref_scaler, x, y, k)
        loss, logged = compiled(x, y, k)
        assert bool(scaler.found_inf) is skipped is (i in OVERFLOW_STEPS), i
        assert float(scaler.get_scale()) == float(scale), i
        if skipped:
            assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True)), i
            continue
        pairs = [(name, p, q, p0, opt.state[p], ref_opt.state[q]) for name, p, q, p0 in
                 zip(names, model.parameters(), ref_model.parameters(), start, strict=True)]
        yield i, grads, terms, (loss, logged), (ref_loss, ref_logged), pairs


def _assert_sgd_step(i: int, pairs: list, grad_atol: dict[str, float], lr: float) -> None:
    """One SGD(momentum) step's results, the optimizer's gradients within ``grad_atol``: the
    buffer (0.9 buf + g, two roundings of its magnitude) and the parameter (tests/tolerance.py)."""
    eps = torch.finfo(torch.float32).eps
    for name, p, q, p0, state, ref_state in pairs:
        if "momentum_buffer" in ref_state:
            buf, ref_buf = state["momentum_buffer"], ref_state["momentum_buffer"]
            torch.testing.assert_close(buf, ref_buf, rtol=0, msg=f"{name} momentum of step {i}",
                                       atol=grad_atol[name] + 2 * eps * float(ref_buf.abs().max()))
        torch.testing.assert_close(p, q, rtol=0, msg=f"{name} of step {i}",
                                   atol=sgd_update_atol(grad_atol[name], lr, float(p0.abs().max())))


def test_user_clip_under_inductor_matches_torch_amp():
    """Inductor's decompositions would turn backward's ``empty_like(param)`` into a bare
    ``empty``; it stays whole through the trace, so the store into ``.grad`` is found."""
    kw = {"lr": 0.1, "momentum": 0.9}
    for i, grads, terms, (loss, logged), (ref_loss, ref_logged), pairs in _synced_steps(
            clip_norm, clip_norm, kw, 8, backend_compiler="inductor"):
        # inductor's kernels against eager's: the loss's and the gradients' sums in other orders
        # (LOSS_SUMS, GRAD_SUMS), carried through the user's clip (and its logged norm) and the
        # update (tests/tolerance.py)
        assert_close_reordered(loss, ref_loss, n=LOSS_SUMS)
        clip_atol, norm_atol = clip_norm_atols(
            grads, {n: reordered_sum_atol(GRAD_SUMS, terms[n]) for n in grads}, 0.5)
        torch.testing.assert_close(logged, ref_logged, rtol=0, atol=norm_atol, msg=f"logged norm of step {i}")
        _assert_sgd_step(i, pairs, clip_atol, kw["lr"])


def test_max_gradient_norm_clips_what_the_optimizer_reads_after_the_user_clip():
    """dlspass's own clip (``max_gradient_norm``) acts where torch.amp users put a second
    clip: on the gradients the optimizer reads, after the step's own code."""

    def both_clips(model: torch.nn.Module) -> torch.Tensor:
        logged = clip_value(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        return logged

    for i, grads, _, (loss, _), (ref_loss, _), pairs in _synced_steps(
            clip_value, both_clips, {"lr": 0.1}, 10, max_gradient_norm=0.01):
        # bit equality up to dlspass's norm clip: the eager backend runs the loop's ATen ops in
        # its order (the forward, backward, the user's clip by value) ...
        torch.testing.assert_close(loss, ref_loss, **EXACT)
        # ... then dlspass's norm (a sum of squares per tensor, summed) against torch's
        # (_foreach_norm, then the norm of the norms): the same squares added in other orders,
        # the same gradients (tests/tolerance.py)
        clipped = {n: g.clamp(-0.02, 0.02) for n, g in grads.items()}
        clip_atol, _ = clip_norm_atols(clipped, dict.fromkeys(clipped, 0.0), 0.01)
        _assert_sgd_step(i, pairs, clip_atol, 0.1)


def test_the_step_code_reads_the_gradients_before_dlspass_own_norm_clip():
    """What the step's code returns from the gradients (clip_value's norm of the clipped
    values) is what torch.amp's loop computes before its own second clip, bit for bit (the
    eager backend runs the same ATen ops in the same order)."""

    def both_clips(model: torch.nn.Module) -> torch.Tensor:
        logged = clip_value(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        return logged

    batches = _batches(2)
    _, ref = _torch_amp_run(both_clips, torch.optim.SGD, {"lr": 0.1}, batches)
    _, got = _dlspass_run(clip_value, torch.optim.SGD, {"lr": 0.1}, batches, max_gradient_norm=0.01)
    assert float(ref[0][3]) > 0.01  # the second clip bites
    torch.testing.assert_close(got[0][3], ref[0][3], **EXACT)


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
