"""ReinplaceFusedKernelPass: the in-place fused kernel writes into the step's inputs exactly what the functional kernel and its copies wrote."""

from __future__ import annotations

import torch
import torch.fx as fx
from test_guard_fused_updates_pass import assert_changes_nothing, fused_adamw_step

from dlspass.graph import roles
from dlspass.passes.guard_fused_updates_pass import GuardFusedUpdatesPass
from dlspass.passes.reinplace_fused_kernel_pass import IN_PLACE, ReinplaceFusedKernelPass
from dlspass.passes.write_updates_in_place_pass import WriteUpdatesInPlacePass


def _in_place_step():
    step = fused_adamw_step()
    GuardFusedUpdatesPass()(step.gm)
    WriteUpdatesInPlacePass()(step.gm)
    return step


def _targets(gm: fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _run(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs (cloned) and the inputs after the call, on a fresh copy of ``inputs``."""
    mine = [t.clone() for t in inputs]
    with torch.no_grad():
        out = [t.clone() for t in gm(*mine)]
    return out, mine


def test_the_kernel_runs_in_place_and_writes_what_the_copies_wrote() -> None:
    step = _in_place_step()
    gm = step.gm
    before = fx.GraphModule(gm, gm.graph.__deepcopy__())
    n_params = len(step.params)
    result = ReinplaceFusedKernelPass()(gm)
    assert result.modified
    assert result.stats == {"kernels": 1, "copies": 3 * n_params}  # param, exp_avg, exp_avg_sq
    targets = _targets(gm)
    assert [t for t in targets if t in IN_PLACE.values()] == [torch.ops.aten._fused_adamw_.tensor_lr]
    assert not set(IN_PLACE) & set(targets)
    # the outputs that were the kernel's copies are now the inputs it updated
    placeholders = set(gm.graph.find_nodes(op="placeholder"))
    outs = roles.output_values(gm.graph)
    for (role, target), v in zip(roles.output_roles(gm.graph), outs, strict=True):
        if role in (roles.PARAM_UPDATE, roles.OPT_STATE_UPDATE) and not target.endswith(".step"):
            assert v in placeholders, (role, target)
    # a normal step and an overflowing one: the same kernel on the same values, in place or
    # into new tensors then copied, so the outputs and the inputs after the call are bit-equal
    huge = step.state._replace(loss_scale=torch.tensor(float("inf")))
    for inputs in (step.inputs(), step.inputs(state=huge)):
        (want_out, want_in), (got_out, got_in) = _run(before, inputs), _run(gm, inputs)
        assert all(torch.equal(a, b) for a, b in zip(got_out, want_out, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got_in, want_in, strict=True))
    # and the normal step did update the parameters in their own storage
    _, after = _run(gm, step.inputs())
    assert not torch.equal(after[0], step.inputs()[0])


def test_a_kernel_whose_updates_are_not_all_copied_back_is_left_alone() -> None:
    # without the write-back the updates are functional outputs: an in-place kernel would
    # change the step's inputs, which that step does not do
    step = fused_adamw_step()
    GuardFusedUpdatesPass()(step.gm)
    assert_changes_nothing(ReinplaceFusedKernelPass(), step.gm, {"kernels": 0, "copies": 0})
    # and a second run on a rewritten graph finds nothing more to do
    step = _in_place_step()
    ReinplaceFusedKernelPass()(step.gm)
    assert_changes_nothing(ReinplaceFusedKernelPass(), step.gm, {"kernels": 0, "copies": 0})
