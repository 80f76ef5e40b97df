"""UpdateScalePass: the scaler-state outputs become ``scale_policy.update_state(state, isfinite)``."""

from __future__ import annotations

import torch.fx as fx

from dlspass import scale_policy
from dlspass.graph import roles
from dlspass.graph.splice import splice
from dlspass.passes.base import (
    FlagConsumerPass,
    PassContractError,
    global_node,
    no_check_reason,
    outputs,
    placeholder,
    set_outputs,
)


class UpdateScalePass(FlagConsumerPass):
    """Trace the policy's update rule in once, fed by the step's one overflow flag."""

    name = "update_scale"

    def rewrite(self, gm: fx.GraphModule) -> bool:
        config = self.config
        assert config is not None
        graph = gm.graph
        fields = scale_policy.STATE_FIELDS
        state = [placeholder(graph, roles.SCALER_STATE, f) for f in fields]
        isfinite = global_node(graph, roles.ISFINITE)

        def update(c, *st):
            return list(scale_policy.update_state(scale_policy.ScalerState(*st), c, config))

        new = splice(graph, update, [isfinite, *state], role=roles.SCALE_UPDATE, by_pass=self.name,
                     before=graph.output_node(),
                     output_roles=[(roles.SCALE_UPDATE, f) for f in fields])
        by_field = dict(zip(fields, new, strict=True))
        repl = {}
        for i, role, target, _ in outputs(graph):
            if role == roles.SCALER_STATE_UPDATE:
                if target not in by_field:
                    raise PassContractError(f"update_scale: output {i} names unknown state field {target!r}")
                repl[i] = by_field[target]
        set_outputs(graph, repl)
        return True

    def ensures(self, gm: fx.GraphModule) -> None:
        if no_check_reason(self.config) is not None:
            return
        for i, role, target, v in outputs(gm.graph):
            if role != roles.SCALER_STATE_UPDATE:
                continue
            # a field the policy leaves unchanged (cerebras' hysteresis) is its placeholder
            want = roles.SCALER_STATE if v.op == "placeholder" else roles.SCALE_UPDATE
            if roles.role_of(v) != want or roles.target_of(v) != target:
                raise PassContractError(f"update_scale: output {i} ({target!r}) node {v.name!r} is not "
                                        "the scale update of that state field")
