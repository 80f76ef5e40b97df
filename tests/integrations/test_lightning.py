"""Lightning 2.6 (the Trainer and Fabric) with dlspass scalers through the ``MixedPrecision``
plugin (docs/INTEGRATIONS.md), against torch.amp.GradScaler in the same code: one injected
overflow, gradient clipping, an LR schedule that moves every step, and checkpoint and resume
through the framework."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from framework_runs import (
    GROWTH_INTERVAL,
    HALF,
    INIT_SCALE,
    MAX_NORM,
    OVERFLOW_STEP,
    STEPS,
    Record,
    assert_same_run,
    batches,
    flat_params,
    make_model,
    torch_amp_scaler,
    torch_grad_scaler,
)
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision

import dlspass
from dlspass.config import DLSConfig


def _grad_scaler():
    # Lightning steps the LR scheduler whether or not the step was skipped, with torch.amp's
    # scaler too: the plain GradScaler matches it here
    return dlspass.GradScaler(config=DLSConfig(policy="torch", initial_loss_scale=INIT_SCALE,
                                               steps_per_increase=GROWTH_INTERVAL))


SCALERS = {"TorchGradScaler": torch_grad_scaler, "GradScaler-policy-torch": _grad_scaler}


def _lr_lambda(step: int) -> float:
    return 1.0 / (1 + step)


# ---- the Trainer -------------------------------------------------------------------------------
class _Module(L.LightningModule):
    def __init__(self, rec: Record) -> None:
        super().__init__()
        self.net, _ = make_model()
        self.rec = rec

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        if self.current_epoch == 0 and batch_idx == OVERFLOW_STEP:
            loss = loss * float("inf")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        opt = self.optimizers(use_pl_optimizer=False)
        self.rec.add(self.trainer.precision_plugin.scaler.get_scale(),
                     opt.param_groups[0]["lr"], flat_params(self.net))

    def configure_optimizers(self):
        _, opt = make_model()
        opt = torch.optim.SGD(self.net.parameters(), **{k: v for k, v in opt.defaults.items()
                                                        if k in ("lr", "momentum")})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def train_dataloader(self):
        # one epoch is the first half of the run: resuming from an epoch's end is exact
        return torch.utils.data.DataLoader(list(batches()[:HALF]), batch_size=None)


def _fit(make_scaler, epochs: int, rec: Record, ckpt_path=None) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs,
        plugins=[MixedPrecision(precision="16-mixed", device="cpu", scaler=make_scaler())],
        gradient_clip_val=MAX_NORM, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dataloader workers, the LR-before-step warning
        trainer.fit(_Module(rec), ckpt_path=ckpt_path)
    return trainer


def _trainer_run(make_scaler, tmp) -> tuple[Record, Record]:
    whole = Record()
    _fit(make_scaler, 2, whole)
    first = _fit(make_scaler, 1, Record())
    first.save_checkpoint(tmp / "half.ckpt")
    resumed = Record()
    _fit(make_scaler, 2, resumed, ckpt_path=tmp / "half.ckpt")
    return whole, resumed


def _assert_same_as_torch_amp(run, make_scaler, tmp) -> Record:
    """Runs ``run`` (whole, then resumed from half) with torch.amp's scaler and with
    ``make_scaler``; both runs, and the resumed tail, must match step for step. Returns
    torch.amp's whole run, whose overflow step must have been skipped."""
    (tmp / "t").mkdir()
    (tmp / "d").mkdir()
    ref, ref_resumed = run(torch_amp_scaler, tmp / "t")
    got, got_resumed = run(make_scaler, tmp / "d")
    assert torch.equal(ref.params[OVERFLOW_STEP], ref.params[OVERFLOW_STEP - 1])  # skipped
    assert_same_run(got, ref)
    assert_same_run(got_resumed, ref_resumed)
    tail = Record(ref.scales[HALF:], ref.lrs[HALF:], ref.params[HALF:], 0)
    assert_same_run(got_resumed, tail)
    return ref


@pytest.mark.parametrize("make", SCALERS.values(), ids=SCALERS.keys())
def test_lightning_trainer_recipe_matchestorch_amp_scaler(make, tmp_path):
    ref = _assert_same_as_torch_amp(_trainer_run, make, tmp_path)
    assert len(ref.params) == STEPS
    assert ref.scales[OVERFLOW_STEP] == ref.scales[OVERFLOW_STEP - 1] / 2


def test_lightning_16_mixed_on_cpu_is_bf16_without_the_plugin():
    """The finding the recipe is for: on CPU ``precision="16-mixed"`` becomes bf16 (no scaler)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False)
    assert plain.precision_plugin.precision == "bf16-mixed"
    assert getattr(plain.precision_plugin, "scaler", None) is None
    scaler = torch_grad_scaler()
    given = L.Trainer(accelerator="cpu", logger=False,
                      plugins=[MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)])
    assert given.precision_plugin.precision == "16-mixed"
    assert given.precision_plugin.scaler is scaler


# ---- Fabric ------------------------------------------------------------------------------------
def _fabric(make_scaler):
    scaler = make_scaler()
    fabric = L.Fabric(accelerator="cpu", devices=1,
                      plugins=FabricMixedPrecision(precision="16-mixed", device="cpu", scaler=scaler))
    model, opt = make_model()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    model, opt = fabric.setup(model, opt)
    return fabric, scaler, model, opt, sched


def _fabric_steps(fabric, scaler, model, opt, sched, steps: range, rec: Record) -> None:
    for i in steps:
        x, y = batches()[i]
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if i == OVERFLOW_STEP:
            loss = loss * float("inf")
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=MAX_NORM, error_if_nonfinite=False)
        opt.step()
        sched.step()
        opt.zero_grad()
        rec.add(scaler.get_scale(), opt.param_groups[0]["lr"], flat_params(model))


def _fabric_run(make_scaler, tmp) -> tuple[Record, Record]:
    whole = Record()
    fabric, scaler, model, opt, sched = _fabric(make_scaler)
    _fabric_steps(fabric, scaler, model, opt, sched, range(HALF), whole)
    # the scaler is saved only when it is in the state (Fabric does not add it)
    fabric.save(tmp / "half.ckpt", {"model": model, "optimizer": opt, "scheduler": sched,
                                    "scaler": scaler})
    _fabric_steps(fabric, scaler, model, opt, sched, range(HALF, STEPS), whole)
    resumed = Record()
    fabric, scaler, model, opt, sched = _fabric(make_scaler)
    fabric.load(tmp / "half.ckpt", {"model": model, "optimizer": opt, "scheduler": sched,
                                    "scaler": scaler})
    _fabric_steps(fabric, scaler, model, opt, sched, range(HALF, STEPS), resumed)
    return whole, resumed


@pytest.mark.parametrize("make", SCALERS.values(), ids=SCALERS.keys())
def test_fabric_recipe_matchestorch_amp_scaler(make, tmp_path):
    _assert_same_as_torch_amp(_fabric_run, make, tmp_path)


def test_fabric_saves_no_scaler_unless_it_is_in_the_state(tmp_path):
    fabric, scaler, model, opt, _ = _fabric(torch_grad_scaler)
    fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": opt})
    saved = torch.load(tmp_path / "a.ckpt", weights_only=False)
    assert set(saved) == {"model", "optimizer"}
    fabric.save(tmp_path / "b.ckpt", {"model": model, "optimizer": opt, "scaler": scaler})
    saved = torch.load(tmp_path / "b.ckpt", weights_only=False)
    assert saved["scaler"] == scaler.state_dict()
