"""The step graph's input and output layout, and the one function that tags a traced step with it.

Every front end (``dlspass.capture.functional.trace_step``, ``dlspass.capture.joint_step``'s
joint-program step, the pass tests) traces a flat function of

    (params, buffers, optimizer_state, scaler_state, hyperparameters, batch)

with the loss, seed and gradients marked (``mark_backward``), then calls ``tag_step_io`` so the
graph follows the contract in ``dlspass.graph.roles``. ``StepIO`` names each group once; it
splits the flat inputs inside the traced function and gives the placeholder and output roles
afterwards, so the order cannot differ between the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx as fx
from torch import Tensor

from dlspass.graph import roles
from dlspass.graph.marks import mark
from dlspass.scale_policy import STATE_FIELDS


def safe_name(name: str) -> str:
    """``name`` with every character that is not a letter or digit replaced by ``_`` (a valid
    Python identifier part, for placeholder and buffer names)."""
    return "".join(c if c.isalnum() else "_" for c in name)


class StepInputs(NamedTuple):
    """The flat inputs of one step, by group (what ``StepIO.split`` returns)."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    opt_state: dict[str, Tensor]
    scaler_state: list[Tensor]
    hyper: dict[str, Tensor]
    batch: list[Tensor]


@dataclass(frozen=True)
class StepIO:
    """Names of each input group in placeholder order; ``updated_params`` are the parameters
    the optimizer returns (all of them when None), ``batch`` names the batch tensors."""

    params: Sequence[str]
    buffers: Sequence[str]
    opt_state: Sequence[str]
    hyper: Sequence[str]
    batch: Sequence[str]
    updated_params: Sequence[str] | None = None
    scaler_state: Sequence[str] = STATE_FIELDS

    def split(self, flat: Sequence[Tensor]) -> StepInputs:
        """``flat`` (in placeholder order) as its groups; the batch is what is left."""
        it = iter(flat)
        params = {k: next(it) for k in self.params}
        buffers = {k: next(it) for k in self.buffers}
        opt_state = {k: next(it) for k in self.opt_state}
        scaler = [next(it) for _ in self.scaler_state]
        hyper = {k: next(it) for k in self.hyper}
        return StepInputs(params, buffers, opt_state, scaler, hyper, list(it))

    def placeholder_roles(self) -> list[tuple[str, str]]:
        """``(role, target)`` of each placeholder, in order."""
        return ([(roles.PARAM, k) for k in self.params] + [(roles.BUFFER, k) for k in self.buffers]
                + [(roles.OPT_STATE, k) for k in self.opt_state]
                + [(roles.SCALER_STATE, k) for k in self.scaler_state]
                + [(roles.HYPER, k) for k in self.hyper] + [(roles.INPUT, k) for k in self.batch])

    def output_roles(self) -> list[tuple[str, str | None]]:
        """``(role, target)`` of each output, in order (the loss last)."""
        updated = self.params if self.updated_params is None else self.updated_params
        return ([(roles.PARAM_UPDATE, k) for k in updated]
                + [(roles.BUFFER_UPDATE, k) for k in self.buffers]
                + [(roles.OPT_STATE_UPDATE, k) for k in self.opt_state]
                + [(roles.SCALER_STATE_UPDATE, k) for k in self.scaler_state] + [(roles.LOSS, None)])


def mark_backward(loss: Tensor) -> tuple[Tensor, Tensor]:
    """Inside the traced step: the marked loss and the marked backward seed ``ones_like(loss)``."""
    loss = mark(loss, roles.LOSS)
    return loss, mark(torch.ones_like(loss), roles.SEED)


def mark_grads(grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inside the traced step: each gradient marked GRAD with its parameter's name."""
    return {k: mark(g, roles.GRAD, k) for k, g in grads.items()}


def tag_step_io(gm: fx.GraphModule, io: StepIO, *,
                name: Callable[[str, str], str] | None = None) -> None:
    """Tag the placeholders and outputs of the traced step ``gm`` as ``io`` lays them out.

    Placeholders get their role and target (and ``name(role, target)`` as their name, when
    given); the output node records every position's role, and output values that are
    computed nodes without a role of their own get it too (a placeholder passed through
    unchanged keeps its placeholder role). Lints and recompiles ``gm``.
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, (role, target) in zip(placeholders, io.placeholder_roles(), strict=True):
        roles.set_role(node, role, target)
        if name is not None:
            node.name = node.target = name(role, target)
    out_roles = io.output_roles()
    roles.set_output_roles(gm.graph, out_roles)
    for node, (role, target) in zip(roles.output_values(gm.graph), out_roles, strict=True):
        if isinstance(node, fx.Node) and node.op != "placeholder" and roles.role_of(node) is None:
            roles.set_role(node, role, target)
    gm.graph.lint()
    gm.recompile()
