"""The CUDA-graph decision wired into ``dlspass.compile``'s one hand-off to inductor
(``dlspass.capture.aot.step_backend``): what inductor is asked for, and the one-line warning.

A CPU step is compiled through the real hand-off with inductor's forward compile replaced by a
spy that records the settings it runs under and returns the graph uncompiled (no code is
generated: the check is what aot hands inductor). CUDA steps are fake-CUDA graphs (no GPU here).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from test_cudagraph_policy import _sgd, sgd_on_fake
from torch._dynamo.source import ConstantSource
from torch._inductor import config as inductor_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import dlspass
from dlspass.cache_facts import inductor_key_config
from dlspass.capture import aot
from dlspass.cudagraph_policy import (
    CPU_TENSORS,
    DYNAMIC_SHAPES,
    NOT_CUDA,
    USER_SYNC,
    CudaGraphDecision,
    cudagraph_decision,
    inductor_options,
    step_facts,
)
from dlspass.formats import INDUCTOR_CONFIG
from dlspass.models import MLP, mse_train_step


def _cpu_step(scaler: dlspass.GradScaler | None = None):
    """A small float32 SGD step on CPU through ``dlspass.compile``'s inductor hand-off."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return dlspass.compile(mse_train_step(model, opt), optimizer=opt, scaler=scaler or dlspass.GradScaler(),
                           mixed_precision=False, backend_compiler="inductor")


def test_a_cpu_step_reaches_not_cuda_and_inductor_gets_the_settings_it_had(monkeypatch):
    decisions: list[tuple[CudaGraphDecision, dict]] = []
    seen: list[tuple[dict, bool]] = []

    def decide(gm: fx.GraphModule) -> dict:
        got = real_decide(gm)
        decisions.append((cudagraph_decision(step_facts(gm.graph)), got))
        return got

    def forward(g, ex, *, compiler_config_extra, **kw):  # inductor's forward compile, spied
        seen.append((inductor_config.get_config_copy(), compiler_config_extra.cudagraphs.value))
        return make_boxed_func(g.forward)

    real_decide = aot.step_cudagraph_config
    monkeypatch.setattr(aot, "step_cudagraph_config", decide)
    monkeypatch.setattr(aot.cfx, "compile_fx_forward", forward)
    scaler = dlspass.GradScaler()
    step = _cpu_step(scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a CPU step warns nothing
        step(torch.randn(4, 8), torch.randn(4, 4))
    assert len(decisions) == 1 and len(seen) == 1
    decision, options = decisions[0]
    assert not decision.record and decision.reason.startswith(NOT_CUDA) and not decision.on_cuda
    assert options == {}
    # the settings inductor compiled under: exactly those the hand-off set before the decision
    # was wired (dlspass's own, the CPU facts with the plan's cache key, the step's layout and
    # node-order settings), nothing of CUDA graphs
    with inductor_config.patch({**INDUCTOR_CONFIG, **inductor_key_config(step.plan.cache_key()),
                                "layout_optimization": False, "reorder_for_locality": False}):
        expected = inductor_config.get_config_copy()
    config, cudagraphs = seen[0]
    # the CPU facts pass is made anew for each compile: the same when its cache key is
    key = "post_grad_custom_post_pass"
    assert config.pop(key).uuid() == expected.pop(key).uuid()
    assert config == expected
    assert cudagraphs is False
    # nothing is recorded on CPU, so nothing is marked a static input (mark_static_address's mark)
    assert not any(hasattr(t, "_dynamo_static_input_type") for t in scaler.state)


def test_a_static_all_cuda_step_gets_cudagraph_trees_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = aot.step_cudagraph_config(sgd_on_fake(((4, 3), "cuda"), ((4, 3), "cuda"), ((), "cuda")))
    assert options == inductor_options(CudaGraphDecision(True))
    assert options["triton.cudagraphs"] is True and options["triton.cudagraph_trees"] is True
    with inductor_config.patch(options):  # settings this torch has (an unknown key raises)
        assert inductor_config.triton.cudagraphs is True


def _sync_graph() -> fx.GraphModule:
    # x.sum().item() in the step (a fake value cannot be read, so the graph is written out):
    # the host waits for the device
    with FakeTensorMode():
        x = torch.empty(4, device="cuda")
        gm = make_fx(torch.sum)(x)
    total = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(total):
        item = gm.graph.call_function(torch.ops.aten._local_scalar_dense.default, (total,))
    item.meta["val"] = 1.0
    return gm


def _symbolic_cuda_graph() -> fx.GraphModule:
    # the rows of p and g a symbol (a step traced with dynamic shapes)
    env = ShapeEnv()
    rows = env.create_symintnode(env.create_symbol(4, ConstantSource("rows")), hint=4)
    with FakeTensorMode(shape_env=env):
        args = [torch.empty(rows, 3, device="cuda"), torch.empty(rows, 3, device="cuda"),
                torch.empty((), device="cuda")]
        return make_fx(_sgd)(*args)


@pytest.mark.parametrize(("build", "reason"), [
    (lambda: sgd_on_fake(((4, 3), "cuda"), ((4, 3), "cuda"), ((), "cpu")), CPU_TENSORS),
    (_sync_graph, USER_SYNC),
    (_symbolic_cuda_graph, DYNAMIC_SHAPES),
])
def test_a_cuda_step_that_cannot_be_recorded_warns_its_reason_in_one_line(build, reason):
    gm = build()
    expected = cudagraph_decision(step_facts(gm.graph))
    assert expected.reason.startswith(reason)
    with pytest.warns(UserWarning) as caught:
        options = aot.step_cudagraph_config(gm)
    [w] = [w for w in caught if "CUDA graph" in str(w.message)]
    assert str(w.message) == f"dlspass.compile: the step runs without a CUDA graph: {expected.reason}"
    assert "\n" not in str(w.message)
    assert options == {"triton.cudagraphs": False}


def test_a_cpu_graph_gets_no_settings_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert aot.step_cudagraph_config(sgd_on_fake(((4, 3), "cpu"), ((4, 3), "cpu"), ((), "cpu"))) == {}


def test_the_decision_s_settings_reach_inductor_s_compile_of_the_step(monkeypatch):
    # the CUDA decision forced on a CPU step: the settings and inductor's own cudagraphs switch
    # (read when its per-graph settings are made) must both say record
    seen: list[tuple[bool, bool, bool]] = []

    def forward(g, ex, *, compiler_config_extra, **kw):
        seen.append((inductor_config.triton.cudagraphs, inductor_config.triton.cudagraph_trees,
                     compiler_config_extra.cudagraphs.value))
        return make_boxed_func(g.forward)

    monkeypatch.setattr(aot, "step_cudagraph_config", lambda gm: inductor_options(CudaGraphDecision(True)))
    monkeypatch.setattr(aot.cfx, "compile_fx_forward", forward)
    step = _cpu_step()
    step(torch.randn(4, 8), torch.randn(4, 4))
    assert seen == [(True, True, True)]
