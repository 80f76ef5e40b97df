"""Kernel launches per training step: dlspass's whole-step graph against torch's best practice.

Both steps are counted the same way (`dlspass.debug.kernel_count`): the kernels in the code
inductor generates for the step's compiled graphs (generated and library kernels), plus the ATen
ops that run outside compiled graphs in one profiled step, each at its outermost call. torch's
best practice is ``torch.compile(model)`` + fused AdamW + ``torch.autocast`` +
``torch.amp.GradScaler`` (float16): its scaler and optimizer run eagerly; dlspass's DLS and
optimizer are in its one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import dlspass
from dlspass.debug.kernel_count import compiled_launches, eager_ops
from dlspass.models import MHAGPT

VOCAB, SEQ, BATCH = 32, 8, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MHAGPT(vocab=VOCAB, d=32, n_layer=1, n_head=2, block_size=SEQ).train()


def _loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), targets.reshape(-1))


def _torch_step(model: torch.nn.Module):
    cmodel = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")

    def step(idx, targets):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(cmodel, idx, targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _dlspass_step(model: torch.nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = dlspass.GradScaler(config=dlspass.DLSConfig(fp16_type="float16"))

    def step(idx, targets):
        loss = _loss(model, idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return dlspass.compile(step, optimizer=opt, scaler=scaler)


def _launches(step, batch) -> tuple[int, list[str]]:
    k = compiled_launches(step, *batch)  # the first call compiles
    step(*batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(*batch)
    eager = eager_ops(prof.events())
    return k.launches + k.extern_launches + len(eager), eager


def test_dlspass_step_launches_no_more_kernels_than_torch_best_practice():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    torch._dynamo.reset()
    theirs, their_eager = _launches(_torch_step(_model()), batch)
    torch._dynamo.reset()
    ours, our_eager = _launches(_dlspass_step(_model()), batch)
    # the counting sees torch's eager tail: the fused optimizer and the scaler's unscale and
    # inf check (one multi-tensor op each) run outside its compiled graphs
    assert "aten::_fused_adamw_" in their_eager, their_eager
    assert "aten::_amp_foreach_non_finite_check_and_unscale_" in their_eager, their_eager
    # dlspass runs none of them eagerly: the update and the DLS math are in its one graph
    assert not {"aten::_fused_adamw_", "aten::_amp_foreach_non_finite_check_and_unscale_",
                "aten::_amp_update_scale_"} & set(our_eager), our_eager
    # hyperparameters unchanged since the last call are not written again (no fill_ per step)
    assert "aten::fill_" not in our_eager, our_eager
    assert ours <= theirs, (ours, theirs, our_eager, their_eager)
