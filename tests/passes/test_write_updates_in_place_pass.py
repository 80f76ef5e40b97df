"""WriteUpdatesInPlacePass: the updates land in the input tensors themselves, equal to the functional step's."""

from __future__ import annotations

import torch
from stepgraph import mlp_step, run

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.passes.write_updates_in_place_pass import SOURCE_OF, WriteUpdatesInPlacePass


def test_updates_are_written_into_their_inputs() -> None:
    step = mlp_step(DLSConfig(mixed_precision=False))
    gm = step.gm
    functional = run(step)  # the step as traced: updates returned as new tensors
    placeholders = {(roles.role_of(n), roles.target_of(n)): i
                    for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    out_roles = roles.output_roles(gm.graph)
    written = [i for i, (r, t) in enumerate(out_roles)
               if r in SOURCE_OF and roles.output_values(gm.graph)[i].op != "placeholder"]
    assert written  # the parameters and the momentum buffers at least

    result = WriteUpdatesInPlacePass()(gm)
    assert result.modified and result.stats["moved"] == len(written)
    inputs = [t.clone() for t in step.inputs()]
    before = [t.clone() for t in inputs]
    with torch.no_grad():
        out = list(gm(*inputs))
    for i, (role, target) in enumerate(out_roles):
        want = functional[role] if role == roles.LOSS else functional[role][target]  # run() unwraps the loss
        assert torch.equal(out[i], want), (role, target)
        if i in written:
            j = placeholders[(SOURCE_OF[role], target)]
            assert out[i] is inputs[j]  # the input's own storage, updated
            assert not torch.equal(inputs[j], before[j]) or torch.equal(want, before[j])


def test_second_run_changes_nothing() -> None:
    gm = mlp_step(DLSConfig(mixed_precision=False)).gm
    WriteUpdatesInPlacePass()(gm)
    code = gm.code
    again = WriteUpdatesInPlacePass()(gm)
    assert not again.modified and again.stats["moved"] == 0
    assert gm.code == code
