"""CloneSharedOutputsPass: every output position gets a node of its own, holding the same value."""

from __future__ import annotations

import torch
from stepgraph import mlp_step

from dlspass.graph import roles
from dlspass.passes.clone_shared_outputs_pass import CloneSharedOutputsPass
from dlspass.scale_policy import STATE_FIELDS


def test_placeholders_and_repeated_values_are_cloned_with_their_roles() -> None:
    step = mlp_step()  # no DLS: the scaler-state outputs are their placeholders
    gm = step.gm
    graph = gm.graph
    vals, out_roles = roles.output_values(graph), roles.output_roles(graph)
    # the loss returned a second time, as a graph whose two outputs are one value would
    graph.output_node().args = ((*vals, vals[-1]),)
    roles.set_output_roles(graph, [*out_roles, (roles.LOSS, None)])
    gm.recompile()
    with torch.no_grad():
        before = gm(*step.inputs())
    shared = [i for i, v in enumerate(roles.output_values(graph))
              if v.op == "placeholder" or v in roles.output_values(graph)[:i]]
    assert len(shared) == len(STATE_FIELDS) + 1  # the scaler state, the second loss

    assert CloneSharedOutputsPass()(gm).modified
    vals = roles.output_values(graph)
    assert len(set(vals)) == len(vals) and not any(v.op == "placeholder" for v in vals)
    for i in shared:
        assert vals[i].target is torch.ops.aten.clone.default
        assert (roles.role_of(vals[i]), roles.target_of(vals[i])) == roles.output_roles(graph)[i]
    with torch.no_grad():
        after = gm(*step.inputs())
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)
    assert not CloneSharedOutputsPass()(gm).modified
