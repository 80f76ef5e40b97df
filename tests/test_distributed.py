"""DLS under DDP and FSDP2: real gloo process groups on loopback, 2 and 4 processes.

Each world size is started once (module-scoped fixture): every rank runs all scenarios of
`_worker` and saves its observations; the tests compare ranks with each other and with
single-process references (eager fp32 on the concatenated batch, torch's own clipping and
optimizers, the worked trace of docs/SEMANTICS.md §1.4).
"""

from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
from gloo_launch import PYTEST_TIMEOUT_S, gloo_group, launch, save_result
from tolerance import assert_within

pytestmark = pytest.mark.timeout(PYTEST_TIMEOUT_S)

INIT_SCALE = 1024.0
# cerebras policy, steps_per_increase=2, tolerance 0: overflows at iterations 2 and 4 of 7.
# Hand-worked: 1024 | 512 (overflow) | 512 | 256 (overflow) | 256 | 256 | 512 (3 > 2 clean)
EXPECTED_SCALES = [1024.0, 512.0, 512.0, 256.0, 256.0, 256.0, 512.0]
# the 4-process run uses the torch preset (all-finite check, the not-finite count is reduced):
# x0.5 per overflow, x2 once 2 consecutive clean steps reach the interval (iteration 6)
EXPECTED_SCALES_TORCH = [1024.0, 512.0, 512.0, 256.0, 256.0, 512.0, 512.0]
OVERFLOW_ITERS = (2, 4)
DDP_MAX_NORM = 0.3


# ---- worker side -------------------------------------------------------------------------------
def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _shard(batch: tuple, rank: int, world: int) -> tuple:
    return tuple(t.chunk(world)[rank] for t in batch)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1)
                      for p in model.parameters()])


def _scenario_ddp_inf(rank: int, world: int) -> dict:
    """DDP + eager scaler; an inf on the last rank only (loss at 2, a local grad at 4)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dlspass.models import MLP, mse_loss
    from dlspass.scaler import GradScaler

    torch.manual_seed(0)
    model = DDP(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    policy = "cerebras" if world == 2 else "torch"
    scaler = GradScaler(init_scale=INIT_SCALE, steps_per_increase=2, policy=policy)
    scales, params, local_ok = [], [], []
    for it in range(1, len(EXPECTED_SCALES) + 1):
        batch = _shard(_batch(it), rank, world)
        loss = mse_loss(model, batch)
        if it == OVERFLOW_ITERS[0] and rank == world - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if it == OVERFLOW_ITERS[1] and rank == world - 1:
            # after DDP's reduction: only this rank sees it
            model.module.fc2.weight.grad[0, 0] = float("inf")
        local_ok.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(float(scaler.get_scale()))
        params.append(_flat(model))
    return {"scales": scales, "params": torch.stack(params), "local_ok": local_ok,
            "skipped": int(scaler.get_num_skipped_steps()), "state": scaler.state_dict(),
            "scaler": scaler}


def _sync_and_bound(model: torch.nn.Module, ref: torch.nn.Module, full: tuple, lr: float,
                    max_norm: float | None = None) -> torch.Tensor:
    """Copy the data-parallel run's parameters into ``ref`` and return, per element, how far
    one SGD step of the run (the two halves' gradients averaged over the ranks, optionally
    norm-clipped) can land from ``ref``'s single-process step on the whole batch ``full``: the
    gradients add the same terms in other orders (the MLP's forward and backward chain of sums
    over the batch, plus the average's division), carried through the clip and the update
    (tests/tolerance.py). A run's differences would grow with the steps; one step's are bounded."""
    import copy

    from tolerance import (
        clip_norm_atols,
        grad_term_sums,
        mlp_grad_sums,
        reordered_sum_atol,
        sgd_update_atol,
    )

    from dlspass.models import mse_loss

    torch.nn.utils.vector_to_parameters(_flat(model), ref.parameters())
    cp = copy.deepcopy(ref)
    grads = dict(zip([k for k, _ in cp.named_parameters()],
                     torch.autograd.grad(mse_loss(cp, full), list(cp.parameters())), strict=True))
    terms = grad_term_sums(ref, lambda m: mse_loss(m, full))
    atol = {k: reordered_sum_atol(mlp_grad_sums([8, 16, 16, 4], batch=len(full[0])) + 1, t) for k, t in terms.items()}
    if max_norm is not None:
        atol = clip_norm_atols(grads, atol, max_norm)[0]
    return torch.cat([torch.full((p.numel(),), sgd_update_atol(atol[k], lr, float(p.detach().abs().max())))
                      for k, p in ref.named_parameters()])


def _scenario_ddp_equiv(rank: int, world: int) -> dict:
    """DDP + eager scaler + clipping vs one process on the concatenated batch (fp32 SGD).

    The clipping norm must be the norm of the (replicated) averaged gradient, not summed over
    ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dlspass.models import MLP, mse_loss
    from dlspass.scaler import GradScaler

    torch.manual_seed(1)
    ref = MLP()
    torch.manual_seed(1)
    model = DDP(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=INIT_SCALE, max_gradient_norm=DDP_MAX_NORM)
    ref_norms, steps = [], []
    for it in range(3):
        full = _batch(100 + it)
        atol = _sync_and_bound(model.module, ref, full, 0.1, DDP_MAX_NORM)
        scaler.scale(mse_loss(model, _shard(full, rank, world))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        mse_loss(ref, full).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), DDP_MAX_NORM)))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        steps.append((_flat(model), _flat(ref), atol))
    return {"params": _flat(model), "ref": _flat(ref), "scale": float(scaler.get_scale()),
            "ref_norms": ref_norms, "steps": steps}


def _sync_adam_and_bound(model: torch.nn.Module, opt: torch.optim.Optimizer, ref: torch.nn.Module,
                         ref_opt: torch.optim.Optimizer, full: tuple, max_norm: float) -> tuple[dict, dict]:
    """Copy the sharded run's parameters and Adam state into ``ref``/``ref_opt``; return the
    per-parameter bound on the clipped gradients' difference (the halves averaged against the
    whole batch: the MLP's chain of sums plus the average, carried through the clip) and the
    clipped eager gradients at that start (tests/tolerance.py)."""
    import copy

    from tolerance import clip_norm_atols, grad_term_sums, mlp_grad_sums, reordered_sum_atol

    from dlspass.models import mse_loss

    torch.nn.utils.vector_to_parameters(_flat(model), ref.parameters())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        if p in opt.state:
            ref_opt.state[q] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                                for k, v in opt.state[p].items()}
    cp = copy.deepcopy(ref)
    grads = dict(zip([k for k, _ in cp.named_parameters()],
                     torch.autograd.grad(mse_loss(cp, full), list(cp.parameters())), strict=True))
    terms = grad_term_sums(ref, lambda m: mse_loss(m, full))
    atol = {k: reordered_sum_atol(mlp_grad_sums([8, 16, 16, 4], batch=len(full[0])) + 1, t) for k, t in terms.items()}
    clip_atol = clip_norm_atols(grads, atol, max_norm)[0]
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    coef = min(1.0, max_norm / (norm + 1e-6))
    return clip_atol, {k: g * coef for k, g in grads.items()}


def _adam_atol(ref: torch.nn.Module, ref_opt: torch.optim.Optimizer, grads: dict, grad_atol: dict,
               start: torch.Tensor) -> torch.Tensor:
    """Per element, the bound of tolerance.adam_step_atol on the step ``ref_opt`` just took."""
    from tolerance import adam_step_atol

    group = ref_opt.param_groups[0]
    out, i = [], 0
    for k, q in ref.named_parameters():
        st = ref_opt.state[q]
        p0 = start[i:i + q.numel()].reshape(q.shape)
        i += q.numel()
        out.append(adam_step_atol(grads[k], grad_atol[k], st["exp_avg"], st["exp_avg_sq"], int(st["step"]),
                                  group["lr"], group["betas"], group["eps"], p0).reshape(-1))
    return torch.cat(out)


def _scenario_fsdp_clip(rank: int, world: int) -> dict:
    """FSDP2 + Adam + global-norm clipping vs the unsharded model; then an inf in one shard."""
    from torch.distributed.fsdp import fully_shard

    from dlspass.models import MLP, mse_loss
    from dlspass.scaler import GradScaler

    max_norm = 0.05
    torch.manual_seed(2)
    ref = MLP()
    torch.manual_seed(2)
    model = MLP()
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=INIT_SCALE, max_gradient_norm=max_norm)
    ref_norms, flags, steps = [], [], []
    for it in range(3):
        full = _batch(200 + it)
        # each step from the sharded run's parameters and Adam state (one step's differences
        # are bounded, a run's grow): the gradients' bound, clipped, through Adam
        clip_atol, grads = _sync_adam_and_bound(model, opt, ref, ref_opt, full, max_norm)
        start = _flat(ref)
        scaler.scale(mse_loss(model, _shard(full, rank, world))).backward()
        flags.append(bool(scaler.step(opt)))
        scaler.update()
        opt.zero_grad(set_to_none=True)
        mse_loss(ref, full).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        steps.append((_flat(model), _flat(ref), _adam_atol(ref, ref_opt, grads, clip_atol, start)))
    before = _flat(model)
    adam_before = [v.to_local().clone() for st in opt.state.values() for v in st.values()
                   if hasattr(v, "to_local")]
    # an inf in the LAST rank's local shard only
    scaler.scale(mse_loss(model, _shard(_batch(300), rank, world))).backward()
    if rank == world - 1:
        model.fc1.weight.grad.to_local()[0, 0] = float("inf")
    flags.append(bool(scaler.step(opt)))
    scaler.update()
    adam_after = [v.to_local() for st in opt.state.values() for v in st.values()
                  if hasattr(v, "to_local")]
    return {"params": before, "ref": _flat(ref), "ref_norms": ref_norms, "flags": flags, "steps": steps,
            "after_skip": _flat(model), "scale": float(scaler.get_scale()),
            "adam_unchanged": all(torch.equal(a, b) for a, b in zip(adam_before, adam_after,
                                                                    strict=True)),
            "n_adam": len(adam_after)}


def _scenario_captured(rank: int, world: int) -> dict:
    """capture_step_distributed: averaged grads + flag in one graph; inf in one rank's batch."""
    from dlspass.capture.functional import capture_step_distributed
    from dlspass.config import DLSConfig
    from dlspass.distributed import collective_nodes
    from dlspass.models import MLP, mse_loss

    torch.manual_seed(3)
    ref = MLP()
    torch.manual_seed(3 + rank)  # capture broadcasts rank 0's parameters, as DDP does
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    cfg = DLSConfig(mixed_precision=False, initial_loss_scale=INIT_SCALE, steps_per_increase=2)
    step = capture_step_distributed(model, mse_loss, opt, _shard(_batch(400), rank, world), cfg)
    scales, params, steps = [], [], []
    for it in range(1, 5):
        full = _batch(400 + it)
        atol = _sync_and_bound(model, ref, full, 0.1)
        mine = _shard(full, rank, world)
        if it == 2 and rank == world - 1:
            mine = (mine[0].clone().index_fill_(0, torch.tensor([0]), float("inf")), mine[1])
        step(mine)
        scales.append(float(step.scaler.get_scale()))
        params.append(_flat(model))
        if it != 2:
            mse_loss(ref, full).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            steps.append((_flat(model), _flat(ref), atol))
    kinds = [str(n.target) for n in collective_nodes(step.graph_module)]
    return {"scales": scales, "params": torch.stack(params), "ref": _flat(ref), "kinds": kinds, "steps": steps,
            "sizes": [tuple(n.meta["val"].shape) for n in collective_nodes(step.graph_module)]}


def _scenario_dcp(rank: int, world: int, ckpt: str, trained: dict) -> dict:
    """Save the trained scaler with DCP; restore it into fresh scalers on every rank."""
    from torch.distributed.checkpoint import FileSystemReader

    from dlspass.checkpoint import load_scaler, save_scaler
    from dlspass.scaler import GradScaler

    scaler = trained["scaler"]
    save_scaler(scaler, ckpt)
    fresh = GradScaler(init_scale=INIT_SCALE, steps_per_increase=2)
    before = fresh.state_dict()
    load_scaler(fresh, ckpt)
    meta = FileSystemReader(ckpt).read_metadata()
    fqns = [idx.fqn for idx in meta.storage_data if idx.fqn.startswith("grad_scaler")]
    return {"saved": scaler.state_dict(), "before": before, "loaded": fresh.state_dict(),
            "fqns": fqns}


def _worker(rank: int, world: int, outdir: str) -> dict:
    results: dict = {}
    scenarios = [("ddp_inf", _scenario_ddp_inf)]
    if world == 2:
        scenarios += [("ddp_equiv", _scenario_ddp_equiv), ("fsdp_clip", _scenario_fsdp_clip),
                      ("captured", _scenario_captured)]
    for name, fn in scenarios:
        try:
            results[name] = fn(rank, world)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    if world == 2 and "error" not in results["ddp_inf"]:
        try:
            results["dcp"] = _scenario_dcp(rank, world, os.path.join(outdir, "ckpt"),
                                           results["ddp_inf"])
        except Exception:
            results["dcp"] = {"error": traceback.format_exc()}
    for r in results.values():
        r.pop("scaler", None)
    return results


# ---- test side ---------------------------------------------------------------------------------
def _launch(world: int) -> list[dict]:
    return launch(__file__, world)


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return _launch(2)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return _launch(4)


def _get(results: list[dict], name: str) -> list[dict]:
    out = [r[name] for r in results]
    for rank, r in enumerate(out):
        if "error" in r:
            pytest.fail(f"rank {rank}, scenario {name}:\n{r['error']}")
    return out


def test_inf_on_one_rank_skips_everywhere_2(two: list[dict]) -> None:
    _check_inf_on_one_rank(_get(two, "ddp_inf"), EXPECTED_SCALES)


def test_inf_on_one_rank_skips_everywhere_4_torch_policy(four: list[dict]) -> None:
    _check_inf_on_one_rank(_get(four, "ddp_inf"), EXPECTED_SCALES_TORCH)


def _check_inf_on_one_rank(ranks: list[dict], expected: list[float]) -> None:
    # the injected gradient inf was seen by the last rank only
    assert ranks[0]["local_ok"][OVERFLOW_ITERS[1] - 1] is True
    assert ranks[-1]["local_ok"][OVERFLOW_ITERS[1] - 1] is False
    for r in ranks:
        assert r["scales"] == expected
        assert r["skipped"] == len(OVERFLOW_ITERS)
        torch.testing.assert_close(r["params"], ranks[0]["params"], rtol=0, atol=0)
        for it in OVERFLOW_ITERS:  # a skipped iteration leaves the parameters bit-identical
            assert torch.equal(r["params"][it - 1], r["params"][it - 2])
        assert torch.isfinite(r["params"]).all()
    for k in ("loss_scale", "steps_since_rescale", "num_skipped_steps", "overflows_since_rescale"):
        assert all(torch.equal(r["state"][k], ranks[0]["state"][k]) for r in ranks)


def test_ddp_matches_single_process_on_concatenated_batch(two: list[dict]) -> None:
    r0, r1 = _get(two, "ddp_equiv")
    assert torch.equal(r0["params"], r1["params"])
    # clipping bites, so a norm summed over ranks (sqrt(2) too large) would change the update
    assert all(DDP_MAX_NORM < n for n in r0["ref_norms"]), r0["ref_norms"]
    _assert_steps(r0["steps"])
    assert r0["scale"] == INIT_SCALE
    assert not torch.equal(r0["ref"], _get(two, "captured")[0]["ref"])  # the runs did train


def test_fsdp2_clipping_matches_unsharded(two: list[dict]) -> None:
    r0, r1 = _get(two, "fsdp_clip")
    assert all(n > 0.05 for n in r0["ref_norms"]), "clipping must be active for the test to bite"
    _assert_steps(r0["steps"])
    assert torch.equal(r0["steps"][-1][0], r0["params"])
    assert torch.equal(r0["params"], r1["params"])
    # the last iteration: an inf in rank 1's local shard only -> both ranks skip
    assert r0["flags"] == r1["flags"] == [True, True, True, False]
    assert torch.equal(r0["after_skip"], r0["params"]) and torch.equal(r1["after_skip"], r1["params"])
    assert r0["adam_unchanged"] and r1["adam_unchanged"] and r0["n_adam"] > 0
    assert r0["scale"] == r1["scale"] == INIT_SCALE / 2


def test_captured_step_averages_grads_and_agrees(two: list[dict]) -> None:
    r0, r1 = _get(two, "captured")
    # one bucketed gradient all-reduce (all 6 fp32 tensors) + one scalar flag all-reduce
    assert r0["kinds"] == ["_c10d_functional.all_reduce.default"] * 2
    n_params = 8 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4
    assert sorted(r0["sizes"]) == [(), (n_params,)]
    assert r0["scales"] == r1["scales"] == [1024.0, 512.0, 512.0, 512.0]
    assert torch.equal(r0["params"], r1["params"])
    assert torch.equal(r0["params"][1], r0["params"][0])  # the overflow iteration was skipped
    _assert_steps(r0["steps"])


def _assert_steps(steps: list) -> None:
    """Each recorded step of a data-parallel run against the single-process step from the same
    parameters (and Adam state), within the worker's derived per-element bound
    (``_sync_and_bound``, ``_adam_atol``)."""
    assert steps
    for i, (got, want, atol) in enumerate(steps):
        assert_within(got, want, atol, f"parameters after step {i}")


def test_dcp_save_load_scaler_state(two: list[dict]) -> None:
    for r in _get(two, "dcp"):
        assert {f"grad_scaler.{k}" for k in ("loss_scale", "num_skipped_steps",
                                              "config_json")} <= set(r["fqns"])
        assert float(r["before"]["loss_scale"]) == INIT_SCALE
        assert float(r["saved"]["loss_scale"]) == EXPECTED_SCALES[-1]
        for k, v in r["saved"].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(r["loaded"][k], v), k
                assert r["loaded"][k].dtype == v.dtype
        assert r["loaded"]["config"] == r["saved"]["config"]


def test_dcp_round_trip_of_torch_grad_scaler(tmp_path) -> None:
    """TorchGradScaler (torch's state_dict keys) saves and loads through DCP and keeps its course."""
    import warnings

    from dlspass import TorchGradScaler
    from dlspass.checkpoint import load_scaler, save_scaler

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = TorchGradScaler("cpu", init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25,
                             growth_interval=2)
    for i in range(5):
        loss = model(torch.randn(4, 3)).sum() * (float("inf") if i == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    fresh = TorchGradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialised
        save_scaler(scaler, str(tmp_path / "ckpt"))
        load_scaler(fresh, str(tmp_path / "ckpt"))
    # torch's own keys and values: scale, factors, interval and growth tracker.
    assert fresh.state_dict() == scaler.state_dict()
    assert fresh.state_dict()["growth_factor"] == 4.0 and fresh.get_growth_interval() == 2


def test_single_process_needs_no_group() -> None:
    """Without an initialised process group nothing is communicated (and none is required)."""
    from dlspass.distributed import DistributedSetupError, resolve_group
    from dlspass.errors import DLSInputError
    from dlspass.passes.all_reduce_flag_pass import AllReduceFlagPass
    from dlspass.passes.all_reduce_grads_pass import AllReduceGradsPass

    # an input error that is still the RuntimeError it always was
    assert issubclass(DistributedSetupError, DLSInputError) and issubclass(DistributedSetupError, RuntimeError)
    assert resolve_group(None) is None
    with pytest.raises(DistributedSetupError, match="not initialised"):
        resolve_group(object())
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    for fn in (AllReduceGradsPass(), AllReduceFlagPass()):
        with pytest.raises(DistributedSetupError, match="not initialised"):
            fn(gm)


if __name__ == "__main__":
    with gloo_group(sys.argv) as (rank, world, outdir):
        save_result(_worker(rank, world, outdir), outdir, rank)
