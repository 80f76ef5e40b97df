"""dlspass.graph.step_io: one layout splits the flat inputs and tags the traced step."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.graph import roles
from dlspass.graph.marks import resolve_marks
from dlspass.graph.step_io import StepIO, mark_backward, mark_grads, safe_name, tag_step_io

IO = StepIO(params=["w", "b"], buffers=[], opt_state=["w.m"], hyper=["group0.lr"],
            batch=["batch.0"], updated_params=["w"], scaler_state=["loss_scale"])


def _step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    p, _b, o, s, h, (x,) = IO.split(flat)
    loss, seed = mark_backward(((x * p["w"]).sum() + p["b"]) ** 2)
    (g,) = mark_grads({"w": torch.autograd.grad(loss, p["w"], seed)[0]}).values()
    new_m = o["w.m"] * 0.9 + g
    return p["w"] - h["group0.lr"] * new_m, new_m, *s, loss


def test_split_follows_placeholder_order() -> None:
    flat = [torch.tensor(float(i)) for i in range(6)]
    p, b, o, s, h, batch = IO.split(flat)
    assert [*p.values(), *b.values(), *o.values(), *s, *h.values(), *batch] == flat
    assert list(p) == ["w", "b"] and list(o) == ["w.m"] and list(h) == ["group0.lr"]


def test_a_traced_step_is_tagged_and_computes_the_eager_step() -> None:
    w, b, m, scale, lr, x = (torch.randn(3), torch.randn(()), torch.randn(3), torch.tensor(2.0),
                             torch.tensor(0.1), torch.randn(3))
    w.requires_grad_()
    gm = make_fx(_step, tracing_mode="fake")(w, b, m, scale, lr, x)
    resolve_marks(gm)
    tag_step_io(gm, IO, name=lambda role, target: safe_name(f"{role}__{target}"))
    phs = gm.graph.find_nodes(op="placeholder")
    assert [(roles.role_of(n), roles.target_of(n)) for n in phs] == IO.placeholder_roles()
    assert [n.name for n in phs] == ["param__w", "param__b", "opt_state__w_m",
                                     "scaler_state__loss_scale", "hyper__group0_lr", "input__batch_0"]
    assert roles.output_roles(gm.graph) == [(roles.PARAM_UPDATE, "w"), (roles.OPT_STATE_UPDATE, "w.m"),
                                            (roles.SCALER_STATE_UPDATE, "loss_scale"), (roles.LOSS, None)]
    vals = roles.output_values(gm.graph)
    assert vals[2] is phs[3] and roles.role_of(vals[2]) == roles.SCALER_STATE  # passed through
    assert [roles.role_of(v) for v in (vals[0], vals[1], vals[3])] == [
        roles.PARAM_UPDATE, roles.OPT_STATE_UPDATE, roles.LOSS]
    assert len(roles.nodes_with_role(gm.graph, roles.SEED)) == 1
    assert [roles.target_of(n) for n in roles.nodes_with_role(gm.graph, roles.GRAD)] == ["w"]
    got = gm(w.detach(), b, m, scale, lr, x)
    want = _step(w, b, m, scale, lr, x)
    for g, e in zip(got, want, strict=True):
        # bit equality: make_fx (no decomposition) records the ops the eager step and its autograd
        # dispatch, so both sides run the same kernels in the same order
        torch.testing.assert_close(g, e.detach(), rtol=0, atol=0)
