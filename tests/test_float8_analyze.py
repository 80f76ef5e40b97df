"""``dlspass analyze --fp16-type float8`` (dlspass.debug.float8_risk): per matmul of the step,
what the float8 cast loses and whether to leave it in 16 bits; the cast checked against
torchao 0.18.0's own ``hp_tensor_to_float8_dynamic``, the matmuls against the float8 pass."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from stepgraph import trace_step
from torch import Tensor, nn

from dlspass.cli import commands as cli
from dlspass.config import DLSConfig
from dlspass.debug.float8_risk import analyze_float8, cast_losses
from dlspass.debug.precision_risk import AnalyzeError
from dlspass.float8_policy import RECIPES
from dlspass.models import MHAGPT, gpt_loss
from dlspass.passes import apply_dls
from dlspass.passes.lower_matmuls_to_float8_pass import float8_decisions

torchao_float8 = pytest.importorskip("torchao.float8")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(48, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))  # tanh: a spike in x stops at layer a


def _mse(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def _wide(seed: int) -> Tensor:
    """Values over 2^-24 .. 2^8: many of them below what a tensorwise float8 cast keeps."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 32, generator=g) * torch.exp2(torch.randint(-24, 8, (64, 32), generator=g).float())


@pytest.mark.parametrize("case", ["tensorwise-e4m3", "tensorwise-e5m2", "rowwise"])
def test_the_cast_loses_what_torchaos_cast_loses(case: str) -> None:
    x = _wide(0)
    grad = case.endswith("e5m2")
    recipe = RECIPES[case.split("-")[0]]
    dtype = recipe.dtype_for(grad)
    if recipe.rowwise:
        ref = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig(), scaling_granularity=ScalingGranularity.AXISWISE,
                                          axiswise_dim=-1, round_scales_to_power_of_2=True)
    else:
        ref = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig())
    nonzero = x != 0
    expected = int((nonzero & (ref._data.float() == 0)).sum()) / int(nonzero.sum())
    got = cast_losses(x, recipe, grad, -1 if recipe.rowwise else None)
    # the same count of the same cast: exact
    assert got.flushed == expected
    assert 0 < got.flushed < 1  # the input reaches below the cast's range (the test can fail)
    assert got.dtype == str(dtype).removeprefix("torch.") and got.amax == float(x.abs().max())


def test_every_matmul_the_pass_converts_is_judged_and_an_outlier_is_left_in_16_bits() -> None:
    torch.manual_seed(0)
    model = Two()
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    x[0, 0] = 1e6  # one spike: the other inputs of layer a scale below e4m3's smallest value
    rows = analyze_float8(model, _mse, (x, y))
    # the same matmuls as the float8 pass converts in the captured step of the same model
    step = trace_step(model, _mse, (x, y))
    decisions = float8_decisions(apply_dls(step.gm, DLSConfig(loss_scale=None, mixed_precision=False,
                                                              float8="tensorwise")).graph)
    converted = Counter(d["op"] for d in decisions.values() if d["float8"])
    assert Counter(f"{r.op}.default" for r in rows) == converted and len(rows) == 5
    forward = [r for r in rows if r.phase == "forward"]
    assert [r.module for r in forward] == ["a", "b"]
    assert not forward[0].fits and "leave in 16 bits" in forward[0].verdict
    assert forward[0].operands[0].flushed > 0.9 and forward[1].fits
    # the backward's matmuls each read one gradient (e5m2 in tensorwise) and one forward value
    for r in rows:
        assert sum(o.gradient for o in r.operands) == (r.phase == "backward"), r.name
        assert all(o.dtype == ("float8_e5m2" if o.gradient else "float8_e4m3fn") for o in r.operands)
    # the weight gradient of layer a reads the spiked input too: left in 16 bits; without the
    # spike every matmul fits
    assert sum(not r.fits for r in rows) == 2
    x[0, 0] = 0.5
    assert all(r.fits for r in analyze_float8(model, _mse, (x, y)))
    assert all(p.grad is None for p in model.parameters())


def test_cli_analyze_fp16_type_float8(capsys, tmp_path) -> None:
    assert cli.run(["analyze", "cli_factories:mlp", "--fp16-type", "float8", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recipe"] == "tensorwise" and data["matmuls"]
    assert {m["phase"] for m in data["matmuls"]} == {"forward", "backward"}
    assert cli.run(["analyze", "cli_factories:mlp", "--fp16-type", "float8", "--float8", "rowwise"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("float8 rowwise: ") and len(out) == 1 + len(data["matmuls"])
    # refusals: one line, exit 2
    for args, why in ((["--float8", "blockwise"], "--float8: expected one of"),
                      (["--format", "html"], "text or json")):
        assert cli.run(["analyze", "cli_factories:mlp", "--fp16-type", "float8", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
    joint = tmp_path / "joint.pt2"
    joint.write_bytes(b"")
    assert cli.run(["analyze", str(joint), "--fp16-type", "float8"]) == 2
    assert "not judged per matmul" in capsys.readouterr().err
    with pytest.raises(AnalyzeError, match="recipe"):
        analyze_float8(Two(), _mse, (torch.randn(2, 32), torch.randn(2, 16)), recipe="blockwise")


def test_an_mha_gpt_is_judged_on_all_27_matmuls_the_pass_converts() -> None:
    """nn.MultiheadAttention's in-projection, batched products and out_proj too. Eager autograd
    spells some linears ``mm`` + ``add`` where the traced graph has ``addmm``: the count holds."""
    torch.manual_seed(0)
    model = MHAGPT(vocab=32, d=32, n_layer=2, n_head=2, block_size=8)
    batch = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    rows = analyze_float8(model, gpt_loss, batch)
    step = trace_step(model, gpt_loss, batch)
    decisions = float8_decisions(apply_dls(step.gm, DLSConfig(loss_scale=None, mixed_precision=False,
                                                              float8="tensorwise")).graph)
    assert len(rows) == sum(1 for d in decisions.values() if d["float8"]) == 27
    assert {r.module for r in rows if r.phase == "forward"} >= {"blocks.0.attn", "blocks.1.fc", "head"}
