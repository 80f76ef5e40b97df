"""apply_dls: the whole pipeline against an eager fp32 step with dlspass.scale_policy math."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from typing import Any

import pytest
import torch
from stepgraph import MLP_GRAD_SUMS, Step, cnn_step, mlp_step, reference_step, run
from tolerance import grad_term_sums, reordered_sum_atol, sgd_update_atol, smallcnn_grad_sums

from dlspass.config import ConfigError, DLSConfig
from dlspass.graph import roles
from dlspass.passes import (
    PassContractError,
    applied_passes,
    apply_dls,
    recorded_config,
    skip_reasons,
)
from dlspass.scale_policy import ScalerState

FP32 = DLSConfig(mixed_precision=False, initial_loss_scale=1024.0, steps_per_increase=2)


# cnn_step's SmallCNN (width 2, 3 classes, batch of 2 4x4 images): the forward is the same on
# both sides (the loss is bit-equal), the backward sums in other orders (tests/tolerance.py)
CNN_GRAD_SUMS = smallcnn_grad_sums(width=2, n_classes=3, batch=2, hw=4)


def _assert_matches(got: dict, ref: dict, step: Step, **override: Any) -> None:
    """``got`` (the rewritten graph run on ``step``'s inputs, with ``override``) against
    ``reference_step``'s ``ref``."""
    assert set(got[roles.BUFFER_UPDATE]) == set(ref[roles.BUFFER_UPDATE])
    for k, v in ref[roles.BUFFER_UPDATE].items():
        # bit equality: BatchNorm's running statistics come from the forward, where the traced
        # step runs the ATen ops eager dispatches, in the same order
        assert torch.equal(got[roles.BUFFER_UPDATE][k], v), k
    for role in (roles.PARAM_UPDATE, roles.OPT_STATE_UPDATE):
        assert set(got[role]) == set(ref[role])
    if not bool(ref["isfinite"]):
        # a skipped step: both sides select the unchanged inputs, bit for bit
        for role in (roles.PARAM_UPDATE, roles.OPT_STATE_UPDATE):
            for k, v in ref[role].items():
                assert torch.equal(got[role][k], v), k
    else:
        # the traced backward against eager autograd's: other summation orders along the
        # model's longest chain of sums, S each gradient's terms' magnitudes (which cancel in
        # BatchNorm); the scale is a power of two, exact; the SGD update carries that and adds
        # its own rounding (tests/tolerance.py)
        g = {"params": step.params, "buffers": step.buffers, "batch": step.batch, **override}
        model = copy.deepcopy(step.model)
        model.load_state_dict({**g["params"], **g["buffers"]})
        terms = grad_term_sums(model, lambda m: step.loss_fn(m, tuple(g["batch"])))
        n = CNN_GRAD_SUMS if any(k.startswith("bn") for k in terms) else MLP_GRAD_SUMS
        lr = float(step.hyper["group0.lr"])
        for k, p in g["params"].items():
            grad_atol = reordered_sum_atol(n, terms[k])
            buf = f"{k}.momentum_buffer"
            torch.testing.assert_close(got[roles.OPT_STATE_UPDATE][buf], ref[roles.OPT_STATE_UPDATE][buf],
                                       rtol=0, atol=grad_atol, msg=buf)
            torch.testing.assert_close(got[roles.PARAM_UPDATE][k], ref[roles.PARAM_UPDATE][k], rtol=0,
                                       atol=sgd_update_atol(grad_atol, lr, float(p.abs().max())), msg=k)
    # bit equality: the loss is the forward's, where the traced step runs the ATen ops eager
    # dispatches, in the same order
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=0, atol=0, equal_nan=True)
    for a, b, name in zip(got["state"], ref["state"], ScalerState._fields, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("make", [mlp_step, cnn_step], ids=["mlp", "cnn_batchnorm"])
def test_fp32_pipeline_matches_eager_reference(make) -> None:
    step = make(FP32)
    gm = apply_dls(step.gm, FP32)
    _assert_matches(run(step, gm), reference_step(step, FP32), step)


def test_fp32_pipeline_three_steps_with_overflow_matches_reference() -> None:
    step = mlp_step(FP32)
    gm = apply_dls(step.gm, FP32)
    params, opt, state = step.params, step.opt_state, step.state
    bad_batch = [step.batch[0] * float("inf"), step.batch[1]]
    for batch in (step.batch, bad_batch, step.batch):
        got = run(step, gm, params=params, opt_state=opt, state=state, batch=batch)
        ref = reference_step(step, FP32, params=params, opt_state=opt, state=state, batch=batch)
        _assert_matches(got, ref, step, params=params, opt_state=opt, state=state, batch=batch)
        params, opt, state = got[roles.PARAM_UPDATE], got[roles.OPT_STATE_UPDATE], got["state"]
    # scale 1024 -> 1024 (clean) -> 512 (overflow) -> 512 (clean), one skipped step
    assert float(state.loss_scale) == 512.0
    assert int(state.num_skipped_steps) == 1


def test_pipeline_is_idempotent() -> None:
    cfg = DLSConfig(max_gradient_norm=1.0)
    gm = apply_dls(mlp_step(cfg).gm, cfg)
    code = gm.code
    n = len(gm.graph.nodes)
    gm2 = apply_dls(gm, cfg)
    assert gm2.code == code and len(gm2.graph.nodes) == n
    assert applied_passes(gm2.graph) == ["lower_precision", "scale_seed", "unscale_grads",
                                         "clip_grad_norm", "guard_updates", "update_scale"]


def test_each_pass_applied_twice_changes_nothing() -> None:
    cfg = DLSConfig(max_gradient_norm=1.0)
    from dlspass.passes import default_passes

    gm = mlp_step(cfg).gm
    for p in default_passes(cfg):
        p(gm)
        gm.recompile()
        code = gm.code
        assert not p(gm).modified, p.name
        gm.recompile()
        assert gm.code == code, p.name


def test_different_config_is_an_error() -> None:
    cfg = DLSConfig()
    gm = apply_dls(mlp_step(cfg).gm, cfg)
    with pytest.raises(PassContractError, match="already rewritten with config"):
        apply_dls(gm, DLSConfig(initial_loss_scale=8.0))
    with pytest.raises(PassContractError, match="precision native.*refusing.*precision emulate"):
        apply_dls(gm, cfg.with_overrides(precision_mode="emulate"))
    # float16's default mode spelled out is the config the graph was rewritten with
    code = gm.code
    assert apply_dls(gm, cfg.with_overrides(precision_mode="native")).code == code


def test_config_is_recorded_as_json_and_round_trips() -> None:
    cfg = DLSConfig(fp16_type="cbfloat16", max_gradient_value=2.0)
    gm = apply_dls(mlp_step(cfg).gm, cfg)
    assert isinstance(gm.graph.output_node().meta["custom"]["dlspass_config"], str)
    # the record carries the mode that ran (cbfloat16's default, emulate), not a separate key
    assert recorded_config(gm) == dataclasses.replace(cfg, precision_mode="emulate")
    assert roles.MODE_KEY not in gm.graph.output_node().meta["custom"]


def test_static_scale_scales_and_unscales_but_never_skips() -> None:
    cfg = DLSConfig(loss_scale=128.0, mixed_precision=False)
    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    rs = {roles.role_of(n) for n in gm.graph.nodes}
    assert {roles.SCALED_SEED, roles.UNSCALE} <= rs
    assert not rs & {roles.ISFINITE, roles.GUARD, roles.SCALE_UPDATE}
    _assert_matches(run(step, gm), reference_step(step, cfg), step)
    # an overflow is not checked: the parameters change (to non-finite values)
    got = run(step, gm, batch=[step.batch[0] * float("inf"), step.batch[1]])
    assert not all(torch.isfinite(v).all() for v in got[roles.PARAM_UPDATE].values())


@pytest.mark.parametrize("cfg", [None, DLSConfig(loss_scale=None, mixed_precision=False),
                                 DLSConfig(fp16_type="bfloat16", mixed_precision=False)])
def test_no_scaling_leaves_the_graph_as_captured(cfg) -> None:
    step = mlp_step(cfg)
    code = step.gm.code
    gm = apply_dls(step.gm, cfg)
    gm.recompile()
    assert gm.code == code


def test_bfloat16_lowers_precision_without_scaling() -> None:
    cfg = DLSConfig(fp16_type="bfloat16")
    gm = apply_dls(mlp_step(cfg).gm, cfg)
    rs = [roles.role_of(n) for n in gm.graph.nodes]
    assert roles.CAST in rs and roles.SCALED_SEED not in rs and roles.UNSCALE not in rs


def test_input_graph_without_roles_is_rejected() -> None:
    gm = copy.deepcopy(mlp_step().gm)
    for n in gm.graph.nodes:
        n.meta.get("custom", {}).pop("dlspass_role", None)
    with pytest.raises(PassContractError, match="backward_seed"):
        apply_dls(gm, DLSConfig())


def test_a_contract_error_inside_a_pass_reaches_the_caller_as_itself() -> None:
    # torch's PassManager would re-raise it as a bare Exception naming the pass
    cfg = DLSConfig(mixed_precision=False)
    gm = copy.deepcopy(mlp_step(cfg).gm)
    for n in gm.graph.find_nodes(op="placeholder"):
        if roles.target_of(n) == "loss_scale":
            n.meta["custom"]["dlspass_target"] = "renamed"
    with pytest.raises(PassContractError, match="scale_seed|no scaler_state placeholder for 'loss_scale'"):
        apply_dls(gm, cfg)


def test_bad_precision_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="precision_mode"), \
            pytest.warns(DeprecationWarning, match=r"config=DLSConfig\(precision_mode="):
        apply_dls(mlp_step().gm, DLSConfig(), precision_mode="fast")


def test_precision_mode_keyword_is_deprecated_and_merged_into_the_config() -> None:
    cfg = DLSConfig()
    with pytest.warns(DeprecationWarning, match=r"apply_dls\(precision_mode=\.\.\.\) is deprecated: "
                      r"pass config=DLSConfig\(precision_mode='emulate'\)"):
        old = apply_dls(mlp_step(cfg).gm, cfg, precision_mode="emulate")
    new = apply_dls(mlp_step(cfg).gm, cfg.with_overrides(precision_mode="emulate"))
    assert old.code == new.code
    assert recorded_config(old) == recorded_config(new) == cfg.with_overrides(precision_mode="emulate")


def _as_written_before_the_config_carried_the_mode(gm, mode: str) -> None:
    """Rewrite ``gm``'s record the way apply_dls wrote it before: the config as given (its
    ``precision_mode`` null) and the mode under ``roles.MODE_KEY``."""
    for node in (gm.graph.output_node(), *roles.nodes_with_role(gm.graph, roles.SEED)):
        custom = node.meta["custom"]
        data = json.loads(custom[roles.CONFIG_KEY])
        custom[roles.CONFIG_KEY] = json.dumps({**data, "precision_mode": None}, sort_keys=True)
        custom[roles.MODE_KEY] = mode


def test_a_graph_recorded_with_the_old_mode_key_reads_as_it_ran() -> None:
    # float16 with no mode given is native now; the old record says this graph ran emulated
    emulated = DLSConfig(precision_mode="emulate")
    gm = apply_dls(mlp_step(emulated).gm, emulated)
    code = gm.code
    _as_written_before_the_config_carried_the_mode(gm, "emulate")
    assert recorded_config(gm) == emulated
    assert apply_dls(gm, emulated).code == code  # the same config: unchanged
    with pytest.raises(PassContractError, match="precision emulate.*refusing.*precision native"):
        apply_dls(gm, DLSConfig())


@pytest.mark.parametrize(("cfg", "want"), [
    (DLSConfig(loss_scale=128.0, mixed_precision=False),
     {"clip_grad_norm": "no max_gradient_norm or max_gradient_value: no clipping",
      "guard_updates": "static scale: no overflow check",
      "update_scale": "static scale: no overflow check"}),
    (DLSConfig(fp16_type="bfloat16", max_gradient_norm=1.0),
     {p: "bfloat16: scaling off" for p in ("scale_seed", "unscale_grads", "guard_updates",
                                            "update_scale")}),
    (DLSConfig(max_gradient_value=1.0, mixed_precision=False), {}),
], ids=["static", "bfloat16", "dynamic"])
def test_each_skipped_pass_records_why_where_export_and_inspect_find_it(cfg, want) -> None:
    from dlspass.debug.inspect_report import render, summarize_graph

    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    assert skip_reasons(gm.graph) == want
    assert not set(want) & set(applied_passes(gm.graph))
    # torch.export rebuilds the output node; the seed node keeps the record
    ep = torch.export.export(gm, tuple(step.inputs()), strict=False)
    assert skip_reasons(ep.graph_module.graph) == want
    report = summarize_graph(gm)
    assert report["skipped_passes"] == want
    text = render(report, "text")
    for name, why in want.items():
        assert f"skipped: {name} ({why})" in text


def test_debug_log_names_each_pass_its_new_nodes_and_skip_reasons(caplog) -> None:
    cfg = DLSConfig(loss_scale=128.0, mixed_precision=False)
    with caplog.at_level(logging.DEBUG, logger="dlspass.passes"):
        gm = apply_dls(mlp_step(cfg).gm, cfg)
    lines = {r.getMessage().split(":")[0]: r.getMessage() for r in caplog.records
             if r.name == "dlspass.passes"}
    assert lines["guard_updates"] == "guard_updates: skipped (static scale: no overflow check)"
    scaled = roles.the_node(gm.graph, roles.SCALED_SEED)
    assert lines["scale_seed"] == f"scale_seed: added 1 nodes {[scaled.name]}, removed 0 nodes []"
    unscale = sorted(n.name for n in gm.graph.nodes if roles.pass_of(n) == "unscale_grads")
    assert lines["unscale_grads"].startswith(f"unscale_grads: added {len(unscale)} nodes {unscale}")
    # at INFO nothing is computed or logged
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dlspass.passes"):
        apply_dls(mlp_step(cfg).gm, cfg)
    assert not [r for r in caplog.records if r.name == "dlspass.passes"]


def test_real_capture_adam_overflow_skips_bit_identically() -> None:
    functional = pytest.importorskip("dlspass.capture.functional")
    from dlspass.models import MLP, mse_loss

    torch.manual_seed(0)
    model = MLP(d_in=4, d_hidden=8, d_out=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = (torch.randn(5, 4), torch.randn(5, 3))
    cfg = DLSConfig(max_gradient_norm=1.0)
    step = functional.capture_step(model, mse_loss, opt, batch, config=cfg)
    assert verify_ok(step.graph_module)
    step(batch)  # one clean step: Adam moments and step count become non-trivial
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = {k: v.clone() for k, v in step._fopt.state_tensors().items()}
    step.scaler.state = step.scaler.state._replace(loss_scale=torch.tensor(3.4e38))
    step((batch[0] * 100, batch[1] * 100))
    for k, v in model.named_parameters():
        assert torch.equal(v.detach(), params[k]), k
    after = step._fopt.state_tensors()
    assert set(after) == set(state) and any("step" in k for k in state)
    for k, v in state.items():
        assert torch.equal(after[k], v), k
    assert int(step.scaler.state.num_skipped_steps) == 1
    assert float(step.scaler.state.loss_scale) == 32768.0  # halved, then capped at the max


def verify_ok(gm) -> bool:
    from dlspass.graph.invariants import verify

    return verify(gm)


def test_recorded_config_survives_torch_export() -> None:
    cfg = DLSConfig(mixed_precision=False, max_gradient_norm=2.0)
    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    ep = torch.export.export(gm, tuple(step.inputs()), strict=False)
    exported = ep.graph_module
    # the record carries the mode in effect (float16's default, native)
    assert recorded_config(exported) == dataclasses.replace(cfg, precision_mode="native")
    with pytest.raises(PassContractError, match="already rewritten"):
        apply_dls(exported, DLSConfig())
