"""DropNoneGetitemsPass: unused getitems of None results go; the graph computes what it did."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dlspass.passes.drop_none_getitems_pass import DropNoneGetitemsPass


def _weight_grads(go: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # no input gradient requested: the op's first result is None, its getitem unused
    gx, gw, gb = torch.ops.aten.convolution_backward.default(
        go, x, w, [3], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True])
    return gw, gb


def test_the_none_getitem_goes_and_the_gradients_match_autograd() -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 2, 4, 4), torch.randn(3, 2, 3, 3), torch.randn(3)
    go = torch.randn(2, 3, 2, 2)
    gm = fx.symbolic_trace(_weight_grads)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(go, x, w)
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert [n.meta.get("val") is None for n in getitems] == [True, False, False]

    assert DropNoneGetitemsPass()(gm).modified
    gm.recompile()
    assert [n.name for n in gm.graph.nodes if n.target is operator.getitem] == \
        [n.name for n in getitems[1:]]
    gw, gb = gm(go, x, w)
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref_w, ref_b = torch.autograd.grad(torch.nn.functional.conv2d(x, wr, br), (wr, br), go)
    # bit equality: both sides are the one aten.convolution_backward call (the traced function
    # calls it; autograd's conv2d backward calls it), the same kernel on the same inputs
    torch.testing.assert_close(gw, ref_w, rtol=0, atol=0)
    torch.testing.assert_close(gb, ref_b, rtol=0, atol=0)
    assert not DropNoneGetitemsPass()(gm).modified
