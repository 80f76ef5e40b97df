"""Benchmark: float8 training steps of dlspass against torchao's and against dlspass bfloat16.

Two parts, both printed as markdown (and written to ``--out``), headed by the command and the
machine:

- **counts** (``--counts``): per model of the compatibility matrix (``tests/models/zoo.py``) and
  the GPT on ``nn.MultiheadAttention`` at 2 layers, how many matmuls of one training step
  (forward and backward) run in float8: torchao 0.18.0's ``convert_to_float8_training``
  (counted as the matmuls that read its ``Float8TrainingTensor``, with ``emulate=True`` so that
  it runs on a CPU) and dlspass's ``float8="tensorwise"`` (the matmuls
  ``LowerMatmulsToFloat8Pass`` converted in the ``capture_step`` graph), out of the step's
  matmuls (``mm``, ``addmm``, ``bmm``).
- **time** (default): the GPT (``dlspass.models.MHAGPT``, d ``--d``, default 2048, where float8
  can pay on a GPU) trained by AdamW, steady step (median of ``--repeats`` interleaved samples of
  ``--steps`` steps) and first call, for
  ``dlspass-bf16`` (``dlspass.compile``, native bfloat16), ``dlspass-f8`` (the same with
  ``float8="tensorwise"``: ``torch._scaled_mm``) and ``torchao-f8``
  (``convert_to_float8_training`` + ``torch.compile(model)`` + fused AdamW under bfloat16
  autocast, torchao's recommended recipe with its native ``torch._scaled_mm``).

On a CPU the float8 kernel has no hardware support: the numbers say what this machine does,
not what float8 gains on an H100. Commands (about 10 minutes on 2 CPU cores):

    OMP_NUM_THREADS=2 .venv/bin/python tools/bench/bench_float8.py --counts --out tools/bench/results/float8_counts.md
    OMP_NUM_THREADS=2 .venv/bin/python tools/bench/bench_float8.py --out tools/bench/results/float8_time.md
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import dlspass
from dlspass.models import MHAGPT
from dlspass.passes.lower_matmuls_to_float8_pass import MATMUL_OPS, float8_decisions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "tests" / "models"), str(HERE)]
import zoo  # noqa: E402  (the matrix's own model factories)
from baselines import torch_best_practice_step, whole_step  # noqa: E402

MATRIX = ("gpt2", "bert", "t5", "vit", "resnet", "convnext", "mhagpt")


class _Float8Matmuls(TorchDispatchMode):
    """Counts the matmuls that read a torchao ``Float8TrainingTensor``."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        if func in MATMUL_OPS and any(isinstance(a, Float8TrainingTensor) for a in args):
            self.n += 1
        return func(*args, **(kwargs or {}))


def torchao_count(model: nn.Module, loss_fn: Callable[..., Tensor], batch: tuple) -> int:
    """Matmuls torchao runs in float8 in one forward and backward of ``model``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = convert_to_float8_training(copy.deepcopy(model), config=Float8LinearConfig(emulate=True))
    counter = _Float8Matmuls()
    with counter:
        loss_fn(converted, batch).backward()
    return counter.n


def dlspass_count(model: nn.Module, loss_fn: Callable[..., Tensor], batch: tuple) -> tuple[int, int]:
    """(matmuls converted, matmuls in the step) of dlspass's captured float8 step."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = dlspass.capture_step(model, loss_fn, opt, batch,
                                config=dlspass.DLSConfig(fp16_type="bfloat16", float8="tensorwise"))
    d = float8_decisions(step.graph_module.graph)
    matmuls = [v for v in d.values() if v["op"] in ("mm.default", "addmm.default", "bmm.default")]
    return sum(v["float8"] is not None for v in matmuls), len(matmuls)


def _gpt_case() -> zoo.Case:
    torch.manual_seed(0)
    ids = torch.randint(0, zoo.VOCAB, (zoo.BATCH, zoo.SEQ + 1))

    def loss_fn(m: nn.Module, b: tuple) -> Tensor:
        return F.cross_entropy(m(b[0]).reshape(-1, zoo.VOCAB), b[1].reshape(-1)) * b[-1]

    model = MHAGPT(vocab=zoo.VOCAB, d=32, n_layer=2, n_head=2, block_size=zoo.SEQ)
    return zoo.Case(model.train(), (ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.tensor(1.0)), loss_fn)


def counts() -> str:
    rows = ["| model | matmuls in the step | torchao float8 | dlspass float8 |", "|---|---|---|---|"]
    cases = [(name, getattr(zoo, name)) for name in MATRIX] + [("mhagpt, 2 layers", _gpt_case)]
    for name, factory in cases:
        case = factory()
        ours, total = dlspass_count(case.model, case.loss_fn, case.batch)
        theirs = torchao_count(case.model, case.loss_fn, case.batch)
        rows.append(f"| {name} | {total} | {theirs} | {ours} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


# ---- time ---------------------------------------------------------------------------------------

def _gpt(args: argparse.Namespace) -> tuple[nn.Module, Callable[..., Tensor], tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    model = MHAGPT(vocab=args.vocab, d=args.d, n_layer=args.layers, n_head=args.d // 128, block_size=args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1))

    def loss_of(m: nn.Module, idx: Tensor, tgt: Tensor) -> Tensor:
        return F.cross_entropy(m(idx).reshape(-1, args.vocab), tgt.reshape(-1))

    return model, loss_of, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def _dlspass(model: nn.Module, loss_of: Callable[..., Tensor], float8: str | None) -> Callable[..., Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return dlspass.compile(whole_step(model, loss_of, opt), optimizer=opt,
                           config=dlspass.DLSConfig(fp16_type="bfloat16", float8=float8))


def _torchao(model: nn.Module, loss_of: Callable[..., Tensor]) -> Callable[..., Tensor]:
    from torchao.float8 import convert_to_float8_training

    converted = convert_to_float8_training(model)
    return torch_best_practice_step(converted, loss_of, lr=1e-4, autocast_dtype=torch.bfloat16, scale=False)


VARIANTS = ("dlspass-bf16", "dlspass-f8", "torchao-f8")


def timing(args: argparse.Namespace) -> str:
    steps, firsts = {}, {}
    for v in VARIANTS:
        model, loss_of, batch = _gpt(args)
        step = (_torchao(model, loss_of) if v == "torchao-f8"
                else _dlspass(model, loss_of, "tensorwise" if v == "dlspass-f8" else None))
        t0 = time.perf_counter()
        step(*batch)
        firsts[v] = time.perf_counter() - t0
        steps[v] = (step, batch, [])
        print(f"{v}: first call {firsts[v]:.1f} s", flush=True)
    for _ in range(args.repeats):
        for v in VARIANTS:  # interleaved: a slow drift of the shared machine hits all alike
            step, batch, samples = steps[v]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(*batch)
            samples.append((time.perf_counter() - t0) / args.steps)
    med = {v: statistics.median(steps[v][2]) for v in VARIANTS}
    rows = [f"GPT (MHAGPT) d {args.d}, {args.layers} layer(s), {args.d // 128} heads, vocab {args.vocab}, "
            f"batch {args.batch}x{args.seq}, AdamW; {args.repeats} interleaved repeats of {args.steps} steps.",
            "", "| variant | step (ms, median) | first call (s) | / dlspass-bf16 |", "|---|---|---|---|"]
    for v in VARIANTS:
        rows.append(f"| {v} | {med[v] * 1e3:.1f} | {firsts[v]:.1f} | {med[v] / med['dlspass-bf16']:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", action="store_true", help="count float8 matmuls per matrix model")
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    command = "python tools/bench/bench_float8.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}, Python "
               f"{platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    body = counts() if args.counts else timing(args)
    text = f"Command: `{command.strip()}`\n\nMachine: {machine}\n\n{body}\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
