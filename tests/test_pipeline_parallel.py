"""The eager scalers across a 2-stage ``torch.distributed.pipelining`` schedule, 2 gloo ranks.

One 2-process run (module-scoped fixture): the MLP split after ``fc1`` into two
``PipelineStage``s driven by ``ScheduleGPipe`` (2 microbatches), trained with three scalers in
the same code: ``torch.amp.GradScaler``, ``dlspass.TorchGradScaler`` and ``dlspass.GradScaler``
(policy "torch", the same scale rule). The last stage scales each microbatch's loss; the first
stage's gradients come back through the schedule's send/recv already scaled.

- "grad": an inf written into ONE stage's gradient after the schedule's backward (stage 0 at
  iteration 2, stage 1 at iteration 4). dlspass's scalers agree on the flag over the default
  group (the world, so every stage), and both stages skip both iterations; torch.amp decides per
  stage: the poisoned stage skips and backs off, the other steps.
- "loss": an inf in the last stage's target (iteration 2) or in the first stage's input
  (iteration 4): it reaches every stage's gradients through the pipeline, so torch.amp skips on
  both stages too, and dlspass's scalers match it bit for bit.

Checked: the stages' skip decisions and scale trajectories are identical, follow torch's rule,
and the stages' parameters and momentum buffers, put together, follow a single-process run of
the whole MLP on the whole batch that leaves the poisoned iterations out: each iteration within
a derived bound of one single-process step from the stages' own state (tests/tolerance.py).
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch
from gloo_launch import launch, serve
from tolerance import assert_sgd_steps, mlp_grad_sums

pytestmark = pytest.mark.timeout(240)

WORLD = 2
WORKER_TIMEOUT_S = 180
ITERS = 6
N_MICROBATCHES = 2
INIT_SCALE = 1024.0
GROWTH_INTERVAL = 2
LR, MOMENTUM = 0.05, 0.9
SKIPPED = (2, 4)  # 1-based iterations with an injected inf
# torch's rule, growth_interval 2: x0.5 per overflow, x2 after 2 clean steps in a row
EXPECTED_SCALES = [1024.0, 512.0, 512.0, 256.0, 256.0, 512.0]
SCALERS = ("torch.amp", "TorchGradScaler", "GradScaler")
# (iteration, stage that gets the inf, where)
INJECT = {
    "grad": [(2, 0, "grad"), (4, 1, "grad")],
    "loss": [(2, 1, "target"), (4, 0, "input")],
}


# ---- worker side -------------------------------------------------------------------------------
def _batch(it: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + it)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _stage_module(stage: int) -> torch.nn.Module:
    """Stage 0: ``relu(fc1(x))``; stage 1: ``fc3(relu(fc2(h)))`` of the MLP (seed 0)."""
    from dlspass.models import MLP

    torch.manual_seed(0)
    mlp = MLP()
    if stage == 0:
        return torch.nn.Sequential(mlp.fc1, torch.nn.ReLU())
    return torch.nn.Sequential(mlp.fc2, torch.nn.ReLU(), mlp.fc3)


def _make_scaler(kind: str) -> object:
    import dlspass

    if kind == "torch.amp":
        return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    if kind == "TorchGradScaler":
        return dlspass.TorchGradScaler("cpu", init_scale=INIT_SCALE,
                                       growth_interval=GROWTH_INTERVAL)
    return dlspass.GradScaler(init_scale=INIT_SCALE, steps_per_increase=GROWTH_INTERVAL,
                              policy="torch")


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _train(scenario: str, kind: str) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = torch.distributed.get_rank()
    module = _stage_module(rank)
    stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = _make_scaler(kind)
    # torch.amp sets its scale up lazily in scale(), which only the last stage calls in the loop
    scaler.scale(torch.ones(()))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return scaler.scale(torch.nn.functional.mse_loss(out, target))

    schedule = ScheduleGPipe(stage, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)
    where = {it: what for it, r, what in INJECT[scenario] if r == rank}
    scales, stepped, params, bufs = [], [], [], []
    for it in range(1, ITERS + 1):
        x, y = (t.clone() for t in _batch(it))
        if where.get(it) == "input":
            x[0, 0] = float("inf")
        if where.get(it) == "target":
            y[0, 0] = float("inf")
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        if where.get(it) == "grad":
            next(iter(module.parameters())).grad.view(-1)[0] = float("inf")
        before = _flat(module)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(float(scaler.get_scale()))
        params.append(_flat(module))
        bufs.append(torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) if "momentum_buffer" in opt.state[p]
                               else torch.full((p.numel(),), float("nan")) for p in module.parameters()]))
        stepped.append(not torch.equal(before, params[-1]))
    return {"scales": scales, "stepped": stepped, "params": torch.stack(params), "bufs": torch.stack(bufs)}


def compute(rank: int) -> dict:
    results: dict = {}
    for scenario in INJECT:
        for kind in SCALERS:
            try:
                results[(scenario, kind)] = _train(scenario, kind)
            except Exception:
                results[(scenario, kind)] = {"error": traceback.format_exc()}
    return results


# ---- test side ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stages() -> list[dict]:
    return launch(__file__, WORLD, WORKER_TIMEOUT_S)


def _get(stages: list[dict], key: tuple[str, str]) -> list[dict]:
    out = [r[key] for r in stages]
    for rank, r in enumerate(out):
        if "error" in r:
            pytest.fail(f"stage {rank}, {key}:\n{r['error']}")
    return out


@pytest.mark.parametrize("scenario", list(INJECT))
@pytest.mark.parametrize("kind", ["TorchGradScaler", "GradScaler"])
def test_every_stage_skips_the_poisoned_iterations_and_matches_one_process(
        stages: list[dict], scenario: str, kind: str) -> None:
    runs = _get(stages, (scenario, kind))
    for r in runs:
        assert r["stepped"] == [it not in SKIPPED for it in range(1, ITERS + 1)]
        assert r["scales"] == EXPECTED_SCALES
    whole = torch.cat([runs[0]["params"], runs[1]["params"]], dim=1)
    bufs = torch.cat([runs[0]["bufs"], runs[1]["bufs"]], dim=1)
    # each iteration against one single-process step from the stages' own state: the two
    # microbatches' gradients, accumulated and averaged (one more term), against the whole
    # batch's, the MLP's chain of sums in other orders (tests/tolerance.py)
    from dlspass.models import MLP

    torch.manual_seed(0)
    assert_sgd_steps(MLP(), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                     [_batch(it) for it in range(1, ITERS + 1)], whole, bufs,
                     [it not in SKIPPED for it in range(1, ITERS + 1)], LR, MOMENTUM,
                     mlp_grad_sums([8, 16, 16, 4], batch=8) + 1)


@pytest.mark.parametrize("kind", ["TorchGradScaler", "GradScaler"])
def test_bit_identical_to_torch_amp_where_the_inf_reaches_every_stage(
        stages: list[dict], kind: str) -> None:
    ours, amp = _get(stages, ("loss", kind)), _get(stages, ("loss", "torch.amp"))
    for rank, (r, a) in enumerate(zip(ours, amp, strict=True)):
        assert r["stepped"] == a["stepped"], rank
        assert r["scales"] == a["scales"], rank
        assert torch.equal(r["params"], a["params"]), rank


def test_torch_amp_decides_per_stage(stages: list[dict]) -> None:
    """What docs/DISTRIBUTED.md says of torch.amp.GradScaler under pipeline parallelism: each
    stage's scaler sees only its own gradients, so an inf in one stage's gradients makes that
    stage skip and back off while the other steps (and the scales part ways)."""
    first, last = _get(stages, ("grad", "torch.amp"))
    assert first["stepped"][1] is False and last["stepped"][1] is True  # stage 0's inf
    assert first["stepped"][3] is True and last["stepped"][3] is False  # stage 1's inf
    assert first["scales"] != last["scales"]


if __name__ == "__main__":
    serve(sys.argv, compute)
