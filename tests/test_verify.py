"""dlspass.verify: accepts every pipeline output, rejects hand-broken graphs naming the node."""

from __future__ import annotations

import pytest
import torch
from stepgraph import mlp_step

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.graph.invariants import VerificationError, verify
from dlspass.passes import apply_dls

aten = torch.ops.aten


@pytest.fixture
def gm():
    cfg = DLSConfig(mixed_precision=False)
    return apply_dls(mlp_step(cfg).gm, cfg)


def _output(gm, role: str, target: str):
    return roles.output_value(gm.graph, role, target)


@pytest.mark.parametrize("cfg", [
    DLSConfig(), DLSConfig(policy="torch", max_gradient_norm=0.5), DLSConfig(policy="deepspeed"),
    DLSConfig(fp16_type="cbfloat16", max_gradient_value=1.0), DLSConfig(loss_scale=64.0),
    DLSConfig(fp16_type="bfloat16"), None,
])
def test_pipeline_outputs_verify(cfg) -> None:
    assert verify(apply_dls(mlp_step(cfg).gm, cfg)) is True


def test_unguarded_update_is_rejected(gm) -> None:
    i, guard = _output(gm, roles.PARAM_UPDATE, "fc2.weight")
    vals = list(roles.output_values(gm.graph))
    vals[i] = guard.args[1]  # the raw optimizer result
    gm.graph.output_node().args = (tuple(vals),)
    with pytest.raises(VerificationError, match=rf"'fc2.weight'.*{guard.args[1].name}.*not guarded"):
        verify(gm)


def test_guard_falling_back_to_the_wrong_placeholder_is_rejected(gm) -> None:
    _, guard = _output(gm, roles.OPT_STATE_UPDATE, "fc1.bias.momentum_buffer")
    other = next(n for n in gm.graph.find_nodes(op="placeholder")
                 if roles.target_of(n) == "fc2.bias.momentum_buffer")
    guard.args = (guard.args[0], guard.args[1], other)
    with pytest.raises(VerificationError, match=rf"guard '{guard.name}'.*falls back to '{other.name}'"):
        verify(gm)


def test_second_unscale_is_rejected(gm) -> None:
    unscaled = next(n for n in roles.nodes_with_role(gm.graph, roles.UNSCALE)
                    if roles.target_of(n) == "fc1.weight")
    recip = next(n for n in roles.nodes_with_role(gm.graph, roles.UNSCALE)
                 if n.target is aten.reciprocal.default)
    with gm.graph.inserting_after(unscaled):
        again = gm.graph.call_function(aten.mul.Tensor, (unscaled, recip))
    again.meta["val"] = unscaled.meta["val"]
    roles.set_role(again, roles.UNSCALE, "fc1.weight")
    unscaled.replace_all_uses_with(again, delete_user_cb=lambda u: u is not again
                                   and roles.role_of(u) not in (roles.GRAD_NORM,))
    with pytest.raises(VerificationError, match=rf"unscale node '{again.name}' unscales a gradient a second time"):
        verify(gm)


def test_unscale_with_a_different_scale_is_rejected(gm) -> None:
    recip = next(n for n in roles.nodes_with_role(gm.graph, roles.UNSCALE)
                 if n.target is aten.reciprocal.default)
    wrong = next(n for n in gm.graph.find_nodes(op="placeholder")
                 if roles.target_of(n) == "non_clamped_scale")
    recip.args = (wrong,)
    with pytest.raises(VerificationError, match=rf"unscale node '{recip.name}' reads '{wrong.name}'"):
        verify(gm)


def test_gradient_that_bypasses_unscale_is_rejected(gm) -> None:
    unscaled = next(n for n in roles.nodes_with_role(gm.graph, roles.UNSCALE)
                    if roles.target_of(n) == "fc3.bias")
    raw = unscaled.args[0]
    unscaled.replace_all_uses_with(raw, delete_user_cb=lambda u: roles.role_of(u) != roles.GRAD_NORM)
    with pytest.raises(VerificationError, match="without an unscale node"):
        verify(gm)


def test_unscaled_seed_is_rejected(gm) -> None:
    seed = roles.the_node(gm.graph, roles.SEED)
    scaled = next(iter(seed.users))
    scaled.replace_all_uses_with(seed)
    with pytest.raises(VerificationError, match=f"backward seed '{seed.name}'"):
        verify(gm)


def test_guard_condition_must_depend_on_the_gradients(gm) -> None:
    _, guard = _output(gm, roles.PARAM_UPDATE, "fc1.bias")
    with gm.graph.inserting_before(guard):
        true = gm.graph.call_function(aten.scalar_tensor.default, (1.0,), {"dtype": torch.bool})
    true.meta["val"] = guard.args[0].meta["val"]
    guard.args = (true, *guard.args[1:])
    with pytest.raises(VerificationError, match=f"guard '{guard.name}'.*does not depend"):
        verify(gm)


def test_exponentially_many_paths_verify_in_linear_time(gm) -> None:
    # 2**400 seed-to-update paths: path enumeration would never finish
    scaled = roles.the_node(gm.graph, roles.SCALED_SEED)
    users = [u for u in scaled.users]
    x = scaled
    anchor = scaled.next
    for _ in range(400):
        with gm.graph.inserting_before(anchor):
            x = gm.graph.call_function(aten.add.Tensor, (x, x))
        x.meta["val"] = scaled.meta["val"]
    for u in users:
        u.replace_input_with(scaled, x)
    assert verify(gm)  # returns at all: DP over a topological order, not path enumeration
