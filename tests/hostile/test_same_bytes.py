"""The bytes validated are the bytes used: a file swapped on disk after the check must not reach
torch. Each test wraps the loader dlspass hands the file to after checking it
(``torch.export.load``, ``torch.load``, ``torch.distributed.checkpoint.load``) so that the file
on disk is replaced just before the loader runs: what is loaded must be what was checked."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from hostile_files import SENTINEL, evil_torch_save, rewrite, save_tiny
from test_checkpoints import _load, _same, _scaler_folder

from dlspass.checkpoint import read_checkpoint, save_checkpoint, save_scaler

pytestmark = pytest.mark.timeout(120)


def _swap_before(monkeypatch, owner, name: str, swap) -> list[int]:
    """Make ``owner.name`` run ``swap`` (once) before doing its work."""
    real = getattr(owner, name)
    calls: list[int] = []

    def swapped_then_loaded(*args, **kwargs):
        if not calls:
            swap()
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, swapped_then_loaded)
    return calls


def test_a_pt2_swapped_after_the_check_is_not_what_torch_loads(tmp_path, monkeypatch):
    from dlspass.capture.pt2_io import load_program

    good = save_tiny(tmp_path / "good.pt2")
    evil = rewrite(good, tmp_path / "evil.pt2", {"data/sample_inputs/model.pt": evil_torch_save()})
    target = tmp_path / "model.pt2"
    shutil.copy(good, target)
    calls = _swap_before(monkeypatch, torch.export, "load", lambda: shutil.copy(evil, target))
    monkeypatch.chdir(tmp_path)
    try:
        load_program(target)
    except ValueError:
        pass  # a refusal is fine; running the payload is not
    assert calls, "torch.export.load never ran"
    assert not (tmp_path / SENTINEL).exists(), "torch loaded the swapped file"


def _checkpoint(path: Path, scale: float) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    from dlspass.scaler import GradScaler

    scaler = GradScaler(init_scale=scale)
    save_checkpoint(path, model, None, None, scaler, step=int(scale))
    return path


def test_a_checkpoint_swapped_after_the_check_is_not_what_torch_loads(tmp_path, monkeypatch):
    target = _checkpoint(tmp_path / "ck.pt", 1024.0)
    other = _checkpoint(tmp_path / "other.pt", 8.0)
    calls = _swap_before(monkeypatch, torch, "load", lambda: shutil.copy(other, target))
    data = read_checkpoint(target)
    assert calls, "torch.load never ran"
    assert data["step"] == 1024, "torch read the swapped checkpoint, not the checked one"


def test_a_dcp_folder_swapped_after_the_check_is_not_what_dcp_loads(tmp_path, monkeypatch):
    scaler, folder = _scaler_folder(tmp_path / "ok")
    other_scaler, other = _scaler_folder(tmp_path / "other")
    sd = other_scaler.state_dict()
    sd["loss_scale"] = sd["non_clamped_scale"] = torch.tensor(4.0)
    other_scaler.load_state_dict(sd)
    shutil.rmtree(other)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_scaler(other_scaler, str(other))
    assert not _same(_load(other).state_dict(), scaler.state_dict())  # the swap would show
    data_files = sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp")
    assert data_files == sorted(p.name for p in other.iterdir() if p.suffix == ".distcp")

    def swap() -> None:
        for name in data_files:
            shutil.copy(other / name, folder / name)

    import torch.distributed.checkpoint as dcp

    calls = _swap_before(monkeypatch, dcp, "load", swap)
    loaded = _load(folder)
    assert calls, "dcp.load never ran"
    assert _same(loaded.state_dict(), scaler.state_dict()), "DCP read the swapped files"
