"""``log_loss_scale: true`` in a Model Zoo YAML logs the scale from every entry point: the eager
scaler (at the end of ``update()``), ``capture_step`` and ``dlspass.compile`` (after the graph
ran). The scale reaches TensorBoard event files (read back with tensorboard's reader) and the
``dlspass.scale_log`` logger every ``log_steps`` steps, with no host read on the other steps."""

from __future__ import annotations

import logging

import pytest
import torch
from test_scale_log import _SyncCounter
from torch import nn

import dlspass
from dlspass.config import DLSConfig

STEPS = 8
SPIKE = 3  # the step whose batch is infinite: every entry point must skip it
YAML = """\
trainer:
  init:
    precision:
      enabled: true
      fp16_type: float16
      loss_scaling_factor: dynamic
      initial_loss_scale: 1024.0
      steps_per_increase: 2
      log_loss_scale: true
    logging:
      log_steps: 4
"""


def _config(tmp_path) -> DLSConfig:
    path = tmp_path / "params.yaml"
    path.write_text(YAML)
    cfg = DLSConfig.from_yaml(str(path), modelzoo_release="2.5")
    assert cfg.log_loss_scale is True and cfg.extras["log_steps"] == 4
    return cfg.with_overrides(mixed_precision=False)  # the scale is the point, not the rounding


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    return (x * float("inf"), y) if step == SPIKE else (x, y)


def _eager(cfg, writer):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dlspass.GradScaler(config=cfg, summary_writer=writer)

    def step(x, y):
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return step, scaler


def _captured(cfg, writer):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = dlspass.capture_step(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), opt,
                                    _batch(0), cfg, summary_writer=writer)
    return (lambda x, y: captured((x, y))), captured.scaler


def _compiled(cfg, writer):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    compiled = dlspass.compile(train_step, optimizer=opt, config=cfg, summary_writer=writer,
                               backend_compiler="eager")
    return compiled, compiled.scaler


ENTRY_POINTS = {"eager": _eager, "capture_step": _captured, "compile": _compiled}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_log_loss_scale_in_a_yaml_reaches_tensorboard_and_the_log(entry, tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    step, scaler = ENTRY_POINTS[entry](_config(tmp_path), writer)
    kept = []  # the test's own copies of the scale after each step (read after the run)
    with caplog.at_level(logging.INFO, logger="dlspass.scale_log"):
        for i in range(1, STEPS + 1):
            step(*_batch(i))
            kept.append(scaler.get_scale_tensor().clone())
    writer.close()
    scales = [t.item() for t in kept]
    # the scale moved: halved at the spike, doubled every 2 clean steps
    assert scales[SPIKE - 1] == scales[SPIKE - 2] / 2 and scales[-1] > scales[SPIKE - 1]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("loss_scale")} == dict(enumerate(scales, start=1))
    assert {e.step for e in acc.Scalars("skipped") if e.value == 1.0} == {SPIKE}
    assert {e.step: e.value for e in acc.Scalars("skipped_steps")} == {4: 1.0, 8: 1.0}
    lines = [r.getMessage() for r in caplog.records if r.name == "dlspass.scale_log"]
    assert lines == [f"step 4: loss scale {scales[3]:g}, 1 skipped steps ({SPIKE} in the last 4 steps)",
                     f"step 8: loss scale {scales[7]:g}, 1 skipped steps (none in the last 4 steps)"]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_no_host_read_on_the_steps_that_do_not_log(entry, tmp_path, monkeypatch):
    torch.manual_seed(0)
    step, _ = ENTRY_POINTS[entry](_config(tmp_path), None)
    step(*_batch(1))  # the first call compiles (dlspass.compile): outside the count
    counter = _SyncCounter(monkeypatch)
    for i in range(2, STEPS + 1):
        counter.start(i)
        step(*_batch(i))
        counter.stop(i)
    # the logging steps read their window in one transfer; no other step reads the device
    assert {s: n for s, n in counter.per_step.items() if n} == {4: 1, 8: 1}


class _Writer:
    """A SummaryWriter's three methods the logger calls, recorded."""

    def __init__(self) -> None:
        self.scalars: dict[str, dict[int, float]] = {}

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars.setdefault(tag, {})[global_step] = value

    def add_text(self, tag: str, text: str, global_step: int) -> None:
        raise AssertionError("no localize callable: no overflow text")

    def flush(self) -> None:
        pass


def test_a_summary_writer_alone_switches_logging_on_also_for_the_torch_amp_scaler():
    cfg = DLSConfig(mixed_precision=False, extras={"log_steps": 2})
    assert dlspass.GradScaler(config=cfg).scale_log is None  # neither log_loss_scale nor a writer
    writer = _Writer()
    scaler = dlspass.TorchGradScaler(device="cpu", init_scale=8.0, growth_interval=1,
                                     summary_writer=writer)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(1, 5):
        scaler.scale(nn.functional.mse_loss(model(_batch(i)[0]), _batch(i)[1])).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    # torch's rule: doubled after each clean step, halved at the spike (step 3); logged every
    # 100 steps by default, so only the four kept steps after a flush
    assert writer.scalars == {}
    scaler.scale_log.flush()
    assert writer.scalars["loss_scale"] == {1: 16.0, 2: 32.0, 3: 16.0, 4: 32.0}
    assert writer.scalars["skipped"] == {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0}
