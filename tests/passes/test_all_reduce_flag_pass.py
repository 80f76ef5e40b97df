"""AllReduceFlagPass on 2 real gloo ranks: an overflow on one rank makes every rank skip the step
and back off the scale, as eager DLS does on the rank that overflowed; clean steps are each
rank's eager DLS step.

The ranks run this file as a script (``gloo_launch.serve`` of ``_observations``); the test compares what they saved with
`stepgraph.reference_step` (eager autograd + ``dlspass.scale_policy``).
"""

from __future__ import annotations

import sys

import pytest
import torch
from gloo_launch import PYTEST_TIMEOUT_S, launch
from stepgraph import MLP_GRAD_SUMS, eager_grads, node_values, reference_step, run, trace_step
from tolerance import reordered_sum_atol, sgd_update_atol

from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.models import MLP, mse_loss

pytestmark = pytest.mark.timeout(PYTEST_TIMEOUT_S)

DLS = DLSConfig(mixed_precision=False, initial_loss_scale=1024.0)


def _step(rank: int, overflow: bool, config: DLSConfig = DLS):
    torch.manual_seed(0)
    model = MLP(d_in=4, d_hidden=8, d_out=3)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    if overflow and rank == 1:
        x[2, 1] = float("inf")  # only the last rank sees it
    return trace_step(model, mse_loss, (x, y), config)


def _agreed(rank: int, overflow: bool) -> dict:
    from dlspass.distributed import DistributedContractError, collective_nodes
    from dlspass.passes import apply_dls
    from dlspass.passes.all_reduce_flag_pass import AllReduceFlagPass
    from dlspass.passes.base import global_node

    step = _step(rank, overflow)
    gm = apply_dls(step.gm, DLS)
    local = global_node(gm.graph, roles.ISFINITE)
    AllReduceFlagPass()(gm)
    agreed = global_node(gm.graph, roles.ISFINITE)
    try:
        AllReduceFlagPass()(gm)
        twice = "no error"
    except DistributedContractError as err:
        twice = str(err)
    out = run(step, gm)
    local_ok, agreed_ok = node_values(gm, step.inputs(), [local, agreed])
    return {"local_target": roles.target_of(local), "local_ok": bool(local_ok), "agreed_ok": bool(agreed_ok),
            "updates": out[roles.PARAM_UPDATE], "scale": out["state"].loss_scale,
            "n_collectives": len(collective_nodes(gm)), "twice": twice,
            # every reader of the flag but the reduction reads the agreed one
            "local_readers": sorted({roles.role_of(u) for u in local.users})}


def _no_flag(rank: int) -> dict:
    from dlspass.passes import apply_dls
    from dlspass.passes.all_reduce_flag_pass import AllReduceFlagPass

    static = DLSConfig(mixed_precision=False, loss_scale=1024.0)
    gm = apply_dls(_step(rank, False, static).gm, static)
    code = gm.code
    result = AllReduceFlagPass()(gm)
    return {"modified": result.modified, "same_code": gm.code == code}


def _observations(rank: int) -> dict:
    return {"overflow": _agreed(rank, True), "clean": _agreed(rank, False), "static": _no_flag(rank)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(__file__, 2)


def test_an_overflow_on_one_rank_skips_the_step_on_all(ranks: list[dict]) -> None:
    ref = [reference_step(_step(r, True), DLS) for r in range(2)]
    assert [bool(x["isfinite"]) for x in ref] == [True, False]
    assert [r["overflow"]["local_ok"] for r in ranks] == [True, False]
    step = _step(0, True)
    for r in ranks:
        res = r["overflow"]
        assert res["agreed_ok"] is False
        for name, p in step.params.items():
            assert torch.equal(res["updates"][name], p)  # skipped: parameters unchanged
        assert torch.equal(res["scale"], ref[1]["state"].loss_scale)  # backed off like rank 1's


def test_clean_steps_are_each_ranks_eager_step(ranks: list[dict]) -> None:
    for rank, r in enumerate(ranks):
        res = r["clean"]
        step = _step(rank, False)
        ref = reference_step(step, DLS)
        assert res["local_ok"] and res["agreed_ok"]
        grads = eager_grads(step)
        for name, v in ref[roles.PARAM_UPDATE].items():
            # the traced step's gradients and eager autograd's sum in other orders (other
            # kernels); the SGD tail may round in another order (tests/tolerance.py)
            atol = sgd_update_atol(reordered_sum_atol(MLP_GRAD_SUMS, float(grads[name].abs().max())),
                                   float(step.hyper["group0.lr"]), float(step.params[name].abs().max()))
            torch.testing.assert_close(res["updates"][name], v, rtol=0, atol=atol)
        assert torch.equal(res["scale"], ref["state"].loss_scale)


def test_one_collective_local_flag_retagged_and_twice_refused(ranks: list[dict]) -> None:
    for r in ranks:
        res = r["overflow"]
        assert res["n_collectives"] == 1 and res["local_target"] == "local"
        assert res["local_readers"] == ["flag_allreduce"]
        assert "already all-reduced" in res["twice"]


def test_static_scale_has_no_flag_to_agree_on(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["static"] == {"modified": False, "same_code": True}


if __name__ == "__main__":
    from gloo_launch import serve

    serve(sys.argv, _observations)
