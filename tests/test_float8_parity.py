"""The training-parity study of float8 (tools/study/float8_parity.py): its verdict logic on
made-up curves (fast), and one tiny real run of it (slow; the study itself is the full run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "study" / "float8_parity.py"


def _study():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("float8_parity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_within_spread_means_each_seed_moves_less_than_the_seeds_lie_apart() -> None:
    study = _study()
    bf16 = [[3.0, 2.0, 1.0], [3.2, 2.1, 1.3], [3.1, 2.3, 1.1]]  # spread per step: 0.2, 0.3, 0.3
    near = [[3.05, 2.1, 1.2], [3.1, 2.2, 1.2], [3.1, 2.2, 1.0]]  # deviation: 0.1, 0.1, 0.2
    v = study.spread_verdict(bf16, near)
    assert v["within"]
    assert v["deviation"] == pytest.approx([0.1, 0.1, 0.2])
    assert v["spread"] == pytest.approx([0.2, 0.3, 0.3])
    assert v["worst_step"] == 2 and v["worst_ratio"] == pytest.approx(2 / 3)
    # one seed drifts at the last step by more than the spread: a MISS that names the step
    far = [near[0], near[1], [3.1, 2.2, 1.5]]
    v = study.spread_verdict(bf16, far)
    assert not v["within"] and v["worst_step"] == 2 and v["deviation"][2] == pytest.approx(0.4)
    # the float8 run is compared with the SAME seed's bfloat16 run: one seed 0.35 off its own
    # curve at the last step (band width 0.3) is a MISS, though all other seeds match exactly
    off = [[3.0, 2.0, 1.0], [3.2, 2.1, 1.3], [3.1, 2.3, 1.1 + 0.35]]
    assert not study.spread_verdict(bf16, off)["within"]
    assert study.spread_verdict(bf16, bf16)["within"]
    with pytest.raises(ValueError, match="2 seeds"):
        study.spread_verdict(bf16[:1], near[:1])


@pytest.mark.slow
def test_a_tiny_real_run_of_the_study_is_within_spread() -> None:
    study = _study()
    res = study.run(steps=3, seeds=2, lr=1e-3, models=("mhagpt",))
    assert set(res["verdicts"]["mhagpt"]) == {"float8 capture_step", "float8 dlspass.compile"}
    # the same captured float8 step, run eagerly by both entry points: the same losses
    assert res["losses"]["mhagpt"]["float8 capture_step"] == res["losses"]["mhagpt"]["float8 dlspass.compile"]
    assert all(v["within"] for v in res["verdicts"]["mhagpt"].values())
