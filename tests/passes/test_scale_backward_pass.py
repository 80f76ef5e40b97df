"""ScaleBackwardPass on AOTAutograd's own backward graphs, against eager autograd and the scaler's check."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from functorch.compile import aot_function, make_boxed_func

from dlspass import scale_policy
from dlspass.config import ConfigError, DLSConfig
from dlspass.graph import roles
from dlspass.passes.scale_backward_pass import SCALE_INPUT, ScaleBackwardPass


def _backward_graph(fn: Any, *inputs: torch.Tensor, tangents: tuple[torch.Tensor, ...]):
    """AOTAutograd's backward graph of ``fn`` and the real arguments it ran with."""
    seen: dict[str, Any] = {}

    def bw_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen["gm"] = gm
        inner = make_boxed_func(gm.forward)

        def run(args: list[Any]) -> Any:
            seen["args"] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return inner(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    compiled = aot_function(fn, fw_compiler=lambda gm, ex: make_boxed_func(gm.forward),
                            bw_compiler=bw_compiler)
    outs = compiled(*inputs)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    torch.autograd.backward(outs, tangents)
    return seen["gm"], seen["args"]


def _with(gm: fx.GraphModule, args: list[Any], **by_name: torch.Tensor) -> list[Any]:
    """``args`` (the graph's inputs before the pass added the scale) with some replaced by name."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")][:len(args)]
    return [by_name.get(n, a) for n, a in zip(names, args, strict=True)]


def _two_outputs(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tanh(x @ w + b)
    return h.pow(2).mean(), h.sum(0)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 4, generator=g).requires_grad_()
    b = torch.randn(4, generator=g).requires_grad_()
    return w, b, torch.randn(5, 6, generator=g)


def _eager_grads(tangents: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    w, b, x = _inputs()
    return list(torch.autograd.grad(_two_outputs(w, b, x), (w, b), tangents))


TANGENTS = (torch.tensor(1.0), torch.full((4,), 0.25))


@pytest.mark.parametrize("policy", ["cerebras", "torch"])
def test_every_tangent_scaled_gradients_unscaled_flag_appended(policy: str) -> None:
    config = DLSConfig(policy=policy)
    gm, args = _backward_graph(_two_outputs, *_inputs(), tangents=TANGENTS)
    n_tangents = sum(n.name.startswith("tangents") for n in gm.graph.find_nodes(op="placeholder"))
    assert n_tangents == 2
    before = set(gm.graph.nodes)
    assert ScaleBackwardPass(config)(gm).modified

    scale = gm.graph.find_nodes(op="placeholder")[-1]
    assert scale.name == SCALE_INPUT and roles.target_of(scale) == "loss_scale"
    scaled = roles.nodes_with_role(gm.graph, roles.SCALED_SEED)
    assert sorted(n.args[0].name for n in scaled) == ["tangents_1", "tangents_2"]
    assert all(n.args[1] is scale for n in scaled)
    # every node the pass added carries a fake value of the right shape and dtype
    for node in set(gm.graph.nodes) - before:
        if node.op in ("call_function", "placeholder"):
            assert isinstance(node.meta.get("val"), torch.Tensor), node.name

    # a power-of-two scale round-trips exactly: the gradients are eager autograd's
    *grads, flag = gm(*args, torch.tensor(2.0**12))
    assert grads[2] is None  # x needs no gradient
    for got, want in zip(grads[:2], _eager_grads(TANGENTS), strict=True):
        assert torch.equal(got, want)
    assert flag.dtype == torch.bool and bool(flag)

    # the scale reaches the backward: a scale that overflows it trips the flag, as it does in
    # eager autograd seeded with the scaled tangents, unscaled and checked by the scaler's policy
    scale, big = torch.tensor(2.0**127), (torch.tensor(64.0), torch.full((4,), 64.0))
    *grads, flag = gm(*_with(gm, args, tangents_1=big[0], tangents_2=big[1]), scale)
    eager = _eager_grads(tuple(t * scale for t in big))
    want, _ = scale_policy.check_overflow(scale_policy.unscale(eager, scale), config)
    assert not bool(want) and not bool(flag)
    for got, ref in zip(grads[:2], scale_policy.unscale(eager, scale), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


def test_flag_is_the_scalers_check_on_the_unscaled_gradients() -> None:
    """Gradients near 1e21 are finite, their squares are not: cerebras' global-norm check flags it, torch's does not."""
    big = (torch.tensor(1e22), torch.full((4,), 0.25))
    for policy in ("cerebras", "torch"):
        config = DLSConfig(policy=policy)
        gm, args = _backward_graph(_two_outputs, *_inputs(), tangents=TANGENTS)
        ScaleBackwardPass(config)(gm)
        *grads, flag = gm(*_with(gm, args, tangents_1=big[0]), torch.tensor(1.0))
        assert all(torch.isfinite(g).all() for g in grads[:2])
        want_flag, _ = scale_policy.check_overflow(_eager_grads(big), config)
        assert bool(flag) == bool(want_flag) == (policy == "torch")


def test_nan_in_a_gradient_clears_the_flag_and_applying_twice_changes_nothing() -> None:
    config = DLSConfig(policy="torch")
    gm, args = _backward_graph(_two_outputs, *_inputs(), tangents=TANGENTS)
    ScaleBackwardPass(config)(gm)
    code = gm.code
    assert not ScaleBackwardPass(config)(gm).modified
    assert gm.code == code
    *_, flag = gm(*_with(gm, args, tangents_2=torch.full((4,), float("nan"))), torch.tensor(1.0))
    assert not bool(flag)


def test_a_graph_without_floating_tangent_is_a_config_error() -> None:
    gm = fx.symbolic_trace(lambda x: x * 2)
    with pytest.raises(ConfigError, match="no floating-point tangent"):
        ScaleBackwardPass(DLSConfig())(gm)
