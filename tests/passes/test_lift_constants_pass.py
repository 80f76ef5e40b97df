"""LiftConstantsPass: tensor constants become placeholders before the inputs; values unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.graph import roles
from dlspass.passes.base import PassContractError
from dlspass.passes.lift_constants_pass import LiftConstantsPass

WEIGHTS = torch.tensor([1.0, -2.0, 0.5])


def _f(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (p * x * WEIGHTS.clone()).sum()  # the constant is traced as a get_attr


def test_constants_become_placeholders_before_the_first_input() -> None:
    p, x = torch.randn(3), torch.randn(3)
    gm = make_fx(_f)(p, x)
    assert [n.op for n in gm.graph.nodes].count("get_attr") == 1
    ph_p, ph_x = gm.graph.find_nodes(op="placeholder")
    roles.set_role(ph_p, roles.PARAM, "p")
    roles.set_role(ph_x, roles.INPUT, "batch.0")

    lift = LiftConstantsPass()(gm)
    assert lift.modified
    gm.recompile()
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    (const,) = lift.constants
    assert const.startswith("c_") and names == ["p_1", const, "x_1"]
    # bit equality: the lifted constant is the traced tensor itself, and make_fx recorded the ops
    # _f dispatches, so both sides run the same kernels in the same order
    torch.testing.assert_close(lift.constants[const], WEIGHTS, rtol=0, atol=0)
    torch.testing.assert_close(gm(p, lift.constants[const], x), _f(p, x), rtol=0, atol=0)
    assert not LiftConstantsPass()(gm).modified


def test_a_get_attr_of_no_tensor_is_a_contract_error() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    k = graph.get_attr("k")
    graph.output((graph.call_function(torch.add, (x, k)),))
    root = torch.nn.Module()
    root.k = 3
    with pytest.raises(PassContractError, match="cannot package get_attr 'k' of type int"):
        LiftConstantsPass()(fx.GraphModule(root, graph))
