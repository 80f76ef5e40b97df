"""GuardFusedUpdatesPass: a fused Adam kernel skips by its own ``found_inf``, bit-equal to the ``where`` guards it replaces."""

from __future__ import annotations

import torch
import torch.fx as fx
from stepgraph import Step, _Bound, mlp_step, run
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.capture.fused_optimizer import fused_group_update
from dlspass.capture.optim import GroupPlan
from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.graph.invariants import verify
from dlspass.graph.marks import resolve_marks
from dlspass.graph.step_io import StepIO, mark_backward, mark_grads, tag_step_io
from dlspass.models import MLP, mse_loss
from dlspass.passes import apply_dls
from dlspass.passes.guard_fused_updates_pass import FUSED_KERNELS, GuardFusedUpdatesPass
from dlspass.scale_policy import init_state

CONFIG = DLSConfig(mixed_precision=False, loss_scale="dynamic")
CONSTANTS = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def fused_adamw_step() -> Step:
    """An MLP step whose optimizer is torch's fused AdamW kernel (`fused_group_update`), laid
    out as ``dlspass.capture`` lays out a step, with DLS applied and verified."""
    torch.manual_seed(0)
    model = MLP(d_in=4, d_hidden=8, d_out=3)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    keys = ("step", "exp_avg", "exp_avg_sq")
    opt_state = {f"{k}.{s}": (torch.full((), 3.0) if s == "step" else torch.rand_like(v))
                 for k, v in params.items() for s in keys}
    hyper = {"group0.lr": torch.tensor(1e-2, dtype=torch.float64)}
    state = init_state(CONFIG)
    batch = [torch.randn(5, 4), torch.randn(5, 3)]
    io = StepIO(params=list(params), buffers=[], opt_state=list(opt_state), hyper=list(hyper),
                batch=["batch.0", "batch.1"])
    plan = GroupPlan(index=0, names=tuple(params), decoupled=True, fused=True)

    def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
        p_in, _, o_in, s_in, h_in, xs = io.split(flat)
        loss, vjp_fn = torch.func.vjp(lambda p: mse_loss(_Bound(model, p), tuple(xs)), p_in)
        loss, seed = mark_backward(loss)
        (grads,) = vjp_fn(seed)
        grads = mark_grads(grads)
        names = list(io.params)
        new_p, new_st = fused_group_update(
            plan, [p_in[k] for k in names], [grads[k] for k in names],
            [{s: o_in[f"{k}.{s}"] for s in keys} for k in names], h_in["group0.lr"], CONSTANTS)
        new_o = {f"{k}.{s}": st[s] for k, st in zip(names, new_st, strict=True) for s in keys}
        return (*new_p, *(new_o[k] for k in io.opt_state), *s_in, loss)

    flat_in = [*params.values(), *opt_state.values(), *state, *hyper.values(), *batch]
    gm = make_fx(torch.func.functionalize(flat_step, remove="mutations_and_views"),
                 tracing_mode="fake")(*flat_in)
    resolve_marks(gm)
    tag_step_io(gm, io)
    gm = apply_dls(gm, CONFIG)
    return Step(gm, params, {}, opt_state, state, hyper, batch, model, mse_loss)


def _guards(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if roles.role_of(n) == roles.GUARD]


def _run(gm: fx.GraphModule, step: Step, **override) -> list[Tensor]:
    with torch.no_grad():
        return list(gm(*step.inputs(**override)))


def test_the_kernel_gets_the_flag_and_the_guards_of_its_outputs_go() -> None:
    step = fused_adamw_step()
    gm = step.gm
    assert verify(gm)
    n_params = len(step.params)
    assert len(_guards(gm)) == 4 * n_params  # param, exp_avg, exp_avg_sq and step per param...
    before = fx.GraphModule(gm, gm.graph.__deepcopy__())  # the where form, as verified
    result = GuardFusedUpdatesPass()(gm)
    assert result.modified
    # ... of which params, exp_avg and exp_avg_sq are the kernel's: the step counts keep theirs
    assert result.stats == {"kernels": 1, "guards": 3 * n_params}
    (kernel,) = [n for n in gm.graph.nodes if n.target in FUSED_KERNELS]
    assert kernel.kwargs["found_inf"] is not None
    left = _guards(gm)
    assert len(left) == n_params and all(roles.target_of(g).endswith(".step") for g in left)
    # a normal step and an overflowing one (an infinite scale: infinite gradients): the same
    # kernel on the same inputs either way, so bit-equal to the where form
    huge = step.state._replace(loss_scale=torch.tensor(float("inf")))
    for override in ({}, {"state": huge}):
        want, got = _run(before, step, **override), _run(gm, step, **override)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), override
    # the overflow step returns every parameter and state tensor as it was
    got = run(step, gm, state=huge)
    assert got["state"].num_skipped_steps == step.state.num_skipped_steps + 1
    for role, olds in ((roles.PARAM_UPDATE, step.params), (roles.OPT_STATE_UPDATE, step.opt_state)):
        assert all(torch.equal(got[role][k], old) for k, old in olds.items()), role
    # and a normal one moves every one of them
    got = run(step, gm)
    assert got["state"].num_skipped_steps == step.state.num_skipped_steps
    for role, olds in ((roles.PARAM_UPDATE, step.params), (roles.OPT_STATE_UPDATE, step.opt_state)):
        assert not any(torch.equal(got[role][k], old) for k, old in olds.items()), role


def assert_changes_nothing(graph_pass, gm: fx.GraphModule, stats: dict[str, int]) -> None:
    """``graph_pass`` on ``gm`` reports no change, with ``stats``, and leaves its code as it was."""
    code = gm.code
    result = graph_pass(gm)
    assert not result.modified and result.stats == stats
    assert gm.code == code


def test_second_run_and_graphs_without_a_kernel_change_nothing() -> None:
    step = fused_adamw_step()
    GuardFusedUpdatesPass()(step.gm)
    assert_changes_nothing(GuardFusedUpdatesPass(), step.gm, {"kernels": 0, "guards": 0})
    plain = apply_dls(mlp_step(CONFIG).gm, CONFIG)  # per-parameter SGD: no fused kernel
    assert_changes_nothing(GuardFusedUpdatesPass(), plain, {"kernels": 0, "guards": 0})
