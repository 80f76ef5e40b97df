"""ExposeSeedPass: the joint graph's marked seed becomes an input; fed 1.0 it computes what the
joint computed, fed 2.0 the gradients double (and the loss does not change)."""

from __future__ import annotations

import cli_factories as cf
import pytest
import torch

from dlspass.capture.joint_step import joint_graph
from dlspass.capture.pt2_io import load_program
from dlspass.graph.marks import MARK_OP
from dlspass.passes import PassContractError
from dlspass.passes.expose_seed_pass import ExposeSeedPass


def _joint_and_args():
    ep, _ = load_program(cf.joint_file("mlp"))
    j = joint_graph(ep, "joint")
    state = {**ep.state_dict, **ep.constants}
    _model, batch = cf.mlp()
    user = dict(zip(j.inputs, batch, strict=True))
    args = [state[s.target] if s.target in state else user[s.arg.name] for s in ep.graph_signature.input_specs]
    return j, args


def test_seed_input_reproduces_the_joint_and_scales_the_gradients():
    j, args = _joint_and_args()
    gm = j.gm
    before = [t.detach().clone() for t in gm(*args)]
    assert ExposeSeedPass("loss_seed")(gm).modified
    placeholders = gm.graph.find_nodes(op="placeholder")
    assert placeholders[-1].name == "loss_seed" and placeholders[-1].meta["val"].shape == ()
    assert not gm.graph.find_nodes(op="call_function", target=MARK_OP)
    one = gm(*args, torch.tensor(1.0))
    two = gm(*args, torch.tensor(2.0))
    kinds = [k for k, _t in j.out_kinds]
    assert "grad" in kinds and "loss" in kinds
    for kind, want, have1, have2 in zip(kinds, before, one, two, strict=True):
        assert torch.equal(have1, want)
        if kind == "grad":
            assert torch.equal(have2, 2 * want)  # a power of two scales the backward exactly
        elif kind == "loss":
            assert torch.equal(have2, want)


def test_second_run_is_a_no_op_and_a_graph_without_a_seed_is_refused():
    j, _args = _joint_and_args()
    ExposeSeedPass("loss_seed")(j.gm)
    assert not ExposeSeedPass("loss_seed")(j.gm).modified
    with pytest.raises(PassContractError, match="0 marked backward seeds"):
        ExposeSeedPass("other_name")(j.gm)
