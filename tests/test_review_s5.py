"""Review of session 5's changes (issues 31 and 32): defects found, each with the test that
showed it.

The fused-kernel cases compare ``dlspass.compile`` with ``backend_compiler="eager"`` against
eager torch (the same fused optimizer with ``torch.amp.GradScaler``); as in
tests/test_fused_optimizer_tail.py both run the same ATen ops on the same values in the same
order (power-of-two scales, no subnormal gradient), so the comparison is bit equality.
"""

from __future__ import annotations

import sys

import pytest
import torch
from test_fused_optimizer_tail import INIT, INTERVAL, OVERFLOW_STEPS, _batches, _compiled, _loss

import dlspass

N = 5  # steps: one overflow (OVERFLOW_STEPS[0] == 2) and steps on both sides of it


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    # a parameter the loss never reads: no gradient, so torch.optim skips it in its group
    m.register_parameter("unused", torch.nn.Parameter(torch.randn(3, 3)))
    return m


def _optimizer(model: torch.nn.Module, opt_cls, opt_kw) -> torch.optim.Optimizer:
    """Two groups with different options, the second with the parameter that has no gradient,
    and a scheduler-driven lr."""
    groups = [{"params": list(model[0].parameters())},
              {"params": [*model[2].parameters(), model.unused], "lr": 3e-3,
               "weight_decay": 0.2, "betas": (0.8, 0.95)}]
    return opt_cls(groups, fused=True, **opt_kw)


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, and the optimizer state of those with a gradient (dlspass creates the
    unused parameter's zero state up front, torch never does: not compared)."""
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        if p is not model.unused:
            out += [v.detach().clone() for _, v in sorted(opt.state[p].items())]
    return out


@pytest.mark.parametrize("opt_cls,opt_kw", [
    (torch.optim.Adam, {"lr": 1e-2, "maximize": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
], ids=["Adam-maximize", "AdamW-amsgrad"])
def test_fused_step_with_a_scheduler_two_groups_and_a_gradless_param_is_torch_and_never_recompiles(
        opt_cls, opt_kw):
    """Found: the fused path read its constants from ``param_groups[gi]`` inside the traced
    code, and dynamo guarded that dict's ``lr`` as a constant: the first lr change recompiled
    the whole step (fused_optimizer.fused_constants promised schedulers never recompile)."""
    torch._dynamo.reset()  # dynamo's per-code memory (automatic dynamic) from an earlier case
    batches = _batches()[:N]
    ref_model = _model()
    ref_opt = _optimizer(ref_model, opt_cls, opt_kw)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    model = _model()
    opt = _optimizer(model, opt_cls, opt_kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    dls_scaler = dlspass.GradScaler(policy="torch", init_scale=INIT, steps_per_increase=INTERVAL)
    compiled = _compiled(model, opt, dls_scaler, backend_compiler="eager")
    unused = model.unused.detach().clone()
    for i, (x, y, k) in enumerate(batches):
        loss = _loss(ref_model, x, y, k)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        ref_sched.step()
        compiled(x, y, k)
        sched.step()
        assert bool(dls_scaler.found_inf) == (i in OVERFLOW_STEPS), i
        got, ref = _snapshot(model, opt), _snapshot(ref_model, ref_opt)
        # same ATen ops, same values, same order (module docstring): bit-equal
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), f"step {i}"
    assert torch.equal(model.unused, unused)
    assert len(compiled.graphs) == 1  # lr is a tensor input: the scheduler never recompiles


@pytest.mark.parametrize("damage", ["truncated", "bytes changed"])
def test_a_truncated_or_damaged_saved_step_is_refused_with_one_line(tmp_path, damage):
    """Found: ``load_step`` handed a truncated body to pickle (a raw ``UnpicklingError`` with a
    traceback from torch's loader) and loaded a body with changed bytes without noticing; the
    header now carries the body's checksum. The file is the header a save of this step writes
    (tests/test_aot_save_load.py's ``_fake_saved``), so only the body's damage can refuse it."""
    from test_aot_save_load import _fake_saved, make_step

    from dlspass.capture.saved_step import SavedStepMismatchError

    path = _fake_saved(tmp_path / "step.dlstep", make_step())
    blob = path.read_bytes()
    path.write_bytes(blob[:-4] if damage == "truncated" else blob[:-4] + b"PICK")
    with pytest.raises(SavedStepMismatchError, match="truncated or damaged") as e:
        make_step().load(path)
    assert "\n" not in str(e.value)


def _step_around(loss_fn):
    """test_aot_save_load's step with the loss function taken from the closure."""
    from dlspass.models import MLP

    torch.manual_seed(0)
    model = MLP(d_in=32, d_hidden=64, d_out=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return dlspass.compile(train_step, optimizer=opt, scaler=dlspass.GradScaler(fp16_type="float16"))


def test_a_saved_step_is_refused_by_a_step_around_another_loss_function(tmp_path):
    """Found (silent wrong training): torch's ``aot_compile`` keeps no guard on which function a
    closure cell holds, so a step saved around ``F.mse_loss`` and loaded by the same step
    function around ``F.l1_loss`` (or a lambda) ran the saved MSE graph: it returned and
    trained on the MSE loss (reproduced end to end: loaded loss 1.0818, l1 loss 0.6937).
    The header now names the functions the step reaches (`_callables`)."""
    import torch.nn.functional as F
    from test_aot_save_load import _fake_saved

    from dlspass.capture.saved_step import SavedStepMismatchError

    path = _fake_saved(tmp_path / "step.dlstep", _step_around(F.mse_loss))
    for other in (F.l1_loss, lambda a, b: F.mse_loss(a, b) * 2):
        with pytest.raises(SavedStepMismatchError, match="functions the step function calls") as e:
            _step_around(other).load(path)
        assert "\n" not in str(e.value)
    # the same step passes every check of the header (the fake body then fails to unpickle)
    with pytest.raises(Exception) as e:
        _step_around(F.mse_loss).load(path)
    assert not isinstance(e.value, SavedStepMismatchError), e.value


SCALE = 1.0  # module globals traced code reads (the test below changes them)
ACT = torch.tanh


@pytest.mark.parametrize(("name", "value", "message"), [
    ("SCALE", 3.0, r"SCALE: saved 1\.0, now 3\.0"),
    ("ACT", torch.relu, r"ACT: saved \S*tanh, now \S*relu"),
])
def test_a_saved_step_is_refused_after_a_module_constant_it_read_changed(tmp_path, monkeypatch, name,
                                                                          value, message):
    """Found (silent wrong training): a model whose ``forward`` reads a module global
    (``SCALE = 1.0``), saved, then loaded where the line reads ``SCALE = 3.0``, ran the saved
    graph with 1.0 (reproduced end to end: loaded loss 1.0818, the model's eager loss 1.3658):
    torch's ``aot_compile`` keeps no guard on globals and the line is outside the traced
    lines' checksums. The header now carries the traced modules' plain constants, and which
    function an alias such as ``ACT = torch.tanh`` names (the same dropped guard)."""
    from test_aot_save_load import _fake_saved, make_step

    from dlspass.capture.saved_step import SavedStepMismatchError, module_constants

    step = make_step()
    path = _fake_saved(tmp_path / "step.dlstep", step, module_constants=module_constants([__name__]))
    monkeypatch.setattr(sys.modules[__name__], name, value)
    with pytest.raises(SavedStepMismatchError, match=message) as e:
        make_step().load(path)
    assert "\n" not in str(e.value)


def _saved_child(mode: str, out: str, path: str) -> None:
    """One process of the test below: ``save`` compiles, saves and trains three steps of
    test_aot_save_load's step in cbfloat16; ``load`` loads the file and trains the same."""
    from test_aot_save_load import batches, make_step

    step = make_step("cbfloat16")
    data = batches()[:3]
    if mode == "save":
        step.save(path, *data[0])
    else:
        step.load(path)
    losses = [step(*b) for b in data]
    torch.save({"loss": losses, "params": [p.detach().clone() for p in step.optimizer.param_groups[0]["params"]]}, out)


@pytest.mark.slow  # two processes compiling with inductor (about 40 s): tools/run_slow.sh
def test_a_saved_cbfloat16_step_keeps_its_rounding_where_the_loader_enables_unsafe_math(tmp_path):
    """Found (silent wrong numerics): a loaded step builds its kernels from the C++ source the
    file carries with the loading process's inductor config; under
    ``TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG=1`` g++ folded ``round_split``'s
    ``c - (c - a)`` to ``a`` and the loaded cbfloat16 step trained unrounded (its losses and
    parameters differed from the saving process's). Bit equality: the loader runs the very
    code the saver ran, on the same inputs in the same order (tests/test_aot_save_load.py)."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path = tmp_path / "step.dlstep"
    got = {}
    for mode, unsafe in (("save", "0"), ("load", "1")):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"cache-{mode}"),
               "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}",
               "TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG": unsafe}
        env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
        out = tmp_path / f"{mode}.pt"
        proc = subprocess.run([sys.executable, __file__, mode, str(out), str(path)], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
        assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-3000:]}"
        got[mode] = torch.load(out)
    for key in ("loss", "params"):
        for i, (a, b) in enumerate(zip(got["load"][key], got["save"][key], strict=True)):
            assert torch.equal(a, b), f"{key}[{i}]"


if __name__ == "__main__":
    _saved_child(*sys.argv[1:])
