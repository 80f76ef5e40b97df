"""Hostile command-line values: non-finite or out-of-range hyperparameters, huge values, paths.

``--lr inf`` used to be accepted and the written step turned the weights to NaN on its first
call; torch.optim itself refuses negative values (``Invalid learning rate``) but accepts inf
and NaN. Every such flag must be refused with exit 2 and one line before any file is read.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from dlspass.cli import run

pytestmark = pytest.mark.timeout(120)


def _refused(capsys, tmp_path, *flags: str) -> str:
    src = tmp_path / "joint.pt2"
    src.write_bytes(b"never read")  # refused before the input is opened
    capsys.readouterr()
    t = time.monotonic()
    rc = run(["transform", str(src), "-o", str(tmp_path / "out.pt2"), *flags])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
    assert len(err) < 700 and time.monotonic() - t < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joint.pt2"]
    return err


@pytest.mark.parametrize(("flag", "value"), [
    ("--lr", "inf"), ("--lr", "nan"), ("--lr", "-0.1"), ("--lr", "0"),
    ("--momentum", "nan"), ("--momentum", "inf"), ("--momentum", "-0.9"),
    ("--weight-decay", "inf"), ("--weight-decay", "nan"), ("--weight-decay", "-1"),
    ("--eps", "nan"), ("--eps", "inf"), ("--eps", "-1e-8"),
    ("--max-gradient-norm", "inf"), ("--max-gradient-norm", "nan"), ("--max-gradient-norm", "-1"),
    ("--loss-scale", "inf"), ("--loss-scale", "nan"), ("--loss-scale", "-8"), ("--loss-scale", "0"),
    ("--betas", "nan,0.999"), ("--betas", "0.9,inf"), ("--betas", "1.5,0.9"),
])
def test_bad_hyperparameter_is_refused(capsys, tmp_path, flag, value):
    err = _refused(capsys, tmp_path, flag, value)
    assert flag in err, err


@pytest.mark.parametrize(("flag", "value"), [("--lr", "-0.1"), ("--momentum", "-0.9"),
                                             ("--weight-decay", "-1"), ("--eps", "-1e-8")])
def test_negative_values_refused_are_those_torch_optim_refuses(flag, value):
    """The reference: torch.optim raises ValueError for the same negative values."""
    p = [torch.nn.Parameter(torch.zeros(1))]
    kw = {"--lr": "lr", "--momentum": "momentum", "--weight-decay": "weight_decay", "--eps": "eps"}[flag]
    cls = torch.optim.Adam if kw == "eps" else torch.optim.SGD
    with pytest.raises(ValueError):
        cls(p, **{"lr": 0.1, kw: float(value)})


def test_torch_optim_accepts_inf_and_nan_so_the_cli_must_check():
    """Why the CLI checks: torch takes lr=inf and the step writes NaN into the weight."""
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=math.inf)
    w.grad = torch.zeros(1)
    opt.step()
    assert torch.isnan(w).all()


def test_a_huge_flag_value_is_quoted_not_echoed(capsys, tmp_path):
    err = _refused(capsys, tmp_path, "--fp16-type", "z" * 10_000_000)
    assert "characters" in err


def test_over_long_and_looping_paths_are_input_errors(capsys, tmp_path):
    loop = tmp_path / "loop.pt2"
    loop.symlink_to(loop)
    for path in (tmp_path / ("p" * 4000 + ".pt2"), loop):
        capsys.readouterr()
        rc = run(["inspect", str(path)])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert err.count("\n") == 1 and len(err) < 700, err


@pytest.mark.parametrize(("field", "value"), [
    ("lr", math.inf), ("lr", math.nan), ("momentum", math.nan), ("weight_decay", math.inf),
    ("eps", math.nan), ("eps", -1e-8), ("betas", (0.9, math.nan)), ("lr", "0.1"),
])
def test_python_api_optimizer_spec_refuses_what_the_cli_refuses(field, value):
    """`OptimizerSpec` (the Python API behind `transform`) checks values as the CLI does."""
    from dlspass.capture.optim import OptimizerSpec
    from dlspass.errors import DLSInputError

    kind = "adam" if field in ("eps", "betas") else "sgd"
    with pytest.raises(DLSInputError, match=field):
        OptimizerSpec(kind=kind, **{field: value})
    OptimizerSpec(kind=kind)  # the defaults stay valid
