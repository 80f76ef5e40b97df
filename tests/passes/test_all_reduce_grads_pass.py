"""AllReduceGradsPass on 2 real gloo ranks: the graph's gradients are the mean (or sum) of the
ranks' eager autograd gradients, and SGD steps with them on every rank alike.

The ranks run this file as a script (``gloo_launch.serve`` of ``_observations``); the test compares what they saved with the
per-rank eager gradients, reduced here with plain torch.
"""

from __future__ import annotations

import sys

import pytest
import torch
from gloo_launch import PYTEST_TIMEOUT_S, launch
from stepgraph import MLP_GRAD_SUMS, eager_grads, node_values, run, sgd_momentum, trace_step
from tolerance import reordered_sum_atol, sgd_update_atol

from dlspass.graph import roles
from dlspass.models import MLP, mse_loss

pytestmark = pytest.mark.timeout(PYTEST_TIMEOUT_S)


def _step(rank: int):
    torch.manual_seed(0)  # the same model on every rank
    model = MLP(d_in=4, d_hidden=8, d_out=3)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    return trace_step(model, mse_loss, (torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)))


def _reduced(rank: int, average: bool) -> dict:
    from dlspass.distributed import collective_nodes
    from dlspass.passes.all_reduce_grads_pass import AllReduceGradsPass

    step = _step(rank)
    gm = step.gm
    n_grads = len(roles.nodes_with_role(gm.graph, roles.GRAD))
    AllReduceGradsPass(average=average)(gm)
    grads = roles.nodes_with_role(gm.graph, roles.GRAD)
    local = [n for n in gm.graph.nodes if roles.role_of(n) == "local_grad"]
    vals = node_values(gm, step.inputs(), grads)
    return {
        "grads": {roles.target_of(n): v for n, v in zip(grads, vals, strict=True)},
        "updates": run(step)[roles.PARAM_UPDATE],
        "n_grads": n_grads, "n_local": len(local), "n_collectives": len(collective_nodes(gm)),
        # each rank-local gradient is read by the bucket only
        "local_users_in_bucket": all(roles.role_of(u) == "grad_allreduce" for n in local for u in n.users),
    }


def _observations(rank: int) -> dict:
    return {"mean": _reduced(rank, True), "sum": _reduced(rank, False)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(__file__, 2)


def _grad_atol(eager: list[dict], name: str, average: bool) -> float:
    """Each rank's traced gradient and its eager one sum MLP_GRAD_SUMS terms in other orders
    (other kernels); the all-reduce adds the two ranks' (one more term), the mean halves it."""
    magnitude = sum(float(e[name].abs().max()) for e in eager) / (2 if average else 1)
    return reordered_sum_atol(MLP_GRAD_SUMS + 1, magnitude)


def test_gradients_are_the_mean_of_the_ranks_eager_gradients(ranks: list[dict]) -> None:
    eager = [eager_grads(_step(r)) for r in range(2)]
    for r in range(2):
        got = ranks[r]["mean"]["grads"]
        assert set(got) == set(eager[0])
        for name in got:
            torch.testing.assert_close(got[name], (eager[0][name] + eager[1][name]) / 2, rtol=0,
                                       atol=_grad_atol(eager, name, average=True))
            assert torch.equal(got[name], ranks[0]["mean"]["grads"][name])  # identical on all ranks


def test_sum_mode(ranks: list[dict]) -> None:
    eager = [eager_grads(_step(r)) for r in range(2)]
    for name, v in ranks[0]["sum"]["grads"].items():
        torch.testing.assert_close(v, eager[0][name] + eager[1][name], rtol=0,
                                   atol=_grad_atol(eager, name, average=False))


def test_optimizer_steps_with_the_reduced_gradients(ranks: list[dict]) -> None:
    eager = [eager_grads(_step(r)) for r in range(2)]
    step = _step(0)
    for name, p in step.params.items():
        mean = (eager[0][name] + eager[1][name]) / 2
        lr = step.hyper["group0.lr"]
        want, _ = sgd_momentum(p, mean, step.opt_state[f"{name}.momentum_buffer"], lr)
        atol = sgd_update_atol(_grad_atol(eager, name, average=True), float(lr), float(p.abs().max()))
        for r in range(2):
            torch.testing.assert_close(ranks[r]["mean"]["updates"][name], want, rtol=0, atol=atol)


def test_one_bucket_per_dtype_and_local_grads_retagged(ranks: list[dict]) -> None:
    for r in ranks:
        res = r["mean"]
        assert res["n_collectives"] == 1  # one float32 bucket
        assert res["n_local"] == res["n_grads"] == len(res["grads"])
        assert res["local_users_in_bucket"]


if __name__ == "__main__":
    from gloo_launch import serve

    serve(sys.argv, _observations)
