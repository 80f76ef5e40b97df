"""Crash and resume: atomic checkpoints, weights_only loading, SIGKILL mid-run and resume.

The kill test runs ``tools/reliability/resume_worker.py`` three times in subprocesses (an
uninterrupted run; a run killed with SIGKILL at a random step; its resumption) and requires the
final parameters, optimizer state, scheduler position and scaler state to be bit-identical.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dlspass
from dlspass.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from dlspass.models import MLP, mse_loss

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tools" / "reliability" / "resume_worker.py"
STEPS, EVERY = 60, 5


def worker_cmd(ckpt: Path, out: Path, sleep: float = 0.0) -> list[str]:
    return [sys.executable, str(WORKER), "--ckpt-dir", str(ckpt), "--steps", str(STEPS),
            "--every", str(EVERY), "--out", str(out), "--sleep", str(sleep)]


def flat_state(path: Path) -> dict[str, object]:
    d = read_checkpoint(path)
    out: dict[str, object] = {"step": d["step"]}
    for k, v in d["model"].items():
        out[f"model.{k}"] = v
    for pid, st in d["optimizer"]["state"].items():
        for k, v in st.items():
            out[f"opt.{pid}.{k}"] = v
    out["sched"] = d["scheduler"]
    for k, v in d["grad_scaler"].items():
        if k != "config":
            out[f"scaler.{k}"] = v
    out["rng"] = d["rng"]["torch"]
    return out


def assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k
        else:
            assert x == y, k


def test_sigkill_at_random_step_then_resume_is_bit_identical(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ref = tmp_path / "ref.pt"
    subprocess.run(worker_cmd(tmp_path / "ref_ck", ref), check=True, env=env, timeout=120,
                   capture_output=True)
    kill_at = random.Random(int(os.environ.get("DLSPASS_KILL_SEED", "0")) or None).randint(EVERY + 1, STEPS - 5)
    ck, out = tmp_path / "ck", tmp_path / "out.pt"
    proc = subprocess.Popen(worker_cmd(ck, out, sleep=0.02), stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == f"step {kill_at}":
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run should have been killed mid-way"
    assert not out.exists()
    last = latest_checkpoint(ck)
    assert last is not None and read_checkpoint(last)["step"] <= kill_at + 1
    print(f"killed at step {kill_at}; newest checkpoint {last.name}")
    resumed = subprocess.run(worker_cmd(ck, out), check=True, env=env, timeout=120,
                             capture_output=True, text=True)
    # it really resumed (a restart from scratch would also end identical)
    first = resumed.stdout.splitlines()[0]
    assert first == f"resumed from step {read_checkpoint(last)['step']}", first
    assert_same(flat_state(ref), flat_state(out))


# ---- in-process: the file format and atomicity ---------------------------------------------------
def setup_run(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dlspass.GradScaler(steps_per_increase=2)
    sched = dlspass.hold_scheduler_on_skip(torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), scaler)
    return model, opt, sched, scaler


def train_steps(model, opt, sched, scaler, ks) -> None:
    for k in ks:
        g = torch.Generator().manual_seed(k)
        opt.zero_grad(set_to_none=True)
        loss = mse_loss(model, (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)))
        scaler.scale(loss * (float("inf") if k % 4 == 1 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def test_round_trip_restores_everything_and_loads_weights_only(tmp_path: Path) -> None:
    a = setup_run()
    train_steps(*a, range(7))
    p = save_checkpoint(tmp_path / "c.pt", *a, step=7, extra={"note": "x", "t": torch.ones(2)})
    raw = torch.load(p, weights_only=True)  # no pickled objects anywhere
    assert raw["step"] == 7 and raw["grad_scaler"]["num_skipped_steps"] == 2
    b = setup_run(seed=1)
    assert load_checkpoint(p, *b) == 7
    assert b[3].state == a[3].state or all(torch.equal(x, y) for x, y in zip(b[3].state, a[3].state, strict=True))
    assert b[2].held_steps == a[2].held_steps == 2
    assert b[2].last_epoch == a[2].last_epoch
    train_steps(*a, range(7, 12))
    train_steps(*b, range(7, 12))
    for x, y in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a[3].get_scale(), b[3].get_scale())


def test_missing_scaler_state_restarts_dls(tmp_path: Path) -> None:
    a = setup_run()
    train_steps(*a, range(5))
    p = save_checkpoint(tmp_path / "c.pt", a[0], a[1], None, None, step=5)
    b = setup_run()
    train_steps(*b, range(3))  # moves the scaler away from its initial state
    load_checkpoint(p, b[0], b[1], scaler=b[3])
    assert float(b[3].get_scale()) == 2.0**15 and int(b[3].get_num_skipped_steps()) == 0


def test_interrupted_save_leaves_the_old_checkpoint(tmp_path: Path, monkeypatch) -> None:
    a = setup_run()
    p = save_checkpoint(checkpoint_path(tmp_path, 5), *a, step=5)
    before = p.read_bytes()
    real_save = torch.save

    def torn_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(p, *a, step=6)
    monkeypatch.setattr(torch, "save", real_save)
    assert p.read_bytes() == before
    assert [q.name for q in tmp_path.iterdir()] == [p.name], "no temporary file left behind"


def test_latest_checkpoint_skips_damaged_and_temporary_files(tmp_path: Path) -> None:
    a = setup_run()
    good = save_checkpoint(checkpoint_path(tmp_path, 10), *a, step=10)
    data = good.read_bytes()
    checkpoint_path(tmp_path, 20).write_bytes(data[: len(data) // 2])  # torn by another tool
    (tmp_path / ".ckpt-000000030.pt.abc.tmp").write_bytes(data[:100])
    assert latest_checkpoint(tmp_path) == good
    assert latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("content, match", [
    (b"", "not a readable checkpoint"), (b"garbage" * 10, "not a readable checkpoint"),
])
def test_damaged_files_are_one_line_errors(tmp_path: Path, content: bytes, match: str) -> None:
    p = tmp_path / "bad.pt"
    p.write_bytes(content)
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(p, MLP())
    assert "\n" not in str(e.value)
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a dlspass checkpoint"):
        read_checkpoint(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        read_checkpoint(tmp_path / "nope.pt")


def test_captured_step_checkpoint_resumes_bit_identically(tmp_path: Path) -> None:
    """A captured step's model, optimizer and scaler (``step.scaler``) checkpoint the same way."""
    cfg = dlspass.DLSConfig(mixed_precision=False, steps_per_increase=2)

    def batch(k):
        g = torch.Generator().manual_seed(k)
        return (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g),
                torch.tensor(float("inf") if k % 4 == 1 else 1.0))

    def loss_fn(model, b):
        return mse_loss(model, b[:2]) * b[2]

    def make():
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, opt, dlspass.capture_step(model, loss_fn, opt, batch(0), config=cfg)

    m1, o1, s1 = make()
    for k in range(6):
        s1(batch(k))
    p = save_checkpoint(tmp_path / "c.pt", m1, o1, None, s1.scaler, step=6)
    m2, o2, s2 = make()
    load_checkpoint(p, m2, o2, scaler=s2.scaler)
    for k in range(6, 12):
        s1(batch(k))
        s2(batch(k))
    for x, y in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(s1.scaler.state, s2.scaler.state, strict=True))
