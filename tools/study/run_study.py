"""Mixed-precision study: does loss scaling rescue 16-bit gradients? (Micikevicius et al., 2018)

Trains two models from outside dlspass, randomly initialised, with dlspass's captured training
step (``dlspass.capture_step``: forward + backward + optimizer as one FX graph, every
mm/bmm/conv input and output rounded to the 16-bit format in the forward AND the backward):

- ``gpt2``: Hugging Face ``transformers`` ``GPT2LMHeadModel`` (2 layers, 64 wide, 2 heads,
  byte-level vocabulary of 256, eager attention so every matmul is an aten op) on a byte corpus
  made of the Python standard library's docstrings (shipped with the interpreter, no download);
- ``lenet``: LeNet-5 (LeCun et al., 1998; ReLU and max-pooling, convolutions padded for 8x8
  inputs) on scikit-learn's ``load_digits`` (1797 8x8 images shipped with the package).

Runs (each with seeds 0, 1, 2): fp32; float16 / cbfloat16 / bfloat16 with no scaling; float16
with static scales 8, 128 and 32768; dlspass DLS for float16 and cbfloat16 (cerebras policy,
default initial scales 2**15 and 2**31, ``steps_per_increase`` shortened to 50 so the scale
moves within a few hundred steps); ``torch.amp.GradScaler`` on the eager model under an aten
dispatch mode that rounds exactly the ops the precision pass rounds (init 2**16,
``growth_interval`` 50).

Two settings per model: ``natural`` (the plain mean loss) and ``stress`` (the loss multiplied
by a small power of two, as a large-batch or long-sequence mean reduction would do; Adam's
``eps`` is multiplied by the same factor, which makes Adam invariant to it in exact arithmetic,
so the fp32 runs of both settings match). The
gradient probe records, on the fp32 run of seed 0 at the first, middle and last step, the
histogram of log2|g| of activation gradients (the gradient entering every Linear/Conv1D/Conv2d
backward, what the 16-bit backward matmul reads) and weight gradients, and the fraction of
elements that are zero in fp32, zero after rounding to float16 / cbfloat16 (unscaled and
scaled), and zero when the backward itself runs in 16 bits.

Command (writes ``results.json``, ``figures/*.png`` and ``RESULTS.md`` beside this file)::

    .venv/bin/python tools/study/run_study.py --jobs 2
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

HERE = Path(__file__).resolve().parent
SEEDS = (0, 1, 2)
GROWTH_INTERVAL = 50  # DLS steps_per_increase and torch.amp growth_interval
# Adam's eps scales with the stress factor: with both scaled by a power of two, Adam's update
# is the same in exact arithmetic, so the fp32 runs of the two settings train identically.
ADAM_EPS = 1e-8
HIST_LO, HIST_HI = -64, 16  # log2|g| histogram range (integer bins)
PROBE_FMTS = ("float16", "cbfloat16")
SHORT = {"float16": "fp16", "cbfloat16": "cb16", "bfloat16": "bf16"}


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    """One training configuration: ``kind`` is "captured" (dlspass) or "torch_amp" (eager)."""

    name: str
    kind: str
    fmt: str | None  # None: fp32
    loss_scale: str | float | None


RUNS = (
    RunSpec("fp32", "captured", None, None),
    RunSpec("fp16 no scaling", "captured", "float16", None),
    RunSpec("cb16 no scaling", "captured", "cbfloat16", None),
    RunSpec("bf16 no scaling", "captured", "bfloat16", None),
    RunSpec("fp16 static 8", "captured", "float16", 8.0),
    RunSpec("fp16 static 128", "captured", "float16", 128.0),
    RunSpec("fp16 static 32768", "captured", "float16", 32768.0),
    RunSpec("fp16 DLS (dlspass)", "captured", "float16", "dynamic"),
    RunSpec("cb16 DLS (dlspass)", "captured", "cbfloat16", "dynamic"),
    RunSpec("fp16 torch.amp.GradScaler", "torch_amp", "float16", "dynamic"),
)


def dls_config(spec: RunSpec) -> Any:
    """The ``DLSConfig`` a captured run uses."""
    from dlspass import DLSConfig

    if spec.fmt is None:
        return DLSConfig(mixed_precision=False, loss_scale=None)
    extra = {"steps_per_increase": GROWTH_INTERVAL} if spec.loss_scale == "dynamic" else {}
    return DLSConfig(fp16_type=spec.fmt, loss_scale=spec.loss_scale, **extra)


# ---------------------------------------------------------------------------------------------
# Eager 16-bit emulation (for torch.amp.GradScaler and the gradient probe)
# ---------------------------------------------------------------------------------------------

class Emulate16(TorchDispatchMode):
    """Round every float32 input and output of the precision pass's ops to ``fmt``.

    Works below autograd, so the backward's mm/bmm/convolution_backward are rounded too: the
    eager twin of ``LowerPrecisionPass`` (``dlspass.cli.demo.emulate_format`` rounds only around
    ``nn.Linear``, which misses GPT-2's ``Conv1D``, LeNet's ``Conv2d`` and attention's bmm).
    """

    def __init__(self, fmt: str) -> None:
        super().__init__()
        from dlspass.formats import get_format, round_to_format
        from dlspass.precision_policy import DEFAULT_LOWER_OPS

        self.fmt = get_format(fmt).name
        self._ops = DEFAULT_LOWER_OPS
        self._round = round_to_format

    def _r(self, t: Any) -> Any:
        if isinstance(t, Tensor) and t.dtype == torch.float32:
            return self._round(t, self.fmt)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._ops:
            return func(*args, **kwargs)
        args, kwargs = tree_map(self._r, (args, kwargs))
        return tree_map(self._r, func(*args, **kwargs))


@contextmanager
def maybe_emulate(fmt: str | None) -> Iterator[None]:
    """``Emulate16(fmt)`` or nothing for fp32."""
    if fmt is None:
        yield
        return
    with Emulate16(fmt):
        yield


# ---------------------------------------------------------------------------------------------
# Tasks: model, data, loss, evaluation
# ---------------------------------------------------------------------------------------------

_CORPUS_MODULES = (
    "os", "collections", "itertools", "functools", "json", "re", "string", "textwrap", "pathlib",
    "random", "statistics", "fractions", "decimal", "heapq", "bisect", "contextlib", "argparse",
    "logging", "dataclasses", "enum", "inspect", "pickle", "csv", "datetime", "calendar",
    "shutil", "tempfile", "glob", "fnmatch", "difflib", "unittest", "threading", "subprocess",
    "email", "urllib.parse", "zipfile", "tarfile", "gzip", "base64", "hashlib", "struct",
    "codecs", "io", "abc", "operator", "copy", "pprint", "weakref", "types", "queue", "sched",
    "configparser", "ast", "tokenize", "traceback", "warnings", "doctest", "timeit", "locale",
    "gettext", "optparse", "shlex", "cmd", "ipaddress", "mimetypes", "filecmp", "linecache",
)


def stdlib_corpus() -> bytes:
    """English text shipped with Python: the docstrings of fixed stdlib modules and members."""
    docs: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _CORPUS_MODULES:
            mod = importlib.import_module(name)
            if mod.__doc__:
                docs.append(inspect.cleandoc(mod.__doc__))
            for key in sorted(vars(mod)):
                obj = getattr(mod, key)
                doc = getattr(obj, "__doc__", None)
                if (not key.startswith("_") and isinstance(doc, str)
                        and (inspect.isfunction(obj) or inspect.isclass(obj))
                        and getattr(obj, "__module__", "") == mod.__name__):
                    docs.append(inspect.cleandoc(doc))
    return "\n\n".join(docs).encode("ascii", "replace")


class LeNet5(nn.Module):
    """LeNet-5 (conv 6, pool, conv 16, pool, fc 120, fc 84, fc 10) for 1x8x8 inputs."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


@dataclass
class Task:
    """A model, its data and how to train and evaluate it."""

    name: str
    title: str
    steps: int
    lr: float
    batch_size: int
    eval_every: int
    stress: float  # loss multiplier of the "stress" setting
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Any], Tensor]
    batches: Callable[[int], list[Any]]  # seed -> one batch per step
    evaluate: Callable[[nn.Module], dict[str, float]]
    has_accuracy: bool


_DATA: dict[str, Any] = {}


def _gpt2_task(steps: int) -> Task:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    seq, bsz = 64, 16
    if "corpus" not in _DATA:
        _DATA["corpus"] = torch.tensor(list(stdlib_corpus()), dtype=torch.long)
    data = _DATA["corpus"]
    split = int(0.9 * len(data))
    train, held = data[:split], data[split:]

    def build() -> nn.Module:
        cfg = GPT2Config(vocab_size=256, n_positions=seq, n_embd=64, n_layer=2, n_head=2,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = "eager"  # explicit matmuls, visible to the precision pass
        return GPT2LMHeadModel(cfg)

    def window(src: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        idx = starts[:, None] + torch.arange(seq + 1)
        chunk = src[idx]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        idx, tgt = batch
        logits = model(input_ids=idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    def batches(seed: int) -> list[Any]:
        g = torch.Generator().manual_seed(10_000 + seed)
        starts = torch.randint(0, len(train) - seq - 1, (steps, bsz), generator=g)
        return [window(train, s) for s in starts]

    eval_batches = [window(held, torch.linspace(0, len(held) - seq - 2, 8 * bsz).long()[i::8])
                    for i in range(8)]

    @torch.no_grad()
    def evaluate(model: nn.Module) -> dict[str, float]:
        model.eval()
        vals = [float(loss(model, b)) for b in eval_batches]
        model.train()
        return {"loss": sum(vals) / len(vals)}

    return Task("gpt2", "GPT-2 (transformers GPT2LMHeadModel, 2x64, byte LM on stdlib docstrings)",
                steps, 3e-3, bsz, max(steps // 8, 1), 2.0**-8, build, loss, batches, evaluate, False)


def _lenet_task(steps: int) -> Task:
    if "digits" not in _DATA:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
        _DATA["digits"] = (x[perm], y[perm])
    x, y = _DATA["digits"]
    n_train = 1437
    xtr, ytr, xte, yte = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    bsz = 64

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        xb, yb = batch
        return F.cross_entropy(model(xb), yb)

    def batches(seed: int) -> list[Any]:
        g = torch.Generator().manual_seed(20_000 + seed)
        idx = torch.randint(0, n_train, (steps, bsz), generator=g)
        return [(xtr[i], ytr[i]) for i in idx]

    @torch.no_grad()
    def evaluate(model: nn.Module) -> dict[str, float]:
        model.eval()
        logits = model(xte)
        model.train()
        return {"loss": float(F.cross_entropy(logits, yte)),
                "acc": float((logits.argmax(1) == yte).float().mean())}

    return Task("lenet", "LeNet-5 on scikit-learn digits (8x8, 1437 train / 360 test)",
                steps, 1e-3, bsz, max(steps // 8, 1), 2.0**-13, LeNet5, loss, batches, evaluate, True)


def make_task(name: str, quick: bool, stress_log2: int | None = None) -> Task:
    """The task ``name`` ("gpt2" or "lenet"); ``quick`` shortens training for smoke runs and
    ``stress_log2`` overrides the stress setting's loss multiplier 2**stress_log2."""
    if name == "gpt2":
        task = _gpt2_task(24 if quick else 480)
    elif name == "lenet":
        task = _lenet_task(24 if quick else 300)
    else:
        raise ValueError(f"unknown task {name!r}; choose gpt2 or lenet")
    if stress_log2 is not None:
        task.stress = 2.0**stress_log2
    return task


# ---------------------------------------------------------------------------------------------
# Gradient probe (the paper's histogram)
# ---------------------------------------------------------------------------------------------

_PROBED_TYPES = ("Linear", "Conv1D", "Conv2d")


def _hist(t: Tensor) -> list[int]:
    a = t.abs()
    nz = a[(a > 0) & torch.isfinite(a)]
    e = torch.floor(torch.log2(nz)).clamp(HIST_LO, HIST_HI - 1) - HIST_LO
    return torch.bincount(e.long(), minlength=HIST_HI - HIST_LO).tolist()


def _zero_frac(t: Tensor) -> float:
    return float((t == 0).float().mean())


def grads_of(task: Task, model: nn.Module, batch: Any, stress: float, fmt: str | None = None,
             scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """(activation gradients, weight gradients), flat, of one eager backward of ``loss*stress*scale``.

    With ``fmt`` the backward runs in 16-bit emulation; the returned values are divided by
    ``scale`` (exact: a power of two) so that they compare with the fp32 ones.
    """
    from dlspass.formats import round_to_format

    acts: list[Tensor] = []

    def hook(_m: nn.Module, _gi: Any, go: tuple) -> None:
        if go[0] is not None:
            g = go[0].detach().flatten()
            # what the 16-bit backward matmul reads: the gradient rounded to the format
            acts.append(g if fmt is None else round_to_format(g, fmt))

    handles = [m.register_full_backward_hook(hook) for m in model.modules()
               if type(m).__name__ in _PROBED_TYPES]
    try:
        model.zero_grad(set_to_none=True)
        with maybe_emulate(fmt):
            (task.loss(model, batch) * (stress * scale)).backward()
        w = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return torch.cat(acts) / scale, w / scale


def probe(task: Task, model: nn.Module, batch: Any, stress: float, step: int) -> dict[str, Any]:
    """Histograms and zero fractions of the fp32 gradients at ``step``, and in 16-bit backwards."""
    from dlspass import DLSConfig
    from dlspass.formats import get_format, round_to_format

    a32, w32 = grads_of(task, model, batch, stress)
    out: dict[str, Any] = {"step": step, "n_act": a32.numel(), "n_weight": w32.numel()}
    for kind, g in (("act", a32), ("weight", w32)):
        out[f"hist_{kind}"] = _hist(g)
        out[f"zero_fp32_{kind}"] = _zero_frac(g)
        for fmt in PROBE_FMTS:
            dls_scale = DLSConfig(fp16_type=fmt).init_scale
            scales = {"1": 1.0, "dls_init": dls_scale}
            if fmt == "float16":
                scales |= {"8": 8.0, "128": 128.0, "32768": 32768.0}
            for label, s in scales.items():
                r = round_to_format(g * s, fmt)
                out[f"zero_{SHORT[fmt]}_x{label}_{kind}"] = _zero_frac(r)
                out[f"inf_{SHORT[fmt]}_x{label}_{kind}"] = float((~torch.isfinite(r)).float().mean())
            out[f"fmt_scale_{SHORT[fmt]}"] = dls_scale
            out[f"min_subnormal_{SHORT[fmt]}"] = get_format(fmt).min_subnormal
    # The compound effect: a 16-bit backward where an underflowed activation gradient zeroes
    # everything computed from it further down.
    for fmt in PROBE_FMTS:
        for label, s in (("1", 1.0), ("dls_init", DLSConfig(fp16_type=fmt).init_scale)):
            a16, w16 = grads_of(task, model, batch, stress, fmt, s)
            out[f"zero_bwd_{SHORT[fmt]}_x{label}_act"] = _zero_frac(a16)
            out[f"zero_bwd_{SHORT[fmt]}_x{label}_weight"] = _zero_frac(w16)
            out[f"inf_bwd_{SHORT[fmt]}_x{label}_weight"] = float((~torch.isfinite(w16)).float().mean())
    return out


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def _fresh_model(task: Task, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return task.build()


def _train_seed(task: Task, spec: RunSpec, seed: int, stress: float, runner: Any,
                do_probe: bool) -> dict[str, Any]:
    """Train one seed; ``runner(model, batch) -> (loss, scale_used, skipped_so_far)``."""
    model, step_fn = runner(seed)
    batches = task.batches(seed)
    probe_at = {0, task.steps // 2, task.steps - 1} if do_probe else set()
    losses, scales, evals, probes = [], [], [], []
    evals.append({"step": 0, **task.evaluate(model)})
    skipped = 0
    for s, batch in enumerate(batches):
        if s in probe_at:
            probes.append(probe(task, model, batch, stress, s))
        loss, scale, skipped = step_fn(batch)
        losses.append(loss / stress)
        scales.append(scale)
        if (s + 1) % task.eval_every == 0 or s + 1 == task.steps:
            evals.append({"step": s + 1, **task.evaluate(model)})
    losses = [float(f"{x:.6g}") for x in losses]
    return {"seed": seed, "train_loss": losses, "scales": scales, "evals": evals,
            "skipped": skipped, "probes": probes}


def _captured_runner(task: Task, spec: RunSpec, stress: float) -> Callable[[int], Any]:
    import dlspass

    cfg = dls_config(spec)
    model = _fresh_model(task, 0)
    opt = torch.optim.Adam(model.parameters(), lr=task.lr, eps=ADAM_EPS * stress)

    def loss_fn(m: nn.Module, batch: Any) -> Tensor:
        return task.loss(m, batch) * stress

    # One capture per configuration; each seed resets the parameters, the optimizer state and
    # the scaler in place (the graph reads them fresh on every call).
    step = dlspass.capture_step(model, loss_fn, opt, task.batches(0)[0], config=cfg)

    def runner(seed: int) -> tuple[nn.Module, Callable[[Any], tuple[float, float, int]]]:
        with torch.no_grad():
            model.load_state_dict(_fresh_model(task, seed).state_dict())
        opt.state.clear()
        step.scaler = dlspass.GradScaler(config=cfg)

        def one(batch: Any) -> tuple[float, float, int]:
            scale = float(step.scaler.get_scale())
            loss = float(step(batch))
            return loss, scale, int(step.scaler.get_num_skipped_steps())

        return model, one

    return runner


def _torch_amp_runner(task: Task, spec: RunSpec, stress: float) -> Callable[[int], Any]:
    def runner(seed: int) -> tuple[nn.Module, Callable[[Any], tuple[float, float, int]]]:
        model = _fresh_model(task, seed)
        opt = torch.optim.Adam(model.parameters(), lr=task.lr, eps=ADAM_EPS * stress)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=GROWTH_INTERVAL)
        skipped = [0]

        def one(batch: Any) -> tuple[float, float, int]:
            scale = float(scaler.get_scale())
            opt.zero_grad(set_to_none=True)
            with Emulate16(spec.fmt):
                loss = task.loss(model, batch) * stress
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            # torch backs off exactly when it found an inf/NaN and skipped the step
            skipped[0] += int(float(scaler.get_scale()) < scale)
            return float(loss), scale, skipped[0]

        return model, one

    return runner


def run_job(job: tuple[str, str, int, bool, tuple[int, ...], int | None]) -> dict[str, Any]:
    """Train every seed of one (task, setting, run) and return its records."""
    task_name, setting, run_index, quick, seeds, stress_log2 = job
    torch.set_num_threads(1)  # tiny tensors: one thread per worker is fastest
    warnings.filterwarnings("ignore")
    task = make_task(task_name, quick, stress_log2)
    spec = RUNS[run_index]
    stress = task.stress if setting == "stress" else 1.0
    t0 = time.perf_counter()
    c0 = time.process_time()
    make = _captured_runner if spec.kind == "captured" else _torch_amp_runner
    runner = make(task, spec, stress)
    seeds_out = [_train_seed(task, spec, seed, stress, runner,
                             do_probe=spec.name == "fp32" and seed == seeds[0])
                 for seed in seeds]
    return {"task": task_name, "setting": setting, "run": asdict(spec), "stress": stress,
            "seconds": round(time.perf_counter() - t0, 1),
            "cpu_seconds": round(time.process_time() - c0, 1), "seeds": seeds_out}


# ---------------------------------------------------------------------------------------------
# Summaries, plots, report
# ---------------------------------------------------------------------------------------------

def _nan(x: float) -> float:
    return x if math.isfinite(x) else float("nan")


def _stats(xs: list[float]) -> dict[str, float]:
    fin = [x for x in xs if math.isfinite(x)]
    if len(fin) < len(xs) or not fin:
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan"),
                "n_diverged": len(xs) - len(fin)}
    m = sum(fin) / len(fin)
    sd = math.sqrt(sum((x - m) ** 2 for x in fin) / max(len(fin) - 1, 1))
    return {"mean": m, "std": sd, "min": min(fin), "max": max(fin), "n_diverged": 0}


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Final/best held-out loss (and accuracy), skipped steps and scales over the seeds."""
    seeds = rec["seeds"]

    def final(key: str) -> list[float]:
        return [_nan(s["evals"][-1].get(key, float("nan"))) for s in seeds]

    def best(key: str, fn: Callable[[list[float]], float]) -> list[float]:
        out = []
        for s in seeds:
            vals = [e[key] for e in s["evals"][1:] if key in e]
            fin = [v for v in vals if math.isfinite(v)]
            # a run that diverged has no "best" worth reporting past its divergence
            out.append(fn(fin) if fin and len(fin) == len(vals) else float("nan"))
        return out

    out = {"final_loss": _stats(final("loss")), "best_loss": _stats(best("loss", min)),
           "start_loss": _stats([s["evals"][0]["loss"] for s in seeds]),
           "skipped": [s["skipped"] for s in seeds],
           "final_scale": [s["scales"][-1] for s in seeds],
           "min_scale": [min(s["scales"]) for s in seeds]}
    if "acc" in seeds[0]["evals"][-1]:
        out["final_acc"] = _stats(final("acc"))
        out["best_acc"] = _stats(best("acc", max))
    return out


def verdict(s: dict[str, float], ref: dict[str, float], higher_is_better: bool = False) -> str:
    """"within" / "worse" / "better" than the fp32 seed range [min, max]; "diverged" for NaN."""
    if s.get("n_diverged") or not math.isfinite(s["mean"]):
        return "diverged"
    lo, hi = ref["min"], ref["max"]
    if lo <= s["mean"] <= hi:
        return "within"
    worse = s["mean"] < lo if higher_is_better else s["mean"] > hi
    return "worse" if worse else "better"


def _fmt(s: dict[str, float], pct: bool = False) -> str:
    if s.get("n_diverged"):
        return f"NaN ({s['n_diverged']} seed(s) diverged)"
    if pct:
        return f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f}"
    return f"{s['mean']:.4f} ± {s['std']:.4f}"


def plot_all(records: list[dict[str, Any]], fig_dir: Path) -> list[str]:
    """Loss curves, scale trajectories and gradient histograms as PNGs; returns file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["task"], r["setting"]), []).append(r)
    for (task, setting), recs in sorted(groups.items()):
        # held-out loss curves, mean over seeds with the min-max band
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in recs:
            # from the first evaluation after step 0: the drop from ln(vocab) hides the rest
            steps = [e["step"] for e in r["seeds"][0]["evals"]][1:]
            ys = [[e["loss"] for e in s["evals"]][1:] for s in r["seeds"]]
            mean = [sum(c) / len(c) for c in zip(*ys, strict=True)]
            style = "-" if r["run"]["name"] in ("fp32", "fp16 no scaling", "fp16 DLS (dlspass)",
                                                "cb16 DLS (dlspass)") else "--"
            (line,) = ax.plot(steps, mean, style, label=r["run"]["name"], lw=1.5)
            ax.fill_between(steps, [min(c) for c in zip(*ys, strict=True)],
                            [max(c) for c in zip(*ys, strict=True)], color=line.get_color(), alpha=0.12)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (fp32 eval)")
        stress = recs[0]["stress"]
        ax.set_title(f"{task}, {setting} (loss x 2^{math.log2(stress):.0f}): mean of 3 seeds, band = min..max")
        ax.legend(fontsize=7)
        name = f"loss_{task}_{setting}.png"
        fig.tight_layout()
        fig.savefig(fig_dir / name, dpi=110)
        plt.close(fig)
        names.append(name)
        # scale trajectories
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in recs:
            if r["run"]["loss_scale"] != "dynamic":
                continue
            for i, s in enumerate(r["seeds"]):
                skipped = "/".join(str(x["skipped"]) for x in r["seeds"])
                ax.plot([math.log2(v) for v in s["scales"]], lw=1,
                        label=f"{r['run']['name']} (skipped per seed {skipped})" if i == 0 else None,
                        color={"float16": "C0", "cbfloat16": "C1"}[r["run"]["fmt"]]
                        if r["run"]["kind"] == "captured" else "C2", alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("log2(loss scale)")
        ax.set_title(f"{task}, {setting}: loss-scale trajectories (3 seeds each)")
        ax.legend(fontsize=7)
        name = f"scale_{task}_{setting}.png"
        fig.tight_layout()
        fig.savefig(fig_dir / name, dpi=110)
        plt.close(fig)
        names.append(name)
        # the paper's histogram: log2|g| of fp32 gradients at step 0
        fp32 = next(r for r in recs if r["run"]["name"] == "fp32")
        pr = fp32["seeds"][0]["probes"][0]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        xs = list(range(HIST_LO, HIST_HI))
        for ax, kind, label in ((axes[0], "act", "activation gradients"),
                                (axes[1], "weight", "weight gradients")):
            h = pr[f"hist_{kind}"]
            tot = pr[f"n_{kind}"]
            ax.bar(xs, [c / tot for c in h], width=1.0, align="edge", color="C7", label="fp32")
            shift = int(math.log2(pr["fmt_scale_fp16"]))
            ax.step([x + shift for x in xs], [c / tot for c in h], where="post", color="C0",
                    lw=1, label=f"x 2^{shift} (fp16 DLS initial scale)")
            ax.axvspan(HIST_LO, -24, color="C3", alpha=0.10)
            ax.axvline(-24, color="C3", lw=1.2, label="fp16 min subnormal 2^-24")
            ax.axvline(-14, color="C3", lw=1, ls="--", label="fp16 min normal 2^-14")
            ax.axvline(16, color="C3", lw=1, ls=":", label="fp16 max ~2^16")
            ax.axvline(-39, color="C1", lw=1.2, label="cb16 min subnormal 2^-39")
            ax.set_yscale("log")
            ax.set_xlim(HIST_LO, HIST_HI + 20)
            ax.set_xlabel("log2 |g|")
            ax.set_ylabel("fraction of elements")
            ax.set_title(
                f"{label}: zero fp32 {100 * pr[f'zero_fp32_{kind}']:.2f}%, "
                f"fp16 {100 * pr[f'zero_fp16_x1_{kind}']:.2f}%, cb16 {100 * pr[f'zero_cb16_x1_{kind}']:.2f}%",
                fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
        fig.suptitle(f"{task}, {setting}: fp32 gradients at step 0 (seed 0); red band flushes to zero in float16")
        name = f"grad_hist_{task}_{setting}.png"
        fig.tight_layout()
        fig.savefig(fig_dir / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def _subnormal(p: dict[str, Any], kind: str, shift: int) -> float:
    """Fraction of ``kind`` gradients that are float16 subnormals (kept, with fewer significant
    bits) after scaling by 2**shift, from the exponent histogram: |g| in [2**-24, 2**-14)."""
    hist = p[f"hist_{kind}"]
    n = sum(c for e, c in enumerate(hist) if -24 <= e + HIST_LO + shift <= -15)
    return n / p[f"n_{kind}"]


def write_report(results: dict[str, Any], path: Path) -> str:
    """RESULTS.md from ``results`` (tables, underflow fractions, claim checks)."""
    records = results["records"]
    lines = [
        "# Mixed-precision study: 16-bit gradients with and without loss scaling",
        "",
        "Reproduces in small the central result of Micikevicius et al., *Mixed Precision Training*",
        "(ICLR 2018) with dlspass's captured training step. Generated by `tools/study/run_study.py`",
        "(its module docstring describes models, data and runs); every number below comes from",
        "`tools/study/results.json`, written by the same run.",
        "",
        f"Command: `{results['command']}`  ",
        f"Wall time: {results['seconds'] / 60:.1f} min with {results['jobs']} worker process(es) "
        f"on {results['cpus']} CPU core(s)"
        + (f" (CPU time of the training jobs: {sum(r['cpu_seconds'] for r in records) / 60:.1f} min)"
           if all("cpu_seconds" in r for r in records) else "")
        + f"; torch {results['torch']}, transformers "
        f"{results['transformers']}, scikit-learn {results['sklearn']}, Python {results['python']}.",
        "",
        "Conventions: losses are held-out cross-entropy evaluated in fp32 (the stress factor is",
        "divided out), reported as mean ± sample std over seeds 0, 1, 2. \"vs fp32\" compares the",
        "mean with the fp32 runs' seed range [min, max] of the same task and setting: `within`,",
        "`worse` (outside the range on the bad side), `better`, or `diverged` (NaN). Skipped steps",
        "are per seed. All 16-bit runs keep fp32 master weights, optimizer and reductions; only",
        "mm/bmm/addmm/conv inputs and outputs (forward and backward) are rounded.",
        "",
    ]
    header_len = len(lines)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["task"], r["setting"]), []).append(r)
    claims: list[str] = []
    for (task, setting), recs in sorted(groups.items()):
        title = results["titles"][task]
        stress = recs[0]["stress"]
        steps = len(recs[0]["seeds"][0]["train_loss"])
        fp32 = next(r for r in recs if r["run"]["name"] == "fp32")
        ref = summarize(fp32)
        has_acc = "final_acc" in ref
        lines += [f"## {task} — {setting}", "",
                  f"{title}; {steps} Adam steps; loss multiplied by 2^{math.log2(stress):.0f}"
                  + (" (stress setting)" if setting == "stress" else " (no stress)") + ".", ""]
        head = "| run | final loss | vs fp32 | best loss |"
        sep = "|---|---|---|---|"
        if has_acc:
            head += " final acc % | vs fp32 | best acc % |"
            sep += "---|---|---|"
        head += " skipped steps | final scale (log2) |"
        sep += "---|---|"
        lines += [head, sep]
        sums = {}
        for r in recs:
            s = summarize(r)
            sums[r["run"]["name"]] = s
            row = (f"| {r['run']['name']} | {_fmt(s['final_loss'])} | "
                   f"{verdict(s['final_loss'], ref['final_loss'])} | {_fmt(s['best_loss'])} |")
            if has_acc:
                row += (f" {_fmt(s['final_acc'], True)} | "
                        f"{verdict(s['final_acc'], ref['final_acc'], True)} | {_fmt(s['best_acc'], True)} |")
            scales = ", ".join(f"{math.log2(x):g}" if x > 0 else "-" for x in s["final_scale"])
            row += f" {', '.join(map(str, s['skipped']))} | {scales} |"
            lines.append(row)
        lines += ["", f"fp32 start loss {ref['start_loss']['mean']:.3f}, final "
                  f"{ref['final_loss']['mean']:.3f} "
                  f"({100 * (1 - ref['final_loss']['mean'] / ref['start_loss']['mean']):.0f}% lower).", ""]
        # underflow table from the fp32 probe
        probes = fp32["seeds"][0]["probes"]
        lines += [f"Gradient underflow (fp32 run, seed 0; % of elements that are zero). "
                  f"`round` = fp32 gradient x scale rounded once; `16-bit bwd` = the backward itself run "
                  f"in 16 bits (zeros propagate). DLS initial scale: fp16 2^{math.log2(probes[0]['fmt_scale_fp16']):.0f}, "
                  f"cb16 2^{math.log2(probes[0]['fmt_scale_cb16']):.0f}.", "",
                  "| step | grads | fp32 zero | fp16 round x1 | fp16 round xDLS | fp16 16-bit bwd x1 | "
                  "fp16 16-bit bwd xDLS | cb16 round x1 | cb16 round xDLS | cb16 16-bit bwd x1 | "
                  "cb16 16-bit bwd xDLS | fp16 inf xDLS | fp16 subnormal x1 | fp16 subnormal xDLS |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in probes:
            for kind in ("act", "weight"):
                def pc(key: str, p=p, kind=kind) -> str:
                    v = p.get(f"{key}_{kind}")
                    return "-" if v is None else f"{100 * v:.2f}"
                lines.append(
                    f"| {p['step']} | {kind} | {pc('zero_fp32')} | {pc('zero_fp16_x1')} | "
                    f"{pc('zero_fp16_xdls_init')} | {pc('zero_bwd_fp16_x1')} | {pc('zero_bwd_fp16_xdls_init')} | "
                    f"{pc('zero_cb16_x1')} | {pc('zero_cb16_xdls_init')} | {pc('zero_bwd_cb16_x1')} | "
                    f"{pc('zero_bwd_cb16_xdls_init')} | {pc('inf_fp16_xdls_init')} | "
                    f"{100 * _subnormal(p, kind, 0):.2f} | "
                    f"{100 * _subnormal(p, kind, int(math.log2(p['fmt_scale_fp16']))):.2f} |")
        p0 = probes[0]
        lines += ["", "Static fp16 scales at step 0 (round, activation gradients): zero "
                  + ", ".join(f"x{k} {100 * p0[f'zero_fp16_x{k}_act']:.2f}%" for k in ("8", "128", "32768"))
                  + "; overflow to inf " + ", ".join(f"x{k} {100 * p0[f'inf_fp16_x{k}_act']:.3f}%"
                                                      for k in ("8", "128", "32768")) + ".", ""]
        lines += [f"![loss]({'figures/'}loss_{task}_{setting}.png)",
                  f"![scale]({'figures/'}scale_{task}_{setting}.png)",
                  f"![gradients]({'figures/'}grad_hist_{task}_{setting}.png)", ""]
        # claim checks
        if "fp16 DLS (dlspass)" not in sums or "fp16 no scaling" not in sums:
            continue
        dls = sums["fp16 DLS (dlspass)"]
        rel = dls["final_loss"]["mean"] / ref["final_loss"]["mean"] - 1
        ok_loss = abs(rel) <= 0.02
        acc_txt = ""
        if has_acc:
            dacc = 100 * (dls["final_acc"]["mean"] - ref["final_acc"]["mean"])
            acc_txt = f", accuracy {dacc:+.1f} points"
            ok_loss = ok_loss or abs(dacc) <= 1.0
        fp16 = sums["fp16 no scaling"]
        v16 = verdict(fp16["final_loss"], ref["final_loss"])
        cuts = [1 - s["evals"][-1]["loss"] / s["evals"][0]["loss"] for s in fp32["seeds"]]
        cut = 1 - ref["final_loss"]["mean"] / ref["start_loss"]["mean"]
        claims.append(
            f"- **{task} / {setting}**: fp32 cuts the held-out loss by {100 * cut:.1f}% "
            f"(seeds {', '.join(f'{100 * c:.1f}%' for c in cuts)}) -> "
            f"{'HOLDS' if cut >= 0.5 else 'DOES NOT HOLD'} (>= 50%). "
            f"fp16 DLS final loss {rel * 100:+.2f}% vs fp32{acc_txt} "
            f"-> {'HOLDS' if ok_loss else 'DOES NOT HOLD'} (within 2% / 1 point). "
            f"fp16 without scaling: {_fmt(fp16['final_loss'])} vs fp32 {_fmt(ref['final_loss'])} "
            f"(range {ref['final_loss']['min']:.4f}..{ref['final_loss']['max']:.4f}) -> `{v16}` "
            f"({'HOLDS' if v16 in ('worse', 'diverged') else 'DOES NOT HOLD'}: worse than the fp32 spread); "
            f"activation gradients zero at step 0: fp32 {100 * p0['zero_fp32_act']:.2f}%, "
            f"fp16 round {100 * p0['zero_fp16_x1_act']:.2f}%, fp16 16-bit backward "
            f"{100 * p0['zero_bwd_fp16_x1_act']:.2f}%. cbfloat16 zero fraction: "
            f"{100 * p0['zero_cb16_x1_act']:.2f}% unscaled, {100 * p0['zero_cb16_xdls_init_act']:.2f}% "
            f"at 2^31 (16-bit backward: {100 * p0['zero_bwd_cb16_x1_act']:.2f}% / "
            f"{100 * p0['zero_bwd_cb16_xdls_init_act']:.2f}%).")
    lines = lines[:header_len] + ["## Claim checks (computed)", "", *claims, ""] + lines[header_len:]
    text = "\n".join(lines) + "\n"
    notes = HERE / "NOTES.md"
    if notes.exists():
        text += "\n" + notes.read_text(encoding="utf-8")
    path.write_text(text, encoding="utf-8")
    return text


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Run the study (see the module docstring); returns the process exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    ap.add_argument("--tasks", default="gpt2,lenet", help="comma-separated: gpt2, lenet")
    ap.add_argument("--settings", default="natural,stress", help="comma-separated: natural, stress")
    ap.add_argument("--runs", default="", help="comma-separated run indices (default: all)")
    ap.add_argument("--quick", action="store_true", help="1 seed, 24 steps: a smoke run")
    ap.add_argument("--seeds", type=int, default=len(SEEDS), help="number of seeds (default 3)")
    ap.add_argument("--stress", default="", help="override stress factors, e.g. gpt2=-8,lenet=-10 (log2)")
    ap.add_argument("--out", type=Path, default=HERE, help="folder for results.json, figures/, RESULTS.md")
    ap.add_argument("--report-only", action="store_true",
                    help="remake figures/ and RESULTS.md from an existing results.json (no training)")
    args = ap.parse_args(argv)
    if args.report_only:
        path = args.out / "results.json"
        if not path.exists():
            ap.error(f"--report-only: {path} does not exist; run the study first")
        results = json.loads(path.read_text(encoding="utf-8"))
        plot_all(results["records"], args.out / "figures")
        write_report(results, args.out / "RESULTS.md")
        print(f"wrote {args.out / 'RESULTS.md'} from {path}")
        return 0
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    tasks = [t for t in args.tasks.split(",") if t]
    settings = [s for s in args.settings.split(",") if s]
    for t in tasks:
        if t not in ("gpt2", "lenet"):
            ap.error(f"--tasks: unknown task {t!r}; choose gpt2, lenet")
    for s in settings:
        if s not in ("natural", "stress"):
            ap.error(f"--settings: unknown setting {s!r}; choose natural, stress")
    run_ids = [int(i) for i in args.runs.split(",") if i] or list(range(len(RUNS)))
    if 0 not in run_ids:
        run_ids = [0, *run_ids]  # fp32 is the reference of every comparison
    seeds = tuple(range(1 if args.quick else args.seeds))
    try:
        stress = {k: int(v) for k, v in (kv.split("=") for kv in args.stress.split(",") if kv)}
    except ValueError:
        ap.error(f"--stress: expected task=log2 pairs such as gpt2=-8, got {args.stress!r}")
    # Longest jobs first (GPT-2, then the slow emulated ones) so the pool ends together.
    jobs = [(t, s, i, args.quick, seeds, stress.get(t)) for t in tasks for s in settings
            for i in run_ids]
    jobs.sort(key=lambda j: (j[0] != "gpt2", RUNS[j[2]].fmt is None))
    from tqdm import tqdm

    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(jobs), desc="study", unit="run", file=sys.stderr, mininterval=0.5,
               ascii=not sys.stderr.isatty())
    if args.jobs == 1:
        for j in jobs:
            records.append(run_job(j))
            bar.set_postfix_str(f"{j[0]}/{j[1]}/{RUNS[j[2]].name}")
            bar.update()
    else:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=4) as pool:
            for rec in pool.imap_unordered(run_job, jobs):
                records.append(rec)
                bar.set_postfix_str(f"{rec['task']}/{rec['setting']}/{rec['run']['name']}")
                bar.update()
    bar.close()
    order = {(t, s, RUNS[i].name): k for k, (t, s, i) in enumerate(
        (t, s, i) for t in tasks for s in settings for i in run_ids)}
    records.sort(key=lambda r: order[(r["task"], r["setting"], r["run"]["name"])])
    import sklearn
    import transformers

    cmd = " ".join([".venv/bin/python", "tools/study/run_study.py", *(argv if argv is not None else sys.argv[1:])])
    results = {
        "command": cmd, "seconds": time.perf_counter() - t0, "jobs": args.jobs,
        "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "sklearn": sklearn.__version__, "python": platform.python_version(),
        "titles": {t: make_task(t, args.quick).title for t in tasks}, "seeds": list(seeds),
        "growth_interval": GROWTH_INTERVAL, "records": records,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results) + "\n", encoding="utf-8")
    plot_all(records, args.out / "figures")
    write_report(results, args.out / "RESULTS.md")
    print(f"wrote {args.out / 'RESULTS.md'} in {results['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    raise SystemExit(main())
