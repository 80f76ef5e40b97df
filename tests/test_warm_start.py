"""A second process's first call of a ``dlspass.compile`` step is served by AOTAutograd's cache,
and trains bit-identically to the process that compiled it; another plan is a miss.

AOTAutograd's key hashes dynamo's graph, its inputs and the configs, not what the dlspass
passes do afterwards; ``StepPlan.cache_key`` puts that into the key (``dlspass.capture.aot``).
Each process (tests/warm_child.py) compiles the same tiny MLP step and trains six steps, the
second overflowing. Bit equality is the right comparison: a warm process runs the very kernels
the cold one compiled (loaded from the cache), on the same inputs in the same order.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerance import assert_same_training
from torch._dynamo.utils import counters

import dlspass
from dlspass import DLSConfig
from dlspass.capture.step_plan import DataParallel, StepPlan
from dlspass.capture.telemetry import Telemetry
from dlspass.models import MLP, mse_train_step

CHILD = Path(__file__).with_name("warm_child.py")
ROOT = CHILD.parent.parent


def _start(tmp: Path, name: str, variant: str, cache: str, *mega: str) -> tuple:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp / cache), "PYTHONPATH": str(ROOT)}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    out = tmp / f"{name}.pt"
    proc = subprocess.Popen([sys.executable, str(CHILD), str(out), variant, *mega], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return name, proc, out


def _finish(started: list[tuple]) -> dict[str, dict]:
    results = {}
    for name, proc, out in started:
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} failed:\n{log[-3000:]}"
        results[name] = torch.load(out)
    return results


def test_a_second_process_hits_aotautograd_and_another_plan_misses(tmp_path):
    art = str(tmp_path / "artifacts.bin")
    cold = _finish([_start(tmp_path, "cold", "base", "shared", "save", art)])["cold"]
    assert cold["counts"]["aot_autograd.autograd_cache_miss"] == 1, cold["counts"]
    assert cold["counts"]["aot_autograd.autograd_cache_bypass"] == 0, cold["counts"]
    assert [bool(f) for f in cold["found_inf"]] == [i == 1 for i in range(6)]  # one skip
    res = _finish([_start(tmp_path, "warm", "base", "shared"),
                   # only the mega-cache file warms this folder (another machine of this kind)
                   _start(tmp_path, "loaded", "base", "fresh", "load", art),
                   _start(tmp_path, "bfloat16", "bfloat16", "shared"),
                   _start(tmp_path, "growth", "growth", "shared"),
                   _start(tmp_path, "static", "static", "shared")])
    for name in ("warm", "loaded"):
        counts = res[name]["counts"]
        # the whole step from AOTAutograd's cache: no joint trace, no dlspass pass, no inductor
        assert counts["aot_autograd.autograd_cache_hit"] >= 1, (name, counts)
        assert counts["aot_autograd.autograd_cache_miss"] == 0, (name, counts)
        assert counts["inductor.fxgraph_cache_miss"] == 0, (name, counts)
        assert_same_training(res[name], cold, f"{name} against the cold process")
        # the rewritten graph is still there for inspection (made again on access)
        assert res[name]["n_graphs"] == 1, name
    # another format, scale growth or scale rule: a miss, never the base plan's step
    for name in ("bfloat16", "growth", "static"):
        counts = res[name]["counts"]
        assert counts["aot_autograd.autograd_cache_hit"] == 0, (name, counts)
        assert counts["aot_autograd.autograd_cache_miss"] == 1, (name, counts)
    # and each trained as its own plan: the scale grows back one clean step later with
    # steps_per_increase 3 than with 2, a static scale never moves
    assert _first_growth(cold["scale"]) + 1 == _first_growth(res["growth"]["scale"]), \
        (cold["scale"], res["growth"]["scale"])
    assert [float(s) for s in res["static"]["scale"]] == [1024.0] * len(cold["scale"])


def _first_growth(scales: list[torch.Tensor]) -> int:
    """The index of the first step whose scale is above the one before it."""
    values = [float(s) for s in scales]
    return next(i for i in range(1, len(values)) if values[i] > values[i - 1])


def _mlp_step(**adam: object):
    torch.manual_seed(0)
    model = MLP(d_in=32, d_hidden=64, d_out=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **adam)
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10, fp16_type="float16")
    return dlspass.compile(mse_train_step(model, opt), optimizer=opt, scaler=scaler)


def test_a_second_compile_in_one_process_hits_and_its_graph_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing cached before
    # as in a fresh process: dynamo's automatic-dynamic profile is kept per code location, so
    # steps other tests compiled with other batch sizes would make this one's first trace dynamic
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    first = _mlp_step()
    first_losses = [first(x, y) for _ in range(2)]
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits  # cold: a miss
    second = _mlp_step()
    second_losses = [second(x, y) for _ in range(2)]
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1
    # the same kernels on the same inputs in the same order: bit-identical
    assert all(torch.equal(a, b) for a, b in zip(first_losses, second_losses, strict=True))
    # the hit ran no pipeline; step.graphs makes the rewritten graph again, as the cold one was
    (cold,), (again,) = first.graphs, second.graphs
    assert _ops(again) == _ops(cold)


def _ops(gm: torch.fx.GraphModule) -> list[tuple[str, str, str, str]]:
    """The graph's nodes in order as (op, target, args, kwargs), each argument node by its
    position: node names carry counters shared by every trace in the process (a rewrite made
    after other tests names its nodes ``..._default_2``), the structure does not."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def by_position(a: object) -> str:
        return str(torch.fx.node.map_arg(a, lambda n: f"%{index[n]}"))

    return [(n.op, str(n.target) if n.op != "placeholder" else "", by_position(n.args),
             by_position(n.kwargs)) for n in gm.graph.nodes]


def test_another_optimizer_structure_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    _mlp_step()(x, y)
    hits, misses = (counters["aot_autograd"][k] for k in ("autograd_cache_hit", "autograd_cache_miss"))
    # amsgrad adds a state tensor and a max to the update: dynamo's graph differs, so does the key
    _mlp_step(amsgrad=True)(x, y)
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits
    assert counters["aot_autograd"]["autograd_cache_miss"] == misses + 1


def _plan(**kw) -> StepPlan:
    return StepPlan(config=kw.pop("config", DLSConfig(fp16_type="float16")), **kw)


class _KeyedPass:
    def __init__(self, uuid: str) -> None:
        self._uuid = uuid

    def __call__(self, gm) -> None:
        pass

    def uuid(self) -> str:
        return self._uuid


@pytest.mark.parametrize("change", [
    {"fp16_type": "bfloat16"}, {"loss_scale": 2.0**8}, {"steps_per_increase": 7},
    {"policy": "torch"}, {"precision_mode": "native"}, {"float8": "rowwise"},
    {"max_gradient_norm": 1.0}, {"hysteresis": 2}])
def test_the_plan_key_changes_with_every_config_field_that_changes_the_step(change):
    base = _plan()
    other = _plan(config=dataclasses.replace(base.config, **change))
    assert base.cache_key() is not None and other.cache_key() is not None
    assert base.cache_key() != other.cache_key()
    assert base.cache_key() == _plan().cache_key()  # stable: a value, not an identity


def test_the_plan_key_names_keyed_passes_and_refuses_what_a_hit_cannot_reproduce():
    keyed = _plan(graph_passes=[_KeyedPass("a")]).cache_key()
    assert keyed is not None and keyed != _plan().cache_key()
    assert keyed != _plan(graph_passes=[_KeyedPass("b")]).cache_key()
    assert _plan(write_in_place=True).cache_key() != _plan().cache_key()
    # no stable identity, or fed through a wrapper a hit would not re-apply: not cached
    assert _plan(graph_passes=[lambda gm: None]).cache_key() is None
    assert _plan(extra_inputs={"x": lambda: torch.zeros(1)}).cache_key() is None
    assert _plan(graph_passes=[Telemetry("float16")]).cache_key() is None
    assert _plan(data_parallel=DataParallel()).cache_key() is None
    assert _plan(backend_compiler="eager").cache_key() is None


def test_the_plan_key_changes_with_dlspass_own_code(monkeypatch):
    from dlspass.capture import step_plan

    before = _plan().cache_key()
    # an upgraded dlspass rewrites the same graph otherwise: its entries must not be served
    monkeypatch.setattr(step_plan, "code_fingerprint", lambda: "another dlspass")
    assert _plan().cache_key() != before


def test_the_code_fingerprint_reads_the_graph_passes_too() -> None:
    """The DLS passes ship as ``dlspass.passes`` from their own folder: an upgrade that changes
    only a pass must change the key as well."""
    from dlspass import cache_facts
    from dlspass.cache_facts import code_roots
    from dlspass.passes import guard_updates_pass

    read = {path.resolve() for root in code_roots() for path in root.rglob("*.py")}
    assert Path(guard_updates_pass.__file__).resolve() in read
    assert Path(cache_facts.__file__).resolve() in read
