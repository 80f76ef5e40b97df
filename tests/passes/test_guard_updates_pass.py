"""GuardUpdatesPass: on overflow params and optimizer state come out bit-identical; buffers advance."""

from __future__ import annotations

import torch
from stepgraph import cnn_step, mlp_step, reference_step, run

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.passes import GuardUpdatesPass, apply_dls
from dlspass.scale_policy import init_state

CFG = DLSConfig(mixed_precision=False)


def test_every_param_and_opt_state_output_is_a_guard_on_its_placeholder() -> None:
    gm = apply_dls(mlp_step(CFG).gm, CFG)
    vals = roles.output_values(gm.graph)
    n_guarded = 0
    for i, (role, target) in enumerate(roles.output_roles(gm.graph)):
        v = vals[i]
        if role in (roles.PARAM_UPDATE, roles.OPT_STATE_UPDATE):
            n_guarded += 1
            assert v.target is torch.ops.aten.where.self and roles.role_of(v) == roles.GUARD
            assert roles.role_of(v.args[0]) == roles.ISFINITE
            old = v.args[2]
            assert old.op == "placeholder" and roles.target_of(old) == target
            assert roles.pass_of(v) == "guard_updates"
        else:
            assert roles.role_of(v) != roles.GUARD
    assert n_guarded == 12
    assert len(roles.nodes_with_role(gm.graph, roles.GUARD)) == 12


def test_overflow_leaves_params_and_opt_state_bit_identical_buffers_advance() -> None:
    step = cnn_step(CFG)
    gm = apply_dls(step.gm, CFG)
    opt = {k: torch.randn_like(v) for k, v in step.opt_state.items()}  # non-trivial momentum
    huge = init_state(CFG)._replace(loss_scale=torch.tensor(3.4e38))
    big = [step.batch[0] * 100, step.batch[1]]
    got = run(step, gm, state=huge, opt_state=opt, batch=big)
    for k, v in step.params.items():
        assert torch.equal(got[roles.PARAM_UPDATE][k], v), k
    for k, v in opt.items():
        assert torch.equal(got[roles.OPT_STATE_UPDATE][k], v), k
    ref = reference_step(step, CFG, state=huge, opt_state=opt, batch=big)
    assert not bool(ref["isfinite"])
    for k, v in ref[roles.BUFFER_UPDATE].items():
        if v.is_floating_point():
            assert not torch.equal(v, step.buffers[k]), k  # BatchNorm statistics moved ...
        # ... as in eager. Bit equality: BatchNorm's running statistics come from the forward, where
        # the traced graph runs the ATen ops eager dispatches, in the same order
        torch.testing.assert_close(got[roles.BUFFER_UPDATE][k], v, rtol=0, atol=0)
    assert int(got["state"].num_skipped_steps) == 1


def test_clean_step_updates_params() -> None:
    step = mlp_step(CFG)
    got = run(step, apply_dls(step.gm, CFG))
    assert all(not torch.equal(got[roles.PARAM_UPDATE][k], v) for k, v in step.params.items())


def test_static_scale_inserts_no_guard_and_pass_is_idempotent() -> None:
    cfg = DLSConfig(loss_scale=4.0, mixed_precision=False)
    gm = apply_dls(mlp_step(cfg).gm, cfg)
    assert not roles.nodes_with_role(gm.graph, roles.GUARD)
    gm = apply_dls(mlp_step(CFG).gm, CFG)
    code = gm.code
    assert not GuardUpdatesPass(CFG)(gm).modified
    gm.recompile()
    assert gm.code == code
