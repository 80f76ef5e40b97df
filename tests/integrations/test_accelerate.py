"""accelerate 1.15 with dlspass scalers (docs/INTEGRATIONS.md), against torch.amp.GradScaler in
the same code: one injected overflow, gradient clipping, an LR schedule that moves every step,
and ``save_state``/``load_state`` half-way."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from framework_runs import (
    HALF,
    MAX_NORM,
    OVERFLOW_STEP,
    STEPS,
    Record,
    assert_same_run,
    batches,
    flat_params,
    make_model,
    skip_visible_scaler,
    torch_amp_scaler,
    torch_grad_scaler,
)

import dlspass
from dlspass.integrations import attach_scaler

SCALERS = {"TorchGradScaler": torch_grad_scaler, "SkipVisibleGradScaler": skip_visible_scaler}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _accelerator(make_scaler):
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = make_scaler()
    attach_scaler(acc, scaler)
    model, opt = make_model()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, scaler, model, opt, sched


def _steps(acc, scaler, model, opt, sched, steps: range, rec: Record, norms: list) -> None:
    for i in steps:
        x, y = batches()[i]
        loss = torch.nn.functional.mse_loss(model(x), y)
        if i == OVERFLOW_STEP:
            loss = loss * float("inf")
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        sched.step()
        opt.zero_grad()
        rec.skipped += int(acc.optimizer_step_was_skipped)
        rec.add(scaler.get_scale(), opt.param_groups[0]["lr"], flat_params(model))


def _run(make_scaler, ckpt) -> tuple[Record, Record, list]:
    """The whole run, saving the state half-way; then a fresh process-like set-up that loads
    it and runs the second half."""
    rec, norms = Record(), []
    acc, scaler, model, opt, sched = _accelerator(make_scaler)
    _steps(acc, scaler, model, opt, sched, range(HALF), rec, norms)
    acc.save_state(str(ckpt))
    _steps(acc, scaler, model, opt, sched, range(HALF, STEPS), rec, norms)
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = Record()
    acc, scaler, model, opt, sched = _accelerator(make_scaler)
    acc.load_state(str(ckpt))
    _steps(acc, scaler, model, opt, sched, range(HALF, STEPS), resumed, [])
    return rec, resumed, norms


@pytest.mark.parametrize("make", SCALERS.values(), ids=SCALERS.keys())
def test_accelerate_recipe_matchestorch_amp_scaler(make, tmp_path):
    ref, ref_resumed, ref_norms = _run(torch_amp_scaler, tmp_path / "torch")
    got, got_resumed, norms = _run(make, tmp_path / "dlspass")
    assert ref.skipped == 1  # the overflow was seen, and the LR held on it
    assert ref.lrs[OVERFLOW_STEP] == ref.lrs[OVERFLOW_STEP - 1]
    assert_same_run(got, ref)
    assert_same_run(got_resumed, ref_resumed)
    tail = Record(ref.scales[HALF:], ref.lrs[HALF:], ref.params[HALF:], 0)
    assert_same_run(got_resumed, tail)  # the resumed run continues the uninterrupted one
    # clipping saw the unscaled gradients (a scaled norm would be ~INIT_SCALE times larger)
    clean = [n for i, n in enumerate(norms) if i != OVERFLOW_STEP]
    assert clean == [n for i, n in enumerate(ref_norms) if i != OVERFLOW_STEP]
    assert MAX_NORM < max(clean) < 50  # and it bit


def test_plain_grad_scaler_is_refused_naming_the_fix():
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(TypeError, match="SkipVisibleGradScaler"):
        attach_scaler(acc, dlspass.GradScaler())


def test_attach_after_prepare_and_without_fp16_are_refused():
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    model, opt = make_model()
    acc.prepare(model, opt)
    with pytest.raises(ValueError, match="before accelerator.prepare"):
        attach_scaler(acc, torch_grad_scaler())
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match="mixed_precision"):
        attach_scaler(Accelerator(cpu=True), torch_grad_scaler())


def test_on_cpu_fp16_has_no_scaler_and_no_autocast_without_the_recipe():
    """The finding the recipe is for: accelerate trains fp16 on CPU in fp32, with no scaler,
    and its clip_grad_norm_ does not unscale."""
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    assert acc.scaler is None and acc.native_amp is False
    model, opt = acc.prepare(*make_model())
    x, _ = batches()[0]
    assert model(x).dtype == torch.float32
