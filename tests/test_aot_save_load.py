"""A ``dlspass.compile`` step saved ahead of time (``CompiledStep.save``) and loaded in another
process (``CompiledStep.load``) trains bit-identically with nothing traced or lowered (dynamo,
AOTAutograd, the dlspass passes and inductor do not run; inductor's kernels are built from the
C++ source the file carries, the cache folder being empty), and a load under another plan is
refused.

The two processes are this file run as a script (``python tests/test_aot_save_load.py MODE
OUT FILE``), each with its own, empty ``TORCHINDUCTOR_CACHE_DIR``: the loader can only run
what the file holds. Bit equality is the right comparison: the saving process runs the very
compiled step it saved (``save`` swaps it in), the loading process runs that code loaded from
the file, on the same inputs in the same order.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dlspass
from dlspass.capture.compiled_step import CompiledStep
from dlspass.capture.saved_step import (
    MAGIC,
    SavedStepMismatchError,
    StepNotSaveableError,
    fingerprint,
)
from dlspass.errors import InputValueError
from dlspass.models import MLP

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
OVERFLOW_STEP = 3  # the loss times 2**40 here: its float16 gradients overflow, the step is skipped
COUNTED = (("frames", "total"), ("stats", "unique_graphs"), ("aot_autograd", "autograd_cache_miss"),
           ("aot_autograd", "autograd_cache_hit"), ("inductor", "fxgraph_cache_miss"),
           ("inductor", "fxgraph_cache_hit"))


def make_step(fp16_type: str = "float16", optimizer: str = "Adam",
              backend_compiler: str = "inductor", **config: object) -> CompiledStep:
    """The same tiny MLP, optimizer and DLS config in every process (seeded)."""
    torch.manual_seed(0)
    model = MLP(d_in=32, d_hidden=64, d_out=32)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if optimizer == "Adam"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))

    def train_step(x: torch.Tensor, y: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y) * factor
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=2,
                                fp16_type=fp16_type, **config)
    return dlspass.compile(train_step, optimizer=opt, scaler=scaler, backend_compiler=backend_compiler)


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g),
             torch.tensor(2.0**40 if i == OVERFLOW_STEP else 1.0)) for i in range(STEPS)]


def child(mode: str, out: str, path: str) -> None:
    """One process: ``save`` compiles, saves and trains; ``load`` loads and trains the same
    steps, then tries the file under other plans. Writes what it saw to ``out``."""
    from torch._dynamo.utils import counters

    data = batches()
    step = make_step()
    start = time.perf_counter()
    if mode == "save":
        step.save(path, *data[0])
    else:
        step.load(path)
    prepare_s = time.perf_counter() - start
    record: dict[str, list] = {"loss": [], "found_inf": [], "scale": [], "params": []}
    first_call_s = 0.0
    for i, batch in enumerate(data):
        start = time.perf_counter()
        record["loss"].append(step(*batch))
        if i == 0:
            first_call_s = time.perf_counter() - start
        record["found_inf"].append(step.scaler.found_inf.clone())
        record["scale"].append(step.scaler.state.loss_scale.clone())
        record["params"].append([p.detach().clone() for p in step.optimizer.param_groups[0]["params"]])
    counts = {f"{g}.{n}": counters[g][n] for g, n in COUNTED}
    refused = {}
    if mode == "load":
        for name, other in (("bfloat16", lambda: make_step("bfloat16")),
                            ("hysteresis", lambda: make_step(hysteresis=2)),
                            ("SGD", lambda: make_step(optimizer="SGD"))):
            try:
                other().load(path)
                refused[name] = None
            except SavedStepMismatchError as e:
                refused[name] = str(e)
        # a call the saved guards do not cover is refused, never run on the saved graph
        x, y, f = data[0]
        for name, call in (("batch of 8", lambda: step(x[:8], y[:8], f)),
                           ("param group added", lambda: _add_group_and_call(step, x, y, f))):
            try:
                call()
                refused[name] = None
            except SavedStepMismatchError as e:
                refused[name] = str(e)
    torch.save({**record, "skipped": step.scaler.state.num_skipped_steps.clone(), "counts": counts,
                "refused": refused, "prepare_s": prepare_s, "first_call_s": first_call_s}, out)


def _add_group_and_call(step: CompiledStep, *batch: torch.Tensor) -> None:
    step.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    step(*batch)


def _run(tmp: Path, mode: str, path: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"cache-{mode}"),
           "PYTHONPATH": str(ROOT)}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    out = tmp / f"{mode}.pt"
    proc = subprocess.run([sys.executable, __file__, mode, str(out), str(path)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-3000:]}"
    return torch.load(out)


def test_a_saved_step_loads_in_a_fresh_process_and_trains_bit_identically(tmp_path):
    path = tmp_path / "step.dlstep"
    saved = _run(tmp_path, "save", path)
    # the saving process compiled the step once, ahead of time, and ran what it saved
    assert saved["counts"]["stats.unique_graphs"] == 1, saved["counts"]
    # the overflow step was skipped: the scale halved and the parameters did not move
    assert [bool(f) for f in saved["found_inf"]] == [i == OVERFLOW_STEP for i in range(STEPS)]
    scale = [float(s) for s in saved["scale"]]
    assert scale[OVERFLOW_STEP] == scale[OVERFLOW_STEP - 1] / 2, scale
    before, after = saved["params"][OVERFLOW_STEP - 1], saved["params"][OVERFLOW_STEP]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not torch.equal(saved["params"][0][0], saved["params"][-1][0])  # the others trained

    loaded = _run(tmp_path, "load", path)
    counts = loaded["counts"]
    # nothing traced or lowered: dynamo saw no frame (so nothing recompiled), AOTAutograd and
    # inductor were never asked to compile (no cache hit or miss either: the folder was empty)
    assert counts["frames.total"] == 0, counts
    assert counts["stats.unique_graphs"] == 0, counts
    assert all(v == 0 for k, v in counts.items() if k.startswith(("aot_autograd", "inductor"))), counts
    # the same compiled code on the same inputs in the same order: bit-identical
    for key in ("loss", "found_inf", "scale"):
        for i, (a, b) in enumerate(zip(loaded[key], saved[key], strict=True)):
            assert torch.equal(a, b), f"{key}[{i}]: {a} vs {b}"
    for i, (a, b) in enumerate(zip(loaded["params"], saved["params"], strict=True)):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), f"params after step {i}"
    assert torch.equal(loaded["skipped"], saved["skipped"])
    # under another plan the file is refused with one line naming what differs, never run
    refused = loaded["refused"]
    assert "fp16_type" in refused["bfloat16"] and "\n" not in refused["bfloat16"], refused
    assert "hysteresis" in refused["hysteresis"], refused
    assert "optimizer type" in refused["SGD"], refused
    for name in ("batch of 8", "param group added"):
        assert refused[name] is not None and "guards failed" in refused[name], refused


# ---- refusals that need no compile ------------------------------------------------------------

def _fake_saved(path: Path, step: CompiledStep, **changes: object) -> Path:
    """A file with the header ``step`` would write (changed by ``changes``) and no body: every
    test below must be refused before the body is read."""
    body = b"not a pickle"
    header = {**fingerprint(step), "sources": [], "module_constants": {},
              "body": hashlib.sha256(body).hexdigest(), **changes}
    path.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + body)
    return path


@pytest.mark.parametrize(("change", "named"), [
    ({"torch": "2.12.0"}, "torch version"),
    ({"dlspass": "another dlspass"}, "dlspass source"),
    ({"python": "3.10.0"}, "Python version"),
    ({"optimizer_options": "('Adam', ())"}, "optimizer static options"),
    ({"params": []}, "parameters"),
    ({"globals": {"LOSS_WEIGHT": "2.0"}}, "constants the step function reads"),
    ({"sources": [["dlspass.models", 1, 3, "0" * 64]]}, "dlspass.models, lines 1-3"),
])
def test_a_load_under_another_plan_is_refused_with_one_line(tmp_path, change, named):
    path = _fake_saved(tmp_path / "step.dlstep", make_step(), **change)
    with pytest.raises(SavedStepMismatchError) as e:
        make_step().load(path)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_header_alone_is_refused_under_another_config(tmp_path):
    path = _fake_saved(tmp_path / "step.dlstep", make_step())
    with pytest.raises(SavedStepMismatchError, match="DLS config field fp16_type"):
        make_step("bfloat16").load(path)
    # and the unchanged header passes the checks: only the body (not a pickle) then fails
    with pytest.raises(Exception) as e:
        make_step().load(path)
    assert not isinstance(e.value, SavedStepMismatchError)


def test_a_file_that_is_not_a_saved_step_is_refused(tmp_path):
    bad = tmp_path / "step.dlstep"
    bad.write_bytes(b"\x80\x04 something else")
    with pytest.raises(SavedStepMismatchError, match="not a step saved by this dlspass"):
        make_step().load(bad)
    with pytest.raises(InputValueError, match="unsupported file type"):
        make_step().load(tmp_path / "step.pt")


@pytest.mark.parametrize(("make", "reason"), [
    (lambda: make_step(backend_compiler="eager"), "backend_compiler='eager'"),
    (lambda: _with_telemetry(), "extra inputs"),
    (lambda: _reading_globals(), "reads Adam 'GLOBAL_OPT' from its module's globals"),
])
def test_what_cannot_be_saved_is_refused_before_compiling(tmp_path, make, reason):
    step = make()
    with pytest.raises(StepNotSaveableError, match=reason):
        step.save(tmp_path / "step.dlstep", *batches()[0])
    assert step.num_calls == 0 and not (tmp_path / "step.dlstep").exists()


def _with_telemetry() -> CompiledStep:
    torch.manual_seed(0)
    model = MLP(d_in=32, d_hidden=64, d_out=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return dlspass.compile(lambda x, y, f: None, optimizer=opt,
                           config=dlspass.DLSConfig(fp16_type="float16", telemetry=True))


GLOBAL_OPT: torch.optim.Optimizer | None = None


def _reading_globals() -> CompiledStep:
    global GLOBAL_OPT
    GLOBAL_OPT = torch.optim.Adam(MLP(d_in=32, d_hidden=64, d_out=32).parameters())

    def train_step(x: torch.Tensor, y: torch.Tensor, factor: torch.Tensor) -> None:
        GLOBAL_OPT.step()

    return dlspass.compile(train_step, optimizer=GLOBAL_OPT,
                           config=dlspass.DLSConfig(fp16_type="float16"))


if __name__ == "__main__":
    child(*sys.argv[1:])
