"""Model factories for the CLI tests: ``FACTORY()`` returns ``(model, example_inputs)``.

``model(*example_inputs)`` returns the scalar loss, so ``dlspass export tests.cli_factories:mlp``
can export it. ``*_batch(step)`` gives deterministic batches for training loops.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dlspass.models import MLP, TinyGPT, copy_task_batch, gpt_loss, mse_loss

GPT_VOCAB, GPT_BATCH, GPT_SEQ = 16, 2, 6


class MLPWithLoss(nn.Module):
    """``MLP`` followed by the mean squared error against ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return mse_loss(self.net, (x, y))


class GPTWithLoss(nn.Module):
    """``TinyGPT`` followed by the next-token cross entropy, times ``mult`` (inf forces overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(vocab=GPT_VOCAB, d=16, n_layer=1, n_head=2, block_size=GPT_SEQ)

    def forward(self, idx: Tensor, targets: Tensor, mult: Tensor) -> Tensor:
        return gpt_loss(self.gpt, (idx, targets)) * mult


class Inference(nn.Module):
    """No loss: returns the MLP's output (for the bad-input tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def mlp_batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def gpt_batch(step: int, mult: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return (*copy_task_batch(GPT_VOCAB, GPT_BATCH, GPT_SEQ, g), torch.tensor(mult))


def mlp() -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return MLPWithLoss(), mlp_batch(0)


def gpt() -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return GPTWithLoss(), gpt_batch(0)


def inference() -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return Inference(), (mlp_batch(0)[0],)


def not_a_pair() -> int:
    return 3


# ---- shared, per-process cached CLI artefacts and training loops ----------------------------

_TMP = Path(tempfile.mkdtemp(prefix="dlspass-cli-tests-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
FACTORIES = {"mlp": (mlp, mlp_batch), "gpt": (gpt, gpt_batch)}
OVERFLOW_STEP = 7
DLS_YAML = """\
trainer:
  init:
    precision:
      enabled: true
      fp16_type: float16
      loss_scaling_factor: dynamic
      initial_loss_scale: 1024
      steps_per_increase: 4
"""


def cli(*args: str) -> int:
    """``dlspass.cli.run(args)`` (in-process, returns the exit code)."""
    from dlspass import cli as dcli

    return dcli.run([str(a) for a in args])


def tmp_dir() -> Path:
    return _TMP


@functools.cache
def dls_yaml() -> Path:
    p = _TMP / "params.yaml"
    p.write_text(DLS_YAML)
    return p


@functools.cache
def joint_file(name: str) -> Path:
    """The exported joint program of factory ``name`` (exported once per test process)."""
    out = _TMP / f"{name}_joint.pt2"
    rc = cli("export", f"cli_factories:{name}", "-o", out)
    assert rc == 0, f"export {name} failed with {rc}"
    return out


@functools.cache
def step_file(name: str, suffix: str, *args: str) -> Path:
    """``dlspass transform`` of ``joint_file(name)`` with ``args`` (cached per argument list)."""
    out = _TMP / f"{name}_step_{abs(hash(args))}{suffix}"
    rc = cli("transform", joint_file(name), "-o", out, *args)
    assert rc == 0, f"transform {name} {args} failed with {rc}"
    return out


def batches(name: str, n: int = 20) -> list[tuple[Tensor, ...]]:
    """``n`` batches; step ``OVERFLOW_STEP`` overflows (an inf input or an inf loss factor)."""
    _, make = FACTORIES[name]
    out = [make(i) for i in range(n)]
    if n <= OVERFLOW_STEP:
        return out
    if name == "mlp":
        x, y = out[OVERFLOW_STEP]
        out[OVERFLOW_STEP] = (torch.full_like(x, float("inf")), y)
    else:
        out[OVERFLOW_STEP] = make(OVERFLOW_STEP, float("inf"))
    return out


def train_pt2(path: Path, data: list[tuple[Tensor, ...]]) -> dict[str, Any]:
    """Load a step ``.pt2`` and run it over ``data``; losses, scales, skips and final params."""
    import dlspass.formats  # noqa: F401 - registers dlspass::round_to_format for loading

    m = torch.export.load(str(path)).module()
    losses, scales, skipped = [], [], []
    with torch.no_grad():
        for batch in data:
            losses.append(float(m(*batch)))
            bufs = dict(m.named_buffers())
            scales.append(float(bufs["dlspass_scaler_loss_scale"]))
            skipped.append(int(bufs["dlspass_scaler_num_skipped_steps"]))
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    return {"losses": losses, "scales": scales, "skipped": skipped, "params": params,
            "state": {k: v.detach().clone() for k, v in m.state_dict().items()}}


def train_reference(name: str, config: Any, optimizer: Any, data: list[tuple[Tensor, ...]]) -> dict[str, Any]:
    """The same training in-process with ``dlspass.capture_step`` (the independent reference)."""
    import dlspass

    make, _ = FACTORIES[name]
    model, example = make()
    opt = optimizer.make(list(model.parameters()))
    step = dlspass.capture_step(model, lambda mod, b: mod(*b), opt, example, config=config)
    losses, scales, skipped = [], [], []
    for batch in data:
        losses.append(float(step(batch)))
        scales.append(float(step.scaler.state.loss_scale))
        skipped.append(int(step.scaler.state.num_skipped_steps))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "scales": scales, "skipped": skipped, "params": params}


def train_onnx(path: Path, state: dict[str, Tensor], data: list[tuple[Tensor, ...]]) -> dict[str, Any]:
    """Run a ``--to onnx`` step in onnxruntime over ``data``, feeding the state back."""
    import json

    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    meta = json.loads(sess.get_modelmeta().custom_metadata_map["dlspass.json"])
    st = {k: v.detach().numpy().copy() for k, v in state.items()}
    names = [o.name for o in sess.get_outputs()]
    losses, scales, skipped = [], [], []
    for batch in data:
        feeds = {k: st[k] for k in meta["state_inputs"]}
        feeds.update({k: np.asarray(b.numpy()) for k, b in zip(meta["user_inputs"], batch, strict=True)})
        outs = dict(zip(names, sess.run(None, feeds), strict=True))
        for k in st:
            if f"{k}.new" in outs:
                st[k] = outs[f"{k}.new"]
        losses.append(float(outs["loss"]))
        scales.append(float(st["dlspass_scaler_loss_scale"]))
        skipped.append(int(st["dlspass_scaler_num_skipped_steps"]))
    return {"losses": losses, "scales": scales, "skipped": skipped,
            "params": {k: torch.from_numpy(np.asarray(v)) for k, v in st.items()}}


def max_rel(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest ``|a - b| / max|b|`` over the entries of ``b`` (per tensor)."""
    return max(float((a[k].double() - v.double()).abs().max() / v.double().abs().max().clamp_min(1e-30))
               for k, v in b.items())
