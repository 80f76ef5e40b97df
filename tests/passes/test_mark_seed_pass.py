"""MarkSeedPass: the joint graph's seed is read through one marker; the graph computes autograd's values."""

from __future__ import annotations

import copy

import pytest
from stepgraph import eager_model_grads, linear_joint
from tolerance import assert_close_reordered

from dlspass.errors import DLSInputError
from dlspass.graph import roles
from dlspass.graph.marks import MARK_OP
from dlspass.passes.mark_seed_pass import MarkSeedPass, joint_seeds


def test_the_seed_is_marked_and_the_gradients_stay_autograds() -> None:
    model, batch, joint = linear_joint()
    loss_name = joint.graph_signature.backward_signature.loss_output
    gm = copy.deepcopy(joint.graph_module)
    (seed,) = joint_seeds(gm.graph, loss_name)
    readers = set(seed.users)

    assert MarkSeedPass(loss_name)(gm).modified
    (mark,) = [n for n in gm.graph.nodes if n.target is MARK_OP]
    assert mark.args == (seed, roles.SEED, "") and set(seed.users) == {mark}
    assert set(mark.users) == readers
    loss, *grads = gm(*(p.detach() for p in model.parameters()), *batch)
    want_loss, want_grads = eager_model_grads(model, batch)
    # the joint graph is decomposed (mse_loss as sub, pow, mean; its own backward), eager runs
    # mse_loss's kernel and autograd's: other summation orders, bounded by the longest chain of
    # sums (tests/tolerance.py). The loss: Linear(3, 2)'s 3-term dot products, then the mean of
    # 4 x 2 squares (all >= 0, so S = |loss|): n = 3 + 8. A gradient: that forward's 3 terms,
    # then the weight gradient's sum over the batch of 4: n = 3 + 4.
    assert_close_reordered(loss, want_loss, n=3 + 8)
    for g, w in zip(grads, want_grads, strict=True):
        assert_close_reordered(g, w, n=3 + 4)


def test_no_seed_is_an_input_error() -> None:
    # a joint program without the seed of its loss is the user's program, not a dlspass bug
    _, _, joint = linear_joint()
    with pytest.raises(DLSInputError, match=r"full_like\(no_such_loss, 1\) \(found 0\)"):
        MarkSeedPass("no_such_loss")(copy.deepcopy(joint.graph_module))
