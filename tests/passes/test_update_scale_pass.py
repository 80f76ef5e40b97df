"""UpdateScalePass: state outputs equal update_state in eager and follow docs/SEMANTICS.md §1.4."""

from __future__ import annotations

import pytest
import torch
from stepgraph import mlp_step, run

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.passes import UpdateScalePass, apply_dls
from dlspass.scale_policy import STATE_FIELDS, init_state, update_state


def _nan_batch(step):
    return [step.batch[0] * float("nan"), step.batch[1]]


@pytest.mark.parametrize("policy", ["cerebras", "torch", "deepspeed", "deepspeed-0.17.0",
                                    "deepspeed-fp16-optimizer", "megatron", "keras"])
@pytest.mark.parametrize("finite", [True, False])
def test_state_outputs_equal_update_state_eager(policy: str, finite: bool) -> None:
    cfg = DLSConfig(policy=policy, mixed_precision=False, steps_per_increase=3)
    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    # a state one clean step away from growth, so the growth branch is exercised too
    state = init_state(cfg)._replace(steps_since_rescale=torch.tensor(3 if policy == "cerebras" else 2))
    got = run(step, gm, state=state, batch=step.batch if finite else _nan_batch(step))
    want = update_state(state, torch.tensor(finite), cfg)
    for f, a, b in zip(STATE_FIELDS, got["state"], want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), f


def test_spec_worked_trace() -> None:
    # docs/SEMANTICS.md §1.4: init=1024, steps_per_increase=3, tolerance=0, overflows 5, 10, 11
    cfg = DLSConfig(initial_loss_scale=1024.0, steps_per_increase=3, mixed_precision=False)
    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    state, after = step.state, []
    for i in range(1, 16):
        batch = _nan_batch(step) if i in (5, 10, 11) else step.batch
        state = run(step, gm, state=state, batch=batch)["state"]
        after.append(float(state.loss_scale))
    assert after == [1024, 1024, 1024, 2048, 1024, 1024, 1024, 1024, 2048, 1024, 512, 512, 512,
                     512, 1024]
    assert int(state.num_skipped_steps) == 3


def test_only_scaler_outputs_change_and_pass_is_idempotent() -> None:
    cfg = DLSConfig(mixed_precision=False)
    gm = apply_dls(mlp_step(cfg).gm, cfg)
    vals = roles.output_values(gm.graph)
    for (role, target), v in zip(roles.output_roles(gm.graph), vals, strict=True):
        if role == roles.SCALER_STATE_UPDATE and v.op != "placeholder":
            assert roles.role_of(v) == roles.SCALE_UPDATE and roles.target_of(v) == target
        elif role != roles.SCALER_STATE_UPDATE:
            assert roles.role_of(v) != roles.SCALE_UPDATE
    code = gm.code
    assert not UpdateScalePass(cfg)(gm).modified
    gm.recompile()
    assert gm.code == code


def test_static_scale_state_passes_through() -> None:
    cfg = DLSConfig(loss_scale=64.0, mixed_precision=False)
    step = mlp_step(cfg)
    got = run(step, apply_dls(step.gm, cfg), batch=_nan_batch(step))
    for a, b in zip(got["state"], step.state, strict=True):
        assert torch.equal(a, b)
