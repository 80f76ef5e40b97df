"""A captured training step (model + SGD with momentum) for the pass tests, laid out by
``dlspass.graph.step_io`` exactly as ``dlspass.capture`` lays out its steps.

The optimizer is the plain ``sgd_momentum`` below rather than torch.optim's functional twin
(which adds a ``momentum_initialized`` flag per parameter): ``reference_step`` recomputes the
same update eagerly, so the pass tests compare the rewritten graph with an independent oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.graph.marks import resolve_marks
from dlspass.graph.step_io import StepIO, mark_backward, mark_grads, tag_step_io
from dlspass.models import MLP, SmallCNN, TinyGPT, ce_loss, gpt_loss, mse_loss
from dlspass.scale_policy import STATE_FIELDS, ScalerState, init_state


@dataclass
class Step:
    """The graph and the real inputs it was traced for (in placeholder order)."""

    gm: fx.GraphModule
    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    opt_state: dict[str, Tensor]
    state: ScalerState
    hyper: dict[str, Tensor]
    batch: list[Tensor]
    model: nn.Module | None = None
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None

    def inputs(self, **override: Any) -> list[Tensor]:
        """Flat inputs; ``override`` replaces a group (params=, state=, batch=, ...)."""
        g = {"params": self.params, "buffers": self.buffers, "opt_state": self.opt_state,
             "state": self.state, "hyper": self.hyper, "batch": self.batch, **override}
        return [*g["params"].values(), *g["buffers"].values(), *g["opt_state"].values(),
                *g["state"], *g["hyper"].values(), *g["batch"]]


def sgd_momentum(p: Tensor, g: Tensor, buf: Tensor, lr: Tensor, momentum: float = 0.9
                 ) -> tuple[Tensor, Tensor]:
    """torch.optim.SGD's momentum update (dampening 0), functional."""
    new_buf = buf * momentum + g
    return p - lr * new_buf, new_buf


def trace_step(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor],
               batch: tuple[Tensor, ...], config: DLSConfig | None = None,
               lr: float = 0.1) -> Step:
    """The un-rewritten, role-tagged step graph of ``model`` trained by SGD with momentum."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    opt_state = {f"{k}.momentum_buffer": torch.zeros_like(v) for k, v in params.items()}
    hyper = {"group0.lr": torch.tensor(lr)}
    state = init_state(config or DLSConfig(loss_scale=None))
    io = StepIO(params=list(params), buffers=list(buffers), opt_state=list(opt_state),
                hyper=list(hyper), batch=[f"batch.{i}" for i in range(len(batch))])

    def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
        p_in, b_in, o_in, s_in, h_in, xs = io.split(flat)

        def forward(p: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
            b = {k: v.clone() for k, v in b_in.items()}
            loss = loss_fn(_Bound(model, {**p, **b}), tuple(xs))
            return loss, b

        loss, vjp_fn, new_b = torch.func.vjp(forward, p_in, has_aux=True)
        loss, seed = mark_backward(loss)
        (grads,) = vjp_fn(seed)
        grads = mark_grads(grads)
        new_p, new_o = {}, {}
        for k in io.params:
            new_p[k], new_o[f"{k}.momentum_buffer"] = sgd_momentum(
                p_in[k], grads[k], o_in[f"{k}.momentum_buffer"], h_in["group0.lr"])
        return (*new_p.values(), *new_b.values(), *new_o.values(), *s_in, loss)

    flat_in = [*params.values(), *buffers.values(), *opt_state.values(), *state,
               *hyper.values(), *batch]
    gm = make_fx(torch.func.functionalize(flat_step, remove="mutations_and_views"),
                 tracing_mode="fake")(*flat_in)
    resolve_marks(gm)
    tag_step_io(gm, io)
    return Step(gm, params, buffers, opt_state, state, hyper, list(batch), model, loss_fn)


class _Bound(nn.Module):
    """``model`` called with the given parameters and buffers (torch.func.functional_call)."""

    def __init__(self, model: nn.Module, tensors: dict[str, Tensor]) -> None:
        super().__init__()
        self._m = [model]
        self._t = tensors

    def forward(self, *args: Any) -> Tensor:
        return torch.func.functional_call(self._m[0], self._t, args)


def run(step: Step, gm: fx.GraphModule | None = None, **override: Any) -> dict[str, Any]:
    """Run the (rewritten) graph on the step's inputs; outputs grouped by role."""
    gm = gm or step.gm
    with torch.no_grad():
        out = list(gm(*step.inputs(**override)))
    grouped: dict[str, Any] = {r: {} for r in roles.OUTPUT_ROLES}
    for (role, target), v in zip(roles.output_roles(gm.graph), out, strict=True):
        grouped[role][target] = v
    grouped["loss"] = grouped[roles.LOSS][None]
    grouped["state"] = ScalerState(*[grouped[roles.SCALER_STATE_UPDATE][f] for f in STATE_FIELDS])
    return grouped


def reference_step(step: Step, config: DLSConfig, **override: Any) -> dict[str, Any]:
    """The same step in eager fp32 with ``dlspass.scale_policy`` math (the pipeline's oracle)."""
    from dlspass import scale_policy

    g = {"params": step.params, "buffers": step.buffers, "opt_state": step.opt_state,
         "state": step.state, "hyper": step.hyper, "batch": step.batch, **override}
    state: ScalerState = g["state"]
    model, loss_fn = step.model, step.loss_fn
    assert model is not None and loss_fn is not None
    p = {k: v.clone().requires_grad_() for k, v in g["params"].items()}
    b = {k: v.clone() for k, v in g["buffers"].items()}
    loss = loss_fn(_Bound(model, {**p, **b}), tuple(g["batch"]))
    scale = state.loss_scale if config.enabled else torch.ones(())
    raw = torch.autograd.grad(loss, list(p.values()), grad_outputs=torch.ones_like(loss) * scale)
    use, isfinite, _ = scale_policy.dls_tail(list(raw), state.loss_scale, config)
    lr = g["hyper"]["group0.lr"]
    new_p, new_o = {}, {}
    with torch.no_grad():
        for (k, v), gr in zip(p.items(), use, strict=True):
            key = f"{k}.momentum_buffer"
            np_, nb = sgd_momentum(v.detach(), gr, g["opt_state"][key], lr)
            new_p[k] = torch.where(isfinite, np_, v.detach())
            new_o[key] = torch.where(isfinite, nb, g["opt_state"][key])
    return {roles.PARAM_UPDATE: new_p, roles.OPT_STATE_UPDATE: new_o, roles.BUFFER_UPDATE: b,
            "loss": loss.detach(), "state": scale_policy.update_state(state, isfinite, config),
            "isfinite": isfinite}


# The longest chain of sums behind one of the MLP's parameter gradients (fc1.weight's): back
# through fc3 (3 outputs), fc2 (8), then over the batch (5); MSE's backward is elementwise. Two
# computations of those gradients by other kernels differ by what summing this many terms in
# another order allows (tests/tolerance.py).
MLP_GRAD_SUMS = 3 + 8 + 5


def mlp_step(config: DLSConfig | None = None, seed: int = 0) -> Step:
    """MLP(4, 8, 3) + MSE, batch of 5."""
    torch.manual_seed(seed)
    model = MLP(d_in=4, d_hidden=8, d_out=3)
    return trace_step(model, mse_loss, (torch.randn(5, 4), torch.randn(5, 3)), config)


def cnn_step(config: DLSConfig | None = None) -> Step:
    """SmallCNN (conv + BatchNorm) + cross-entropy, batch of 2 4x4 images."""
    torch.manual_seed(0)
    model = SmallCNN(in_ch=1, n_classes=3, width=2)
    return trace_step(model, ce_loss, (torch.randn(2, 1, 4, 4), torch.tensor([0, 2])), config)


def gpt_step(config: DLSConfig | None = None, n_layer: int = 1, d: int = 8) -> Step:
    """TinyGPT (bmm attention) + next-token loss, batch of 2 sequences of 4."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=8, d=d, n_layer=n_layer, n_head=2, block_size=4)
    idx = torch.randint(0, 8, (2, 4))
    return trace_step(model, gpt_loss, (idx, torch.roll(idx, 1, 1)), config)


def node_values(gm: fx.GraphModule, inputs: list[Tensor], nodes: list[fx.Node]) -> list[Any]:
    """The values ``nodes`` take when ``gm`` runs on ``inputs`` (for checking inner nodes)."""
    wanted = set(nodes)
    seen: dict[fx.Node, Any] = {}

    class _Rec(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            v = super().run_node(n)
            if n in wanted:
                seen[n] = v
            return v

    with torch.no_grad():
        _Rec(gm).run(*inputs)
    return [seen[n] for n in nodes]


def eager_grads(step: Step, **override: Any) -> dict[str, Tensor]:
    """fp32 gradients of the loss by plain autograd (no scaling)."""
    model, loss_fn = step.model, step.loss_fn
    assert model is not None and loss_fn is not None
    params = override.get("params", step.params)
    batch = override.get("batch", step.batch)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    b = {k: v.clone() for k, v in step.buffers.items()}
    loss = loss_fn(_Bound(model, {**p, **b}), tuple(batch))
    return dict(zip(p, torch.autograd.grad(loss, list(p.values())), strict=True))


class _LinearMSE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return torch.nn.functional.mse_loss(self.fc(x), y)


def linear_joint() -> tuple[nn.Module, tuple[Tensor, Tensor], torch.export.ExportedProgram]:
    """A Linear + MSE model, its batch and its joint forward-backward program (torch.export):
    placeholders ``fc.weight``, ``fc.bias``, ``x``, ``y``; outputs loss and the two gradients."""
    from dlspass.capture.export import joint_with_ties

    torch.manual_seed(0)
    model, batch = _LinearMSE(), (torch.randn(4, 3), torch.randn(4, 2))
    return model, batch, joint_with_ties(torch.export.export(model, batch), "linear_mse")[0]


def eager_model_grads(model: nn.Module, batch: tuple[Tensor, ...], seed: float = 1.0
                      ) -> tuple[Tensor, list[Tensor]]:
    """The loss of ``model(*batch)`` and its parameter gradients by autograd, seeded with ``seed``."""
    params = list(model.parameters())
    loss = model(*batch)
    return loss.detach(), list(torch.autograd.grad(loss, params, torch.full_like(loss, seed)))
