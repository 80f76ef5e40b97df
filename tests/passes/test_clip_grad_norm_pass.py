"""ClipGradNormPass: clipping after the overflow check, matching torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import torch
from stepgraph import MLP_GRAD_SUMS, eager_grads, mlp_step, node_values, run
from test_unscale_grads_pass import conv_bn_linear_grad_atols
from tolerance import clip_norm_atols, reordered_sum_atol

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.passes import ClipGradNormPass, apply_dls


def _clip_nodes(gm):
    return [n for n in roles.nodes_with_role(gm.graph, roles.CLIP) if roles.target_of(n)]


def test_norm_clipping_matches_torch_clip_grad_norm() -> None:
    cfg = DLSConfig(mixed_precision=False, max_gradient_norm=0.05, initial_loss_scale=256.0)
    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    clipped = node_values(gm, step.inputs(), _clip_nodes(gm))
    ref = eager_grads(step)
    params = {k: v.clone().requires_grad_() for k, v in step.params.items()}
    for k, p in params.items():
        p.grad = ref[k].clone()
    total = torch.nn.utils.clip_grad_norm_(list(params.values()), 0.05)
    assert float(total) > 0.05  # the test really clips
    # the traced gradients and eager autograd's sum in other orders (MLP_GRAD_SUMS), carried
    # through the clip (tests/tolerance.py)
    tol = clip_norm_atols(ref, {k: reordered_sum_atol(MLP_GRAD_SUMS, float(g.abs().max())) for k, g in ref.items()},
                          0.05)[0]
    for n, v in zip(_clip_nodes(gm), clipped, strict=True):
        k = roles.target_of(n)
        torch.testing.assert_close(v, params[k].grad, rtol=0, atol=tol[k])
    # the optimizer reads the clipped values: SGD's first momentum buffer is the gradient
    got = run(step, gm)
    for k, p in params.items():
        torch.testing.assert_close(got[roles.OPT_STATE_UPDATE][f"{k}.momentum_buffer"], p.grad,
                                   rtol=0, atol=tol[k])


def test_clip_comes_after_the_check_which_reads_unclipped_grads() -> None:
    cfg = DLSConfig(mixed_precision=False, max_gradient_norm=0.05)
    gm = apply_dls(mlp_step(cfg).gm, cfg)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    flag = next(n for n in roles.nodes_with_role(gm.graph, roles.ISFINITE))
    assert all(order[c] > order[flag] for c in roles.nodes_with_role(gm.graph, roles.CLIP))
    norm_inputs = {a for n in roles.nodes_with_role(gm.graph, roles.GRAD_NORM) for a in n.all_input_nodes}
    assert not norm_inputs & set(roles.nodes_with_role(gm.graph, roles.CLIP))


def test_value_clipping_bounds_every_element() -> None:
    cfg = DLSConfig(mixed_precision=False, max_gradient_value=0.01)
    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    vals = node_values(gm, step.inputs(), _clip_nodes(gm))
    ref = eager_grads(step)
    assert any(float(g.abs().max()) > 0.01 for g in ref.values())
    for n, v in zip(_clip_nodes(gm), vals, strict=True):
        # clamping moves two values no further apart: the gradients' reordering bound
        # (MLP_GRAD_SUMS, tests/tolerance.py)
        g = ref[roles.target_of(n)]
        torch.testing.assert_close(v, g.clamp(-0.01, 0.01), rtol=0,
                                   atol=reordered_sum_atol(MLP_GRAD_SUMS, float(g.abs().max())))


def test_clipping_without_scaling_clips_the_raw_grads() -> None:
    cfg = DLSConfig(loss_scale=None, mixed_precision=False, max_gradient_norm=0.05)
    step = mlp_step(cfg)
    gm = apply_dls(step.gm, cfg)
    assert not roles.nodes_with_role(gm.graph, roles.UNSCALE)
    clipped = node_values(gm, step.inputs(), _clip_nodes(gm))
    total = torch.sqrt(sum((c.double() ** 2).sum() for c in clipped))
    assert float(total) == __import__("pytest").approx(0.05, rel=1e-4)


def test_no_clipping_configured_is_a_noop_and_idempotent() -> None:
    gm = mlp_step().gm
    assert not ClipGradNormPass(DLSConfig())(gm).modified
    cfg = DLSConfig(mixed_precision=False, max_gradient_norm=1.0)
    gm = apply_dls(mlp_step(cfg).gm, cfg)
    n = len(gm.graph.nodes)
    assert not ClipGradNormPass(cfg)(gm).modified and len(gm.graph.nodes) == n


def test_unscaled_clipping_leaves_the_backwards_reads_of_a_gradient_unclipped() -> None:
    """No scaling: clip reads the raw gradients, and BatchNorm's bias gradient, which its input
    gradient reuses in the exported backward, stays unclipped there (conv -> BatchNorm ->
    linear; the same model as in test_unscale_grads_pass.py)."""
    from test_unscale_grads_pass import _exported_step

    from dlspass.passes.base import backward_nodes

    cfg = DLSConfig(loss_scale=None, mixed_precision=False, max_gradient_norm=0.05)
    model, batch, gm, inputs = _exported_step(cfg)
    inside = backward_nodes(gm.graph)
    gm = apply_dls(gm, cfg)
    for g in roles.nodes_with_role(gm.graph, roles.GRAD):
        # the norm reads the raw gradient; the optimizer reads the clipped one
        assert all(roles.role_of(u) in (roles.CLIP, roles.GRAD_NORM) or u in inside for u in g.users)
    clipped = node_values(gm, inputs, _clip_nodes(gm))
    loss = model(*batch)
    torch.autograd.backward(loss)
    raw = {k: p.grad.clone() for k, p in model.named_parameters()}
    total = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.05)
    assert float(total) > 0.05  # the test really clips
    ref = {k: p.grad for k, p in model.named_parameters()}
    # the exported step's gradients against eager autograd's (conv_bn_linear_grad_atols),
    # carried through the clip
    atol = clip_norm_atols(raw, conv_bn_linear_grad_atols(model, batch), 0.05)[0]
    for n, v in zip(_clip_nodes(gm), clipped, strict=True):
        torch.testing.assert_close(v, ref[roles.target_of(n)], rtol=0, atol=atol[roles.target_of(n)])
