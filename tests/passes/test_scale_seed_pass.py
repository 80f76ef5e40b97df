"""ScaleSeedPass: the seed becomes mul(seed, loss_scale); gradients come out exactly ×scale."""

from __future__ import annotations

import pytest
import torch
from stepgraph import mlp_step, node_values

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.passes import PassContractError, ScaleSeedPass
from dlspass.scale_policy import init_state

CFG = DLSConfig(mixed_precision=False, initial_loss_scale=1024.0)


def test_seed_is_multiplied_by_the_loss_scale_placeholder() -> None:
    gm = mlp_step(CFG).gm
    n_before = len(gm.graph.nodes)
    assert ScaleSeedPass(CFG)(gm).modified
    seed = roles.the_node(gm.graph, roles.SEED)
    scaled = roles.the_node(gm.graph, roles.SCALED_SEED)
    assert len(gm.graph.nodes) == n_before + 1
    assert list(seed.users) == [scaled]
    assert scaled.target is torch.ops.aten.mul.Tensor and scaled.args[0] is seed
    ph = scaled.args[1]
    assert ph.op == "placeholder" and roles.target_of(ph) == "loss_scale"
    assert roles.pass_of(scaled) == "scale_seed"
    assert scaled.meta["val"].shape == seed.meta["val"].shape


def test_gradients_are_exactly_scaled() -> None:
    step = mlp_step(CFG)
    gm = step.gm
    grads_before = roles.nodes_with_role(gm.graph, roles.GRAD)
    raw = node_values(gm, step.inputs(), grads_before)
    ScaleSeedPass(CFG)(gm)
    gm.recompile()
    state = init_state(CFG)._replace(loss_scale=torch.tensor(1024.0))
    scaled = node_values(gm, step.inputs(state=state), roles.nodes_with_role(gm.graph, roles.GRAD))
    for r, s in zip(raw, scaled, strict=True):
        assert torch.equal(s, r * 1024.0)  # a power of two scales every rounding step exactly


def test_idempotent_and_noop_without_scaling() -> None:
    gm = mlp_step(CFG).gm
    ScaleSeedPass(CFG)(gm)
    gm.recompile()
    code = gm.code
    assert not ScaleSeedPass(CFG)(gm).modified
    gm.recompile()
    assert gm.code == code
    gm2 = mlp_step().gm
    assert not ScaleSeedPass(DLSConfig(loss_scale=None))(gm2).modified
    assert not ScaleSeedPass(None)(gm2).modified
    assert not roles.nodes_with_role(gm2.graph, roles.SCALED_SEED)


def test_missing_scale_placeholder_is_a_clear_error() -> None:
    gm = mlp_step(CFG).gm
    ph = next(n for n in gm.graph.find_nodes(op="placeholder") if roles.target_of(n) == "loss_scale")
    ph.meta["custom"]["dlspass_target"] = "renamed"
    with pytest.raises(PassContractError, match="no scaler_state placeholder for 'loss_scale'"):
        ScaleSeedPass(CFG)(gm)
