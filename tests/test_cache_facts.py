"""A compiled DLS step served from a cache made under other CPU facts trains as a fresh compile.

torch 2.13 keys inductor's FX graph cache on the thread count but not on the vector ISA it
generates C++ for: a step compiled under ``ATEN_CPU_CAPABILITY=avx512`` and read under ``avx2``
from the same ``TORCHINDUCTOR_CACHE_DIR`` skipped every step (nan losses); the reverse can
corrupt the heap. dlspass puts the facts into the key (``dlspass.cache_facts``).

Each process (tests/cache_child.py) is one kind of machine sharing one cache folder: it
compiles the same tiny step with inductor and trains three steps, the second overflowing.
Bit equality is the right test: a process that misses the cache compiles the same graph under
the same facts as the fresh process it is compared with, so both run the same kernels on the
same inputs in the same order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerance import assert_same_training

from dlspass import cache_facts
from dlspass.cache_facts import CacheFactsError, cpu_facts, load_cache_artifacts

CHILD = Path(__file__).with_name("cache_child.py")
ROOT = CHILD.parent.parent


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


FLAGS = _cpu_flags()
needs_both_isas = pytest.mark.skipif(
    not {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= FLAGS,
    reason="this CPU cannot run both avx2 and avx512 code (or /proc/cpuinfo is unreadable)")

ISA_CAPABILITY = {"avx512": "AVX512", "avx2": "AVX2"}


def _start(tmp: Path, name: str, isa: str, threads: int, cache: str, *mega: str) -> tuple:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa, "OMP_NUM_THREADS": str(threads),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / cache), "PYTHONPATH": str(ROOT)}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    out = tmp / f"{name}.pt"
    proc = subprocess.Popen([sys.executable, str(CHILD), str(out), *mega], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return name, isa, threads, proc, out


def _finish(started: list[tuple]) -> dict[str, dict]:
    results = {}
    for name, isa, threads, proc, out in started:
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} ({isa}, {threads} threads) failed:\n{log[-3000:]}"
        res = torch.load(out)
        # the process ran under the facts it was started with (else the test proves nothing)
        assert res["facts"]["aten_cpu_capability"] == ISA_CAPABILITY[isa], (name, res["facts"])
        assert res["facts"]["threads"] == threads, (name, res["facts"])
        results[name] = res
    return results


def _assert_same_training(got: dict, fresh: dict, what: str) -> None:
    assert_same_training(got, fresh, f"{what}, against a fresh compile")
    assert [bool(f) for f in got["found_inf"]] == [False, True, False], what  # one skip, as made


@needs_both_isas
def test_a_cache_made_under_other_cpu_facts_is_a_miss_and_trains_as_a_fresh_compile(tmp_path):
    art = str(tmp_path / "artifacts.bin")
    # warm cache X (avx512, 2 threads) and its mega-cache; C: a fresh avx2 compile
    res = _finish([_start(tmp_path, "A", "avx512", 2, "X", "save", art),
                   _start(tmp_path, "C", "avx2", 2, "Y")])
    # B: avx2 on the avx512 cache (the nan-loss case); G: A's mega-cache in a fresh folder
    res |= _finish([_start(tmp_path, "B", "avx2", 2, "X"),
                    _start(tmp_path, "G", "avx512", 2, "W", "load", art)])
    _assert_same_training(res["B"], res["C"], "avx2 from an avx512 cache")
    _assert_same_training(res["G"], res["A"], "avx512 from avx512 artifacts")
    assert res["B"]["fxgraph_cache_hit"] == 0, res["B"]["fxgraph_cache_hit"]  # a miss, never a wrong hit
    # the same facts hit: the folder and the artifacts really are shared
    assert res["G"]["fxgraph_cache_hit"] >= 1 and res["G"]["fxgraph_cache_miss"] == 0

    # artifacts made under other facts are refused in one line, naming the fact
    theirs = {**cpu_facts(), "vec_isa": "some-other-isa"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache_facts, "cpu_facts", lambda: theirs)
        with pytest.raises(CacheFactsError) as err:
            load_cache_artifacts(art)
    msg = str(err.value)
    assert "\n" not in msg and "vec_isa" in msg and "some-other-isa" in msg, msg


@pytest.mark.slow  # five more compiles in subprocesses (about a minute): tools/run_slow.sh
@needs_both_isas
def test_the_other_directions_and_thread_counts_miss_and_train_as_fresh_compiles(tmp_path):
    # warm caches X (avx512, 2 threads) and Y (avx2, 2 threads); Z: a fresh 1-thread compile
    res = _finish([_start(tmp_path, "A", "avx512", 2, "X"), _start(tmp_path, "C", "avx2", 2, "Y"),
                   _start(tmp_path, "F", "avx512", 1, "Z")])
    res |= _finish([_start(tmp_path, "D", "avx512", 2, "Y"),
                    _start(tmp_path, "E", "avx512", 1, "X")])
    for got, fresh, what in (("D", "A", "avx512 from an avx2 cache"),
                             ("E", "F", "1 thread from a 2-thread cache")):
        _assert_same_training(res[got], res[fresh], what)
        assert res[got]["fxgraph_cache_hit"] == 0, (got, res[got]["fxgraph_cache_hit"])


def test_a_file_that_is_not_dlspass_artifacts_is_refused_in_one_line(tmp_path):
    path = tmp_path / "torch-only.bin"
    path.write_bytes(b"\x00\x01 raw torch.compiler.save_cache_artifacts bytes")
    with pytest.raises(CacheFactsError, match="not a dlspass cache-artifacts file$"):
        load_cache_artifacts(path)


def test_the_key_pass_keeps_an_installed_pass_and_its_uuid(monkeypatch):
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Mine(CustomGraphPass):
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "mine-1"

    # inductor's own patch, not monkeypatch: pytest's undo deletes a module attribute it did not
    # find in the module's __dict__, and a deleted inductor setting stays hidden for the process
    with inductor_config.patch({cache_facts.HOOK: Mine()}):
        patch = cache_facts.inductor_key_config()[cache_facts.HOOK]
    patch("g")
    assert seen == ["g"]
    # the facts and the installed pass's uuid both change the key
    facts_only = cache_facts.CacheFactsPass(None).uuid()
    assert patch.uuid() != facts_only
    monkeypatch.setattr(cache_facts, "cpu_facts", lambda: {**cpu_facts(), "threads": 99})
    assert cache_facts.CacheFactsPass(None).uuid() != facts_only
    # a pass without a uuid keeps inductor's answer for it: no caching
    assert cache_facts.CacheFactsPass(lambda g: None).uuid() is None
