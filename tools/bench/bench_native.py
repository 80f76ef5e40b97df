"""Benchmark: native 16-bit training steps of dlspass against torch's best practice per format.

Models (``--models``): ``gpt`` (``dlspass.models.MHAGPT``: d 384, 4 layers of
``nn.MultiheadAttention``, 6 heads, vocab 1024, batch 16x128), ``gpt2`` (transformers
``GPT2LMHeadModel``, small config: d 256, 4 layers, vocab 1024, batch 16x128) and ``resnet18``
(transformers ``ResNetForImageClassification``, the ResNet-18 layout, 10 classes, batch 16 of
3x64x64). AdamW everywhere. Variants, each compiled with inductor:

- ``fp32``: ``torch.compile(model)``, fused AdamW, float32;
- ``torch-<fmt>``: the same under ``torch.autocast(dtype=<fmt>)`` (float16 adds
  ``torch.amp.GradScaler``): torch's best practice for the format;
- ``dlspass-<fmt>``: ``dlspass.compile`` of the whole step with a dynamic ``dlspass.GradScaler``
  in the default precision mode: native 16-bit kernels for float16 and bfloat16, the emulated
  format for cbfloat16 (``--formats cbfloat16``: no torch variant, compare with fp32);
- ``emulate-<fmt>`` (only with ``--emulate``): ``dlspass.compile`` with
  ``precision_mode="emulate"``, the format rounded in float32 kernels.

Reported per model and variant: the steady step (median over ``--repeats`` interleaved samples of
``--steps`` steps each, every variant built in this one process), the first call (compile
included) and the step's peak memory above what was resident when it started (the activations
saved for the backward and the temporaries; median of three steady steps): on CUDA
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, on Linux CPUs the
process's resident high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) over its
resident size after ``malloc_trim``, with glibc's mmap threshold fixed at 1 MiB so that large
tensors go back to the system when freed. Parameters and optimizer state, resident before the
step, are not in it (every variant keeps float32 master weights and AdamW state alike).

Prints a markdown table (and writes it to ``--out``) headed by the command and the machine.
The measurement (all three models, bfloat16 and float16), on a quiet machine (one process,
nothing else running; about 15 minutes on 2 CPU cores):

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_native.py --emulate --out tools/bench/results/native.md

and the cbfloat16 goal (emulated step against fp32 compiled):
``... bench_native.py --formats cbfloat16``. On CUDA: ``tools/bench/gpu_check.sh``. A smoke
run (``--small``: tiny models, seconds of steady time, compile dominated; the numbers mean
nothing): ``... bench_native.py --small --models gpt --repeats 1 --steps 1``. ``--large`` (for
GPUs): the GPT at d 1024, 8 layers, 16 heads, vocab 8192, batch 16x512; GPT-2 at d 768, 6 layers,
12 heads, vocab 8192, batch 16x512; ResNet-18 on batch 64 of 3x128x128.

``--zoo`` takes the compatibility matrix's models instead (``tests/models/zoo.py``, their own
tiny sizes: ``gpt2``, ``bert``, ``t5``, ``vit``, ``resnet``, ``convnext``, ``mhagpt``,
``graph_break``); ``graph_break``'s step is not one graph, which ``dlspass.compile`` refuses by
design, so its dlspass variant is ``backend-<fmt>``: ``torch.compile(model, backend="dlspass")``
in the native format with fused AdamW, torch's best practice's shape with dlspass's lowering in
place of autocast. ``--launches`` adds kernel launches per step (the kernels in the code
inductor generates at the first call plus the ATen ops a steady step runs outside compiled
code, ``dlspass.debug.kernel_count``, as tests/test_kernel_launches.py counts them);
``--alloc-peak`` reads the CPU step's peak from the allocator's own events (exact, for models
too small for the resident size); ``--clock cpu`` times the steps by the process's CPU time
(`_timed`: on a shared machine, for steps of a few milliseconds); ``--no-fp32`` leaves the fp32
variant out. The matrix's bfloat16 rows of issue 32 (tools/bench/RESULTS.md):

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_native.py --zoo --formats bfloat16 --no-fp32 --launches --alloc-peak --clock cpu --repeats 15 --steps 10 --out tools/bench/results/native_zoo_bf16.md
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from baselines import (  # this folder: sys.path[0]
    run_and_report,
    torch_best_practice_step,
    whole_step,
)
from torch import Tensor, nn

import dlspass
from dlspass.debug.kernel_count import compiled_launches
from dlspass.models import MHAGPT

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SIZES = ("small", "default", "large")
Batch = tuple[Tensor, ...]


# ---- models: (model, loss_of(model, *batch), batch) -------------------------------------------

def _tokens(batch: int, seq: int, vocab: int, device: str) -> Batch:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)


def _gpt(size: str, device: str) -> tuple[nn.Module, Callable[..., Tensor], Batch]:
    d, layers, heads, vocab, batch, seq = {"small": (64, 2, 4, 128, 4, 32),
                                           "default": (384, 4, 6, 1024, 16, 128),
                                           "large": (1024, 8, 16, 8192, 16, 512)}[size]
    model = MHAGPT(vocab=vocab, d=d, n_layer=layers, n_head=heads, block_size=seq)

    def loss_of(m: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
        logits = m(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, loss_of, _tokens(batch, seq, vocab, device)


def _gpt2(size: str, device: str) -> tuple[nn.Module, Callable[..., Tensor], Batch]:
    from transformers import GPT2Config, GPT2LMHeadModel

    d, layers, heads, vocab, batch, seq = {"small": (64, 2, 2, 128, 4, 32),
                                           "default": (256, 4, 4, 1024, 16, 128),
                                           "large": (768, 6, 12, 8192, 16, 512)}[size]
    cfg = GPT2Config(n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)

    def loss_of(m: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
        return m(input_ids=idx, labels=idx).loss

    return model, loss_of, _tokens(batch, seq, vocab, device)


def _resnet18(size: str, device: str) -> tuple[nn.Module, Callable[..., Tensor], Batch]:
    from transformers import ResNetConfig, ResNetForImageClassification

    if size == "small":
        cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                           num_labels=10)
        batch, pixels = 4, 32
    else:
        cfg = ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                           layer_type="basic", num_labels=10)
        batch, pixels = (64, 128) if size == "large" else (16, 64)
    model = ResNetForImageClassification(cfg)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, pixels, pixels, generator=g).to(device)
    labels = torch.randint(0, 10, (batch,), generator=g).to(device)

    def loss_of(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return m(pixel_values=x, labels=y).loss

    return model, loss_of, (images, labels)


MODELS = {"gpt": _gpt, "gpt2": _gpt2, "resnet18": _resnet18}

# the compatibility matrix's models (tests/models/zoo.py: tiny configs, docs/COMPATIBILITY.md),
# ``--zoo``; the names of this file's three models there
ZOO_MODELS = ("gpt2", "bert", "t5", "vit", "resnet", "convnext", "mhagpt", "graph_break")
ZOO_NAMES = {"gpt": "mhagpt", "gpt2": "gpt2", "resnet18": "resnet"}
# steps that are not one graph: ``dlspass.compile`` refuses them by design (docs/COMPATIBILITY.md,
# reason 2), so their dlspass variant is the model-graph entry point (``backend-<fmt>``)
ZOO_NOT_ONE_GRAPH = ("graph_break",)


def zoo_model(name: str, device: str) -> tuple[nn.Module, Callable[..., Tensor], Batch]:
    """A model of the compatibility matrix (``tests/models/zoo.py``, by its name there) in this
    file's shape; its batch ends with the zoo's loss multiplier (1.0)."""
    zoo_dir = str(Path(__file__).resolve().parents[2] / "tests" / "models")
    if zoo_dir not in sys.path:
        sys.path.insert(0, zoo_dir)
    import zoo

    case = zoo.MODELS[name]()

    def loss_of(m: nn.Module, *batch: Tensor) -> Tensor:
        return case.loss_fn(m, batch)

    return case.model, loss_of, tuple(t.to(device) for t in case.batch)


# ---- variants: step(*batch) -> loss ------------------------------------------------------------

def _torch_step(model: nn.Module, loss_of: Callable[..., Tensor], device: str,
                fmt: str | None) -> Callable[..., Tensor]:
    """torch's best practice: compiled model, fused AdamW, autocast (and GradScaler for float16)."""
    return torch_best_practice_step(model, loss_of, lr=1e-4, device=device,
                                    autocast_dtype=DTYPES[fmt] if fmt else None,
                                    scale=fmt == "float16")


def _dlspass_step(model: nn.Module, loss_of: Callable[..., Tensor], fmt: str, device: str,
                  mode: str | None) -> Callable[..., Tensor]:
    """``dlspass.compile`` of the whole step with a dynamic scaler; ``mode`` None: the config's
    default precision mode (native for float16 and bfloat16, emulate for cbfloat16)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = dlspass.GradScaler(config=dlspass.DLSConfig(fp16_type=fmt), device=device)
    return dlspass.compile(whole_step(model, loss_of, opt), optimizer=opt, scaler=scaler, precision_mode=mode)


def _backend_step(model: nn.Module, loss_of: Callable[..., Tensor], fmt: str,
                  device: str) -> Callable[..., Tensor]:
    """dlspass's model-graph entry point in torch's best practice's shape, for a model whose
    step is not one graph (``dlspass.compile`` refuses a graph break by design):
    ``torch.compile(model, backend="dlspass")`` in the native format, fused AdamW and, for
    float16, the eager ``dlspass.GradScaler``."""
    cfg = dlspass.DLSConfig(fp16_type=fmt)
    return torch_best_practice_step(
        model, loss_of, lr=1e-4, device=device, scale=False, backend="dlspass",
        backend_options={"config": cfg, "precision_mode": "native"},
        scaler=dlspass.GradScaler(config=cfg, device=device) if fmt == "float16" else None)


def build(model_name: str, variant: str, device: str, size: str,
          zoo: bool = False) -> tuple[Callable[..., Tensor], Batch]:
    """The step of ``variant`` on a fresh ``model_name`` (same seed for every variant);
    ``zoo``: ``model_name`` is a compatibility-matrix model (`zoo_model`, its own size)."""
    torch.manual_seed(0)
    model, loss_of, batch = zoo_model(model_name, device) if zoo else MODELS[model_name](size, device)
    model.to(device).train()
    kind, _, fmt = variant.partition("-")
    if kind == "fp32":
        return _torch_step(model, loss_of, device, None), batch
    if kind == "torch":
        return _torch_step(model, loss_of, device, fmt), batch
    if kind == "backend":
        return _backend_step(model, loss_of, fmt, device), batch
    return _dlspass_step(model, loss_of, fmt, device, None if kind == "dlspass" else "emulate"), batch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step: Callable[..., Tensor], batch: Batch, steps: int, device: str,
           clock: str = "wall") -> float:
    """Seconds per step over ``steps`` calls. ``clock="cpu"`` (CPU device only): the process's
    CPU time instead of the wall clock. With one intra-op thread the step's work is this
    process's CPU time, which other jobs on a shared machine do not add to (they add waits to
    the wall clock, in bursts that a few-millisecond step cannot average out)."""
    now = time.process_time if clock == "cpu" and device == "cpu" else time.perf_counter
    _sync(device)
    t0 = now()
    for _ in range(steps):
        step(*batch)
    _sync(device)
    return (now() - t0) / steps


# ---- memory: one step's peak above what was resident when it began -----------------------------

_LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
if _LIBC is not None:
    # M_MMAP_THRESHOLD (-3) fixed at 1 MiB: large tensors are mmapped and unmapped when freed,
    # so the resident size follows the live tensors instead of glibc's grown heap
    _LIBC.mallopt(-3, 1 << 20)


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def step_peak_mb(step: Callable[..., Tensor], batch: Batch, device: str) -> float | None:
    """MB one call of ``step`` holds at its peak beyond what was resident before it (None where
    the platform gives no way to read it)."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(*batch)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    if _LIBC is None:
        return None
    _LIBC.malloc_trim(0)
    base = _proc_status_bytes("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    step(*batch)
    return (_proc_status_bytes("VmHWM:") - base) / 2**20


def step_alloc_peak_mb(step: Callable[..., Tensor], batch: Batch) -> float:
    """MB one call of ``step`` holds allocated at its peak beyond what was allocated when it
    began, from the CPU allocator's own events (``torch.profiler`` memory events summed in the
    order they happened): exact and independent of load and of the C library's heap, so it
    serves models too small for the resident size (`step_peak_mb`) to see."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(*batch)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak / 2**20


def eager_launches(step: Callable[..., Tensor], batch: Batch) -> list[str]:
    """The ATen ops one steady call of ``step`` runs outside compiled code, each at its
    outermost call (``eager_ops``, as tests/test_kernel_launches.py counts them)."""
    from torch.profiler import ProfilerActivity, profile

    from dlspass.debug.kernel_count import eager_ops

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(*batch)
    return eager_ops(prof.events())


def run_model(model_name: str, variants: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    if args.zoo and model_name in ZOO_NOT_ONE_GRAPH:  # dlspass.compile refuses it by design
        variants = [v.replace("dlspass-", "backend-") for v in variants]
    torch._dynamo.reset()  # the previous model's graphs are done with; this model's all stay alive
    rows: dict[str, dict[str, Any]] = {}
    built: dict[str, tuple[Callable[..., Tensor], Batch]] = {}
    for v in variants:
        try:
            step, batch = build(model_name, v, args.device, args.size, args.zoo)
            _sync(args.device)
            t0 = time.perf_counter()
            if args.launches:  # the first call compiles: count the kernels of the code it generates
                k = compiled_launches(step, *batch)
            else:
                step(*batch)
            _sync(args.device)
            rows[v] = {"first_s": time.perf_counter() - t0, "samples": []}
            if args.launches:
                step(*batch)  # the optimizer state exists from here on: the counted step is steady
                rows[v].update(compiled=k.launches + k.extern_launches, eager=eager_launches(step, batch))
            built[v] = (step, batch)
        except Exception as e:  # a failing variant is a row of the report, not the end of it
            traceback.print_exc()
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            rows[v] = {"error": f"{type(e).__name__}: {first}"}
    for _ in range(args.repeats):  # interleaved: every variant sees the same machine load
        for v, (step, batch) in built.items():
            rows[v]["samples"].append(_timed(step, batch, args.steps, args.device, args.clock))
    for v, (step, batch) in built.items():
        rows[v]["step_ms"] = 1000 * statistics.median(rows[v].pop("samples"))
        if args.alloc_peak and args.device == "cpu":
            rows[v]["peak_mb"] = step_alloc_peak_mb(step, batch)  # exact: one call is enough
            continue
        peaks = [step_peak_mb(step, batch, args.device) for _ in range(3)]
        rows[v]["peak_mb"] = None if None in peaks else statistics.median(peaks)
    return rows


def report(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace, command: str) -> str:
    dev = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine())
    peak_kind = ("allocated (CPU allocator's events)" if args.alloc_peak and args.device == "cpu"
                 else "above what was resident")
    lines = [f"# Native 16-bit steps vs torch best practice ({args.device}: {dev})", "",
             f"`{command}`; torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
             f"{args.repeats} interleaved samples of {args.steps} steps, medians of "
             f"{'process CPU time' if args.clock == 'cpu' and args.device == 'cpu' else 'wall time'}; sizes: "
             f"{'the compatibility matrix (tests/models/zoo.py)' if args.zoo else args.size}; "
             f"step peak: {peak_kind}", ""]
    launch_head = " | launches (compiled + eager) | launches vs torch" if args.launches else ""
    for model_name, rows in results.items():
        lines += [f"## {model_name}", "",
                  "| variant | ms/step | vs fp32 | vs torch same format | first call (s) | step peak (MB) "
                  f"| peak vs torch same format{launch_head} |",
                  "|---" * (7 + 2 * args.launches) + "|"]
        base = rows.get("fp32", {}).get("step_ms")
        for v, r in rows.items():
            if "error" in r:
                lines.append(f"| {v} | failed: {r['error']} |" + " |" * (5 + 2 * args.launches))
                continue
            fmt = v.partition("-")[2]
            ref = rows.get(f"torch-{fmt}", {})
            mine = not v.startswith(("torch", "fp32"))
            mem = r.get("peak_mb")
            cells = [v, f"{r['step_ms']:.2f}", _ratio(r["step_ms"], base),
                     _ratio(r["step_ms"], ref.get("step_ms")) if mine else "",
                     f"{r['first_s']:.1f}", "" if mem is None else f"{mem:.3f}",
                     _ratio(mem, ref.get("peak_mb")) if mine and mem is not None else ""]
            if args.launches:
                cells += [_launch_parts(r), _launch_cmp(r, ref) if mine else ""]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if args.launches:
            lines += [f"- {v} eager ops: " + (", ".join(f"{k} x{n}" for k, n in sorted(Counter(r["eager"]).items()))
                                              or "none")
                      for v, r in rows.items() if "eager" in r]
            lines.append("")
    return "\n".join(lines)


def _launches(r: dict[str, Any]) -> int:
    return r["compiled"] + len(r["eager"])


def _launch_parts(r: dict[str, Any]) -> str:
    return f"{r['compiled']} + {len(r['eager'])} = {_launches(r)}"


def _launch_cmp(r: dict[str, Any], ref: dict[str, Any]) -> str:
    if "compiled" not in ref:
        return ""
    return "ok" if _launches(r) <= _launches(ref) else "MORE"


def _ratio(x: float, base: float | None) -> str:
    return f"{x / base:.2f}" if base else ""


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", nargs="+",
                        help=f"default: all of {', '.join(MODELS)} (with --zoo: all the matrix's models)")
    parser.add_argument("--formats", nargs="+", default=["bfloat16", "float16"],
                        choices=[*DTYPES, "cbfloat16"],
                        help="cbfloat16 has no torch variant: its dlspass step is emulated")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed sample")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--small", dest="size", action="store_const", const="small",
                       help="smoke sizes for every model")
    sizes.add_argument("--large", dest="size", action="store_const", const="large",
                       help="GPU sizes for every model")
    parser.add_argument("--emulate", action="store_true", help="also time dlspass's emulated format")
    parser.add_argument("--out", type=Path, help="also write the markdown table here (after each model)")
    parser.add_argument("--zoo", action="store_true",
                        help=f"the compatibility matrix's models instead (tests/models/zoo.py: {', '.join(ZOO_MODELS)})")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: time steps by the process's CPU time (CPU device; see _timed)")
    parser.add_argument("--no-fp32", dest="fp32", action="store_false", help="leave out the fp32 variant")
    parser.add_argument("--launches", action="store_true",
                        help="count kernel launches per step (compiled + eager; dlspass.debug.kernel_count)")
    parser.add_argument("--alloc-peak", action="store_true",
                        help="CPU: the step's peak from the allocator's events (exact; for small models)")
    parser.set_defaults(size="default")
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = list(ZOO_MODELS if args.zoo else MODELS)
    bad = set(args.models) - set(ZOO_MODELS if args.zoo else MODELS)
    if bad:
        parser.exit(2, f"bench_native: unknown model(s) {sorted(bad)}{' with --zoo' if args.zoo else ''}\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "bench_native: --device cuda but torch sees no CUDA device\n")
    variants = ["fp32"] if args.fp32 else []
    for fmt in args.formats:
        if fmt not in DTYPES:
            variants.append(f"dlspass-{fmt}")
            continue
        variants += [f"torch-{fmt}", f"dlspass-{fmt}", *([f"emulate-{fmt}"] if args.emulate else [])]
    command = "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "(unset)") + " python " + \
        " ".join([str(Path(__file__).relative_to(Path.cwd())) if Path.cwd() in Path(__file__).parents
                  else __file__, *(argv if argv is not None else sys.argv[1:])])
    jobs = [(m, lambda m=m: run_model(m, variants, args)) for m in args.models]
    return run_and_report(jobs, lambda results: report(results, args, command), args.out)


if __name__ == "__main__":
    main()
