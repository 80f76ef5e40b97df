"""Where the first call of a compiled training step spends its time.

Usage: ``.venv/bin/python tools/bench/compile_breakdown.py [--model tinygpt|demo|gpt2]
[--configs dls,plain,torch,cb16] [--warm] [--saved] [--json]``; ``--model demo`` builds the steps
``dlspass demo`` compiles (its model, Adam and float16; `_build_demo`, which also knows ``fp32``).
Every optimizer is built ``fused=True``, as torch's best practice builds it (``baselines.py``).

Each configuration compiles in its own child process with a fresh ``TORCHINDUCTOR_CACHE_DIR``
(cold: nothing cached), so every row pays import-free, cache-free compile time; ``--warm`` runs
each configuration a second time on the cache the first run left (a second process of the same
program). ``--saved`` adds, for each dlspass configuration, a process that compiles the step
ahead of time and saves it (``CompiledStep.save``, row ``aot save``) and two that load it
(``CompiledStep.load``): one with another, empty cache folder (``aot load, empty cache``: the
kernels' C++ is compiled again) and one on the saving process's folder (``aot load, warm
cache``); their first call includes the save or the load. Children run in turn, never at once, so they share the
machine's load alike.

Timers are torch's own (``torch._dynamo.utils.compile_times()``; they are inclusive, so a
row's parts nest as the column names say) plus the dlspass passes (the whole step pipeline,
``run_step_pipeline``: tagging, ``apply_dls``, verify, the in-place updates), timed by
wrapping it. Counts come from
``torch._dynamo.utils.counters`` and ``dlspass.debug.kernel_count`` (kernel launches per step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = ("torch", "plain", "dls", "cb16")
MODELS = ("tinygpt", "demo", "gpt2")

COLUMNS = ("first call", "restarted trace (wasted)", "dynamo + AOT + dlspass", "dlspass passes",
           "inductor", "lowering", "fusion (scheduler init)", "kernel codegen",
           "C++ compile, summed (files)", "load (waits for C++)", "launches (defs)")


# ---- child: build one configuration and call it once ----------------------------------------------

def _build(model_name: str, config: str) -> tuple[Callable, tuple]:
    import torch
    from baselines import torch_best_practice_step  # this folder: the script's sys.path[0]

    import dlspass
    from dlspass.models import TinyGPT, copy_task_batch, gpt_loss

    torch.manual_seed(0)
    if model_name == "demo":
        return _build_demo(config)
    if model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2,
                                           n_head=2, attn_implementation="eager"))
        vocab, seq, batch = 256, 32, 8

        def loss_of(m: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return m(input_ids=idx, labels=tgt).loss
    else:
        vocab, d, seq, batch = 64, 128, 64, 16
        model = TinyGPT(vocab=vocab, d=d, n_layer=2, n_head=2, block_size=seq)

        def loss_of(m: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return gpt_loss(m, (idx, tgt))
    data = copy_task_batch(vocab, batch, seq, torch.Generator().manual_seed(0))
    if config == "torch":
        return torch_best_practice_step(model, loss_of, lr=1e-3), data
    # fused=True as in torch's best practice: dlspass.compile then runs torch's fused kernel
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def train_step(idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    kw: dict = {"mixed_precision": False}
    scaler = None
    if config in ("dls", "cb16"):
        scaler = dlspass.GradScaler(loss_scale="dynamic",
                                    fp16_type="cbfloat16" if config == "cb16" else "float16")
    if config == "cb16":
        kw = {}
    return dlspass.compile(train_step, optimizer=opt, scaler=scaler, **kw), data


def _build_demo(config: str) -> tuple[Callable, tuple]:
    """The steps ``dlspass demo`` compiles: its model, optimizer, step function and float16
    (``plain`` is its run without scaling; ``cb16`` the DLS step in cbfloat16; ``fp32`` the DLS
    step without lowering (``mixed_precision=False``); ``torch`` the
    same model and weighted loss in float32 under ``torch.compile`` with fused Adam and
    ``torch.amp.GradScaler``)."""
    import torch
    import torch.nn.functional as F
    from baselines import torch_best_practice_step

    import dlspass
    from dlspass.cli import demo
    from dlspass.models import copy_task_batch

    model, _ = demo._model_and_optimizer(0)
    # the demo's Adam, built fused=True as torch's best practice builds it
    opt = torch.optim.Adam(model.parameters(), lr=demo._LR, eps=demo._EPS, fused=True)
    idx, tgt = copy_task_batch(demo._VOCAB, demo._BATCH, demo._SEQ, torch.Generator().manual_seed(0))
    data = (idx, tgt, torch.tensor(1.0))
    if config == "torch":
        def weighted(m: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor,
                     spike: torch.Tensor) -> torch.Tensor:
            logits = m(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
            return loss * demo.LOSS_WEIGHT * spike

        return torch_best_practice_step(model, weighted, torch.optim.Adam, lr=demo._LR,
                                        eps=demo._EPS), data
    fmt = "cbfloat16" if config == "cb16" else demo._FORMAT
    scaler = (dlspass.GradScaler(loss_scale="dynamic", fp16_type=fmt,
                                 steps_per_increase=demo._STEPS_PER_INCREASE)
              if config in ("dls", "cb16", "fp32") else None)
    return dlspass.compile(demo._step_fn(model, opt), optimizer=opt, scaler=scaler, fp16_type=fmt,
                           mixed_precision=config != "fp32"), data


def _time_dlspass_passes() -> dict[str, float]:
    """Wrap the dlspass graph passes so their time is recorded (seconds, summed)."""
    import dlspass.capture.step_pipeline as sp

    spent: dict[str, float] = {"dlspass passes": 0.0}

    def timed(fn: Callable) -> Callable:
        def run(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["dlspass passes"] += time.perf_counter() - t0
        return run

    # every front end calls it through the module (dlspass.capture.aot for dlspass.compile)
    sp.run_step_pipeline = timed(sp.run_step_pipeline)
    return spent


def child(model_name: str, config: str, saved: str = "") -> dict:
    t_import = time.perf_counter()
    import torch
    from torch._dynamo.utils import compile_times, counters
    from torch._inductor.utils import run_and_get_code

    from dlspass.debug.kernel_count import count_kernels

    torch.set_num_threads(1)
    import_s = time.perf_counter() - t_import
    spent = _time_dlspass_passes()
    step, data = _build(model_name, config)
    t0 = time.perf_counter()
    if saved:  # "save:PATH" or "load:PATH": the save or the load is part of the first call
        mode, path = saved.split(":", 1)
        if mode == "save":
            step.save(path, *data)
        else:
            step.load(path)
        step(*data)
        codes: list[str] = []  # nothing compiles at the call: no code to count kernels in
    else:
        _, codes = run_and_get_code(step, *data)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    step(*data)
    second = time.perf_counter() - t1
    raw = compile_times(repr="csv")
    keys, values = raw
    timers = dict(zip(keys, values, strict=True))
    files = str(timers.get("compile_file", "")).split(",") if "compile_file" in timers else []
    kc = count_kernels(codes)
    return {
        "model": model_name, "config": config, "import_s": import_s, "first_call_s": first,
        "second_call_s": second, "timers": timers, "dlspass_passes_s": spent["dlspass passes"],
        "cpp_files": len(files),
        "launches": kc.launches, "definitions": kc.definitions, "extern": kc.extern_launches,
        "counters": {k: dict(v) for k, v in counters.items()
                     if k in ("inductor", "aot_autograd", "stats", "graph_break")},
    }


# ---- parent: one child per configuration -------------------------------------------------------

def run_child(model_name: str, config: str, cache_dir: str, saved: str = "") -> dict:
    import resource

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, __file__, "--child", model_name, config,
                          *([saved] if saved else [])],
                         capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{model_name}/{config} failed:\n{res.stderr[-4000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["process_s"] = wall
    # CPU time of the child and its compiler subprocesses: on a loaded machine the steadier
    # measure of what the compile costs (an idle 2-core machine's wall time is close to it)
    out["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out


def _sum(timers: dict, key: str) -> float:
    """A compile_times timer summed over its calls (``repr="csv"`` gives "a, b" for repeats)."""
    v = timers.get(key)
    return 0.0 if v in (None, "") else sum(float(x) for x in str(v).split(","))


def condensed(r: dict) -> list[str]:
    """One table row: the first call split into exclusive parts (seconds)."""
    t = r["timers"]
    restarted = _sum(t, "compile_attempt_0") if "compile_attempt_1" in t else 0.0
    inductor = _sum(t, "compile_fx_inner")
    front = _sum(t, "_compile.compile_inner") - restarted - inductor
    codegen = _sum(t, "Scheduler.codegen")
    cells = [r["first_call_s"], restarted, front,
             r["dlspass_passes_s"] if r["config"] != "torch" else None,
             inductor, _sum(t, "GraphLowering.run"), _sum(t, "Scheduler.__init__"), codegen]
    out = ["" if v is None else f"{v:.1f}" for v in cells]
    out.append(f"{_sum(t, 'compile_file'):.1f} ({r['cpp_files']})")
    out.append(f"{_sum(t, 'PyCodeCache.load_by_key_path'):.1f}")
    out.append(f"{r['launches']} ({r['definitions']})")
    return out


def table(rows: list[dict]) -> str:
    head = ["model", "config", "cache", "process CPU (s)", "process wall (s)", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cpu = r.get("cpu_s")
        cells = [r["model"], r["config"], r["cache"], "" if cpu is None else f"{cpu:.1f}",
                 f"{r['process_s']:.1f}", *condensed(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="tinygpt")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--warm", action="store_true", help="also run each config again on its cache")
    ap.add_argument("--saved", action="store_true",
                    help="also save each dlspass step ahead of time and load it in a fresh process")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs="+", metavar="MODEL CONFIG [MODE:PATH]", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return ""
    rows = []
    for config in args.configs.split(","):
        cache = tempfile.mkdtemp(prefix=f"dlspass-breakdown-{config}-")
        rows.append({**run_child(args.model, config, cache), "cache": "cold"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.warm:
            rows.append({**run_child(args.model, config, cache), "cache": "warm"})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.saved and config != "torch":
            path = os.path.join(tempfile.mkdtemp(prefix="dlspass-saved-"), "step.dlstep")
            saving = tempfile.mkdtemp(prefix=f"dlspass-breakdown-{config}-save-")
            # the load in an empty folder (another machine: inductor's kernels are compiled
            # from the C++ source the file carries) and in the saving process's folder (as
            # torch's warm start: the compiled kernels are there)
            for mode, cache, label in (
                    ("save", saving, "aot save"),
                    ("load", tempfile.mkdtemp(prefix=f"dlspass-breakdown-{config}-load-"),
                     "aot load, empty cache"),
                    ("load", saving, "aot load, warm cache")):
                rows.append({**run_child(args.model, config, cache, f"{mode}:{path}"),
                             "cache": label})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        out = json.dumps(rows, indent=1)
    else:
        load = os.getloadavg()[0]
        out = (f"Command: `.venv/bin/python tools/bench/compile_breakdown.py "
               f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
               f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} "
               f"at the end, 1 intra-op thread.\n\n" + table(rows))
    print(out)
    return out


if __name__ == "__main__":
    main()
