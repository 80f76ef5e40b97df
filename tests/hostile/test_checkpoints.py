"""Hostile checkpoints: validated before anything is restored; DCP folders that cannot run code.

``load_checkpoint`` must refuse a damaged or crafted entry (model, optimizer, scheduler, scaler,
RNG) with a ``CheckpointError`` and leave every object exactly as it was; ``latest_checkpoint``
must skip such a file. ``load_scaler`` must not unpickle a crafted DCP ``.metadata`` or value;
the controls show the same folders do run their payload under ``trusted=True`` (plain
``dcp.load``).
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import random
import time
import warnings
from pathlib import Path

import pytest
import torch
from hostile_files import SENTINEL, Exec

from dlspass.checkpoint import (
    CheckpointError,
    checkpoint_path,
    dcp_state_dict,
    latest_checkpoint,
    load_checkpoint,
    load_scaler,
    save_checkpoint,
    save_scaler,
)
from dlspass.errors import DLSInputError
from dlspass.scaler import GradScaler

pytestmark = pytest.mark.timeout(120)


def _run(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = GradScaler(init_scale=2.0**10, steps_per_increase=2)
    for _ in range(3):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, scaler


def _snapshot(model, opt, sched, scaler) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": copy.deepcopy(opt.state_dict()), "sched": copy.deepcopy(sched.state_dict()),
            "scaler": {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                       for k, v in scaler.state_dict().items()},
            "rng": (torch.get_rng_state().clone(), random.getstate())}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
            and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _mutate(path: Path, dst: Path, edit) -> Path:
    data = torch.load(path, weights_only=True)
    edit(data)
    torch.save(data, dst)
    return dst


def _first_state(d):
    return next(iter(d["optimizer"]["state"].values()))


CORRUPTIONS = {
    "scale_nan": (lambda d: d["grad_scaler"].__setitem__("loss_scale", torch.tensor(float("nan"))), "loss_scale"),
    "scale_inf": (lambda d: d["grad_scaler"].__setitem__("loss_scale", torch.tensor(float("inf"))), "loss_scale"),
    "scale_zero": (lambda d: d["grad_scaler"].__setitem__("loss_scale", torch.tensor(0.0)), "loss_scale"),
    "scale_negative": (lambda d: d["grad_scaler"].__setitem__("loss_scale", torch.tensor(-8.0)), "loss_scale"),
    "scale_beyond_float32": (lambda d: d["grad_scaler"].__setitem__("loss_scale", torch.tensor(1e39, dtype=torch.float64)), "loss_scale"),
    "scale_underflows_float32": (lambda d: d["grad_scaler"].__setitem__("loss_scale", 1e-46), "loss_scale"),
    "scale_a_string": (lambda d: d["grad_scaler"].__setitem__("loss_scale", "big"), "loss_scale"),
    "non_clamped_nan": (lambda d: d["grad_scaler"].__setitem__("non_clamped_scale", torch.tensor(float("nan"))), "non_clamped_scale"),
    "counter_negative": (lambda d: d["grad_scaler"].__setitem__("num_skipped_steps", torch.tensor(-1)), "num_skipped_steps"),
    "counter_fractional": (lambda d: d["grad_scaler"].__setitem__("steps_since_rescale", 1.5), "steps_since_rescale"),
    "step_negative": (lambda d: d.__setitem__("step", -3), "step"),
    "model_shape": (lambda d: d["model"].__setitem__("0.weight", torch.zeros(2, 2)), "model.0.weight"),
    "model_missing_key": (lambda d: d["model"].pop("2.bias"), "keys do not match"),
    "model_nan_weight": (lambda d: d["model"].__setitem__("0.bias", torch.full((3,), float("nan"))), "non-finite"),
    "model_int_dtype": (lambda d: d["model"].__setitem__("0.bias", torch.zeros(3, dtype=torch.int64)), "dtype"),
    "optimizer_groups": (lambda d: d["optimizer"]["param_groups"].append(dict(d["optimizer"]["param_groups"][0])), "groups"),
    "optimizer_lr_inf": (lambda d: d["optimizer"]["param_groups"][0].__setitem__("lr", float("inf")), "lr"),
    "optimizer_state_shape": (lambda d: _first_state(d).__setitem__("exp_avg", torch.zeros(7)), "exp_avg"),
    "optimizer_state_nan": (lambda d: _first_state(d).__setitem__("exp_avg_sq", _first_state(d)["exp_avg_sq"] * float("nan")), "non-finite"),
    "optimizer_not_a_dict": (lambda d: d.__setitem__("optimizer", [1, 2]), "optimizer"),
    "optimizer_unknown_param": (lambda d: d["optimizer"]["state"].__setitem__(99, {}), "not one of"),
    "scheduler_shape": (lambda d: d["scheduler"].pop("held"), "scheduler"),
    "rng_torch": (lambda d: d["rng"].__setitem__("torch", torch.zeros(3, dtype=torch.uint8)), "rng.torch"),
    "rng_python": (lambda d: d["rng"].__setitem__("python", [3, [1, 2], None]), "rng.python"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ck")
    model, opt, sched, scaler = _run()
    return save_checkpoint(d / "good.pt", model, opt, sched, scaler, step=3)


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_bad_entry_is_refused_and_nothing_is_restored(saved, tmp_path, name):
    edit, words = CORRUPTIONS[name]
    bad = _mutate(saved, tmp_path / "bad.pt", edit)
    objs = _run(seed=1)  # a different run: restoring anything would change it
    random.seed(5)
    torch.manual_seed(5)
    before = _snapshot(*objs)
    t = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(bad, *objs)
    assert time.monotonic() - t < 30
    assert isinstance(info.value, DLSInputError)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert _same(_snapshot(*objs), before), "a refused checkpoint changed the run's state"


def test_good_checkpoint_still_restores_everything(saved):
    objs = _run(seed=1)
    assert load_checkpoint(saved, *objs) == 3
    ref = _run(seed=0)
    assert _same(_snapshot(*objs)["model"], _snapshot(*ref)["model"])
    assert _same(_snapshot(*objs)["scaler"], _snapshot(*ref)["scaler"])


def test_a_failing_restore_is_rolled_back(saved, monkeypatch):
    """If a restore fails after the checks (here the optimizer's own load), the scaler and
    scheduler already restored go back to their old state and the model is never touched."""
    objs = _run(seed=1)
    before = _snapshot(*objs)

    def boom(sd):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(objs[1], "load_state_dict", boom)
    with pytest.raises(CheckpointError, match="nothing was changed"):
        load_checkpoint(saved, *objs)
    monkeypatch.undo()
    assert _same(_snapshot(*objs), before)


def test_latest_checkpoint_skips_a_newest_file_that_would_not_load(saved, tmp_path):
    good = save_checkpoint(checkpoint_path(tmp_path, 10), *_run(), step=10)
    _mutate(saved, checkpoint_path(tmp_path, 20),
            lambda d: d["grad_scaler"].__setitem__("loss_scale", torch.tensor(float("nan"))))
    _mutate(saved, checkpoint_path(tmp_path, 30),
            lambda d: d["rng"].__setitem__("torch", torch.zeros(3, dtype=torch.uint8)))
    assert latest_checkpoint(tmp_path) == good


# ---- DCP -------------------------------------------------------------------------------------

def _dcp_save(state: dict, folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def _scaler_folder(folder: Path) -> tuple[GradScaler, Path]:
    _, _, _, scaler = _run()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_scaler(scaler, str(folder))
    return scaler, folder


def _load(folder: Path, trusted: bool = False) -> GradScaler:
    fresh = GradScaler(init_scale=2.0**10, steps_per_increase=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_scaler(fresh, str(folder), trusted=trusted)
    return fresh


def test_dcp_round_trip_reads_without_pickle(tmp_path):
    scaler, folder = _scaler_folder(tmp_path / "ok")
    assert _same(_load(folder).state_dict(), scaler.state_dict())


def _evil_metadata(tmp_path: Path) -> Path:
    _, folder = _scaler_folder(tmp_path / "evil_meta")
    (folder / ".metadata").write_bytes(pickle.dumps(Exec()))
    return folder


def _evil_value(tmp_path: Path) -> Path:
    _, _, _, scaler = _run()
    state = dcp_state_dict(scaler)
    state["grad_scaler"]["config_json"] = Exec()  # DCP stores non-tensors with torch.save
    return _dcp_save(state, tmp_path / "evil_value")


def _escaping_path(tmp_path: Path) -> Path:
    _, folder = _scaler_folder(tmp_path / "escape")
    meta = pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted here
    for info in meta.storage_data.values():
        info.relative_path = "../outside.distcp"
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 100_000)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return folder


def _bomb_item(tmp_path: Path) -> Path:
    """The loss-scale item replaced by a torch.save zip whose storage declares 1 GiB."""
    from hostile_files import deflate_bomb, members

    _, folder = _scaler_folder(tmp_path / "bomb")
    inner = tmp_path / "scale.pt"
    torch.save(torch.tensor(1.0), inner)
    storage = next(r for r in members(inner)[1] if r.startswith("data/") and r[5:].isdigit())
    blob = deflate_bomb(inner, tmp_path / "scale_bomb.pt", storage, 2**30).read_bytes()
    (folder / "bomb.distcp").write_bytes(blob)
    meta = pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted here
    for index, info in meta.storage_data.items():
        if index.fqn.endswith("loss_scale"):
            info.relative_path, info.offset, info.length = "bomb.distcp", 0, len(blob)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return folder


@pytest.mark.parametrize(("build", "words", "live"), [
    (_evil_metadata, "builtins.exec", True),
    (_evil_value, "cannot be loaded without pickle", True),
    (_escaping_path, "does not name a file in the checkpoint folder", False),
    (_bomb_item, "zip bomb", False),
])
def test_crafted_dcp_folder_cannot_run_code(tmp_path, monkeypatch, build, words, live):
    from dlspass.files.dcp_reader import UnsafeCheckpointError

    folder = build(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    t = time.monotonic()
    with pytest.raises(UnsafeCheckpointError, match=words) as info:
        _load(folder)
    assert isinstance(info.value, DLSInputError) and "\n" not in str(info.value)
    assert time.monotonic() - t < 30
    assert not (work / SENTINEL).exists()
    if live:  # control: plain dcp.load runs the payload
        from torch.distributed.checkpoint.api import CheckpointException

        with contextlib.suppress(Exception, CheckpointException):  # whatever follows the payload
            _load(folder, trusted=True)
        assert (work / SENTINEL).exists()


def test_zip_bomb_checkpoint_is_refused_from_its_directory(saved, tmp_path):
    """A checkpoint whose storage record declares 1 GiB of deflated zeros: torch's reader would
    allocate it; read_checkpoint refuses it before torch opens the file."""
    import resource

    from hostile_files import deflate_bomb, members

    _, files = members(saved)
    storage = next(r for r in files if r.startswith("data/") and r[5:].isdigit())
    bomb = deflate_bomb(saved, checkpoint_path(tmp_path, 99), storage, 2**30)
    assert bomb.stat().st_size < 4 * 2**20
    good = save_checkpoint(checkpoint_path(tmp_path, 1), *_run(), step=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    with pytest.raises(CheckpointError, match="zip bomb"):
        load_checkpoint(bomb, *_run(seed=1))
    assert latest_checkpoint(tmp_path) == good
    assert time.monotonic() - t < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024  # KiB


@pytest.mark.parametrize("cls", [torch.optim.Adafactor, torch.optim.NAdam, torch.optim.Rprop, torch.optim.ASGD])
def test_optimizers_with_state_of_their_own_shape_still_restore(tmp_path, cls):
    """The shape check covers the parameter-shaped state only: Adafactor's factored row/column
    statistics and NAdam's scalar mu_product restore as before."""
    model = torch.nn.Linear(4, 3)
    opt = cls(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    p = save_checkpoint(tmp_path / "c.pt", model, opt, None, None, step=1)
    fresh_model = torch.nn.Linear(4, 3)
    fresh = cls(fresh_model.parameters())
    assert load_checkpoint(p, fresh_model, fresh) == 1
    assert _same(fresh.state_dict(), opt.state_dict())
