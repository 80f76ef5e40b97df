"""capture_step: the captured graph against eager torch.optim and the eager dlspass.GradScaler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tolerance import (
    adam_state_atols,
    adam_step_atol,
    assert_close_reordered,
    assert_within,
    gpt_matmul_roundings,
    grad_term_sums,
    reordered_sum_atol,
    roundings_atol,
    sgd_update_atol,
    smallcnn_grad_sums,
)

import dlspass
from dlspass import formats
from dlspass.capture.functional import CaptureError
from dlspass.graph import roles
from dlspass.models import MLP, SmallCNN, TinyGPT, copy_task_batch

OVERFLOW_STEPS = {3, 7, 8, 15}
STEPS = 20


def mlp_loss(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"]) * batch["mult"]


def cnn_loss(model, batch):
    x, y, mult = batch
    return F.cross_entropy(model(x), y) * mult


def gpt_loss(model, batch):
    idx, tgt, mult = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1)) * mult


def make_case(name: str, seed: int = 0):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        model = MLP()

        def batch(i, mult=1.0):
            g = torch.Generator().manual_seed(100 + i)
            return {"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g),
                    "mult": torch.tensor(mult)}

        return model, mlp_loss, batch
    if name == "cnn":
        model = SmallCNN()

        def batch(i, mult=1.0):
            g = torch.Generator().manual_seed(100 + i)
            return (torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g),
                    torch.tensor(mult))

        return model, cnn_loss, batch
    model = TinyGPT(vocab=32, d=16, n_layer=1, n_head=2, block_size=16)
    del gen

    def batch(i, mult=1.0):
        g = torch.Generator().manual_seed(100 + i)
        idx, tgt = copy_task_batch(32, 4, 12, g)
        return idx, tgt, torch.tensor(mult)

    return model, gpt_loss, batch


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def _state_snapshot(model, opt):
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = {(i, k): (v.clone() if torch.is_tensor(v) else v)
             for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
             for k, v in opt.state.get(p, {}).items()}
    return params, state


def _assert_equal(a, b):
    """Bit equality of two dicts of tensors (or plain values): the captured step runs, without
    compiling, the ATen ops eager autograd and torch.optim dispatch, in the same order, and the
    loss scale is a power of two (exact), so both sides round identically on every CPU."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            torch.testing.assert_close(x, torch.as_tensor(y).to(x.dtype), rtol=0, atol=0,
                                       msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert x == y, k


# SmallCNN's BatchNorm is traced as ATen ops that sum in other orders than eager's fused
# kernels, forward and backward: the loss and the gradients differ by the reordering of these
# chains of sums (4 images of 8 x 8, width 8, 10 classes; the loss adds the batch mean of 4
# positive terms; tests/tolerance.py), and a run's differences grow with the steps, so each
# CNN step starts the reference from the captured step's state and compares one step.
CNN_GRAD_SUMS = smallcnn_grad_sums(width=8, n_classes=10, batch=4, hw=8, forward=True)
CNN_LOSS_SUMS = CNN_GRAD_SUMS - smallcnn_grad_sums(width=8, n_classes=10, batch=4, hw=8) + 4


def _sync(model, opt, ref_model, ref_opt) -> None:
    """The reference takes the captured run's parameters, buffers and optimizer state."""
    ref_model.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _start(model, loss_fn, b) -> tuple[list, dict, dict, dict]:
    """At the shared start: the parameters, the eager gradients, their bounds (CNN_GRAD_SUMS,
    S from tolerance.grad_term_sums) and each BatchNorm's input (for its buffers' bounds)."""
    cp = copy.deepcopy(model)
    bn_inputs = {}
    for name, mod in cp.named_modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.register_forward_hook(lambda m, a, r, name=name: bn_inputs.__setitem__(name, a[0].detach()))
    grads = dict(zip([k for k, _ in cp.named_parameters()],
                     torch.autograd.grad(loss_fn(cp, b), list(cp.parameters())), strict=True))
    terms = grad_term_sums(model, lambda m: loss_fn(m, b))
    grad_atol = {k: reordered_sum_atol(CNN_GRAD_SUMS, t) for k, t in terms.items()}
    return [p.detach().clone() for p in model.parameters()], grads, grad_atol, bn_inputs


def _assert_bn_buffers(model, ref_model, bn_inputs: dict) -> None:
    """BatchNorm's running statistics, r' = (1 - m) r + m * stat, traced against eager's fused
    kernel: the batch mean (N terms, S = mean |x|) and the unbiased variance (the mean, then N
    squares: terms >= 0, S = the variance) summed in other orders, times m, plus the update's
    roundings (three, of values at most (1 - m) |r| + m |stat|) (tests/tolerance.py)."""
    eps32 = torch.finfo(torch.float32).eps
    for name, x in bn_inputs.items():
        mod, ref = model.get_submodule(name), ref_model.get_submodule(name)
        m, n = ref.momentum, x.numel() // x.shape[1]
        dims = (0, 2, 3)
        for buf, s_stat in (("running_mean", x.abs().mean(dims)), ("running_var", x.var(dims))):
            old = (getattr(ref, buf) - m * (x.mean(dims) if buf == "running_mean" else x.var(dims))) / (1 - m)
            atol = (m * reordered_sum_atol(2 * n, float(s_stat.max()))
                    + 3 * eps32 * float(((1 - m) * old.abs() + m * s_stat).max()))
            torch.testing.assert_close(getattr(mod, buf), getattr(ref, buf), rtol=0, atol=atol, msg=f"{name}.{buf}")
        assert torch.equal(mod.num_batches_tracked, ref.num_batches_tracked)


def _assert_one_step(i, model, opt, ref_model, ref_opt, start, grads, grad_atol) -> None:
    """One optimizer step from a shared start whose gradients differ by at most ``grad_atol``
    (per parameter; ``grads`` the eager ones): the parameters and state within the update's
    derived bounds (tests/tolerance.py)."""
    eps32 = torch.finfo(torch.float32).eps
    for (k, p), q, p0 in zip(model.named_parameters(), ref_model.parameters(), start, strict=True):
        group = ref_opt.param_groups[0]
        st, ref_st = opt.state[p], ref_opt.state[q]
        what = f"{k} of step {i}"
        if "momentum_buffer" in ref_st:  # SGD: g + wd p, 0.9 buf + g, p - lr buf
            g = grads[k] + group["weight_decay"] * p0
            atol = grad_atol[k] + 2 * eps32 * float(torch.maximum(g.abs(), ref_st["momentum_buffer"].abs()).max())
            torch.testing.assert_close(st["momentum_buffer"], ref_st["momentum_buffer"], rtol=0, atol=atol, msg=what)
            torch.testing.assert_close(p, q, rtol=0, atol=sgd_update_atol(atol, group["lr"], float(p0.abs().max())),
                                       msg=what)
            continue
        step = int(ref_st["step"])
        assert torch.equal(st["step"], ref_st["step"]), what
        g = grads[k] if isinstance(ref_opt, torch.optim.AdamW) else grads[k] + group["weight_decay"] * p0
        m_atol, v_atol = adam_state_atols(g, grad_atol[k], ref_st["exp_avg"], ref_st["exp_avg_sq"], group["betas"])
        assert_within(st["exp_avg"], ref_st["exp_avg"], m_atol, f"{what}: exp_avg")
        assert_within(st["exp_avg_sq"], ref_st["exp_avg_sq"], v_atol, f"{what}: exp_avg_sq")
        assert_within(p, q, adam_step_atol(g, grad_atol[k], ref_st["exp_avg"], ref_st["exp_avg_sq"], step,
                                           group["lr"], group["betas"], group["eps"], p0), what)


@pytest.mark.parametrize("model_name", ["mlp", "cnn", "gpt"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_fp32_dls_step_matches_eager_gradscaler(model_name, opt_name):
    model, loss_fn, batch = make_case(model_name)
    ref_model = copy.deepcopy(model)
    opt = OPTIMIZERS[opt_name](model.parameters())
    ref_opt = OPTIMIZERS[opt_name](ref_model.parameters())
    cfg = dlspass.DLSConfig(mixed_precision=False, initial_loss_scale=2.0**10, steps_per_increase=3)
    step = dlspass.capture_step(model, loss_fn, opt, batch(0), config=cfg)
    ref_scaler = dlspass.GradScaler(config=cfg)
    for i in range(STEPS):
        mult = float("inf") if i in OVERFLOW_STEPS else 1.0
        b = batch(i, mult)
        before = _state_snapshot(model, opt)
        if model_name == "cnn":
            _sync(model, opt, ref_model, ref_opt)
            start, grads, grad_atol, bn_inputs = _start(ref_model, loss_fn, b)
        loss = step(b)
        ref_loss = loss_fn(ref_model, b)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        assert step.scaler.get_scale().item() == ref_scaler.get_scale().item(), i
        assert step.scaler.get_num_skipped_steps().item() == ref_scaler.get_num_skipped_steps().item()
        if i in OVERFLOW_STEPS:
            after = _state_snapshot(model, opt)
            for k in before[0]:
                assert torch.equal(before[0][k], after[0][k]), (i, k)
            for k in before[1]:
                assert torch.equal(torch.as_tensor(before[1][k]), torch.as_tensor(after[1][k])), (i, k)
        elif model_name != "cnn":
            # bit equality: the forward runs the ATen ops eager dispatches, in the same order
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
        else:
            assert_close_reordered(loss, ref_loss.detach(), n=CNN_LOSS_SUMS)
            _assert_bn_buffers(model, ref_model, bn_inputs)
            _assert_one_step(i, model, opt, ref_model, ref_opt, start, grads, grad_atol)
        if model_name != "cnn":
            _assert_equal(dict(model.named_parameters()), dict(ref_model.named_parameters()))
            mine, ref = _state_snapshot(model, opt)[1], _state_snapshot(ref_model, ref_opt)[1]
            _assert_equal(mine, ref)
    assert step.scaler.get_num_skipped_steps().item() == len(OVERFLOW_STEPS)
    for p in model.parameters():
        assert torch.isfinite(p).all()


def test_no_config_captures_plain_fp32_step():
    model, loss_fn, batch = make_case("cnn")
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step = dlspass.capture_step(model, loss_fn, opt, batch(0))
    assert not any(roles.pass_of(n) for n in step.graph_module.graph.nodes)
    for i in range(5):
        # each step from the captured run's state, its gradients' bound (CNN_GRAD_SUMS)
        _sync(model, opt, ref, ref_opt)
        start, grads, grad_atol, bn_inputs = _start(ref, loss_fn, batch(i))
        step(batch(i))
        loss = loss_fn(ref, batch(i))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _assert_bn_buffers(model, ref, bn_inputs)
        _assert_one_step(i, model, opt, ref, ref_opt, start, grads, grad_atol)


def test_lr_scheduler_changes_lr_without_retrace():
    model, loss_fn, batch = make_case("mlp")
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    step = dlspass.capture_step(model, loss_fn, opt, batch(0),
                                config=dlspass.DLSConfig(mixed_precision=False))
    graph_code = step.graph_module.code
    for i in range(6):
        step(batch(i))
        sched.step()
        loss = loss_fn(ref, batch(i)) * 1.0
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    assert step.graph_module.code == graph_code
    _assert_equal(dict(model.named_parameters()), dict(ref.named_parameters()))


def test_every_tensor_leaf_is_an_input_including_0d():
    model, loss_fn, batch = make_case("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dlspass.capture_step(model, loss_fn, opt, batch(0))
    inputs = [n for n in step.graph_module.graph.nodes if roles.role_of(n) == roles.INPUT]
    assert len(inputs) == 3


def test_error_loss_not_scalar():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError, match="scalar floating-point"):
        dlspass.capture_step(model, lambda m, b: m(b), opt, torch.randn(2, 8))


def test_error_integer_parameter():
    model = MLP()
    model.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    opt = torch.optim.SGD([p for p in model.parameters() if p.is_floating_point()], lr=0.1)
    with pytest.raises(CaptureError, match="count"):
        dlspass.capture_step(model, lambda m, b: m(b).sum(), opt, torch.randn(2, 8))


def test_error_unsupported_optimizer_names_supported_ones():
    model = MLP()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="RMSprop.*SGD|SGD.*RMSprop"):
        dlspass.capture_step(model, lambda m, b: m(b).sum(), opt, torch.randn(2, 8))


def test_error_python_control_flow_on_tensor_values():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m, b):
        loss = m(b).pow(2).mean()
        if loss > 1.0:
            return loss * 2
        return loss

    with pytest.raises(CaptureError, match="control flow"):
        dlspass.capture_step(model, loss_fn, opt, torch.randn(2, 8))


def test_batch_structure_mismatch_is_an_error():
    model, loss_fn, batch = make_case("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dlspass.capture_step(model, loss_fn, opt, batch(0))
    with pytest.raises(CaptureError, match="batch structure"):
        step((batch(0)["x"], batch(0)["y"]))


def test_parameter_unused_by_the_loss_is_not_updated_like_torch_optim():
    model = MLP()
    model.unused = torch.nn.Linear(3, 3)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(2, 8)
    step = dlspass.capture_step(model, lambda m, b: m(b).sum(), opt, x,
                                config=dlspass.DLSConfig(mixed_precision=False))
    for _ in range(3):
        step(x)
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert torch.equal(model.unused.weight, ref.unused.weight)
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()
    _assert_equal(dict(model.named_parameters()), dict(ref.named_parameters()))


def test_cbfloat16_trains_transformers_gpt2_like_the_eager_scaler():
    """transformers' GPT-2 (tiny config, random weights) in cbfloat16: attention reshapes a
    transposed value, which failed ("view size is not compatible ...") while the eager rounding
    op returned a contiguous tensor and its fake kernel the input's strides. Same skips and
    scales as the eager GradScaler in float32, updates within cbfloat16's error (each step from
    the captured run's parameters: one step's rounding error, not a run's growth)."""
    transformers = pytest.importorskip("transformers")
    # no dropout: the captured step and eager torch draw different random numbers
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss_fn(m, batch):
        ids, mult = batch
        return m(input_ids=ids, labels=ids).loss * mult  # mult = inf injects an overflow

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    step = dlspass.capture_step(model, loss_fn, opt, (ids, torch.tensor(1.0)),
                                config=dlspass.DLSConfig(fp16_type="cbfloat16"))
    ref_scaler = dlspass.GradScaler(fp16_type="cbfloat16")
    # cbfloat16 against float32: every input and output of every matmul rounded, along the
    # longest chain of the 2-block model (tests/tolerance.py)
    k_roundings = gpt_matmul_roundings(n_layer=2)
    eps = formats.get_format("cbfloat16").eps
    for i in range(3):
        batch = (ids, torch.tensor(float("inf") if i == 1 else 1.0))
        reference.load_state_dict(model.state_dict())
        before = [p.detach().clone() for p in model.parameters()]
        if i != 1:
            terms = grad_term_sums(reference, lambda m, batch=batch: loss_fn(m, batch))
        step(batch)
        ref_scaler.scale(loss_fn(reference, batch)).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        assert step.scaler.get_scale().item() == ref_scaler.get_scale().item(), i
        assert all(torch.isfinite(p).all() for p in model.parameters()), i
        if i == 1:
            assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
            continue
        for (k, p), q, p0 in zip(model.named_parameters(), reference.parameters(), before, strict=True):
            atol = sgd_update_atol(roundings_atol(k_roundings, terms[k], eps), 0.5, float(p0.abs().max()))
            torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=f"{k} of step {i}")
    assert step.scaler.get_num_skipped_steps().item() == ref_scaler.get_num_skipped_steps().item() == 1


def test_the_users_error_is_an_input_error_and_a_dlspass_bug_is_not(monkeypatch):
    """Inside make_fx only torch's tracing errors and what the user's code raises become a
    CaptureError (CLI exit 2); a failure in dlspass's own code stays what it is (exit 3)."""
    from dlspass.capture import functional

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def bad_loss(m, b):
        raise ValueError("the user's own bug")

    with pytest.raises(CaptureError, match="the loss function raised ValueError: the user's own bug"):
        dlspass.capture_step(model, bad_loss, opt, torch.randn(2, 8))

    def broken_mark_grads(grads):
        raise KeyError("a dlspass bug")

    monkeypatch.setattr(functional, "mark_grads", broken_mark_grads)
    with pytest.raises(KeyError, match="a dlspass bug") as info:
        dlspass.capture_step(model, lambda m, b: m(b).sum(), opt, torch.randn(2, 8))
    assert not isinstance(info.value, dlspass.DLSInputError)
