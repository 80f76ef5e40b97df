"""UnscaleGradsPass: the optimizer reads grads × 1/scale; one overflow flag by the policy's method."""

from __future__ import annotations

import math

import pytest
import torch
from stepgraph import MLP_GRAD_SUMS, eager_grads, mlp_step, node_values
from tolerance import assert_close_reordered, grad_term_sums, reordered_sum_atol

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.passes import ScaleSeedPass, UnscaleGradsPass
from dlspass.scale_policy import init_state


def _apply(cfg: DLSConfig):
    step = mlp_step(cfg)
    for p in (ScaleSeedPass(cfg), UnscaleGradsPass(cfg)):
        p(step.gm)
    step.gm.recompile()
    return step


def _global(gm, role: str):
    return [n for n in roles.nodes_with_role(gm.graph, role) if roles.target_of(n) == "global"]


def test_every_grad_is_read_through_one_unscale_node() -> None:
    cfg = DLSConfig(mixed_precision=False)
    gm = _apply(cfg).gm
    grads = roles.nodes_with_role(gm.graph, roles.GRAD)
    assert len(grads) == 6
    for g in grads:
        (u,) = g.users
        assert roles.role_of(u) == roles.UNSCALE and roles.target_of(u) == roles.target_of(g)
        assert roles.pass_of(u) == "unscale_grads"
    recips = [n for n in roles.nodes_with_role(gm.graph, roles.UNSCALE)
              if n.target is torch.ops.aten.reciprocal.default]
    seed_scale = roles.the_node(gm.graph, roles.SCALED_SEED).args[1]
    assert len(recips) == 1 and recips[0].args[0] is seed_scale  # the seed's own placeholder
    assert len(_global(gm, roles.ISFINITE)) == 1 and len(_global(gm, roles.GRAD_NORM)) == 1


def test_unscaled_grads_norm_and_flag_match_eager() -> None:
    cfg = DLSConfig(mixed_precision=False, initial_loss_scale=2.0**12)
    step = _apply(cfg)
    gm = step.gm
    unscaled = [n for n in roles.nodes_with_role(gm.graph, roles.UNSCALE) if roles.target_of(n)]
    nodes = [*unscaled, *_global(gm, roles.ISFINITE), *_global(gm, roles.GRAD_NORM)]
    vals = node_values(gm, step.inputs(), nodes)
    ref = eager_grads(step)
    for n, v in zip(unscaled, vals, strict=False):
        # the traced backward against eager autograd's kernels: other summation orders, bounded
        # for the MLP's longest chain of sums; the scale and its reciprocal are powers of two,
        # exact (tests/tolerance.py)
        assert_close_reordered(v, ref[roles.target_of(n)], n=MLP_GRAD_SUMS)
    norm64 = math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref.values()))
    assert bool(vals[-2]) is True
    assert float(vals[-1]) == pytest.approx(norm64, rel=1e-6)
    bad = node_values(gm, step.inputs(batch=[step.batch[0] * float("nan"), step.batch[1]]), nodes)
    assert bool(bad[-2]) is False


def test_a_scale_that_overflows_the_backward_is_flagged() -> None:
    cfg = DLSConfig(mixed_precision=False)
    step = _apply(cfg)
    flag = _global(step.gm, roles.ISFINITE)
    huge = init_state(cfg)._replace(loss_scale=torch.tensor(3e38))
    big = [step.batch[0] * 100, step.batch[1] * 100]  # finite gradients of order 100 ...
    (ok,) = node_values(step.gm, step.inputs(batch=big), flag)
    assert bool(ok) is True
    (ok,) = node_values(step.gm, step.inputs(state=huge, batch=big), flag)
    assert bool(ok) is False  # ... that the scale pushes past float32's range


def test_all_finite_policy_has_no_norm_unless_clipping() -> None:
    gm = _apply(DLSConfig(policy="torch", mixed_precision=False)).gm
    assert len(_global(gm, roles.ISFINITE)) == 1 and not _global(gm, roles.GRAD_NORM)
    gm = _apply(DLSConfig(policy="torch", max_gradient_norm=1.0, mixed_precision=False)).gm
    assert len(_global(gm, roles.GRAD_NORM)) == 1


def test_static_scale_unscales_without_a_check() -> None:
    gm = _apply(DLSConfig(loss_scale=8.0, mixed_precision=False)).gm
    assert roles.nodes_with_role(gm.graph, roles.UNSCALE)
    assert not roles.nodes_with_role(gm.graph, roles.ISFINITE)


def test_idempotent() -> None:
    cfg = DLSConfig(mixed_precision=False)
    gm = _apply(cfg).gm
    code = gm.code
    assert not UnscaleGradsPass(cfg)(gm).modified
    gm.recompile()
    assert gm.code == code


class _ConvBNLinear(torch.nn.Module):
    """conv -> BatchNorm -> linear, loss = MSE: BatchNorm's bias gradient also feeds its input
    gradient in the exported (decomposed) backward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(3)
        self.fc = torch.nn.Linear(3 * 4 * 4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).flatten(1)
        return torch.nn.functional.mse_loss(self.fc(h), y)


# The longest chain of sums behind a _ConvBNLinear gradient (conv.weight's) when the forward too
# runs other kernels (the exported graph decomposes BatchNorm): forward through the convolution
# (2 channels x 9 taps), BatchNorm's batch mean and variance (over 4 x 4 x 4 positions each) and
# the linear layer (48 features); back through the linear layer (2 outputs), BatchNorm's two
# batch sums, then the convolution's weight gradient over the 64 positions.
CONV_BN_LINEAR_SUMS = 2 * 9 + 2 * 64 + 48 + 2 + 2 * 64 + 64


def conv_bn_linear_grad_atols(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """How far the exported step's gradients of ``model`` (a _ConvBNLinear) can be from eager
    autograd's: CONV_BN_LINEAR_SUMS terms added in another order, S each gradient's terms'
    magnitudes, which cancel in BatchNorm (tests/tolerance.py)."""
    terms = grad_term_sums(model, lambda m: m(*batch))
    return {k: reordered_sum_atol(CONV_BN_LINEAR_SUMS, s) for k, s in terms.items()}


def _exported_step(cfg: DLSConfig):
    from dlspass.capture.export import joint_with_ties
    from dlspass.capture.joint_step import joint_to_step_graph
    from dlspass.capture.optim import OptimizerSpec

    torch.manual_seed(0)
    model = _ConvBNLinear()
    batch = (torch.randn(4, 2, 4, 4), torch.randn(4, 2))
    joint = joint_with_ties(torch.export.export(model, batch), "conv_bn_linear")[0]
    gm, info = joint_to_step_graph(joint, OptimizerSpec(kind="sgd", lr=0.1), cfg, "conv_bn_linear")
    inputs = [*info.params.values(), *info.buffers.values(), *info.opt_state.values(),
              *info.scaler.values(), *info.hyper.values(), *batch]
    return model, batch, gm, inputs


def test_a_gradient_used_inside_the_backward_keeps_its_scaled_value_there() -> None:
    from dlspass.passes.base import backward_nodes

    cfg = DLSConfig(mixed_precision=False, initial_loss_scale=2.0**10)
    model, batch, gm, inputs = _exported_step(cfg)
    # the situation under test: some gradient is read by the backward itself
    inside = backward_nodes(gm.graph)
    grads = roles.nodes_with_role(gm.graph, roles.GRAD)
    reused = {roles.target_of(g) for g in grads if any(u in inside for u in g.users)}
    assert "bn.bias" in reused
    for p in (ScaleSeedPass(cfg), UnscaleGradsPass(cfg)):
        p(gm)
    gm.recompile()
    for g in roles.nodes_with_role(gm.graph, roles.GRAD):
        # only the optimizer's read moved to the unscaled value; the backward's did not
        assert all(roles.role_of(u) == roles.UNSCALE or u in inside for u in g.users)
    unscaled = [n for n in roles.nodes_with_role(gm.graph, roles.UNSCALE) if roles.target_of(n)]
    vals = node_values(gm, inputs, unscaled)
    loss = model(*batch)  # eager fp32 autograd, no scaling: the reference
    ref = dict(zip([k for k, _ in model.named_parameters()],
                   torch.autograd.grad(loss, list(model.parameters())), strict=True))
    assert {roles.target_of(n) for n in unscaled} == set(ref)
    atol = conv_bn_linear_grad_atols(model, batch)
    for n, v in zip(unscaled, vals, strict=True):
        # the exported, decomposed step against eager autograd: other summation orders (the
        # scale, a power of two, is exact)
        torch.testing.assert_close(v, ref[roles.target_of(n)], rtol=0, atol=atol[roles.target_of(n)])
