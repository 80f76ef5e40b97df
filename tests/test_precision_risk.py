"""dlspass.analyze: its window and recommended scale, checked by rounding the model's own eager
gradients in the format (native casts); forward overflow named by module path; JSON valid
against docs/analyze.schema.json; HTML with one inline-SVG histogram per format and kind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn

import dlspass
from dlspass.cli import commands as cli
from dlspass.debug.precision_risk import AnalyzeError, render

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "analyze.schema.json").read_text())
WEIGHT = 2.0**-20  # the demo's loss weight: float16 gradients underflow without a scale


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y) * WEIGHT


def _eager_grads(scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(activation gradients, parameter gradients) of the scaled loss, by plain autograd."""
    model = _model()
    x, y = _batch()
    h1 = model[0](x)
    h1.retain_grad()
    h2 = model[1](h1)
    h2.retain_grad()
    out = model[2](h2)
    out.retain_grad()
    (nn.functional.mse_loss(out, y) * WEIGHT * scale).backward()
    return [h1.grad, h2.grad, out.grad], [p.grad for p in model.parameters()]


def _in_float16(grads: tuple[list[torch.Tensor], list[torch.Tensor]]) -> tuple[bool, float]:
    """(any gradient value overflows, the fraction of all non-zero parameter-gradient values,
    every parameter together, flushed to zero), by casting."""
    acts, params = grads
    over = any(bool(torch.isinf(g.to(torch.float16)).any()) for g in (*acts, *params))
    lost = sum(int(((g.to(torch.float16) == 0) & (g != 0)).sum()) for g in params)
    total = sum(int((g != 0).sum()) for g in params)
    return over, lost / max(total, 1)


def test_window_edges_and_recommendation_hold_for_the_eager_gradients() -> None:
    analysis = dlspass.analyze(_model(), _loss, _batch(), formats=["float16", "bfloat16"])
    f16, bf16 = analysis.verdicts
    assert f16.window is not None
    lo, hi = f16.window
    assert lo > 0  # the weighted loss needs scaling in float16
    assert f16.verdict == f"fits with DLS from 2^{f16.recommended_exponent}"
    assert f16.recommended_exponent == max(lo, hi - 3)
    # the edges, checked by casting the eager gradients to float16
    assert _in_float16(_eager_grads(2.0**hi))[0] is False
    assert _in_float16(_eager_grads(2.0**(hi + 1)))[0] is True
    assert _in_float16(_eager_grads(2.0**lo))[1] <= analysis.threshold
    assert _in_float16(_eager_grads(2.0**(lo - 1)))[1] > analysis.threshold
    over, lost = _in_float16(_eager_grads(f16.recommended_initial_loss_scale))
    assert not over and lost <= analysis.threshold
    # without a scale float16 loses gradients; bfloat16 keeps them
    assert _in_float16(_eager_grads(1.0))[1] > analysis.threshold
    assert bf16.verdict == "fits" and bf16.fits
    # the deciding tensors are named by module path / parameter name
    assert f16.overflow_deciders and all(n.split(":")[0] in ("activation_grad", "param_grad")
                                         for n in f16.overflow_deciders)
    names = {s.name for s in analysis.samples}
    assert {"0", "1", "2", "0.weight", "2.bias"} <= names


def test_forward_overflow_is_named_and_no_scale_helps() -> None:
    model = _model()
    with torch.no_grad():
        model[0].weight.mul_(1e5)  # the first layer's outputs pass float16's 65504
    analysis = dlspass.analyze(model, _loss, _batch(), formats=["float16", "float8_e5m2", "cbfloat16"])
    f16, e5m2, cb16 = analysis.verdicts
    assert f16.verdict == "does not fit: these tensors overflow in the forward: 0"
    assert f16.forward_overflow == ["0"] and not f16.fits
    assert e5m2.forward_overflow == ["0"]
    assert cb16.forward_overflow == []  # cbfloat16's range holds them
    assert float(model[0](_batch()[0]).detach().abs().max()) > 65504  # the reference: it really overflows


def test_json_report_is_valid_against_the_schema() -> None:
    analysis = dlspass.analyze(_model(), _loss, _batch(), steps=2)
    data = json.loads(render(analysis, "json"))
    jsonschema.validate(data, SCHEMA)
    assert set(data["formats"]) == {"float16", "bfloat16", "cbfloat16", "float8_e4m3fn", "float8_e5m2"}
    assert data["steps"] == 2
    # two identical calibration steps: every tensor was recorded twice
    by_name = {(t["kind"], t["name"]): t for t in data["tensors"]}
    assert by_name[("param_grad", "0.weight")]["count"] == 2 * 16 * 8
    bad = {**data, "formats": {"float16": {**data["formats"]["float16"], "verdict": "maybe"}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_html_has_a_histogram_per_format_and_kind_and_nothing_external() -> None:
    analysis = dlspass.analyze(_model(), _loss, _batch())
    page = render(analysis, "html")
    assert page.count("<svg class='histogram'") == 5 * 3
    assert page.count("class='bar'") > 15
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page
    assert "fits with DLS from 2^" in page


def test_text_report_names_the_window() -> None:
    analysis = dlspass.analyze(_model(), _loss, _batch(), formats=["float16"])
    text = render(analysis, "text")
    lo, hi = analysis.verdicts[0].window
    assert f"window of loss scales: 2^{lo} .. 2^{hi}" in text


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"steps": 0}, "steps: expected a positive int"),
    ({"threshold": 1.5}, "threshold: expected a fraction"),
    ({"headroom": -1}, "headroom: expected an int >= 0"),
    ({"formats": ["fp12"]}, "format: expected one of"),
])
def test_bad_arguments_are_one_clear_error(kwargs, fragment) -> None:
    with pytest.raises(dlspass.DLSInputError, match=fragment):
        dlspass.analyze(_model(), _loss, _batch(), **kwargs)


def test_a_loss_without_grad_is_refused() -> None:
    with pytest.raises(AnalyzeError, match="loss_fn: expected a scalar loss"):
        dlspass.analyze(_model(), lambda m, b: torch.tensor(1.0), _batch())


def test_cli_analyze_on_a_factory(tmp_path, capsys) -> None:
    assert cli.run(["analyze", "cli_factories:mlp", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    out = tmp_path / "risk.html"
    assert cli.run(["analyze", "cli_factories:mlp", "--format", "html", "-o", str(out),
                    "--formats", "float16,bfloat16"]) == 0
    assert out.read_text().count("<svg class='histogram'") == 2 * 3
    capsys.readouterr()
    assert cli.run(["analyze", "no_such_module:make"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot import module 'no_such_module'" in err[0]
    assert cli.run(["analyze", "cli_factories:mlp", "--formats", "fp12"]) == 2
    assert "format: expected one of" in capsys.readouterr().err
    assert not math.isnan(data["threshold"])


class _TwoParams(nn.Module):
    """``a`` (1000 values) gets gradient 1.0 per value, ``b`` (``n_small`` values) 2^-30."""

    def __init__(self, n_small: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(1000))
        self.b = nn.Parameter(torch.zeros(n_small))

    def forward(self) -> torch.Tensor:
        return self.a.sum() + self.b.sum() * 2.0**-30


@pytest.mark.parametrize(("n_small", "lo"), [(4, -24), (20, 6)])
def test_the_flushed_fraction_is_over_all_parameters(n_small: int, lo: int) -> None:
    """Worked by hand: in float16 2^-30 * 2^k flushes while it is <= 2^-25 (half the smallest
    subnormal), i.e. for k <= 5; 1.0 * 2^k flushes for k <= -25 and overflows from 2^16 (65520
    rounds to inf). 4 of 1004 values flushed (0.4%) is within the 0.5% threshold: the window
    starts where ``a`` stops flushing, 2^-24; 20 of 1020 (2%) is not: it starts at 2^6."""
    analysis = dlspass.analyze(_TwoParams(n_small), lambda m, _b: m(), None, formats=["float16"])
    (v,) = analysis.verdicts
    assert analysis.threshold == 0.005
    assert v.window == (lo, 15)
    assert v.recommended_exponent == max(lo, 12)
    if lo > 0:
        assert v.verdict == "fits with DLS from 2^12"
        assert v.underflow_deciders == ["param_grad:b"]
    else:
        assert v.verdict == "fits"


class _Residual(nn.Module):
    """``h = lin(x); h += x``: an in-place op on a module's output (ResNet's residual add)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h += x
        return (h * h).sum()


def test_an_in_place_op_on_a_module_output_is_calibrated() -> None:
    """The gradient flowing into ``lin``'s output is d(sum h^2)/dh = 2 (lin(x) + x)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    model = _Residual()
    analysis = dlspass.analyze(model, lambda m, b: m(b), x, formats=["float16"])
    (g,) = [s for s in analysis.samples if s.kind == "activation_grad" and s.name == "lin"]
    with torch.no_grad():
        want = (2 * (model.lin(x) + x)).abs().double().reshape(-1)
    want = torch.sort(want[want > 0]).values
    # bit equality: both are 2 * (lin(x) + x) from the same forward kernels (the analysis hooks
    # the eager module; autograd's mul-by-2 backward is exact), widened to float64
    torch.testing.assert_close(g.magnitudes, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_cli_analyze_on_an_exported_joint_program_agrees_with_its_factory(name, capsys) -> None:
    """The joint .pt2 run once on its example inputs gives the parameter gradients eager autograd
    gives the factory's model on the same inputs, hence the same window per format."""
    import cli_factories as cf

    assert cli.run(["analyze", f"cli_factories:{name}", "--format", "json"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert cli.run(["analyze", str(cf.joint_file(name)), "--format", "json"]) == 0
    joint = json.loads(capsys.readouterr().out)
    jsonschema.validate(joint, SCHEMA)

    def grads(report: dict) -> dict[str, tuple[int, float]]:
        return {t["name"]: (t["count"], t["amax"]) for t in report["tensors"] if t["kind"] == "param_grad"}

    want, got = grads(eager), grads(joint)
    # export names the module's parameters as the factory's model does (the loss wrapper's path)
    assert sorted(got) == sorted(want)
    for k, (count, amax) in want.items():
        assert got[k][0] == count and got[k][1] == pytest.approx(amax, rel=1e-5), k
    assert {"activation", "activation_grad"} <= {t["kind"] for t in joint["tensors"]}
    # the window's lower edge comes from the parameter gradients alone: the same; the program
    # shows every backward value, not only module outputs' gradients, so it overflows no later
    for fmt, verdict in eager["formats"].items():
        (lo, hi), (jlo, jhi) = verdict["window"], joint["formats"][fmt]["window"]
        assert jlo == lo and jhi <= hi, fmt


def test_cli_analyze_refuses_a_transformed_step_in_one_line(capsys) -> None:
    import cli_factories as cf

    step = cf.step_file("mlp", ".pt2")
    capsys.readouterr()
    assert cli.run(["analyze", str(step)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a dlspass training step already" in err[0]
