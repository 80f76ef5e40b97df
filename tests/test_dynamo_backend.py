"""backend="dlspass": registration, 16-bit lowering of forward and backward, options, make_backend."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from tolerance import (
    gpt_grad_sums,
    gpt_matmul_roundings,
    grad_term_sums,
    reordered_sum_atol,
    roundings_atol,
)

import dlspass
from dlspass import formats
from dlspass.capture import dynamo_backend
from dlspass.config import ConfigError
from dlspass.graph import roles

assert formats.round_to_format  # registers the dlspass::round_to_format op
ROUND = torch.ops.dlspass.round_to_format.default


def _r16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4), torch.randn(3, 8) * 3


def test_backend_is_registered_by_name():
    assert "dlspass" in torch._dynamo.list_backends()


def _rounded_tol(fmt: str, same_ops: bool) -> dict[str, float]:
    """How far apart two results of float32 math on ``fmt``-rounded inputs, rounded to ``fmt``,
    may be. ``same_ops`` (the same ATen ops in the same order: round, float32 kernel, round):
    bit equality. Otherwise the float32 sums differ by their reordering (tests/tolerance.py),
    far below an ``fmt`` ulp, and the final rounding can then land one ``fmt`` ulp away: at
    most eps * |value|, or the subnormal spacing near zero."""
    from dlspass.formats import get_format

    if same_ops:
        return {"rtol": 0.0, "atol": 0.0}
    f = get_format(fmt)
    return {"rtol": f.eps, "atol": f.min_subnormal}


@pytest.mark.parametrize("mode", ["emulate", "native"])
def test_forward_and_backward_lowered_to_float16(mode):
    torch._dynamo.reset()
    model, x = _linear()
    cmodel = torch.compile(model, backend="dlspass", options={
        "fp16_type": "float16", "precision_mode": mode, "backend_compiler": "eager"})
    out = cmodel(x)
    w, b = model.weight, model.bias
    # float16 inputs, float32 accumulation, float16 output: computed independently here
    expected = _r16(F.linear(_r16(x), _r16(w), _r16(b)))
    torch.testing.assert_close(out, expected, **_rounded_tol("float16", same_ops=mode == "emulate"))
    assert not torch.equal(out, F.linear(x, w, b))  # the lowering changed something

    grad_out = torch.randn_like(out) * 7
    out.backward(grad_out)
    expected_gw = _r16(_r16(grad_out).t() @ _r16(x))
    torch.testing.assert_close(w.grad, expected_gw, **_rounded_tol("float16", same_ops=mode == "emulate"))

    # the same backend as a make_backend object, which keeps the graphs it rewrote
    torch._dynamo.reset()
    backend = dlspass.make_backend(fp16_type="float16", precision_mode=mode, backend_compiler="eager")
    grad_w = w.grad.clone()
    model.zero_grad()
    out2 = torch.compile(model, backend=backend)(x)
    assert torch.equal(out2, out)
    out2.backward(grad_out)
    assert torch.equal(w.grad, grad_w)
    fw, bw = backend.graphs
    for gm in (fw, bw):
        rounds = [n for n in gm.graph.nodes if n.target is ROUND]
        if mode == "native":  # real float16 kernels, no rounding op
            mm = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default,
                                                             torch.ops.aten.addmm.default)]
            assert mm and not rounds and all(n.meta["val"].dtype == torch.float16 for n in mm)
            continue
        assert rounds and all(n.args[1] == "float16" for n in rounds)
        assert all(roles.role_of(n) == roles.CAST for n in rounds)


def test_cbfloat16_with_inductor_matches_eager_backend():
    from dlspass.formats import round_to_format

    model, x = _linear()
    outs = {}
    for bc in ("eager", "inductor"):
        torch._dynamo.reset()
        outs[bc] = torch.compile(model, backend="dlspass",
                                 options={"fp16_type": "cbfloat16", "backend_compiler": bc})(x)
    # inductor's kernels against the eager backend's ATen ops (tests/tolerance.py)
    torch.testing.assert_close(outs["inductor"], outs["eager"], **_rounded_tol("cbfloat16", same_ops=False))
    r = lambda t: round_to_format(t, "cbfloat16")  # noqa: E731
    expected = r(F.linear(r(x), r(model.weight), r(model.bias)))
    # the eager backend runs the reference's ops: bit equality
    torch.testing.assert_close(outs["eager"].detach(), expected.detach(),
                               **_rounded_tol("cbfloat16", same_ops=True))


def test_options_are_validated():
    with pytest.raises(ConfigError, match="unknown option.*'loss_scale'"):
        dynamo_backend.validate_options({"loss_scale": 2.0})
    with pytest.raises(ConfigError, match="fp16_type: unknown format 'float8'"):
        dynamo_backend.validate_options({"fp16_type": "float8"})
    with pytest.raises(ConfigError, match="mixed_precision: expected a bool"):
        dlspass.make_backend(mixed_precision="yes")
    torch._dynamo.reset()
    model, x = _linear()
    # raised while dynamo compiles: torch's documented wrapper, the dlspass error inside it
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="unknown option") as info:
        torch.compile(model, backend="dlspass", options={"fp16": "float16"})(x)
    assert isinstance(info.value.inner_exception, ConfigError)


def test_make_backend_scales_seed_and_checks_in_backward():
    torch._dynamo.reset()
    model, x = _linear()
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10)
    backend = dlspass.make_backend(scaler=scaler, mixed_precision=False, backend_compiler="eager")
    cmodel = torch.compile(model, backend=backend)

    cmodel(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    # the backward ran scaled by 2**10 and came back unscaled: same gradients as plain fp32,
    # bit for bit (backend_compiler="eager" runs eager's ATen ops in its order; the scale is a
    # power of two, exact)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert bool(scaler.backend_found_finite)
    fw, bw = backend.graphs
    (scaled,) = roles.nodes_with_role(bw.graph, roles.SCALED_SEED)
    assert scaled.args[0].name.startswith("tangents")
    assert roles.nodes_with_role(bw.graph, roles.ISFINITE)
    added = [n for n in bw.graph.nodes if roles.pass_of(n) == "scale_backward"]
    assert added and all(isinstance(n.meta.get("val"), torch.Tensor) for n in added)

    model.zero_grad()
    bad = x.clone()
    bad[0, 0] = float("inf")
    cmodel(bad).pow(2).mean().backward()
    assert not bool(scaler.backend_found_finite)


def _step_both(x: torch.Tensor, compiled: tuple, reference: tuple) -> None:
    """One step of each ``(model, scaler, optimizer)``: the compiled model's backward without
    ``scaler.scale`` (the backend scales the seed itself), the eager reference's through it."""
    cmodel, scaler, opt = compiled
    cmodel(x).pow(2).mean().backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    model, ref_scaler, ref_opt = reference
    ref_scaler.scale(model(x).pow(2).mean()).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    ref_opt.zero_grad()


def test_make_backend_with_scaler_step_and_update_matches_eager_scaler():
    """The backend's in-graph check drives GradScaler.step/update like the eager scaler's own."""
    torch._dynamo.reset()
    model, x = _linear()
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    cfg = dict(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=2)
    scaler, ref_scaler = dlspass.GradScaler(**cfg), dlspass.GradScaler(**cfg)
    backend = dlspass.make_backend(scaler=scaler, mixed_precision=False, backend_compiler="eager")
    cmodel = torch.compile(model, backend=backend)
    for i in range(6):
        xi = x.clone()
        if i in (1, 4):
            xi[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        _step_both(xi, (cmodel, scaler, opt), (reference, ref_scaler, ref_opt))
        assert scaler.get_scale().item() == ref_scaler.get_scale().item(), i
        if i in (1, 4):
            for p, q in zip(before, model.parameters(), strict=True):
                assert torch.equal(p, q)
        # bit equality: the eager backend's ATen ops in eager's order, a power-of-two scale
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert scaler.get_num_skipped_steps().item() == 2


def test_make_backend_with_torch_grad_scaler_steps_like_torch_amp():
    """With the backend scaling the seed, nothing calls ``scaler.scale(loss)``, which is where
    torch.amp sets its scale up: the first ``step`` must not fail (``_scale is None``), and the
    run must follow torch.amp.GradScaler's on the eager model (skips, scales, weights)."""
    torch._dynamo.reset()
    model, x = _linear()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = dlspass.TorchGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    backend = dlspass.make_backend(scaler=scaler, mixed_precision=False, backend_compiler="eager")
    cmodel = torch.compile(model, backend=backend)
    for i in range(5):
        xi = x.clone()
        if i == 1:
            xi[0, 0] = float("inf")
        _step_both(xi, (cmodel, scaler, opt), (reference, ref_scaler, ref_opt))
        assert scaler.get_scale() == ref_scaler.get_scale(), i
        # bit equality: the eager backend's ATen ops in eager's order, a power-of-two scale
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert scaler.get_num_skipped_steps().item() == 1


class _GraphBreak(torch.nn.Module):
    """The issue's reproduction: two graphs, the overflow in the second one's backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h + off).sum()


def _train_scaled(step_loss, model, n_steps: int, bad_step: int, *, backend_scaled: bool):
    """SGD steps driven by a dlspass.GradScaler; returns (scales, weights after each step)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=2)
    backend = dlspass.make_backend(scaler=scaler, mixed_precision=False, backend_compiler="eager")
    scales, weights = [], []
    for i in range(n_steps):
        for loss in step_loss(model, i == bad_step, backend if backend_scaled else None):
            (loss if backend_scaled else scaler.scale(loss)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale().item())
        weights.append([p.detach().clone() for p in model.parameters()])
    return scales, weights, scaler


def _compiled_losses(micro_losses):
    """``losses(model, bad, backend)`` for `_train_scaled`: ``micro_losses(run, bad)`` with
    ``run`` the model, compiled once with ``backend`` when one is given."""
    compiled: dict[int, torch.nn.Module] = {}

    def losses(model, bad, backend):
        run = model
        if backend is not None:
            run = compiled.setdefault(id(model), torch.compile(model, backend=backend))
        yield from micro_losses(run, bad)

    return losses


def _graph_break_losses(run, bad):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    yield run(x, torch.full((8,), float("inf") if bad else 0.0))


def _accumulated_losses(run, bad):
    g = torch.Generator().manual_seed(2)
    for micro in range(2):  # the overflow is in the first micro-batch only
        x = torch.randn(3, 8, generator=g)
        if bad and micro == 0:
            x[0, 0] = float("inf")
        yield run(x).pow(2).mean()


@pytest.mark.parametrize("case", ["graph_break", "accumulation"])
def test_make_backend_skips_overflow_in_any_backward_like_eager_scaler(case):
    """Several backward graphs (graph break) or several backward calls (accumulation) per step:
    the flags combine, so the step with one overflow is skipped as the eager scaler skips it."""
    torch._dynamo.reset()
    if case == "graph_break":
        make, losses = _GraphBreak, _compiled_losses(_graph_break_losses)
    else:
        make, losses = (lambda: _linear()[0]), _compiled_losses(_accumulated_losses)
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    got = _train_scaled(losses, model, 5, 2, backend_scaled=True)
    want = _train_scaled(losses, reference, 5, 2, backend_scaled=False)
    assert got[0] == want[0]  # same scale trajectory
    assert got[2].get_num_skipped_steps().item() == want[2].get_num_skipped_steps().item() == 1
    for i, (ws, rs) in enumerate(zip(got[1], want[1], strict=True)):
        for w, r in zip(ws, rs, strict=True):
            assert torch.isfinite(w).all(), i
            # bit equality: the eager backend's ATen ops in eager's order, a power-of-two scale
            torch.testing.assert_close(w, r, rtol=0, atol=0)
    for w, r in zip(got[1][1], got[1][2], strict=True):
        assert torch.equal(w, r)  # the skipped step left the weights as they were


def test_make_backend_graph_break_float16_overflow_in_second_graph():
    """The issue's float16 reproduction: ``h + off`` overflows float16 only in ``b``'s graph."""
    torch._dynamo.reset()
    model = _GraphBreak()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10)
    cmodel = torch.compile(model, backend=dlspass.make_backend(
        scaler=scaler, fp16_type="float16", backend_compiler="eager"))
    x = torch.randn(3, 8)
    for off in (0.0, 1e5, 0.0):  # 1e5 is finite in float32, past float16's 65504
        before = [p.detach().clone() for p in model.parameters()]
        cmodel(x, torch.full((8,), off)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        if off:
            assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
    assert scaler.get_num_skipped_steps().item() == 1
    assert scaler.get_scale().item() == 2.0**9


class _FusedQKV(torch.nn.Module):
    """GPT-2's attention in small: one fused projection split into q, k, v, viewed per head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(16, -1)
        b, t, _ = x.shape
        q, k, v = (h.view(b, t, 2, 8).transpose(1, 2) for h in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2)).softmax(-1)
        return torch.matmul(w, v).transpose(1, 2).reshape(b, t, 16).pow(2).mean()


@pytest.mark.parametrize("entry", [
    pytest.param("dlspass", marks=pytest.mark.slow), "no_mixed_precision",
    pytest.param("make_backend", marks=pytest.mark.slow)])
def test_fused_qkv_through_inductor_on_a_cold_cache(entry, tmp_path, monkeypatch):
    """Inductor gets the AOT graphs the way its own backend hands them over (no re-trace of an
    AOT graph: that failed with "Cannot view a tensor ..." on a cold cache)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    model, reference = _FusedQKV(), _FusedQKV()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10)
    if entry == "make_backend":
        cmodel = torch.compile(model, backend=dlspass.make_backend(scaler=scaler))
    else:
        cmodel = torch.compile(model, backend="dlspass",
                               options={"mixed_precision": entry == "dlspass"})
    with torch._inductor.config.patch(fx_graph_cache=False):
        loss = cmodel(x)
        loss.backward()
    ref = reference(x)
    ref.backward()
    terms = grad_term_sums(reference, lambda m: m(x))
    if entry == "no_mixed_precision":
        # inductor's kernels against eager's: the float32 sums in other orders and exp by
        # another implementation (tests/tolerance.py). The loss's chain: the projection's 16
        # terms, q.k's 8, softmax's sum over 5 keys (and exp's roundings, one per side), w.v's 5,
        # then the mean of 2 x 5 x 16 squares (terms >= 0, S = the loss); a gradient's: the
        # forward up to the mean, then back through w.v (8 and 5 terms), softmax (5), q.k (5) and
        # the projection's sum over 2 x 5 tokens, S its terms' magnitudes
        forward = 16 + 8 + 5 + 2 + 5
        loss_atol = reordered_sum_atol(forward + 2 * 5 * 16, float(ref))
        grad_atol = {k: reordered_sum_atol(forward + 8 + 5 + 5 + 5 + 10, t) for k, t in terms.items()}
    else:
        # float16 mixed precision against float32 eager: every input and output of the three
        # matmuls of the forward (the projection, q.k, w.v) rounded to float16, 9 roundings on
        # the way to the output, which the loss squares (18); a gradient's chain adds the
        # backward's: w.v's and q.k's input gradients and the projection's weight gradient, 3
        # roundings each (tests/tolerance.py)
        eps16 = formats.get_format("float16").eps
        loss_atol = roundings_atol(18, float(ref), eps16)
        grad_atol = {k: roundings_atol(9 + 9, t, eps16) for k, t in terms.items()}
    torch.testing.assert_close(loss, ref, rtol=0, atol=loss_atol)
    for (k, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=grad_atol[k], msg=k)
    if entry == "make_backend":
        assert bool(scaler.backend_found_finite)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two cold inductor compiles of GPT-2; far longer on a busy machine
@pytest.mark.parametrize("options", [{"mixed_precision": False}, {"fp16_type": "cbfloat16"}])
def test_transformers_gpt2_through_backend_on_a_cold_cache(options, tmp_path, monkeypatch):
    """transformers' GPT-2 (tiny config, random weights) trains through backend="dlspass"; the
    AOT graphs handed to the top-level compile_fx failed in the re-trace ("Cannot view ...")."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    # no dropout: the compiled graphs and eager torch draw different random numbers
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    reference = transformers.GPT2LMHeadModel(cfg)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch._inductor.config.patch(fx_graph_cache=False):
        loss = torch.compile(model, backend="dlspass", options=options)(input_ids=ids, labels=ids).loss
        loss.backward()
    terms = grad_term_sums(reference, lambda m: m(input_ids=ids, labels=ids).loss)
    ref = reference(input_ids=ids, labels=ids).loss
    ref.backward()
    if options.get("mixed_precision") is False:
        # inductor's kernels against eager's: GPT-2's chain of sums (32 wide, 2 blocks, 8
        # positions, 16 tokens; the loss's forward part and the mean over the tokens, of positive
        # terms), S the loss, a gradient's terms' magnitudes (tests/tolerance.py)
        n = gpt_grad_sums(d=32, n_layer=2, vocab=64, seq=8, tokens=16)
        loss_atol = reordered_sum_atol(n + 16, float(ref))
        grad_atol = {k: reordered_sum_atol(n, t) for k, t in terms.items()}
    else:
        # cbfloat16 against float32: every matmul's inputs and output rounded along the longest
        # chain (tests/tolerance.py); the loss sees the forward's part of it
        eps = formats.get_format("cbfloat16").eps
        loss_atol = roundings_atol(3 * (6 * 2 + 1), float(ref), eps)
        grad_atol = {k: roundings_atol(gpt_matmul_roundings(n_layer=2), t, eps) for k, t in terms.items()}
    torch.testing.assert_close(loss, ref, rtol=0, atol=loss_atol)
    for (k, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=grad_atol[k], msg=k)


def test_make_backend_flag_serves_every_optimizer_of_the_step_and_no_later_step():
    """The backend unscales and checks every gradient of the step once: a second optimizer must
    neither unscale its gradients again nor miss the overflow, and a step whose ``unscale_``
    returns early (no gradients) must not leave the flag to decide the next step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    scaler = dlspass.GradScaler(init_scale=2.0**10)
    backend = dlspass.make_backend(scaler=scaler, mixed_precision=False, backend_compiler="eager")
    cmodel = torch.compile(model, backend=backend)
    opts = [torch.optim.SGD(model[i].parameters(), lr=0.1) for i in range(2)]
    x = torch.randn(16, 8)

    cmodel(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for opt in opts:
        scaler.unscale_(opt)
    # each optimizer's gradients unscaled once (the backend's), not again by unscale_: bit
    # equality (the eager backend's ATen ops in eager's order, a power-of-two scale)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    for opt in opts:
        scaler.step(opt)
    scaler.update()

    before = [p.detach().clone() for p in model.parameters()]
    bad = x.clone()
    bad[0, 0] = float("inf")
    for opt in opts:
        opt.zero_grad()
    cmodel(bad).pow(2).mean().backward()
    for opt in opts:  # the overflow skips both optimizers, not only the first to unscale
        scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    # an overflowing backward, then a step with no gradients at all: its flag must not carry
    cmodel(bad).pow(2).mean().backward()
    for opt in opts:
        opt.zero_grad(set_to_none=True)
        scaler.step(opt)
    scaler.update()
    assert scaler.backend_found_finite is None
    # a clean eager step afterwards is checked on its own gradients and steps
    scaler.scale(model(x).pow(2).mean()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_inductor_compile_settings_come_from_the_signature_torch_has() -> None:
    """torch 2.13's create_compiler_config_extra reads the graph module, torch 2.11's (the GPU
    image's) inductor's config module: each gets what its signature names."""
    import types

    from torch._inductor import compile_fx as cfx

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    got = []
    old = types.SimpleNamespace(create_compiler_config_extra=lambda config: got.append(config))
    new = types.SimpleNamespace(create_compiler_config_extra=lambda gm: got.append(gm))
    sentinel = object()
    dynamo_backend._compiler_config_extra(old, gm, sentinel)
    dynamo_backend._compiler_config_extra(new, gm, sentinel)
    assert got == [sentinel, gm]
    # and torch's own (2.13) accepts the graph module
    assert dynamo_backend._compiler_config_extra(cfx, gm, sentinel).cudagraphs is not None


@pytest.mark.parametrize("watch", [True, "all"])
@pytest.mark.parametrize("how", ["options", "make_backend"])
def test_telemetry_in_the_config_is_refused_not_ignored(how: str, watch: bool | str) -> None:
    config = dlspass.DLSConfig(fp16_type="float16", telemetry=watch)
    # the message names the value the user gave
    msg = re.escape(f"telemetry={watch!r} is not supported by backend='dlspass'")
    if how == "make_backend":
        with pytest.raises(ConfigError, match=msg):
            dlspass.make_backend(scaler=dlspass.GradScaler(config=config))
        return
    torch._dynamo.reset()
    # raised while dynamo compiles: torch's documented wrapper, the dlspass error inside it
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=msg) as info:
        torch.compile(torch.nn.Linear(2, 2), backend="dlspass", options={"config": config})(torch.randn(1, 2))
    assert isinstance(info.value.inner_exception, ConfigError)
