"""DropUnchangedOutputsPass: outputs returning their own placeholder go; every other output keeps its value."""

from __future__ import annotations

import torch
from stepgraph import mlp_step

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.passes import apply_dls
from dlspass.passes.drop_unchanged_outputs_pass import DropUnchangedOutputsPass
from dlspass.scale_policy import STATE_FIELDS


def _by_role(gm: torch.fx.GraphModule, out: tuple) -> dict:
    return dict(zip(roles.output_roles(gm.graph), out, strict=True))


def test_passed_through_scaler_state_goes_and_the_rest_keeps_its_values() -> None:
    step = mlp_step()  # no DLS: the scaler state is returned as it came in
    gm = step.gm
    with torch.no_grad():
        before = _by_role(gm, gm(*step.inputs()))
    assert DropUnchangedOutputsPass()(gm).modified
    with torch.no_grad():
        after = _by_role(gm, gm(*step.inputs()))
    dropped = set(before) - set(after)
    assert dropped == {(roles.SCALER_STATE_UPDATE, f) for f in STATE_FIELDS}
    assert len(roles.output_values(gm.graph)) == len(after)
    for key, value in after.items():
        assert torch.equal(value, before[key]), key
    assert not any(v.op == "placeholder" for v in roles.output_values(gm.graph))


def test_in_a_dynamic_step_only_the_state_it_leaves_alone_goes() -> None:
    cfg = DLSConfig(mixed_precision=False)
    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    passed = {(r, t) for v, (r, t) in zip(roles.output_values(gm.graph), roles.output_roles(gm.graph),
                                          strict=True)
              if v.op == "placeholder" and (roles.role_of(v), roles.target_of(v)) == (
                  roles.SCALER_STATE, t)}
    assert passed and len(passed) < len(STATE_FIELDS)  # the loss scale itself is updated
    with torch.no_grad():
        before = _by_role(gm, gm(*step.inputs()))
    assert DropUnchangedOutputsPass()(gm).modified
    with torch.no_grad():
        after = _by_role(gm, gm(*step.inputs()))
    assert set(before) - set(after) == passed
    for key, value in after.items():
        assert torch.equal(value, before[key]), key
    assert not DropUnchangedOutputsPass()(gm).modified
