"""Telemetry in the step front ends: as a ``graph_passes`` hook or asked for by
``DLSConfig(telemetry=True)``, under ``dlspass.compile`` it adds no graph break, the counts of
the scaled gradients equal counting them in eager, the lowered ops' outputs (``telemetry="all"``)
are counted as recomputing them in eager gives, each float8 matmul operand's cast counts as
recomputing the cast in eager with torchao's own scale and cast gives, and the buffer is fed,
not recompiled, at every step; ``capture_step`` does the same."""

from __future__ import annotations

import math

import pytest
import torch
from numerics_reference import reference_counts
from torch import nn
from torch._dynamo.utils import counters

import dlspass
from dlspass.debug.telemetry import Telemetry
from dlspass.format_ranges import COUNT_FIELDS
from dlspass.models import mse_train_step

# a scale below 1: some float16 gradients flush to zero, some land subnormal
SMALL_SCALE = 2.0**-14


def _by_name(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, dict[str, float]]:
    return {n: dict(zip(COUNT_FIELDS, reference_counts(t, fmt), strict=True)) for n, t in tensors.items()}


def _key(rows: dict[str, dict[str, float]]) -> dict[str, dict[str, object]]:
    """``rows`` with NaN spelled out, so that they compare with ``==``."""
    return {n: {k: "nan" if math.isnan(v) else v for k, v in row.items()} for n, row in rows.items()}


def _mlp_pair(seed: int = 0) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A small MLP, an identical copy to compute the eager reference with, the MLP's SGD and a
    batch."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, reference, opt, torch.randn(8, 6), torch.randn(8, 3)


def _mse(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]), b[1])


def _lowered_config(mode: str, **kw: object) -> dlspass.DLSConfig:
    return dlspass.DLSConfig(fp16_type="float16", precision_mode=mode, initial_loss_scale=SMALL_SCALE,
                             min_loss_scale=2.0**-20, **kw)


def _first_layer_counts(reference: nn.Module, x: torch.Tensor, mode: str) -> dict[str, float]:
    """The first Linear's output as the lowered step computes it, recomputed in eager in
    float32 from its float16 inputs, cast to float16 and counted with plain torch ops (native:
    the kernel rounded it, so the cast value's amax and no flush count)."""
    lin = reference[0]
    x16, w16, b16 = (t.detach().to(torch.float16).to(torch.float32) for t in (x, lin.weight, lin.bias))
    value = torch.addmm(b16, x16, w16.t())
    cast = value.to(torch.float16).to(torch.float32)
    native = mode == "native"
    tiny = torch.finfo(torch.float16).tiny
    return {"amax": (cast if native else value).abs().max().item(),
            "flushed": math.nan if native else float(((value != 0) & (cast == 0)).sum()),
            "subnormal": float(((cast != 0) & (cast.abs() < tiny)).sum()),
            "overflow": float(torch.isinf(cast).sum())}


def test_compiled_step_counts_its_scaled_gradients_without_graph_breaks() -> None:
    model, reference, opt, x, y = _mlp_pair()
    scaler = dlspass.GradScaler(loss_scale="dynamic", initial_loss_scale=SMALL_SCALE, min_loss_scale=2.0**-20)
    telemetry = Telemetry("float16")
    counters.clear()
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt, scaler=scaler, mixed_precision=False,
                           backend_compiler="eager", graph_passes=[telemetry])
    assert step.telemetry is telemetry
    step(x, y)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    # eager: the gradients of the loss times the scale the step used, counted by rounding
    (_mse(reference, (x, y)) * SMALL_SCALE).backward()
    # a compiled step names a gradient by its place in the optimizer (group0.param<i>)
    want = {f"grad:group0.param{i}": p.grad for i, p in enumerate(reference.parameters())}
    got = telemetry.read()
    assert sorted(got) == sorted(want)
    assert got == _by_name(want, "float16")
    assert sum(row["flushed"] for row in got.values()) > 0
    assert sum(row["subnormal"] for row in got.values()) > 0
    # a second step writes the second step's counts into the same buffer, without recompiling
    buffer = telemetry.buffer
    step(x, y)
    assert telemetry.buffer is buffer and counters["stats"]["unique_graphs"] == 1


def test_captured_step_feeds_the_buffer_and_counts_its_scaled_gradients() -> None:
    model, reference, opt, x, y = _mlp_pair()
    config = dlspass.DLSConfig(mixed_precision=False, initial_loss_scale=SMALL_SCALE, min_loss_scale=2.0**-20)
    telemetry = Telemetry("float16")
    step = dlspass.capture_step(model, _mse, opt, (x, y), config, graph_passes=[telemetry])
    step((x, y))
    (_mse(reference, (x, y)) * SMALL_SCALE).backward()
    want = {f"grad:{n}": p.grad for n, p in reference.named_parameters()}
    got = telemetry.read()
    assert sorted(got) == sorted(want)
    assert got == _by_name(want, "float16")
    assert sum(row["flushed"] for row in got.values()) > 0


@pytest.mark.parametrize("mode", ["emulate", "native"])
def test_config_telemetry_in_compile_counts_lowered_ops_as_the_hook_does_without_graph_breaks(mode: str) -> None:
    """``DLSConfig(telemetry="all")`` gives ``step.telemetry``: one graph, no graph break, a row
    per scaled gradient and per lowered op output, the first layer's row equal to recomputing
    it in eager, and the same counts as a ``Telemetry`` passed by hand to the same step."""
    model, reference, opt, x, y = _mlp_pair()
    torch._dynamo.reset()
    counters.clear()
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt, config=_lowered_config(mode, telemetry="all"),
                           backend_compiler="eager")
    step(x, y)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    got = step.telemetry.read()
    assert isinstance(step.telemetry, Telemetry) and step.telemetry in step.graph_passes
    lowered = [n for n in got if n.startswith("lowered:")]
    assert len(lowered) == 5  # two forward addmm, three backward mm
    assert sum(n.startswith("grad:") for n in got) == 4
    assert _key({"first": got[lowered[0]]}) == _key({"first": _first_layer_counts(reference, x, mode)})
    assert sum(got[n]["subnormal"] for n in lowered) > 0

    model2, _, opt2, _, _ = _mlp_pair()  # the same seed: the parameters the first step started from
    hand = Telemetry("float16", watch="all")
    torch._dynamo.reset()
    step2 = dlspass.compile(mse_train_step(model2, opt2), optimizer=opt2, config=_lowered_config(mode),
                            backend_compiler="eager", graph_passes=[hand])
    step2(x, y)
    assert step2.telemetry is hand
    assert _key(hand.read()) == _key(got)


@pytest.mark.parametrize("mode", ["emulate", "native"])
def test_config_telemetry_in_capture_step_counts_as_the_hook_does(mode: str) -> None:
    model, reference, opt, x, y = _mlp_pair()
    step = dlspass.capture_step(model, _mse, opt, (x, y), _lowered_config(mode, telemetry="all"))
    step((x, y))
    got = step.telemetry.read()
    lowered = [n for n in got if n.startswith("lowered:")]
    assert len(lowered) == 5 and sum(n.startswith("grad:") for n in got) == 4
    assert _key({"first": got[lowered[0]]}) == _key({"first": _first_layer_counts(reference, x, mode)})

    model2, _, opt2, _, _ = _mlp_pair()
    hand = Telemetry("float16", watch="all")
    step2 = dlspass.capture_step(model2, _mse, opt2, (x, y), _lowered_config(mode), graph_passes=[hand])
    step2((x, y))
    assert step2.telemetry is hand
    assert _key(hand.read()) == _key(got)


def test_the_default_list_is_the_gradients_and_all_adds_the_lowered_outputs() -> None:
    """``telemetry=True`` (the default list) writes the same gradient rows as ``"all"``, and no
    ``lowered:`` row: those are the activation-sized reads ``"all"`` asks for."""
    rows = {}
    for watch in (True, "default", "all"):
        model, _, opt, x, y = _mlp_pair()
        step = dlspass.capture_step(model, _mse, opt, (x, y), _lowered_config("emulate", telemetry=watch))
        step((x, y))
        assert step.telemetry.watch == ("default" if watch is True else watch)
        rows[watch] = step.telemetry.read()
    grads = {n: r for n, r in rows["all"].items() if n.startswith("grad:")}
    assert len(grads) == 4 and len(rows["all"]) == 4 + 5  # and the 5 lowered matmuls
    assert _key(rows[True]) == _key(grads) and _key(rows["default"]) == _key(grads)


def test_config_and_hook_together_feed_one_telemetry_and_off_means_none() -> None:
    model, _, opt, x, y = _mlp_pair()
    hand = Telemetry("float16")
    step = dlspass.capture_step(model, _mse, opt, (x, y), _lowered_config("emulate", telemetry=True),
                                graph_passes=[hand])
    assert step.telemetry is hand and step.graph_passes == [hand]
    step((x, y))
    assert hand.read()
    plain = dlspass.capture_step(model, _mse, opt, (x, y), _lowered_config("emulate"))
    assert plain.telemetry is None and plain.graph_passes == []


def test_gradient_amax_agrees_with_graphcore_unit_scaling_track_scales() -> None:
    """The outside reference: unit-scaling's ``track_scales`` records each parameter's gradient
    ``abs_max`` (reading every tensor back to the host); the telemetry's amax of the scaled
    gradient, over the scale (a power of two, so the division is exact), is the same number."""
    pytest.importorskip("unit_scaling")
    from unit_scaling.transforms import track_scales

    class Loss(nn.Module):
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, x, y):
            return nn.functional.mse_loss(self.m(x), y)

    model, reference, opt, x, y = _mlp_pair()
    tracked = track_scales(Loss(reference))
    tracked(x, y).backward()
    # dynamo names a parameter placeholder by its path, e.g. l_self_modules_m_modules_0_parameters_bias_
    theirs = {n.name.split("_modules_m_modules_")[1]: n.meta["metrics"].bwd.abs_max
              for n in tracked.scales_graph().nodes if n.op == "placeholder" and "_parameters_" in n.name}

    scale = 2.0**10
    config = dlspass.DLSConfig(mixed_precision=False, initial_loss_scale=scale, telemetry=True)
    step = dlspass.capture_step(model, _mse, opt, (x, y), config)
    step((x, y))
    ours = {f"{name.replace('.', '_parameters_')}_": row["amax"] / scale
            for name, row in ((k.removeprefix("grad:"), v) for k, v in step.telemetry.read().items())}
    assert sorted(ours) == sorted(theirs) and len(ours) == 4
    for name, amax in theirs.items():
        assert ours[name] == pytest.approx(amax, rel=1e-6), name


# float8 telemetry: one bias-free Linear [M, K] @ [K, N] with M, K, N apart, so that a
# converted matmul's [M, K, N] tells which operands it multiplies
M, K, N = 12, 20, 32
LOSS_SCALE = 2.0**4
# float32(448 / a) * a rounds above 448 (and float32(57344 / a) * a above 57344): an operand
# whose amax is this saturates in its own tensorwise cast
SATURATING_AMAX = 1.0615234375


def _float8_operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input, the weight and the loss's multiplier ``c`` (the gradient of the output is
    ``LOSS_SCALE * c``, exactly: a power of two): each with a saturating amax, values its cast
    flushes and values it makes float8 subnormals (e4m3 for ``x`` and ``w``; ``c``'s are placed
    for e5m2, its tensorwise format, and flush in e4m3 too)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(M, K, generator=g) * 2 - 1
    w = (torch.rand(N, K, generator=g) * 2 - 1) * 0.5
    c = (torch.rand(M, N, generator=g) * 2 - 1) / LOSS_SCALE
    for t, tiny, small in ((x, 1e-7, 2e-5), (w, 1e-7, 2e-5), (c, 1e-12, 2e-11)):
        t[0, 0] = SATURATING_AMAX * (-1 if t is w else 1) / (LOSS_SCALE if t is c else 1)
        t[1, :4] = tiny
        t[2, :4] = -small
    return x, w, c


def _float8_config(recipe: str, mode: str = "emulate") -> dlspass.DLSConfig:
    # float32 step (no 16-bit lowering), float16 DLS starting at LOSS_SCALE: the backward's
    # operands are LOSS_SCALE * c, the scaled gradient the float8 step casts
    return dlspass.DLSConfig(fp16_type="float16", mixed_precision=False, initial_loss_scale=LOSS_SCALE,
                             float8=recipe, precision_mode=mode, telemetry=True)


def _cast_counts(t: torch.Tensor, cast_config, axis: int, pow2: bool) -> dict[str, float]:
    """The row of one operand's float8 cast, recomputed in eager with torchao's own scale and
    saturating cast (``tensor_to_scale``, ``to_fp8_saturated``) and counted with torch ops."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    dtype = cast_config.target_dtype
    rowwise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
    scale = tensor_to_scale(t, dtype, scaling_granularity=cast_config.scaling_granularity,
                            axiswise_dim=axis if rowwise else None, round_scales_to_power_of_2=pow2)
    scaled = t.to(torch.float32) * scale
    q = to_fp8_saturated(scaled, dtype).to(torch.float32)
    finfo = torch.finfo(dtype)
    counts = {"amax": t.abs().max().item(),
              "flushed": float(((t != 0) & (q == 0)).sum()),
              "subnormal": float(((q != 0) & (q.abs() < finfo.tiny)).sum()),
              "saturated": float((scaled.abs() > finfo.max).sum())}
    return {**counts, "saturated_fraction": counts["saturated"] / t.numel(),
            "flushed_fraction": counts["flushed"] / t.numel()}


def _float8_want(recipe: str, graph: torch.fx.Graph, x: torch.Tensor, w: torch.Tensor,
                 c: torch.Tensor) -> dict[str, dict[str, float]]:
    """Every converted matmul operand's row, recomputed in eager: the forward ``x @ w.t()``
    casts ``x`` and ``w.t()`` as torchao's input and weight, the weight gradient
    ``g.t() @ x`` casts ``g.t()`` and ``x`` as torchao's grad_output and input for it, rowwise
    along the contraction (an operand's last dim for ``a``, its first for ``b``)."""
    from torchao.float8.config import Float8LinearConfig

    from dlspass.passes.lower_matmuls_to_float8_pass import float8_decisions

    cfg = Float8LinearConfig.from_recipe_name(recipe)
    g = c * LOSS_SCALE
    pow2 = cfg.round_scales_to_power_of_2
    operands = {(M, K, N): (x, cfg.cast_config_input, w.t(), cfg.cast_config_weight),
                (N, M, K): (g.t(), cfg.cast_config_grad_output_for_grad_weight,
                            x, cfg.cast_config_input_for_grad_weight)}
    want = {}
    for mm, decision in float8_decisions(graph).items():
        if decision["float8"] is None:
            continue
        a, ca, b, cb = operands[tuple(decision["mkn"])]
        want[f"float8:{mm}.a"] = _cast_counts(a, ca, -1, pow2)
        want[f"float8:{mm}.b"] = _cast_counts(b, cb, 0, pow2)
    return want


def _float8_model() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w, c = _float8_operands()
    model = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), x, w, c


def _check_float8_rows(got: dict[str, dict[str, float]], want: dict[str, dict[str, float]],
                       recipe: str) -> None:
    rows = {n: r for n, r in got.items() if n.startswith("float8:")}
    assert sorted(rows) == sorted(want) and len(want) == 4  # forward and weight gradient, two operands each
    # bit for bit: both sides run the same float32 ops per value (a correctly rounded multiply,
    # a round-to-nearest-even cast) and count them in integers
    assert rows == want
    assert sum(r["flushed"] for r in rows.values()) > 0 and sum(r["subnormal"] for r in rows.values()) > 0
    # current scaling saturates only the amax itself, by the rounding of amax * scale, and a
    # power-of-2 scale (rowwise) rounds down so never does
    assert sum(r["saturated"] for r in rows.values()) == (4 if recipe == "tensorwise" else 0)
    assert not any(n.startswith("lowered:") for n in got)  # the default list


@pytest.mark.parametrize("mode", ["emulate", "native"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_operand_counts_in_capture_step_equal_recomputing_the_casts_in_eager(recipe: str, mode: str) -> None:
    """Native (``torch._scaled_mm``) and emulated steps cast alike: the same rows."""
    model, opt, x, w, c = _float8_model()
    step = dlspass.capture_step(model, lambda m, b: (m(b[0]) * b[1]).sum(), opt, (x, c),
                                _float8_config(recipe, mode))
    step((x, c))
    got = step.telemetry.read()
    _check_float8_rows(got, _float8_want(recipe, step.graph_module.graph, x, w, c), recipe)
    assert sorted(n for n in got if n.startswith("grad:")) == ["grad:weight"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_operand_counts_in_compile_equal_recomputing_the_casts_in_eager_without_graph_breaks(
        recipe: str) -> None:
    model, opt, x, w, c = _float8_model()

    def train_step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        loss = (model(a) * b).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch._dynamo.reset()
    counters.clear()
    step = dlspass.compile(train_step, optimizer=opt, config=_float8_config(recipe), backend_compiler="eager")
    step(x, c)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    _check_float8_rows(step.telemetry.read(), _float8_want(recipe, step.graphs[-1].graph, x, w, c), recipe)
