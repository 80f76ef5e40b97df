"""DropCopyBackPass: functionalize's copy_ back into cloned buffers goes; the values stay eager's."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from tolerance import assert_close_reordered
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.passes.base import PassContractError
from dlspass.passes.drop_copy_back_pass import DropCopyBackPass

COPY = torch.ops.aten.copy_.default


def _bn_step(bn: torch.nn.BatchNorm1d):
    """Gradient of a BatchNorm loss and the new running statistics, as the capture traces it:
    the buffers are cloned inside the vjp and BatchNorm updates the clones in place."""

    def step(w: torch.Tensor, b: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor,
             nbt: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def forward(w: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            bufs = {"running_mean": rm.clone(), "running_var": rv.clone(),
                    "num_batches_tracked": nbt.clone()}
            out = torch.func.functional_call(bn, {"weight": w, "bias": b, **bufs}, (x,))
            return (out ** 2 * torch.arange(3.0)).sum(), bufs

        loss, vjp_fn, new = torch.func.vjp(forward, w, has_aux=True)
        (g,) = vjp_fn(torch.ones_like(loss))
        return g, new["running_mean"], new["running_var"], new["num_batches_tracked"], loss

    return step


def test_copies_go_and_the_graph_matches_eager() -> None:
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    args = [bn.weight.detach(), bn.bias.detach(), *(t.clone() for t in bn.buffers()), torch.randn(5, 3)]
    step = _bn_step(bn)
    gm = make_fx(torch.func.functionalize(step, remove="mutations"), tracing_mode="fake",
                 decomposition_table=get_decompositions([torch.ops.aten.native_batch_norm.default]))(*args)
    assert any(n.target is COPY for n in gm.graph.nodes)

    assert DropCopyBackPass()(gm).modified
    gm.recompile()
    assert not any(n.target is COPY for n in gm.graph.nodes)
    before = [a.clone() for a in args]
    got = gm(*args)
    want = step(*[a.clone() for a in args])
    # the graph runs native_batch_norm decomposed (mean, var, ... as separate ops), eager its
    # kernel: other summation orders. The longest chain of sums: the batch mean and variance
    # over 5 rows, then the loss's sum over 5 x 3 (terms >= 0) or the weight gradient's over 5:
    # n = 5 + 5 + 15, S the output's largest magnitude where the terms share a sign (the weight
    # gradient's 2 * xhat^2 * c, the variance's squares, the loss's), and for the running mean
    # (momentum 0.1 times the batch mean of x, whose terms cancel) 0.1 * mean|x| (tests/tolerance.py)
    magnitudes = [None, 0.1 * float(args[-1].abs().mean(0).max()), None, None, None]
    for g, w, s in zip(got, want, magnitudes, strict=True):
        assert_close_reordered(g, w, n=5 + 5 + 15, magnitude=s)
    assert not torch.equal(got[1], before[2])  # the running mean moved ...
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b)  # ... in the outputs, not in the inputs
    assert not DropCopyBackPass()(gm).modified


def test_a_copy_between_shapes_is_a_contract_error() -> None:
    graph = fx.Graph()
    dst, src = graph.placeholder("dst"), graph.placeholder("src")
    dst.meta["val"], src.meta["val"] = torch.empty(3), torch.empty(2)
    copy = graph.call_function(COPY, (dst, src))
    graph.output((copy,))
    with pytest.raises(PassContractError, match="cannot functionalize the in-place copy copy_"):
        DropCopyBackPass()(fx.GraphModule(torch.nn.Module(), graph))
