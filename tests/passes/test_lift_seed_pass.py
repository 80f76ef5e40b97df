"""LiftSeedPass: the marked seed becomes an input; the gradients scale with the seed fed in."""

from __future__ import annotations

import copy

import pytest
import torch
from stepgraph import eager_model_grads, linear_joint

from dlspass.graph.marks import MARK_OP
from dlspass.passes.base import PassContractError
from dlspass.passes.lift_seed_pass import LiftSeedPass
from dlspass.passes.mark_seed_pass import MarkSeedPass


def test_the_seed_is_an_input_and_scales_the_gradients_as_autograd_does() -> None:
    model, batch, joint = linear_joint()
    gm = copy.deepcopy(joint.graph_module)
    MarkSeedPass(joint.graph_signature.backward_signature.loss_output)(gm)

    assert LiftSeedPass("loss_seed")(gm).modified
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")][-1] == "loss_seed"
    assert not any(n.target is MARK_OP or n.target is torch.ops.aten.full_like.default
                   for n in gm.graph.nodes)
    params = [p.detach() for p in model.parameters()]
    loss, *grads = gm(*params, *batch, torch.tensor(8.0))
    want_loss, want_grads = eager_model_grads(model, batch, seed=8.0)
    torch.testing.assert_close(loss, want_loss)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_an_unmarked_graph_is_a_contract_error() -> None:
    _, _, joint = linear_joint()
    with pytest.raises(PassContractError, match="no marked backward seed"):
        LiftSeedPass("loss_seed")(copy.deepcopy(joint.graph_module))
