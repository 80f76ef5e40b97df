"""The eager scalers on 2-D device meshes: FSDP + tensor parallelism and HSDP, 4 gloo ranks.

One 4-process run (module-scoped fixture) on a 2x2 mesh trains the MLP with three scalers in the
same code: ``torch.amp.GradScaler``, ``dlspass.TorchGradScaler`` and ``dlspass.GradScaler``
(policy "torch", the same scale rule). At iteration 2 an inf is written into ONE rank's local
gradient shard (or its batch), at iteration 4 into a gradient that is replicated over the
tensor-parallel dimension, on one rank only. Checked: every rank skips exactly the poisoned
iterations, scales follow torch's rule, the ranks hold identical parameters, which equal
torch.amp's bit for bit where torch agrees over the mesh, and follow a single-process run on the
concatenated batch that leaves the poisoned iterations out (each iteration within a derived
bound of one single-process step from the run's own state; tests/tolerance.py). Also: the
global clip norm over shards on both mesh dimensions against the single-process norm, the
layouts that stay refused, and ``dlspass.compile``, ``capture_step`` and
``capture_step_distributed`` refusing FSDP2 and FSDP + TP parameters in one line.
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch
from gloo_launch import launch, serve
from tolerance import assert_sgd_steps, mlp_grad_sums

pytestmark = pytest.mark.timeout(420)

WORLD = 4
WORKER_TIMEOUT_S = 360
ITERS = 6
INIT_SCALE = 1024.0
GROWTH_INTERVAL = 2
LR, MOMENTUM = 0.05, 0.9
MAX_NORM = 0.05
SKIPPED = (2, 4)  # 1-based iterations with an injected inf
# torch's rule, growth_interval 2: x0.5 per overflow, x2 after 2 clean steps in a row
EXPECTED_SCALES = [1024.0, 512.0, 512.0, 256.0, 256.0, 512.0]
SCALERS = ("torch.amp", "TorchGradScaler", "GradScaler")


# ---- worker side -------------------------------------------------------------------------------
def _batch(it: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + it)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _full(model: torch.nn.Module) -> torch.Tensor:
    """The whole parameters, flattened (a collective on every DTensor)."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _full_bufs(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """The whole momentum buffers, flattened in the parameters' order (NaN before the first)."""
    out = []
    for p in model.parameters():
        buf = opt.state.get(p, {}).get("momentum_buffer")
        out.append(torch.full((p.numel(),), float("nan")) if buf is None
                   else buf.full_tensor().detach().reshape(-1))
    return torch.cat(out)


def _local(model: torch.nn.Module) -> torch.Tensor:
    """This rank's pieces of the parameters, flattened (a copy)."""
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]).clone()


def _build(layout: str) -> tuple[torch.nn.Module, object, int, int]:
    """``(model, mesh, batch shard index, number of batch shards)`` for one layout.

    fsdp_tp: fc1 column-, fc2 row-parallel on "tp", fc3 left out of the plan (it lives on the
    "dp" sub-mesh, replicated over tp); then fully_shard on "dp". fsdp_tp_rep_first: the plan
    moved one layer on, so the FIRST gradient (fc1) is the one replicated over tp. hsdp:
    fully_shard on the whole (replicate x shard) mesh.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dlspass.models import MLP

    torch.manual_seed(0)
    model = MLP()
    rank = torch.distributed.get_rank()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        return model, mesh, rank, WORLD
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = ({"fc1": ColwiseParallel(), "fc2": RowwiseParallel()} if layout == "fsdp_tp"
            else {"fc2": ColwiseParallel(), "fc3": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh, mesh["dp"].get_local_rank(), 2


def _make_scaler(kind: str, mesh: object, **kw: object) -> object:
    import dlspass

    if kind == "torch.amp":
        return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    if kind == "TorchGradScaler":  # the mesh itself as the (explicit) group
        return dlspass.TorchGradScaler("cpu", init_scale=INIT_SCALE,
                                       growth_interval=GROWTH_INTERVAL, process_group=mesh)
    return dlspass.GradScaler(init_scale=INIT_SCALE, steps_per_increase=GROWTH_INTERVAL,
                              policy="torch", **kw)


# which rank gets the inf, and where: (iteration, rank, parameter or "loss")
INJECT = {
    # fc2.weight is sharded over both dims; fc3 (dp sub-mesh) is replicated over tp
    "fsdp_tp": [(2, 3, "fc2.weight"), (4, 1, "fc3.weight")],
    # fc1 (first gradient) is replicated over tp: torch.amp reduces found_inf over dp only
    "fsdp_tp_rep_first": [(2, 3, "fc2.weight"), (4, 1, "fc1.weight")],
    # the loss of one rank: FSDP's reduction carries the inf to every rank's shard
    "hsdp_loss": [(2, 2, "loss"), (4, 1, "loss")],
    # one rank's local shard after the reduction (its replica over "replicate" stays finite)
    "hsdp_shard": [(2, 2, "fc2.weight"), (4, 1, "fc3.bias")],
}


def _train(layout: str, kind: str) -> dict:
    model, mesh, shard, n_shards = _build("hsdp" if layout.startswith("hsdp") else layout)
    rank = torch.distributed.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = _make_scaler(kind, mesh)
    scales, stepped, params, bufs = [], [], [], []
    where = {it: what for it, r, what in INJECT[layout] if r == rank}
    for it in range(1, ITERS + 1):
        x, y = (t.chunk(n_shards)[shard].clone() for t in _batch(it))
        if where.get(it) == "loss":
            x[0, 0] = float("inf")
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if it in where and where[it] != "loss":
            model.get_parameter(where[it]).grad.to_local().view(-1)[0] = float("inf")
        before = _local(model)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(float(scaler.get_scale()))
        params.append(_full(model))
        bufs.append(_full_bufs(model, opt))
        stepped.append(not torch.equal(before, _local(model)))  # this rank's own pieces
    return {"scales": scales, "stepped": stepped, "params": torch.stack(params), "bufs": torch.stack(bufs)}


def _clip(layout: str) -> dict:
    """GradScaler(max_gradient_norm) over the mesh; and the agreed norm of plain gradients."""
    from dlspass import GradScaler, distributed
    from dlspass.config import DLSConfig

    model, mesh, shard, n_shards = _build(layout)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # the agreed global norm of the first step's (unscaled) gradients
    x, y = (t.chunk(n_shards)[shard] for t in _batch(100))
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    group = distributed.resolve_group()
    weights = distributed.grad_weights(grads, group)
    _, norm = distributed.check_overflow_distributed(
        [g.to_local() for g in grads], weights, DLSConfig(loss_scale=None, max_gradient_norm=1.0),
        group)
    opt.zero_grad(set_to_none=True)
    scaler = GradScaler(init_scale=INIT_SCALE, max_gradient_norm=MAX_NORM)
    steps = []
    for it in range(3):
        x, y = (t.chunk(n_shards)[shard] for t in _batch(100 + it))
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        steps.append(_full(model))
    return {"norm": float(norm), "weights": weights, "params": _full(model), "steps": torch.stack(steps)}


def _refusals() -> dict:
    """The layouts that stay refused, with their one-line messages."""
    import dlspass
    from dlspass import distributed
    from dlspass.models import mse_train_step

    out: dict = {}
    model, mesh, shard, n_shards = _build("fsdp_tp")
    x, y = (t.chunk(n_shards)[shard] for t in _batch(0))
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # a group that leaves the tp shards out (every rank raises before any collective)
    scaler = dlspass.GradScaler(process_group=mesh["dp"])
    try:
        scaler.unscale_(opt)
    except distributed.UnsupportedLayoutError as e:
        out["dp_only_group"] = str(e)
    from torch.distributed.tensor import DTensor, Partial

    pending = DTensor.from_local(torch.ones(2), mesh["tp"], [Partial()])
    try:
        distributed.grad_weights([pending], distributed.resolve_group())
    except distributed.GradientLayoutError as e:
        out["partial"] = str(e)
    # the step front ends on FSDP2 (1-D) and FSDP + TP parameters: refused at the first call,
    # with and without the parameter broadcast (capture_step without a group too)
    from torch.distributed.fsdp import fully_shard

    from dlspass.config import DLSConfig
    from dlspass.models import MLP, mse_loss

    world = torch.distributed.group.WORLD
    cfg = DLSConfig(mixed_precision=False)
    for layout in ("fsdp", "fsdp_tp"):
        if layout == "fsdp":
            net = MLP()
            fully_shard(net)
        else:
            net = _build("fsdp_tp")[0]
        # one model for every front end: each refuses before it touches the model
        sgd = torch.optim.SGD(net.parameters(), lr=LR)
        for broadcast in (True, False):
            for entry in ("compile", "capture_step_distributed", "capture_step"):
                try:
                    if entry == "compile":
                        step = dlspass.compile(mse_train_step(net, sgd), optimizer=sgd,
                                               mixed_precision=False, backend_compiler="eager",
                                               broadcast_params=broadcast, process_group=world)
                        step(x, y)
                    elif entry == "capture_step_distributed":
                        dlspass.capture_step_distributed(net, mse_loss, sgd, (x, y), cfg,
                                                         broadcast_params=broadcast)
                    else:  # no group: a step graph takes no DTensor parameters at all
                        dlspass.capture_step(net, mse_loss, sgd, (x, y), cfg)
                    got = ("ran", "")
                except Exception as e:  # the test checks the type and the message
                    got = (type(e).__name__, str(e))
                out[(entry, layout, broadcast)] = got
    return out


def compute(rank: int) -> dict:
    results: dict = {}
    jobs: list[tuple[str, object]] = [((layout, kind), (lambda la=layout, k=kind: _train(la, k)))
                                      for layout in INJECT for kind in SCALERS]
    jobs += [(("clip", layout), (lambda la=layout: _clip(la))) for layout in ("fsdp_tp", "hsdp")]
    jobs.append(("refusals", _refusals))
    for key, fn in jobs:
        try:
            results[key] = fn()
        except Exception:
            results[key] = {"error": traceback.format_exc()}
    return results


# ---- test side ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(__file__, WORLD, WORKER_TIMEOUT_S)


def _get(ranks: list[dict], key: object) -> list[dict]:
    out = [r[key] for r in ranks]
    for rank, r in enumerate(out):
        if "error" in r:
            pytest.fail(f"rank {rank}, {key}:\n{r['error']}")
    return out


MESH_SUMS = mlp_grad_sums([8, 16, 16, 4], batch=8) + 2


def _start() -> torch.nn.Module:
    from dlspass.models import MLP

    torch.manual_seed(0)
    return MLP()


def _mse(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("layout", list(INJECT))
@pytest.mark.parametrize("kind", ["TorchGradScaler", "GradScaler"])
def test_every_rank_skips_the_poisoned_iterations_and_matches_one_process(
        ranks: list[dict], layout: str, kind: str) -> None:
    runs = _get(ranks, (layout, kind))
    for r in runs:
        assert r["stepped"] == [it not in SKIPPED for it in range(1, ITERS + 1)]
        assert r["scales"] == EXPECTED_SCALES
        assert torch.equal(r["params"], runs[0]["params"])  # all ranks identical
    # each iteration against one single-process step from the run's own state: the shards'
    # and replicas' gradients add the whole batch's terms in other orders (the MLP's chain of
    # sums, plus the averages over the two mesh dimensions; tests/tolerance.py)
    assert_sgd_steps(_start(), _mse, [_batch(it) for it in range(1, ITERS + 1)], runs[0]["params"],
                     runs[0]["bufs"], [it not in SKIPPED for it in range(1, ITERS + 1)], LR, MOMENTUM, MESH_SUMS)


@pytest.mark.parametrize("layout", ["fsdp_tp", "hsdp_loss"])
@pytest.mark.parametrize("kind", ["TorchGradScaler", "GradScaler"])
def test_bit_identical_to_torch_amp_where_torch_agrees(ranks: list[dict], layout: str,
                                                        kind: str) -> None:
    ours, amp = _get(ranks, (layout, kind)), _get(ranks, (layout, "torch.amp"))
    for rank, (r, a) in enumerate(zip(ours, amp, strict=True)):
        assert r["stepped"] == a["stepped"], rank
        assert r["scales"] == a["scales"], rank
        assert torch.equal(r["params"], a["params"]), rank


def test_torch_amp_agrees_only_over_the_first_gradients_mesh(ranks: list[dict]) -> None:
    """What docs/DISTRIBUTED.md says of torch 2.13's torch.amp.GradScaler: its found_inf is
    reduced over the mesh dimensions where the FIRST gradient of a foreach group is not
    replicated, so an inf in another gradient's shard reaches only some ranks (here fc1, the
    first, lives on the dp mesh only; HSDP's Replicate dimension is never reduced): some ranks
    skip and back off, the others step (and write the inf into their weights)."""
    for layout in ("fsdp_tp_rep_first", "hsdp_shard"):
        runs = _get(ranks, (layout, "torch.amp"))
        assert len({tuple(r["stepped"]) for r in runs}) > 1, layout
        assert len({tuple(r["scales"]) for r in runs}) > 1, layout


@pytest.mark.parametrize("layout", ["fsdp_tp", "hsdp"])
def test_clip_norm_over_both_mesh_dimensions(ranks: list[dict], layout: str) -> None:
    from dlspass.models import MLP

    runs = _get(ranks, ("clip", layout))
    torch.manual_seed(0)
    model = MLP()
    torch.nn.functional.mse_loss(model(_batch(100)[0]), _batch(100)[1]).backward()
    ref_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert ref_norm > MAX_NORM  # clipping bites: a norm off by a replica factor would show
    for r in runs:
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert torch.equal(r["params"], runs[0]["params"])
    # shards on both dims weigh 1; replicas over one 2-wide dimension 1/2 (fc2.bias under TP,
    # fc3 on the dp sub-mesh; every HSDP gradient)
    expected = [1, 1, 1, 0.5, 0.5, 0.5] if layout == "fsdp_tp" else [0.5] * 6
    assert runs[0]["weights"] == expected
    # each step against one single-process clipped step from the run's own parameters
    assert_sgd_steps(_start(), _mse, [_batch(100 + it) for it in range(3)], runs[0]["steps"], None,
                     [True] * 3, LR, 0.0, MESH_SUMS, max_norm=MAX_NORM)
    assert torch.equal(runs[0]["steps"][-1], runs[0]["params"])


def test_what_stays_refused_is_named(ranks: list[dict]) -> None:
    for r in _get(ranks, "refusals"):
        assert "sharded over device-mesh dimension 'tp'" in r["dp_only_group"]
        assert "Partial placement" in r["partial"]
        refused = {k: v for k, v in r.items() if isinstance(k, tuple)}
        assert len(refused) == 12  # 3 front ends x 2 layouts x broadcast or not
        messages = set()
        for (entry, layout, broadcast), (name, msg) in refused.items():
            assert name == "UnsupportedParallelismError", (entry, layout, broadcast, msg)
            assert "\n" not in msg
            assert "FSDP2" in msg and "dlspass.GradScaler" in msg and "process_group" in msg
            prefix = "dlspass.compile" if entry == "compile" else "capture_step"
            assert msg.startswith(prefix + ": "), msg
            messages.add(msg.removeprefix(prefix + ": "))
        assert len(messages) == 1  # one check, one message, whichever front end


if __name__ == "__main__":
    serve(sys.argv, compute)
