"""``dlspass.compile(..., process_group=...)``: one compiled graph = one data-parallel DLS step.

Two gloo processes on 127.0.0.1 (started once for the module, bounded time). Each rank builds
the MLP from a different seed (the first call broadcasts rank 0's parameters), runs the compiled
step (eager backend) on its half of each batch, and at iteration ``INF_ITER`` rank 1 alone gets
an inf in its batch. Checked: 0 graph breaks and one graph on every rank, one bucketed gradient
all-reduce and one flag all-reduce in the graph, every rank skips the poisoned iteration, scale
trajectories and parameters identical across ranks, and each iteration within a derived bound of
one eager single-process SGD step on the concatenated batch from the run's own state (the
poisoned iteration left out; tests/tolerance.py).
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch
from gloo_launch import PYTEST_TIMEOUT_S, gloo_group, launch, save_result
from tolerance import assert_sgd_steps, mlp_grad_sums

pytestmark = pytest.mark.timeout(PYTEST_TIMEOUT_S)

WORLD = 2
ITERS = 6
INF_ITER = 2  # 0-based; rank 1 only
INIT_SCALE = 1024.0
LR, MOMENTUM = 0.05, 0.9


# ---- worker side -------------------------------------------------------------------------------
def _batch(it: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + it)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _scenario(rank: int, world: int) -> dict:
    from torch._dynamo.utils import counters

    import dlspass
    from dlspass.distributed import collective_nodes
    from dlspass.models import MLP, mse_train_step

    torch.manual_seed(rank)  # different on purpose: the first call broadcasts rank 0's
    model = MLP()
    differs_before = not torch.equal(_flat(model), _flat(_rank0_model()))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=INIT_SCALE, steps_per_increase=2)

    train_step = mse_train_step(model, opt)

    step = dlspass.compile(train_step, optimizer=opt, scaler=scaler, mixed_precision=False,
                           backend_compiler="eager", process_group=torch.distributed.group.WORLD)
    counters.clear()
    scales, skipped, params, losses, bufs = [], [], [], [], []
    for it in range(ITERS):
        x, y = (t.chunk(world)[rank].clone() for t in _batch(it))
        if it == INF_ITER and rank == world - 1:
            x[0, 0] = float("inf")
        n0 = int(scaler.state.num_skipped_steps)
        losses.append(float(step(x, y)))
        scales.append(float(scaler.state.loss_scale))
        skipped.append(int(scaler.state.num_skipped_steps) > n0)
        params.append(_flat(model))
        bufs.append(torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) if "momentum_buffer" in opt.state[p]
                               else torch.full((p.numel(),), float("nan")) for p in model.parameters()]))
    (gm,) = step.graphs
    out = {
        "differs_before": differs_before,
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "collectives": [str(n.target) for n in collective_nodes(gm)],
        "scales": scales, "skipped": skipped, "params": torch.stack(params), "losses": losses,
        "bufs": torch.stack(bufs),  # NaN: no momentum buffer yet
        "state": {k: v.clone() for k, v in scaler.state._asdict().items()},
    }
    if rank == 0:
        out["ref"] = _reference(skip={INF_ITER})
    return out


def _rank0_model() -> torch.nn.Module:
    from dlspass.models import MLP

    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = MLP()
    torch.random.set_rng_state(state)
    return model


def _reference(skip: set[int]) -> torch.Tensor:
    """Eager fp32 SGD on the whole batch, one process, no scaler; ``skip``: iterations left out."""
    import torch.nn.functional as F

    model = _rank0_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = []
    for it in range(ITERS):
        if it not in skip:
            x, y = _batch(it)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out.append(_flat(model))
    return torch.stack(out)


def _worker(rank: int, world: int) -> dict:
    try:
        return _scenario(rank, world)
    except Exception:
        return {"error": traceback.format_exc()}


# ---- test side ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    results = launch(__file__, WORLD)
    for rank, r in enumerate(results):
        if "error" in r:
            pytest.fail(f"rank {rank}:\n{r['error']}")
    return results


def test_one_graph_without_breaks_on_every_rank(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["graph_breaks"] == 0
        assert r["unique_graphs"] == 1
        # one bucketed gradient all-reduce (all fp32 grads) and one overflow-flag all-reduce
        assert r["collectives"] == ["_c10d_functional.all_reduce.default"] * 2


def test_inf_on_one_rank_makes_every_rank_skip(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["skipped"] == [it == INF_ITER for it in range(ITERS)]
        assert torch.equal(r["params"][INF_ITER], r["params"][INF_ITER - 1])
        assert torch.isfinite(r["params"]).all()
    assert ranks[-1]["losses"][INF_ITER] != ranks[-1]["losses"][INF_ITER]  # NaN: it saw the inf
    assert ranks[0]["losses"][INF_ITER] == ranks[0]["losses"][INF_ITER]  # rank 0 did not


def test_scale_trajectories_and_state_identical(ranks: list[dict]) -> None:
    # hand-worked, cerebras policy, steps_per_increase=2 (as in test_distributed.py):
    # 1024 | 1024 | 512 (overflow on rank 1) | 512 | 512 | 1024 (3 > 2 clean steps)
    assert ranks[0]["scales"] == ranks[1]["scales"] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]
    for k, v in ranks[0]["state"].items():
        assert torch.equal(ranks[1]["state"][k], v), k


def test_params_identical_across_ranks_and_equal_single_process(ranks: list[dict]) -> None:
    # rank 1 started from other weights: the first call's broadcast made them rank 0's
    assert ranks[1]["differs_before"] and not ranks[0]["differs_before"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    ref = ranks[0]["ref"]
    assert not torch.equal(ref[0], ref[-1])  # it did train
    _assert_steps_match_single_process(ranks[0])


def _assert_steps_match_single_process(r: dict) -> None:
    """Each iteration against one eager single-process SGD step on the whole batch from the
    run's own parameters and momentum buffers: the two halves' gradients, averaged over the
    ranks (one more term), against the whole batch's (tests/tolerance.py)."""
    import torch.nn.functional as F

    assert_sgd_steps(_rank0_model(), lambda m, b: F.mse_loss(m(b[0]), b[1]), [_batch(it) for it in range(ITERS)],
                     r["params"], r["bufs"], [not s for s in r["skipped"]], LR, MOMENTUM,
                     mlp_grad_sums([8, 16, 16, 4], batch=8) + 1)


def test_process_group_without_distributed_is_a_clear_error() -> None:
    import dlspass
    from dlspass.config import ConfigError
    from dlspass.models import MLP

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="torch.distributed is not initialised"):
        dlspass.compile(lambda: None, optimizer=opt, process_group=True, backend_compiler="eager")


if __name__ == "__main__":
    with gloo_group(sys.argv) as (rank, world, outdir):
        save_result(_worker(rank, world), outdir, rank)
