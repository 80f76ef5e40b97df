"""One assembly line: ``capture_step`` and ``dlspass.compile`` run ``run_step_pipeline``.

Both entry points, made data-parallel over a one-rank gloo group (so the collective passes
run), must verify the graph again after the overflow-flag all-reduce: a flag pass that breaks
a DLS invariant (a guard that falls back to the new value) is caught in both, and without it
the last verification of both sees the all-reduced flag. Both steps take the same
``graph_passes`` hook, name parameters alike, and refuse an input no provider feeds.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dlspass
from dlspass.capture import compiled_step, step_pipeline
from dlspass.graph import roles
from dlspass.graph.clone import clone_step_graph
from dlspass.graph.invariants import VerificationError
from dlspass.graph.roles import FLAG_ALLREDUCE
from dlspass.models import MLP, mse_loss, mse_train_step
from dlspass.passes.all_reduce_flag_pass import AllReduceFlagPass

CONFIG = dlspass.DLSConfig(mixed_precision=False)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _captured(group: object, **kw: object) -> dlspass.CapturedStep:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dlspass.capture_step(model, mse_loss, opt, _batch(), config=CONFIG,
                                process_group=group, **kw)
    step(_batch())
    return step


def _compiled(group: object, **kw: object) -> compiled_step.CompiledStep:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt, config=CONFIG,
                           backend_compiler="eager", process_group=group, **kw)
    step(*_batch())
    return step


def test_every_front_end_runs_the_one_pipeline(monkeypatch, tmp_path) -> None:
    from dlspass.capture.export import export_factory
    from dlspass.capture.joint_step import transform_program
    from dlspass.capture.optim import OptimizerSpec

    calls: list[str] = []
    real = step_pipeline.run_step_pipeline

    def spy(gm: torch.fx.GraphModule, *args: object, **kwargs: object) -> object:
        calls.append(gm.__class__.__name__)
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(step_pipeline, "run_step_pipeline", spy)
    _captured(None)
    assert len(calls) == 1, "capture_step"
    _compiled(None)
    assert len(calls) == 2, "dlspass.compile"
    ep, _ = export_factory("cli_factories:mlp")
    transform_program(ep, None, CONFIG, OptimizerSpec(kind="sgd", lr=0.1))
    assert len(calls) == 3, "the .pt2 front end"


def test_both_entry_points_verify_after_the_flag_allreduce(one_rank, monkeypatch) -> None:
    seen: list[bool] = []
    real_verify = step_pipeline.verify

    def spy(gm: torch.fx.GraphModule) -> bool:
        seen.append(any(roles.role_of(n) == FLAG_ALLREDUCE for n in gm.graph.nodes))
        return real_verify(gm)

    monkeypatch.setattr(step_pipeline, "verify", spy)
    for make in (_captured, _compiled):
        seen.clear()
        make(one_rank)
        assert seen == [True], make.__name__  # once, after the collectives


def test_an_invariant_broken_after_the_collectives_is_caught_by_both(one_rank, monkeypatch) -> None:
    class BreakingFlagPass(AllReduceFlagPass):
        """The real flag all-reduce, then a guard that falls back to the new value."""

        def __call__(self, gm: torch.fx.GraphModule):  # type: ignore[override]
            result = super().__call__(gm)
            guard = next(n for n in gm.graph.nodes if roles.role_of(n) == roles.GUARD)
            guard.update_arg(2, guard.args[1])
            gm.recompile()
            return result

    monkeypatch.setattr(step_pipeline, "AllReduceFlagPass", BreakingFlagPass)
    for make in (_captured, _compiled):
        with pytest.raises(VerificationError, match="falls back to"):
            make(one_rank)


def test_both_steps_run_graph_passes_before_dls_and_name_parameters_alike() -> None:
    seen: dict[str, list[str]] = {}

    def recorder(name: str):
        def graph_pass(gm: torch.fx.GraphModule) -> None:
            # before DLS: no pass has been applied, the gradients are the backward's
            assert not roles.nodes_with_role(gm.graph, roles.SCALED_SEED)
            seen[name] = sorted(roles.target_of(n) for n in roles.nodes_with_role(gm.graph, roles.GRAD))
        return graph_pass

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = dlspass.capture_step(model, mse_loss, opt, _batch(), config=CONFIG,
                                    graph_passes=[recorder("captured")])
    torch._dynamo.reset()
    compiled = dlspass.compile(mse_train_step(model, opt), optimizer=opt, config=CONFIG,
                               backend_compiler="eager", model=model,
                               graph_passes=[recorder("compiled")])
    compiled(*_batch())
    names = sorted(n for n, _ in model.named_parameters())
    assert seen == {"captured": names, "compiled": names}
    assert captured.graph_targets(model) == compiled.graph_targets(model) == {n: n for n in names}
    # without model=, dlspass.compile keeps the optimizer's group/param names
    torch._dynamo.reset()
    plain = dlspass.compile(mse_train_step(model, opt), optimizer=opt, config=CONFIG)
    assert plain.graph_targets(model)["fc2.weight"] == "group0.param2"


class _PhaseRecorder:
    """A graph pass that records, when it runs, whether DLS has run and how many roundings to
    float16 the lowering left."""

    def __init__(self, seen: list, phase: str | None) -> None:
        self.seen = seen
        if phase is not None:
            self.pipeline_phase = phase

    def __call__(self, gm: torch.fx.GraphModule) -> None:
        rounds = [n for n in gm.graph.nodes if n.target is torch.ops.dlspass.round_to_format.default]
        self.seen.append((getattr(self, "pipeline_phase", None),
                          bool(roles.nodes_with_role(gm.graph, roles.SCALED_SEED)), len(rounds)))


def test_a_pass_may_run_after_dls_and_sees_the_lowered_step_in_both_steps() -> None:
    """``pipeline_phase = "after_dls"`` runs a pass after the lowering and the DLS passes (the
    telemetry needs the 16-bit ops); without the attribute, or with "before_dls", before them;
    an unknown phase is refused."""
    config = dlspass.DLSConfig(fp16_type="float16", precision_mode="emulate")
    for front in ("captured", "compiled"):
        seen: list = []
        # listed after first: the phases, not the list order, decide
        passes = [_PhaseRecorder(seen, "after_dls"), _PhaseRecorder(seen, None),
                  _PhaseRecorder(seen, "before_dls")]
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if front == "captured":
            dlspass.capture_step(model, mse_loss, opt, _batch(), config=config, graph_passes=passes)
        else:
            torch._dynamo.reset()
            dlspass.compile(mse_train_step(model, opt), optimizer=opt, config=config,
                            backend_compiler="eager", graph_passes=passes)(*_batch())
        assert [s[:2] for s in seen] == [(None, False), ("before_dls", False), ("after_dls", True)], front
        assert seen[0][2] == seen[1][2] == 0 and seen[2][2] > 0, front
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(dlspass.ConfigError, match="pipeline_phase 'later'; expected one of before_dls, after_dls"):
        dlspass.capture_step(model, mse_loss, opt, _batch(), config=config,
                             graph_passes=[_PhaseRecorder([], "later")])


def test_a_front_end_without_a_telemetry_hook_refuses_a_config_asking_for_telemetry() -> None:
    """The ``.pt2`` transform runs the pipeline with no buffer to feed: telemetry=True there is
    refused in one line, not silently dropped."""
    model = MLP()
    step = dlspass.capture_step(model, mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), _batch(),
                                config=CONFIG)
    gm = clone_step_graph(step._traced)
    with pytest.raises(dlspass.StepCaptureError, match="telemetry=True: this step front end has no telemetry"):
        step_pipeline.run_step_pipeline(gm, CONFIG.with_overrides(telemetry=True))
    with pytest.raises(dlspass.StepCaptureError, match="telemetry='all': this step front end has no telemetry"):
        step_pipeline.run_step_pipeline(gm, CONFIG.with_overrides(telemetry="all"))
    step_pipeline.run_step_pipeline(gm, CONFIG)  # the same graph, without telemetry: fine


def test_both_steps_refuse_an_input_no_provider_feeds() -> None:
    def add_input(gm: torch.fx.GraphModule) -> None:
        last = gm.graph.find_nodes(op="placeholder")[-1]
        with gm.graph.inserting_after(last):
            ph = gm.graph.placeholder("unfed")
        ph.meta["val"] = last.meta["val"]
        roles.set_role(ph, roles.INPUT, "unfed")

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(dlspass.StepCaptureError, match=r"\['unfed'\].*does not provide"):
        dlspass.capture_step(model, mse_loss, opt, _batch(), config=CONFIG, graph_passes=[add_input])
    torch._dynamo.reset()
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt, config=CONFIG,
                           backend_compiler="eager", graph_passes=[add_input])
    with pytest.raises(dlspass.StepCaptureError, match=r"\['unfed'\].*does not provide"):
        step(*_batch())


def test_a_captured_step_feeds_extra_inputs_and_rebuilds_when_its_passes_change() -> None:
    """A pass that scales the loss by a fed input: the step reads the provider at every call."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dlspass.capture_step(model, mse_loss, opt, _batch(), config=CONFIG)
    plain = step.graph_module
    factor = torch.tensor(3.0)

    def scale_loss(gm: torch.fx.GraphModule) -> None:
        last = gm.graph.find_nodes(op="placeholder")[-1]
        with gm.graph.inserting_after(last):
            ph = gm.graph.placeholder("factor")
        ph.meta["val"] = torch.empty(())
        roles.set_role(ph, roles.INPUT, "factor")
        out = gm.graph.output_node()
        loss = out.args[0][-1]
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (loss, ph))
        scaled.meta["val"] = loss.meta["val"]
        out.update_arg(0, (*out.args[0][:-1], scaled))
        gm.recompile()

    step.extra_inputs["factor"] = lambda: factor
    step.graph_passes.append(scale_loss)
    x, y = _batch()
    with torch.no_grad():
        ref = float(mse_loss(model, (x, y)))
    assert float(step((x, y))) == pytest.approx(3.0 * ref)
    assert step.graph_module is not plain and step.num_calls == 1
    step.graph_passes.remove(scale_loss)
    del step.extra_inputs["factor"]
    with torch.no_grad():
        ref = float(mse_loss(model, (x, y)))
    assert float(step((x, y))) == pytest.approx(ref)
    assert step.graph_module is plain  # the build without the pass, kept
