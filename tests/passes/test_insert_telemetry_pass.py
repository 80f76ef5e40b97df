"""InsertTelemetryPass: the counts the graph writes into its buffer equal counting, in eager, the
same tensors by rounding each value; the graph's other outputs are unchanged. (Under
``dlspass.compile``, as a ``graph_passes`` hook: tests/test_telemetry.py.)"""

from __future__ import annotations

import math
import operator

import pytest
import torch
from numerics_reference import reference_counts
from stepgraph import MLP_GRAD_SUMS, eager_grads, gpt_step, mlp_step, node_values, run
from tolerance import assert_close_reordered
from torch import nn

from dlspass.config import ConfigError, DLSConfig
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
from dlspass.precision_policy import PrecisionPolicy

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
    apply_dls(step.gm, config)
    result = InsertTelemetryPass(fmt)(step.gm)  # after the DLS passes, as the pipeline runs it
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
    # the counted gradients are the scaled ones: the scale times the plain gradients of the loss.
    # Against the same traced step without the passes: the same ATen ops in the same order on a
    # seed multiplied by a power of two, which every float32 op carries through exactly (no value
    # here comes near float32's overflow or subnormal range), so bit equality holds.
    fresh = mlp_step(config)
    grad_nodes = {f"grad:{roles.target_of(n)}": n
                  for n in roles.nodes_with_role(fresh.gm.graph, roles.GRAD)}
    unscaled = node_values(fresh.gm, fresh.inputs(), [grad_nodes[n] for n in names])
    for name, v, u in zip(names, values, unscaled, strict=True):
        assert torch.equal(v, u * scale), name
    # and against plain autograd in eager: other kernels (addmm vs mm, its transposes), so other
    # summation orders: the bound for the MLP's longest chain of sums (MLP_GRAD_SUMS), with S
    # taken as the gradient's largest magnitude (tests/tolerance.py)
    eager = eager_grads(step)
    for name, v in zip(names, values, strict=True):
        assert_close_reordered(v, eager[name.removeprefix("grad:")] * scale, n=MLP_GRAD_SUMS)
    # the step still returns the loss of the step without telemetry
    (i, _), = [(i, r) for i, r in enumerate(roles.output_roles(step.gm.graph)) if r[0] == roles.LOSS]
    assert torch.equal(out[i], plain["loss"])


def _key(row: dict[str, float]) -> dict[str, object]:
    """A row with NaN spelled out, so that rows compare with ``==``."""
    return {k: "nan" if math.isnan(v) else v for k, v in row.items()}


def _count_by_cast(value: torch.Tensor, rounded_by_kernel: bool) -> dict[str, float]:
    """Where ``value`` (float32) lands in float16, counted by casting it, with plain torch ops:
    the reference the lowered rows are checked against. A kernel that rounded its output
    itself (native) shows the cast value and no flush count."""
    cast = value.to(torch.float16).to(torch.float32)
    seen = cast if rounded_by_kernel else value
    tiny = torch.finfo(torch.float16).tiny  # the smallest normal
    return {"amax": seen.abs().max().item(),
            "flushed": math.nan if rounded_by_kernel else float(((value != 0) & (cast == 0)).sum()),
            "subnormal": float(((cast != 0) & (cast.abs() < tiny)).sum()),
            "overflow": float(torch.isinf(cast).sum())}


def _op_of(y):
    return y.args[0] if y.target is operator.getitem else y


def _recomputed(y, vals: dict) -> torch.Tensor:
    """The lowered output ``y`` recomputed in eager, in float32, from the op's inputs as the
    graph fed them (``vals``; the 16-bit ones widened): the op's own ATen kernel, called here."""
    op = _op_of(y)

    def f32(a):
        if isinstance(a, torch.fx.Node):
            v = vals[a]
            return v.to(torch.float32) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        return a

    args, kwargs = torch.fx.node.map_aggregate((op.args, op.kwargs), f32)
    out = op.target(*args, **kwargs)
    return out[y.args[1]] if op is not y else out


@pytest.mark.parametrize("mode", ["emulate", "native"])
@pytest.mark.parametrize("make_step", [mlp_step, gpt_step], ids=["mlp", "gpt"])
def test_lowered_op_outputs_equal_recomputing_the_op_in_eager(mode: str, make_step) -> None:
    """Every lowered op's output has a row, and the row equals recomputing the op in float32
    from the same inputs, casting to float16 and counting; in native mode the kernel rounded
    the output itself, so ``flushed`` is NaN (unknown) rather than a 0 that reads as none."""
    config = DLSConfig(fp16_type="float16", precision_mode=mode, initial_loss_scale=2.0**-14,
                       min_loss_scale=2.0**-20)
    step = make_step(config)
    apply_dls(step.gm, config)
    InsertTelemetryPass("float16", watch="all")(step.gm)  # after the lowering, as the step pipeline runs it
    names = telemetry_names(step.gm.graph)
    lowered = [n for n in names if n.startswith("lowered:")]
    ops = [n for n in step.gm.graph.nodes if n.op == "call_function" and PrecisionPolicy().lowers(n.target)]
    assert lowered and len(lowered) >= len(ops)  # forward and backward matmuls, each output once
    buffer = _buffer(step.gm)
    inputs = [*step.inputs(), buffer]
    with torch.no_grad():
        step.gm(*inputs)
    got = _read(names, buffer)
    nodes = {f"lowered:{n.name}": n for n in step.gm.graph.nodes}
    arg_nodes = list(dict.fromkeys(a for name in lowered for a in _op_of(nodes[name]).all_input_nodes))
    vals = dict(zip(arg_nodes, node_values(step.gm, inputs, arg_nodes), strict=True))
    for name in lowered:
        y = nodes[name]
        assert y.meta["val"].dtype == (torch.float16 if mode == "native" else torch.float32), name
        want = _count_by_cast(_recomputed(y, vals), rounded_by_kernel=mode == "native")
        assert _key(got[name]) == _key(want), name
    assert sum(got[n]["subnormal"] for n in lowered) > 0
    if mode == "emulate":
        assert sum(got[n]["flushed"] for n in lowered) > 0


@pytest.mark.parametrize("mode", ["emulate", "native"])
def test_gradients_a_lowered_matmul_rounded_have_no_flush_count(mode: str) -> None:
    """A weight's gradient comes out of a lowered matmul already rounded to float16 (by the
    kernel, or by the emulation's rounding): what was flushed is gone, so ``flushed`` is NaN,
    and the other counts are those of the gradient's values. A bias's gradient (a float32 sum)
    keeps its flush count."""
    config = DLSConfig(fp16_type="float16", precision_mode=mode, initial_loss_scale=2.0**-14,
                       min_loss_scale=2.0**-20)
    step = mlp_step(config)
    apply_dls(step.gm, config)
    InsertTelemetryPass("float16", watch="all")(step.gm)
    names = telemetry_names(step.gm.graph)
    grads = [n for n in names if n.startswith("grad:")]
    buffer = _buffer(step.gm)
    inputs = [*step.inputs(), buffer]
    with torch.no_grad():
        step.gm(*inputs)
    got = _read(names, buffer)
    values = node_values(step.gm, inputs, _watched_nodes(step.gm, grads))
    for name, v in zip(grads, values, strict=True):
        is_weight = name.endswith(".weight")
        assert torch.equal(v.to(torch.float16).to(v.dtype), v) or not is_weight  # rounded indeed
        want = _count_by_cast(v.to(torch.float32), rounded_by_kernel=False)
        if is_weight:
            want["flushed"] = math.nan
        assert _key(got[name]) == _key(want), name


def test_the_default_watch_list_has_the_gradients_and_no_lowered_output() -> None:
    """The default list leaves the lowered outputs (activation-sized, each one more read) to
    ``watch="all"``; its gradient rows are those of ``all``; an unknown list is refused."""
    config = DLSConfig(fp16_type="float16", precision_mode="emulate", initial_loss_scale=2.0**-14,
                       min_loss_scale=2.0**-20)
    got = {}
    for watch in ("default", "all"):
        step = mlp_step(config)
        apply_dls(step.gm, config)
        InsertTelemetryPass("float16", watch=watch)(step.gm)
        names = telemetry_names(step.gm.graph)
        buffer = _buffer(step.gm)
        with torch.no_grad():
            step.gm(*step.inputs(), buffer)
        got[watch] = _read(names, buffer)
    grads = {n: r for n, r in got["all"].items() if n.startswith("grad:")}
    want = sorted(f"grad:{roles.target_of(n)}" for n in roles.nodes_with_role(step.gm.graph, roles.GRAD))
    assert sorted(grads) == want and len(got["all"]) > len(grads)
    assert _key_rows(got["default"]) == _key_rows(grads)
    with pytest.raises(ConfigError, match="telemetry: unknown watch list 'some'; choose one of default, all"):
        InsertTelemetryPass("float16", watch="some")  # type: ignore[arg-type]


def _key_rows(rows: dict[str, dict[str, float]]) -> dict[str, dict[str, object]]:
    return {n: _key(r) for n, r in rows.items()}


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
