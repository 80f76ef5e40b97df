"""The transformers 5.23 Trainer with dlspass scalers (docs/INTEGRATIONS.md), against
torch.amp.GradScaler in the same code: one injected overflow, ``max_grad_norm`` clipping, a
linear LR schedule, and the Trainer's own checkpoint and ``resume_from_checkpoint``."""

from __future__ import annotations

import pytest
import torch
from accelerate.state import AcceleratorState
from framework_runs import (
    HALF,
    LR,
    OVERFLOW_STEP,
    STEPS,
    Record,
    TinyNet,
    assert_same_run,
    batches,
    flat_params,
    skip_visible_scaler,
    torch_amp_scaler,
    torch_grad_scaler,
)
from transformers import Trainer, TrainerCallback, TrainingArguments

from dlspass.integrations import attach_scaler


class _LossNet(torch.nn.Module):
    """TinyNet returning the Trainer's ``{"loss": ...}``; a batch with ``poison`` set has an
    infinite loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyNet()

    def forward(self, x, labels, poison):
        loss = torch.nn.functional.mse_loss(self.net(x).float(), labels)
        return {"loss": loss * torch.where(poison.any(), float("inf"), 1.0)}


class _Batches(torch.utils.data.Dataset):
    """Step i's batch is item i (batch size 1 of pre-made batches, no shuffling)."""

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, i: int) -> dict:
        x, y = batches()[i]
        return {"x": x, "labels": y, "poison": torch.tensor(i == OVERFLOW_STEP)}


def _collate(items: list[dict]) -> dict:
    (item,) = items
    return item


class _Recorder(TrainerCallback):
    def __init__(self, trainer_box: list) -> None:
        self.box = trainer_box
        self.rec = Record()

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.box[0]
        self.rec.skipped += int(trainer.accelerator.optimizer_step_was_skipped)
        self.rec.add(trainer.accelerator.scaler.get_scale(),
                     trainer.optimizer.param_groups[0]["lr"], flat_params(trainer.model))


class _InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _trainer(make_scaler, out, max_steps: int) -> tuple[Trainer, _Recorder]:
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, fp16=True, max_steps=max_steps,
        per_device_train_batch_size=1, learning_rate=LR, lr_scheduler_type="linear",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.5, optim="sgd", save_steps=HALF,
        save_strategy="steps", logging_strategy="no", report_to=[], seed=0,
        remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    box: list = []
    recorder = _Recorder(box)
    trainer = _InOrder(model=_LossNet(), args=args, train_dataset=_Batches(),
                       data_collator=_collate, callbacks=[recorder])
    box.append(trainer)
    attach_scaler(trainer.accelerator, make_scaler())
    return trainer, recorder





SCALERS = {"TorchGradScaler": torch_grad_scaler, "SkipVisibleGradScaler": skip_visible_scaler}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _run(make_scaler, out) -> tuple[Record, Record]:
    trainer, whole = _trainer(make_scaler, out, STEPS)
    trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer, resumed = _trainer(make_scaler, out, STEPS)
    trainer.train(resume_from_checkpoint=str(out / f"checkpoint-{HALF}"))
    return whole.rec, resumed.rec


@pytest.mark.parametrize("make", SCALERS.values(), ids=SCALERS.keys())
def test_trainer_recipe_matchestorch_amp_scaler(make, tmp_path):
    ref, ref_resumed = _run(torch_amp_scaler, tmp_path / "torch")
    got, got_resumed = _run(make, tmp_path / "dlspass")
    assert ref.skipped == 1 and len(ref.params) == STEPS
    assert ref.lrs[OVERFLOW_STEP] == ref.lrs[OVERFLOW_STEP - 1]  # the LR held on the skip
    assert_same_run(got, ref)
    assert_same_run(got_resumed, ref_resumed)
    tail = Record(ref.scales[HALF:], ref.lrs[HALF:], ref.params[HALF:], 0)
    assert_same_run(got_resumed, tail)  # the resumed run continues the uninterrupted one


def test_fp16_on_cpu_trains_without_a_scaler_unless_one_is_attached(tmp_path):
    """The finding the recipe is for: TrainingArguments(fp16=True, use_cpu=True) gives no
    scaler and no autocast (fp32 training), and says nothing."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fp16=True, report_to=[])
    trainer = Trainer(model=_LossNet(), args=args)
    assert trainer.accelerator.scaler is None and trainer.accelerator.native_amp is False
