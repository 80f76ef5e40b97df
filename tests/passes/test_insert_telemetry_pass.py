"""InsertTelemetryPass: the counts the graph writes into its buffer equal counting, in eager, the
same tensors by rounding each value; the graph's other outputs are unchanged. (Under
``dlspass.compile``, as a ``graph_passes`` hook: tests/test_telemetry.py.)"""

from __future__ import annotations

import pytest
import torch
from numerics_reference import reference_counts
from stepgraph import eager_grads, gpt_step, mlp_step, node_values, run
from torch import nn

from dlspass.config import DLSConfig
from dlspass.format_ranges import COUNT_FIELDS
from dlspass.graph import roles
from dlspass.passes import apply_dls
from dlspass.passes.base import PassContractError
from dlspass.passes.insert_telemetry_pass import (
    BUFFER_TARGET,
    InsertTelemetryPass,
    buffer_node,
    telemetry_names,
)

DLS = DLSConfig(mixed_precision=False, initial_loss_scale=2.0**10)


def _buffer(gm) -> torch.Tensor:
    val = buffer_node(gm.graph).meta["val"]
    return torch.full(val.shape, -1.0, dtype=val.dtype, device=val.device)


def _read(names: list[str], buffer: torch.Tensor) -> dict[str, dict[str, float]]:
    return {n: dict(zip(COUNT_FIELDS, row, strict=True)) for n, row in zip(names, buffer.tolist(), strict=True)}


def _by_name(names: list[str], tensors: list[torch.Tensor], fmt: str) -> dict[str, dict[str, float]]:
    return {n: dict(zip(COUNT_FIELDS, reference_counts(t, fmt), strict=True))
            for n, t in zip(names, tensors, strict=True)}


def _watched_nodes(gm, names: list[str]) -> list:
    """The nodes the pass counted, found independently: GRAD nodes by target, others by name."""
    grads = {f"grad:{roles.target_of(n)}": n for n in roles.nodes_with_role(gm.graph, roles.GRAD)}
    by_name = {f"lowered:{n.name}": n for n in gm.graph.nodes}
    return [grads.get(n) or by_name[n] for n in names]


# (format, loss scale, the class the MLP's scaled gradients reach there)
CASES = [("float16", 2.0**-14, "flushed"), ("float16", 2.0**-6, "subnormal"),
         ("float8_e4m3fn", 2.0**14, "overflow"), ("float8_e5m2", 2.0**-2, "subnormal"),
         ("cbfloat16", 2.0**-30, "flushed"), ("bfloat16", 2.0**10, None)]


@pytest.mark.parametrize(("fmt", "scale", "reached"), CASES)
def test_counts_of_the_scaled_gradients_equal_eager_counting(fmt: str, scale: float,
                                                             reached: str | None) -> None:
    config = DLSConfig(mixed_precision=False, initial_loss_scale=scale, min_loss_scale=2.0**-40)
    step = mlp_step(config)
    plain = run(step)
    result = InsertTelemetryPass(fmt)(step.gm)  # before the DLS passes, as graph_passes run
    apply_dls(step.gm, config)
    placeholders = list(step.gm.graph.find_nodes(op="placeholder"))
    assert roles.target_of(placeholders[-1]) == BUFFER_TARGET
    names = telemetry_names(step.gm.graph)
    assert result.stats == {"watched": len(names)}
    buffer = _buffer(step.gm)
    inputs = [*step.inputs(), buffer]
    with torch.no_grad():
        out = step.gm(*inputs)
    got = _read(names, buffer)
    assert sorted(got) == sorted(f"grad:{k}" for k in step.params)
    values = node_values(step.gm, inputs, _watched_nodes(step.gm, names))
    assert got == _by_name(names, values, fmt)
    if reached is not None:
        assert sum(row[reached] for row in got.values()) > 0
    # the counted gradients are the scaled ones: the scale times the plain gradients of the loss
    eager = eager_grads(step)
    for name, v in zip(names, values, strict=True):
        torch.testing.assert_close(v, eager[name.removeprefix("grad:")] * scale)
    # the step still returns the loss of the step without telemetry
    (i, _), = [(i, r) for i, r in enumerate(roles.output_roles(step.gm.graph)) if r[0] == roles.LOSS]
    assert torch.equal(out[i], plain["loss"])


def test_lowered_op_outputs_are_counted_before_rounding() -> None:
    config = DLSConfig(fp16_type="float16", initial_loss_scale=2.0**10, precision_mode="emulate")
    step = gpt_step(config)
    apply_dls(step.gm, config)
    InsertTelemetryPass("float16")(step.gm)
    names = telemetry_names(step.gm.graph)
    lowered = [n for n in names if n.startswith("lowered:")]
    assert len(lowered) >= 4  # the GPT's matmuls, forward and backward
    buffer = _buffer(step.gm)
    inputs = [*step.inputs(), buffer]
    with torch.no_grad():
        step.gm(*inputs)
    values = node_values(step.gm, inputs, _watched_nodes(step.gm, names))
    assert all(v.dtype == torch.float32 for v in values)
    assert _read(names, buffer) == _by_name(names, values, "float16")


def test_a_second_run_changes_nothing_and_no_grad_is_refused() -> None:
    step = mlp_step(DLS)
    telemetry = InsertTelemetryPass("float16")
    telemetry(step.gm)
    n = len(step.gm.graph.nodes)
    again = telemetry(step.gm)
    assert not again.modified and again.skipped == "already applied" and len(step.gm.graph.nodes) == n
    empty = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(PassContractError, match="insert_telemetry: the graph has no grad node"):
        InsertTelemetryPass("float16")(empty)
