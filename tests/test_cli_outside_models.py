"""The CLI on outside models: ``dlspass export`` -> ``transform`` -> ``torch.export.load`` -> train.

Tiny transformers models with random weights (``tests/hf_factories.py``): GPT-2 as shipped,
BERT and T5 (tied embeddings), ViT, ResNet (BatchNorm) and ConvNeXt. Each is exported and
transformed in fp32 with dynamic loss scaling and SGD through ``dlspass.cli.run``, loaded with
torch alone and trained for four steps, the third with an inf loss; the eager
``dlspass.GradScaler`` loop with the same model, batches and settings is the reference. GPT-2
runs in the default suite; the others take longer and are marked slow.
"""

from __future__ import annotations

import cli_factories as cf
import hf_factories as hf
import pytest
import torch

from dlspass.capture.optim import OptimizerSpec
from dlspass.config import DLSConfig

pytest.importorskip("transformers")

STEPS, OVERFLOW_AT = 4, 2
SGD = OptimizerSpec(kind="sgd", lr=0.05)
FLAGS = ("--optimizer", "sgd", "--lr", "0.05")
SLOW = pytest.mark.slow
MODELS = [pytest.param("gpt2"), *(pytest.param(m, marks=SLOW)
                                  for m in ("bert", "t5", "vit", "resnet", "convnext"))]


def _cli(name: str, tmp_path, *flags: str):
    joint, step = tmp_path / f"{name}.pt2", tmp_path / f"{name}_step.pt2"
    assert cf.cli("export", f"hf_factories:{name}", "-o", joint) == 0
    assert cf.cli("transform", joint, "-o", step, *FLAGS, *flags) == 0
    return joint, step


@pytest.mark.parametrize("name", MODELS)
def test_exported_step_trains_like_eager_grad_scaler(name, tmp_path):
    _, step = _cli(name, tmp_path, "--no-mixed-precision")
    data = hf.batches(hf.BATCHES[name], STEPS, OVERFLOW_AT)
    got = hf.train_step_file(step, data)
    config = DLSConfig(mixed_precision=False)  # what the CLI's defaults build
    ref = hf.train_eager(hf.FACTORIES[name], config, SGD, data)
    assert got["skipped"] == [0, 0, 1, 1]
    hf.assert_same_training(got, ref, OVERFLOW_AT, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "vit", "resnet", "convnext"])
def test_cbfloat16_step_skips_like_eager_and_stays_finite(name, tmp_path):
    """cbfloat16 has no eager counterpart here: the step skips the overflow and nothing else,
    halves the scale there (from cbfloat16's initial 2**31), keeps every weight finite and
    moves the weights as the fp32 step does, within 10%."""
    _, step = _cli(name, tmp_path, "--fp16-type", "cbfloat16")
    data = hf.batches(hf.BATCHES[name], STEPS, OVERFLOW_AT)
    got = hf.train_step_file(step, data)
    assert got["skipped"] == [0, 0, 1, 1]
    scale0 = 2.0**31  # the default (cerebras) policy's initial scale for cbfloat16
    assert got["scales"][:OVERFLOW_AT] == [scale0] * OVERFLOW_AT
    assert got["scales"][OVERFLOW_AT] == scale0 / 2
    fp32 = hf.train_step_file(_cli(name, tmp_path, "--no-mixed-precision")[1], data)
    init = {k: v.detach() for k, v in hf.FACTORIES[name]()[0].named_parameters()}
    assert all(torch.isfinite(v).all() for v in got["params"].values())
    # rounded matmuls change the update, but not its course: the whole update (every
    # parameter's change, together) is within 10% of the fp32 step's
    moved = torch.cat([(got["params"][k] - init[k]).flatten() for k in init])
    moved32 = torch.cat([(fp32["params"][k] - init[k]).flatten() for k in init])
    assert float(moved32.norm()) > 0
    assert float((moved - moved32).norm()) <= 0.1 * float(moved32.norm())
