"""Tolerances derived from what is compared, for tests that check one floating-point result
against another.

Two cases, and a test says in a comment which one it is in:

* both sides run the same ops on the same inputs in the same order: they must be bit-equal
  (``torch.equal`` / ``assert_close(..., rtol=0, atol=0)``), on every CPU, whatever kernel torch
  picks, since both sides pick the same one;
* the two sides add the same terms in different orders (eager vs inductor, fused vs unfused,
  a decomposed op vs its ATen kernel, traced vs eager autograd, an ISA's vector width): the
  bound below, from the format's epsilon and the reduction length, not torch's default
  ``assert_close`` tolerance (which assumes neither).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch


def reordered_sum_atol(n: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """How far apart two ``dtype`` sums of the same ``n`` terms can be when added in different
    orders, where ``magnitude`` bounds the sum of the terms' magnitudes, S = sum |t_i|.

    Any order of floating-point summation returns the exact sum within gamma_(n-1) * S, with
    gamma_k = k*u / (1 - k*u) and u = eps/2 the unit roundoff (the standard error bound of
    recursive, pairwise and blocked summation alike); two orders are therefore within
    2 * gamma_(n-1) * S <= n * eps * S of each other (for n*u < 1/2). A chain of sums (a
    gradient through several layers) adds its lengths to first order: pass their total as n.
    """
    eps = torch.finfo(dtype).eps
    u = eps / 2
    k = max(n - 1, 1)
    assert k * u < 0.5, "the first-order bound needs n * eps < 1"
    return 2 * k * u / (1 - k * u) * magnitude


def assert_close_reordered(actual: torch.Tensor, expected: torch.Tensor, n: int,
                           magnitude: float | None = None) -> None:
    """``actual`` equals ``expected`` up to summing ``n`` terms per element in another order
    (:func:`reordered_sum_atol`), in ``expected``'s dtype (integer tensors: exactly). ``magnitude`` (S) defaults to the
    largest magnitude in ``expected``: right when an element's terms share a sign (|sum| = S),
    as in sums of squares, norms and means of same-signed values; where terms cancel, pass S."""
    if not expected.is_floating_point():  # integers (a step count): exact on both sides
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        return
    if magnitude is None:
        magnitude = expected.detach().abs().max().item() if expected.numel() else 0.0
    atol = reordered_sum_atol(n, magnitude, expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol)


def gpt_grad_sums(d: int, n_layer: int, vocab: int, seq: int, tokens: int) -> int:
    """The longest chain of sums behind a GPT gradient (``dlspass.models.TinyGPT``, or
    transformers' GPT-2: pre-norm blocks of causal attention with 2 heads and a 4x MLP), both
    sides running their own kernels forward and backward, counted generously (every stage's
    sums added):
    per block forward, LayerNorm's mean and variance (d each), the qkv projection (d), q.k (the
    head width, d / 2 at two heads), softmax's sum over ``seq`` keys plus exp's roundings (2),
    att.v (``seq``), the output projection (d), LayerNorm (2 d), the MLP's fc (d), GELU's
    roundings (2) and out (4 d); then the final LayerNorm (2 d), the head (d) and the
    cross-entropy's log-sum-exp over ``vocab`` (+ 2). Backward: the head's input gradient
    (``vocab``), the final LayerNorm (2 d), per block the input gradients of out (d), fc (4 d),
    LayerNorm (2 d), proj (d), att.v (d / 2 and ``seq``), softmax (``seq``), q.k (``seq`` twice),
    qkv (3 d) and LayerNorm (2 d); then a weight gradient's sum over the ``tokens``. The ``n``
    of :func:`reordered_sum_atol`."""
    block_fwd = 2 * d + d + d // 2 + seq + 2 + seq + d + 2 * d + d + 2 + 4 * d
    block_bwd = d + 4 * d + 2 * d + d + d // 2 + seq + seq + 2 * seq + 3 * d + 2 * d
    forward = n_layer * block_fwd + 2 * d + d + vocab + 2
    backward = vocab + 2 * d + n_layer * block_bwd + tokens
    return forward + backward


def gpt_matmul_roundings(n_layer: int) -> int:
    """How many roundings the longest chain behind a GPT gradient (the tied token embedding's)
    takes when every input and output of every matmul is rounded to a narrower format (3 per
    matmul): forward through ``n_layer`` blocks of 6 matmuls (the qkv projection, q.k, w.v, the
    output projection, the MLP's two) and the LM head, then back through the head's and each
    block's input gradients and the head's weight gradient. The ``k`` of
    :func:`roundings_atol`."""
    forward = 3 * (6 * n_layer + 1)
    return forward + 3 + 3 * 6 * n_layer + 3


def roundings_atol(k: int, magnitude: float, eps: float) -> float:
    """How far a result computed with ``k`` roundings to a narrower format of machine epsilon
    ``eps`` along its longest chain (each input and output of a lowered matmul rounded, unit
    roundoff u = eps / 2) can be from the same result in float32, where ``magnitude`` bounds
    the sum of its terms' magnitudes (S): gamma_k * S with gamma_k = k*u / (1 - k*u), the
    standard first-order bound of k relative errors of u. The float32 sums' own reordering
    (:func:`reordered_sum_atol`) is far below and not added."""
    u = eps / 2
    assert k * u < 0.5, "the first-order bound needs k * eps < 1"
    return k * u / (1 - k * u) * magnitude


def mlp_grad_sums(widths: Sequence[int], batch: int, forward: bool = True) -> int:
    """The longest chain of sums behind a gradient of an MLP of Linear layers ``widths[0] ->
    widths[1] -> ... -> widths[-1]`` trained on ``batch`` rows (the first layer's weight
    gradient's): back through every later layer (each input gradient sums over that layer's
    outputs, ``widths[2:]``), then over the batch; with ``forward``, also the forward's sums
    (each layer over its inputs, ``widths[:-1]``), for when the two sides compute the forward
    by other kernels too (the loss gradient is a function of the output). Elementwise steps
    (activations, an MSE's backward) add no sums. The ``n`` of :func:`reordered_sum_atol`."""
    return (sum(widths[:-1]) if forward else 0) + sum(widths[2:]) + batch


def grad_term_sums(model: torch.nn.Module,
                   loss_fn: Callable[[torch.nn.Module], torch.Tensor]) -> dict[str, float]:
    """Per parameter of ``model``, the S of :func:`reordered_sum_atol` for its gradient's last
    sum: the largest, over the gradient's elements, sum of the magnitudes of the terms that sum
    adds up (|grad_output| times |input| over the batch and positions for Linear, Conv2d and
    transformers' Conv1D weights, |grad_output| times |x_hat| for BatchNorm2d/LayerNorm
    weights, |grad_output| for biases and, over a row's tokens, Embedding rows; a parameter
    used by two modules, as a tied embedding, adds both), from one eager forward and backward
    of ``loss_fn(copy)`` on a copy of ``model`` (``loss_fn`` calls each module once; a
    magnitude, so float32 rounding in it does not matter). Unlike a gradient's own magnitude
    this holds where the terms cancel (a BatchNorm weight's gradient sums grad_output * x_hat,
    whose signs mix by construction, and the gradient of a bias before a BatchNorm is zero up
    to rounding)."""
    import copy

    m = copy.deepcopy(model)  # hooks and BatchNorm's running statistics stay off the original
    inputs: dict[torch.nn.Module, torch.Tensor] = {}
    acc: dict[int, torch.Tensor] = {}  # by parameter identity: tied parameters add up

    def fwd(mod: torch.nn.Module, args: tuple, _res: object) -> None:
        inputs[mod] = args[0].detach()

    def bwd(mod: torch.nn.Module, _gin: object, gout: tuple, name: str = "") -> None:
        x, g = inputs[mod].abs(), gout[0].detach().abs()
        if isinstance(mod, torch.nn.Linear):
            w = g.flatten(0, -2).t() @ x.flatten(0, -2)
            b = g.flatten(0, -2).sum(0)
        elif isinstance(mod, torch.nn.Conv2d):
            w = torch.nn.grad.conv2d_weight(x, mod.weight.shape, g, mod.stride, mod.padding,
                                            mod.dilation, mod.groups)
            b = g.sum((0, 2, 3))
        elif isinstance(mod, torch.nn.BatchNorm2d):
            xi = inputs[mod]
            mean, var = xi.mean((0, 2, 3), keepdim=True), xi.var((0, 2, 3), unbiased=False, keepdim=True)
            w = (g * ((xi - mean) / (var + mod.eps).sqrt()).abs()).sum((0, 2, 3))
            b = g.sum((0, 2, 3))
        elif isinstance(mod, torch.nn.LayerNorm):
            xi = inputs[mod]
            dims = tuple(range(-len(mod.normalized_shape), 0))
            mean, var = xi.mean(dims, keepdim=True), xi.var(dims, unbiased=False, keepdim=True)
            lead = xi.dim() - len(dims)
            w = (g * ((xi - mean) / (var + mod.eps).sqrt()).abs()).flatten(0, lead - 1).sum(0)
            b = g.flatten(0, lead - 1).sum(0)
        elif isinstance(mod, torch.nn.Embedding):  # each row sums |grad_output| over its tokens
            ids = inputs[mod].flatten()
            w = torch.zeros_like(mod.weight).index_add_(0, ids, g.flatten(0, -2).to(mod.weight.dtype))
            b = None
        elif type(mod).__name__ == "Conv1D":  # transformers' x @ weight + bias, weight (in, out)
            w = x.flatten(0, -2).t() @ g.flatten(0, -2)
            b = g.flatten(0, -2).sum(0)
        else:
            raise TypeError(f"grad_term_sums: no rule for {type(mod).__name__} ({name})")
        for p, t in ((mod.weight, w), (getattr(mod, "bias", None), b)):
            if p is not None and t is not None:
                acc[id(p)] = acc[id(p)] + t if id(p) in acc else t

    for name, mod in m.named_modules():
        if list(mod.parameters(recurse=False)):
            mod.register_forward_hook(fwd)
            mod.register_full_backward_hook(lambda mod, gi, go, name=name: bwd(mod, gi, go, name))
    with warnings.catch_warnings():  # a first layer's hook fires without input gradients: fine
        warnings.simplefilter("ignore", UserWarning)
        loss_fn(m).backward()
    return {k: float(acc[id(p)].max()) for k, p in m.named_parameters()}


def smallcnn_grad_sums(width: int, n_classes: int, batch: int, hw: int, in_ch: int = 1,
                       forward: bool = False) -> int:
    """The longest chain of sums behind a ``dlspass.models.SmallCNN`` gradient (conv1's weight)
    on ``batch`` images of ``in_ch`` x ``hw`` x ``hw``: back through the head (``n_classes``),
    BatchNorm2's two batch sums (over the pooled positions), conv2's input gradient (its 2
    ``width`` channels x 9 taps), BatchNorm1's two sums (over the full positions), then conv1's
    weight gradient over those positions. With ``forward`` (the two sides compute the forward
    by other kernels too), also the forward's: conv1 (``in_ch`` x 9 taps), BatchNorm1's mean
    and variance, conv2 (``width`` x 9), BatchNorm2's, the spatial mean, the head (2 ``width``)
    and the cross-entropy's log-sum-exp (``n_classes`` + 2 for exp and log). The ``n`` of
    :func:`reordered_sum_atol`."""
    full, pooled = batch * hw * hw, batch * (hw // 2) ** 2
    fwd = (in_ch * 9 + 2 * full + width * 9 + 2 * pooled + (hw // 2) ** 2 + 2 * width + n_classes + 2
           if forward else 0)
    return fwd + n_classes + 2 * pooled + 2 * width * 9 + 2 * full + full


def sgd_update_atol(grad_atol: float, lr: float, param_magnitude: float,
                    dtype: torch.dtype = torch.float32) -> float:
    """How far apart two SGD(-momentum) updates ``p - lr * (mu * m + g)`` can be whose gradients
    differ by at most ``grad_atol``: ``lr * grad_atol`` carried through, plus the update's own
    elementwise tail (the momentum multiply-add, the lr multiply, the subtraction) rounded in
    another order or fused: at most four roundings of u = eps/2 each, relative to values no
    larger than the parameters (``param_magnitude``), so 2 * eps * param_magnitude."""
    return lr * grad_atol + 2 * torch.finfo(dtype).eps * param_magnitude


def clip_norm_atols(grads: dict[str, torch.Tensor], grad_atol: dict[str, float],
                    max_norm: float) -> tuple[dict[str, float], float]:
    """How far apart two norm clips (torch.nn.utils.clip_grad_norm_'s g * max_norm / ||g||, or g
    itself where ||g|| <= max_norm) can be, per parameter, whose unclipped ``grads`` differ by at
    most ``grad_atol``; and how far apart their two norms ||g|| can be. The norm's relative error:
    its sum of squares over every element (terms >= 0, plus the square root and the division)
    added in another order, and the gradients' own differences, at most ||grad_atol||_2 / ||g||.
    A clipped element carries its gradient's bound times the coefficient plus its value times
    the coefficient's relative error (the norm's)."""
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    n_all = sum(g.numel() for g in grads.values())
    rel = (reordered_sum_atol(n_all + 2, 1.0)
           + math.sqrt(sum(g.numel() * grad_atol[k] ** 2 for k, g in grads.items())) / norm)
    if norm <= max_norm:
        return dict(grad_atol), norm * rel
    coef = max_norm / norm
    return {k: coef * grad_atol[k] + coef * float(g.abs().max()) * rel for k, g in grads.items()}, norm * rel


def adam_first_step_atol(grad: torch.Tensor, grad_atol: float, lr: float, eps: float,
                         param: torch.Tensor) -> torch.Tensor:
    """Per element, how far apart two Adam(W) first steps from the same ``param`` can land
    whose gradients are within ``grad_atol`` of ``grad`` (and of each other). The first step
    moves by lr * g / (|g| + eps) (its bias corrections cancel, up to roundings), a function of
    g with slope eps / (|g| + eps)^2 <= 1 / eps, largest where |g| is smallest: so lr times
    ``grad_atol`` times that slope at the smallest |g| the interval allows, never more than
    2 lr (the two directions); plus the update's own roundings (m, v, the square root, the
    division: lr * 4 eps32) and the parameter's (weight decay, the subtraction: 2 eps32 |p|).
    Near-zero gradients legitimately move far; where |g| >> grad_atol the bound is tight."""
    e32 = torch.finfo(param.dtype).eps
    low = (grad.abs() - grad_atol).clamp_min(0.0)
    slope = eps / (low + eps) ** 2
    return (lr * torch.clamp(grad_atol * slope, max=2.0) + lr * 4 * e32
            + 2 * e32 * param.detach().abs())


def adam_step_atol(grad: torch.Tensor, grad_atol: float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   step: int, lr: float, betas: tuple[float, float], eps: float,
                   param: torch.Tensor) -> torch.Tensor:
    """Per element, how far apart two Adam(W) steps (torch's single-tensor update, step
    ``step``) from the same parameter and state can land whose gradients are within
    ``grad_atol`` of ``grad``; ``exp_avg``/``exp_avg_sq`` are one side's new state. The update is
    lr / bc1 * m / D with D = sqrt(v) / sqrt(bc2) + eps >= eps. A gradient difference d moves m by
    (1 - b1) d and v by at most (1 - b2) (2 |g| d + d^2), so sqrt(v) by at most
    min(sqrt(dv), dv / sqrt(v)); to first order the update moves by lr / bc1 (dm / D + |m| dD /
    D^2). Plus the state's and the update's own roundings, each rounding of a value differing
    between the sides adding at most eps32 of it: m and v (2 each), the update (lr / bc1 |m| / D
    over 4) and the parameter (weight decay, the subtraction: 2 eps32 |p|)."""
    e32 = torch.finfo(param.dtype).eps
    b1, b2 = betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    m, v = exp_avg.abs(), exp_avg_sq.abs()
    dm = (1 - b1) * grad_atol + 2 * e32 * m
    dv = (1 - b2) * (2 * grad.abs() * grad_atol + grad_atol ** 2) + 2 * e32 * v
    dsqrt = torch.minimum(dv.sqrt(), dv / v.sqrt().clamp_min(torch.finfo(v.dtype).tiny))
    d = v.sqrt() / math.sqrt(bc2) + eps
    dd = dsqrt / math.sqrt(bc2)
    du = lr / bc1 * (dm + m * dd / d) / torch.clamp(d - dd, min=eps)
    return du + 4 * e32 * lr / bc1 * m / d + 2 * e32 * param.detach().abs()


def adam_state_atols(grad: torch.Tensor, grad_atol: float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     betas: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The bounds on the new ``exp_avg`` and ``exp_avg_sq`` of :func:`adam_step_atol`."""
    e32 = torch.finfo(exp_avg.dtype).eps
    b1, b2 = betas
    return ((1 - b1) * grad_atol + 2 * e32 * exp_avg.abs(),
            (1 - b2) * (2 * grad.abs() * grad_atol + grad_atol ** 2) + 2 * e32 * exp_avg_sq.abs())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, atol: torch.Tensor, what: str) -> None:
    """|actual - expected| <= atol elementwise (a per-element bound such as
    :func:`adam_first_step_atol`)."""
    diff = (actual.detach() - expected.detach()).abs()
    bad = ~(diff <= atol)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {diff.numel()} elements out of bound, "
                           f"worst {float((diff - atol).max())} above")


def assert_sgd_steps(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, tuple], torch.Tensor],
                     batches: Sequence[tuple], params: torch.Tensor, bufs: torch.Tensor | None,
                     stepped: Sequence[bool], lr: float, momentum: float, n: int,
                     max_norm: float | None = None) -> None:
    """Each iteration of a recorded SGD run (``params``, and with ``momentum`` ``bufs``: the flat
    parameters and momentum buffers after each iteration, NaN for a buffer not created yet)
    against one eager step of ``model`` (torch's SGD: clip_grad_norm_ to ``max_norm`` if given,
    buf = momentum * buf + g or g at first, p - lr * buf) on ``batches[i]`` from the run's own
    state before it. A run whose gradients add the same terms in other orders (data-parallel
    halves averaged, pipeline stages, sharded layouts) drifts from a single-process run by
    more with every step; one step from a shared state is bounded: the gradients' ``n``-term
    reordering (S from :func:`grad_term_sums`), carried through the clip
    (:func:`clip_norm_atols`), the buffer's two roundings and the update
    (:func:`sgd_update_atol`, per element). An iteration that did not step leaves both
    bit for bit. ``model`` holds the run's starting parameters."""
    eps = torch.finfo(torch.float32).eps
    names = [k for k, _ in model.named_parameters()]
    start = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    buf: torch.Tensor | None = None
    for it, batch in enumerate(batches):
        if not stepped[it]:
            assert torch.equal(params[it], start), f"iteration {it} changed the parameters"
            if bufs is not None and buf is not None:
                assert torch.equal(bufs[it], buf), f"iteration {it} changed the momentum buffers"
            continue
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(start, model.parameters())
        grads = dict(zip(names, torch.autograd.grad(loss_fn(model, batch), list(model.parameters())), strict=True))
        terms = grad_term_sums(model, lambda m, batch=batch: loss_fn(m, batch))
        atol = {k: reordered_sum_atol(n, s) for k, s in terms.items()}
        if max_norm is not None:
            norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
            atol = clip_norm_atols(grads, atol, max_norm)[0]
            coef = min(1.0, max_norm / (norm + 1e-6))
            grads = {k: g * coef for k, g in grads.items()}
        g = torch.cat([grads[k].reshape(-1) for k in names])
        g_atol = torch.cat([torch.full((grads[k].numel(),), atol[k]) for k in names])
        new_buf = g if (momentum == 0 or buf is None) else buf * momentum + g
        buf_atol = g_atol + 2 * eps * new_buf.abs()
        if momentum:
            assert bufs is not None
            assert_within(bufs[it], new_buf, buf_atol, f"momentum buffers after iteration {it}")
        assert_within(params[it], start - lr * new_buf, lr * buf_atol + 2 * eps * start.abs(),
                      f"parameters after iteration {it}")
        start = params[it]
        buf = bufs[it] if momentum else None


def assert_same_training(got: dict, ref: dict, what: str) -> None:
    """Bit equality of two recorded training runs (``loss``, ``found_inf``, ``scale`` and
    ``params`` lists and the ``skipped`` count): for two processes that run the same kernels
    on the same inputs in the same order (a cache hit against its cold compile, or a miss
    against a fresh compile under the same CPU facts). A non-finite loss (an overflow step)
    matches a non-finite loss."""
    for key in ("loss", "found_inf", "scale", "params"):
        for i, (a, b) in enumerate(zip(got[key], ref[key], strict=True)):
            assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), \
                f"{what}: {key}[{i}] differs: {a} vs {b}"
    assert torch.equal(got["skipped"], ref["skipped"]), what
