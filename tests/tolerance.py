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
    adds up (|grad_output| times |input| over the batch and positions for Linear and Conv2d
    weights, |grad_output| times |x_hat| for BatchNorm2d/LayerNorm weights, |grad_output| for
    biases), from one eager forward and backward of ``loss_fn(copy)`` on a copy of ``model``
    (``loss_fn`` calls it once; a magnitude, so float32 rounding in it does not matter). Unlike a gradient's own magnitude this holds where the terms cancel (a
    BatchNorm weight's gradient sums grad_output * x_hat, whose signs mix by construction, and
    the gradient of a bias before a BatchNorm is zero up to rounding)."""
    import copy

    m = copy.deepcopy(model)  # hooks and BatchNorm's running statistics stay off the original
    inputs: dict[torch.nn.Module, torch.Tensor] = {}
    out: dict[str, float] = {}

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
        else:
            raise TypeError(f"grad_term_sums: no rule for {type(mod).__name__} ({name})")
        out[f"{name}.weight" if name else "weight"] = float(w.max())
        out[f"{name}.bias" if name else "bias"] = float(b.max())

    for name, mod in m.named_modules():
        if list(mod.parameters(recurse=False)):
            mod.register_forward_hook(fwd)
            mod.register_full_backward_hook(lambda mod, gi, go, name=name: bwd(mod, gi, go, name))
    with warnings.catch_warnings():  # a first layer's hook fires without input gradients: fine
        warnings.simplefilter("ignore", UserWarning)
        loss_fn(m).backward()
    return {k: out[k] for k, _ in m.named_parameters()}


def sgd_update_atol(grad_atol: float, lr: float, param_magnitude: float,
                    dtype: torch.dtype = torch.float32) -> float:
    """How far apart two SGD(-momentum) updates ``p - lr * (mu * m + g)`` can be whose gradients
    differ by at most ``grad_atol``: ``lr * grad_atol`` carried through, plus the update's own
    elementwise tail (the momentum multiply-add, the lr multiply, the subtraction) rounded in
    another order or fused: at most four roundings of u = eps/2 each, relative to values no
    larger than the parameters (``param_magnitude``), so 2 * eps * param_magnitude."""
    return lr * grad_atol + 2 * torch.finfo(dtype).eps * param_magnitude


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
