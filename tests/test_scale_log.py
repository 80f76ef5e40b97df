"""ScaleLogger: the scale and the skipped steps reach Python logging and TensorBoard event files,
read back with TensorBoard's own reader, with no host sync on the steps that do not log."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import dlspass
from dlspass.scale_log import ScaleLogError, ScaleLogger

SPIKES = {3, 7}  # the steps whose loss is made infinite: the scaler must skip exactly these


def _train(steps: int, logger_factory, *, on_step=None) -> tuple[dlspass.GradScaler, list]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dlspass.GradScaler(loss_scale="dynamic", initial_loss_scale=2.0**10, steps_per_increase=2)
    scale_log = logger_factory(scaler)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    kept = []  # the test's own copies of the scale after each step (read after the run)
    for step in range(1, steps + 1):
        loss = nn.functional.mse_loss(model(x), y)
        if step in SPIKES:
            loss = loss * float("inf")
        if on_step is not None:
            on_step.start(step)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scale_log.step()
        if on_step is not None:
            on_step.stop(step)
        kept.append(scaler.get_scale_tensor().clone())
    return scaler, [t.item() for t in kept]


def test_scale_and_skipped_steps_reach_tensorboard_and_the_log(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="dlspass.scale_log"):
        scaler, scales = _train(12, lambda s: ScaleLogger(s, every=4, writer=writer))
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    logged = {e.step: e.value for e in acc.Scalars("loss_scale")}
    assert logged == {s: pytest.approx(v) for s, v in zip(range(1, 13), scales, strict=True)}
    # the scale moved: halved at each spike, grown back after clean steps
    assert scales[2] == scales[1] / 2 and scales[6] == scales[5] / 2 and scales[5] > scales[4]
    skipped = {e.step for e in acc.Scalars("skipped") if e.value == 1.0}
    assert skipped == SPIKES
    count = {e.step: e.value for e in acc.Scalars("skipped_steps")}
    assert count == {4: 1.0, 8: 2.0, 12: 2.0}
    assert int(scaler.get_num_skipped_steps()) == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "dlspass.scale_log"]
    assert len(lines) == 3
    assert lines[0].startswith(f"step 4: loss scale {scales[3]:g}, 1 skipped steps (3 in the last 4")
    assert "(7 in the last 4 steps)" in lines[1] and "(none in the last 4 steps)" in lines[2]


class _SyncCounter:
    """Counts the Tensor calls that read a value to the host, per training step."""

    READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")

    def __init__(self, monkeypatch) -> None:
        self.per_step: dict[int, int] = {}
        self._step: int | None = None
        for name in self.READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(original))

    def _counting(self, original):
        def read(t, *args, **kwargs):
            if self._step is not None:
                self.per_step[self._step] += 1
            return original(t, *args, **kwargs)
        return read

    def start(self, step: int) -> None:
        self._step = step
        self.per_step[step] = 0

    def stop(self, step: int) -> None:
        self._step = None


def test_no_host_sync_on_steps_that_do_not_log(monkeypatch):
    counter = _SyncCounter(monkeypatch)
    _train(12, lambda s: ScaleLogger(s, every=4), on_step=counter)
    # the counter sees reads: the logging steps read their window (one transfer)
    assert {s: n for s, n in counter.per_step.items() if n} == {4: 1, 8: 1, 12: 1}


def test_localize_runs_only_on_a_window_with_a_skipped_step(caplog):
    calls = []

    def localize():
        calls.append(1)
        return ["weight"]

    with caplog.at_level(logging.INFO, logger="dlspass.scale_log"):
        _train(12, lambda s: ScaleLogger(s, every=4, localize=localize))
    assert len(calls) == 2  # the windows 1-4 and 5-8 had a spike, 9-12 had none
    assert "overflow: weight" in caplog.records[0].getMessage()


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_bad_interval_is_refused(every):
    with pytest.raises(ScaleLogError, match="every: expected a positive int"):
        ScaleLogger(dlspass.GradScaler(), every=every)


def test_not_a_scaler_is_refused():
    with pytest.raises(ScaleLogError, match="scaler: object has no"):
        ScaleLogger(object())
