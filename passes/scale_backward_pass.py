"""ScaleBackwardPass: an AOT backward graph takes the loss scale as a new last input, multiplies every floating tangent by it, returns its float32 gradients unscaled (`scale_policy.unscale`) and, as one more output, the overflow flag (`scale_policy.check_overflow`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from dlspass import scale_policy
from dlspass.config import ConfigError, DLSConfig
from dlspass.graph import roles
from dlspass.graph.roles import GLOBAL
from dlspass.graph.splice import add_input, insert_op, splice
from dlspass.passes.base import DLSPass, PassContractError, is_float

# inductor takes the backward's inputs up to the first "tangents" name as saved activations
# (static inputs); the scale changes every step, like a tangent, so its name says "tangents"
SCALE_INPUT = "dls_loss_scale_tangents"


class ScaleBackwardPass(DLSPass):
    """The loss scaling ``dlspass.make_backend`` puts into each backward graph AOTAutograd makes.

    Every tangent is scaled, not only the loss's: the backward is linear in its tangents, so
    this is the eager scaler's ``scale(loss).backward()`` also for a model that returns more
    than the loss (its other outputs' tangents are zeros) and for the backward of a graph that
    ends at a graph break (its tangents are the next graph's unscaled input gradients). The
    float32 gradients leave the graph unscaled and the flag is the scaler's own test
    (global norm for cerebras, all-finite otherwise) on them.

    Unlike ``ScaleSeedPass``/``UnscaleGradsPass`` (which read a step graph's roles and act by the
    config's scale mode), this acts on every backward graph: the backend always feeds the
    scaler's current scale (1 when scaling is off) and returns a flag, and the scaler decides
    what the flag means. It only checks; clipping stays in ``GradScaler.unscale_``, which clips
    the gradients autograd accumulated over every backward graph of the step.
    """

    name = "scale_backward"

    def __init__(self, config: DLSConfig) -> None:
        self.config = dataclasses.replace(config, max_gradient_norm=None, max_gradient_value=None)

    def rewrite(self, gm: fx.GraphModule) -> bool:
        graph = gm.graph
        placeholders = graph.find_nodes(op="placeholder")
        tangents = [n for n in placeholders if n.name.startswith("tangents") and is_float(n)]
        if not tangents:
            raise ConfigError("dlspass backend: the backward graph has no floating-point tangent to "
                              "scale (the compiled model returns no differentiable output)")
        scale = add_input(graph, SCALE_INPUT, torch.empty((), dtype=torch.float32),
                          role=roles.SCALER_STATE, target="loss_scale")

        first = next(n for n in graph.nodes if n.op != "placeholder")
        for tangent in tangents:
            scaled = insert_op(graph, torch.ops.aten.mul.Tensor, (tangent, scale), before=first,
                               role=roles.SCALED_SEED, by_pass=self.name)
            tangent.replace_all_uses_with(scaled, delete_user_cb=lambda u, s=scaled: u is not s)

        # read after the tangents moved: a gradient that is a tangent is now its scaled value
        vals = roles.output_values(graph)
        idx = [i for i, v in enumerate(vals) if is_float(v, torch.float32)]
        out = graph.output_node()
        unscaled = splice(graph, lambda s, *gs: scale_policy.unscale(gs, s),
                          [scale, *(vals[i] for i in idx)], role=roles.UNSCALE, by_pass=self.name,
                          before=out)
        config = self.config
        (isfinite,) = splice(graph, lambda *us: [scale_policy.check_overflow(us, config)[0]],
                             unscaled, role=roles.ISFINITE, by_pass=self.name, before=out,
                             output_roles=[(roles.ISFINITE, GLOBAL)])
        for i, u in zip(idx, unscaled, strict=True):
            vals[i] = u
        # one output more (the flag): a change of the output node, which splice does not make
        out.args = ((*vals, isfinite),)
        return True

    def ensures(self, gm: fx.GraphModule) -> None:
        graph = gm.graph
        vals = roles.output_values(graph)
        if not vals or roles.role_of(vals[-1]) != roles.ISFINITE:
            raise PassContractError(f"{self.name}: the last output is not the overflow flag")
        for node in graph.find_nodes(op="placeholder"):
            if node.name.startswith("tangents") and is_float(node):
                bad = [u.name for u in node.users if roles.role_of(u) != roles.SCALED_SEED]
                if bad:
                    raise PassContractError(f"{self.name}: {node.name} is still read unscaled by {bad}")
