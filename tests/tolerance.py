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
    (:func:`reordered_sum_atol`), in ``expected``'s dtype. ``magnitude`` (S) defaults to the
    largest magnitude in ``expected``: right when an element's terms share a sign (|sum| = S),
    as in sums of squares, norms and means of same-signed values; where terms cancel, pass S."""
    if magnitude is None:
        magnitude = expected.detach().abs().max().item() if expected.numel() else 0.0
    atol = reordered_sum_atol(n, magnitude, expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol)
