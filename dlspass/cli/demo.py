"""``dlspass demo``: what dynamic loss scaling is for, on a step compiled to fused kernels.

The bundled TinyGPT learns a copy task three times from the same weights and batches:

1. in float32 with plain eager torch (the reference);
2. in float16 mixed precision through ``dlspass.compile`` without loss scaling;
3. in float16 through ``dlspass.compile`` with dynamic loss scaling (DLS).

The loss is weighted by ``2**-20`` (as a loss divided by a large normaliser or a small auxiliary
weight), which Adam does not mind in float32 but which puts the float16 gradients of the
matmuls below float16's smallest subnormal (``2**-24``): without scaling they flush to zero and
the model does not learn, while the DLS run, its backward scaled by ``2**15``, tracks float32.
A loss spike injected into the DLS run overflows float16; DLS skips that step, halves the scale
and grows it back. float16 is emulated (values rounded to float16 in float32 containers,
forward and backward, on every matmul's inputs and outputs), the same lowering ``dlspass.compile``
applies for any 16-bit format.

Each float16 step (forward, backward, DLS, Adam) is one graph compiled by inductor to fused C++
kernels; the report counts the kernels each step launches (``dlspass.debug.kernel_count``), so the
difference is what DLS costs. Inductor compiles a graph on one core, so the step without
scaling compiles (and trains) in a second process while this one compiles the DLS step.
``backend_compiler="eager"`` runs the same graphs on eager kernels, in one process (for machines
without a C++ compiler; `cpp_compiler_available` tells).

``emulate_format`` (eager hooks that round nn.Linear inputs, outputs and their gradients) is
kept for eager studies that compare against torch.amp.GradScaler.
"""

from __future__ import annotations

import html
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dlspass.errors import InputValueError
from dlspass.models import TinyGPT, copy_task_batch, gpt_loss

if TYPE_CHECKING:
    from dlspass.scaler import GradScaler

__all__ = ["cpp_compiler_available", "default_spikes", "emulate_format", "format_summary", "run_demo"]

# Small enough for a few ms per step on one CPU core, big enough to learn the copy task (one
# layer learns it as well as two: the copied token sits at a fixed offset, found by position),
# and a step graph small enough for inductor to compile in about a minute on one core.
_VOCAB, _DIM, _LAYERS, _HEADS, _SEQ, _BATCH = 16, 32, 1, 2, 16, 16
_LR = 1e-2
# Adam divides by sqrt(v) + eps; with gradients near 2**-30 torch's default eps (1e-8) would
# swamp them, so eps is far below the gradients (the float32 reference learns as without the
# weight).
_EPS = 1e-16
_FORMAT = "float16"
# The loss weight: the gradients of the logits are about 2**-8 / 256 (batch x sequence) times
# this, about 2**-36 .. 2**-30, below float16's smallest subnormal 2**-24.
LOSS_WEIGHT = 2.0**-20
_STEPS_PER_INCREASE = 10
# A loss spike: at a scale of 2**15 the spiked gradients are far past float16's max (65504).
_SPIKE = 2.0**40

@contextmanager
def emulate_format(model: nn.Module, fmt: str = "cbfloat16"):
    """Round the inputs, outputs and their gradients of every ``nn.Linear`` in ``model`` to ``fmt``.

    Installs forward pre/post hooks for the duration of the ``with`` block. Rounding uses
    `dlspass.formats.round_to_format`, whose gradient is straight-through, so the tensor hooks
    registered on the rounded tensors are what puts the backward's gradients into ``fmt``.
    """
    from dlspass.formats import get_format, round_to_format

    name = get_format(fmt).name

    def rounded(t: Tensor) -> Tensor:
        out = round_to_format(t, name)
        if out.requires_grad:
            out.register_hook(lambda g: round_to_format(g, name))
        return out

    def pre_hook(_mod: nn.Module, args: tuple) -> tuple:
        return tuple(rounded(a) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)

    def post_hook(_mod: nn.Module, _args: tuple, output: Any) -> Any:
        return rounded(output) if isinstance(output, Tensor) else output

    handles = []
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_pre_hook(pre_hook))
            handles.append(mod.register_forward_hook(post_hook))
    try:
        yield len(handles) // 2
    finally:
        for h in handles:
            h.remove()



def cpp_compiler_available() -> bool:
    """True when inductor finds a C++ compiler (its own search: ``$CXX``, else ``g++``)."""
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except (exc.InvalidCxxCompiler, OSError):
        return False
    return True


def default_spikes(steps: int) -> tuple[int, ...]:
    """The demo's spike: a quarter into the run, early enough for the scale to grow back."""
    return (max(1, steps // 4),) if steps >= 4 else ()


def _progress(steps: int, quiet: bool, label: str):
    from tqdm import tqdm

    # tqdm writes plain carriage-return updates when stderr is not a terminal (CI), and
    # `disable` keeps it silent for --quiet.
    return tqdm(range(steps), file=sys.stderr, disable=quiet, desc=label,
                unit="step", mininterval=0.25, leave=True, ascii=not sys.stderr.isatty())


def run_demo(steps: int = 100, seed: int = 0, out_dir: str | Path | None = None,
             quiet: bool = False, spikes: Sequence[int] = (), *, compare: bool = True,
             backend_compiler: str = "inductor") -> dict[str, Any]:
    """Train TinyGPT on the copy task in float16 with DLS through ``dlspass.compile``.

    Returns the DLS run's numbers at the top level: ``start_loss``/``end_loss`` (float32 loss of
    one fixed held-out batch before and after training), ``first_train_loss``/
    ``last_train_loss``, ``initial_scale``, ``final_scale``, ``skipped_steps``, the per-step
    ``losses``/``scales``/``skipped``/``step_seconds`` lists; and ``steps``, ``seed``, ``spikes``, ``format``,
    ``loss_weight``, ``backend_compiler``, ``graph_breaks``, ``seconds``, ``compile_seconds`` (the
    DLS step's first call, which compiles; with ``compare`` also ``unscaled_compile_seconds``).
    With ``compare`` also ``fp32`` (plain eager torch in float32) and ``unscaled`` (float16
    through ``dlspass.compile`` without loss scaling), each with the same loss numbers, and,
    with inductor, ``kernels``: the generated-kernel launches per step with and without DLS and
    their difference. With ``out_dir`` the dict goes to ``out_dir/demo_metrics.json`` and the
    summary (`format_summary`) above the inspect report of the DLS graph to ``out_dir/report.html``.

    ``spikes`` lists 1-based steps of the DLS run whose loss is multiplied by 2**40 before the
    backward, a loss spike whose float16 gradients overflow: DLS skips those steps and halves
    the scale. ``backend_compiler="eager"`` runs the compiled graphs on eager kernels.

    Example:
        >>> r = run_demo(steps=5, quiet=True, compare=False, backend_compiler="eager")  # doctest: +SKIP
        >>> r["graph_breaks"]  # doctest: +SKIP
        0
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputValueError(f"steps: expected a positive integer, got {steps!r}")
    bad = [s for s in spikes if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= steps]
    if bad:
        raise InputValueError(f"spikes: expected steps between 1 and {steps}, got {bad[0]!r}")
    if backend_compiler not in ("eager", "inductor"):
        raise InputValueError(f"backend_compiler: expected 'eager' or 'inductor', got {backend_compiler!r}")
    if out_dir is not None:
        # Fail on an unusable output folder before training, not after it.
        try:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputValueError(f"out_dir: cannot create {str(out_dir)!r}: {exc.strerror} "
                                  f"({exc.filename})") from None

    threads = torch.get_num_threads()
    # Tensors this small run fastest on one thread; extra intra-op threads only contend.
    torch.set_num_threads(1)
    try:
        return _train(steps, seed, out_dir, quiet, frozenset(spikes), compare, backend_compiler)
    finally:
        torch.set_num_threads(threads)


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(vocab=_VOCAB, d=_DIM, n_layer=_LAYERS, n_head=_HEADS, block_size=_SEQ)
    return model, torch.optim.Adam(model.parameters(), lr=_LR, eps=_EPS)


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    import torch.nn.functional as F

    def train_step(idx: Tensor, tgt: Tensor, spike: Tensor) -> Tensor:
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        (loss * LOSS_WEIGHT * spike).backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return train_step


def _run(label: str, step: Callable, scaler: GradScaler | None, spiked: frozenset[int],
         model: nn.Module, steps: int, seed: int, quiet: bool,
         backend_compiler: str) -> tuple[dict[str, Any], list[str], float]:
    """Train ``steps`` steps; returns the run's numbers, inductor's code of a compiled step
    (its first call compiles) and that first call's seconds."""
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    scales: list[float] = []
    skipped: list[int] = []
    code: list[str] = []
    seconds: list[float] = []
    first_call = 0.0
    held_out = _held_out(seed)
    start_loss = _eval(model, held_out)
    bar = _progress(steps, quiet, label)
    for i in bar:
        idx, tgt = copy_task_batch(_VOCAB, _BATCH, _SEQ, gen)
        spike = torch.tensor(_SPIKE if i + 1 in spiked else 1.0)
        if scaler is not None:
            scales.append(float(scaler.get_scale()))  # the scale this step's backward uses
        t1 = time.perf_counter()
        if i == 0 and label in _COMPILED_RUNS:
            loss, code = _first_call(step, backend_compiler, idx, tgt, spike)
            first_call = time.perf_counter() - t1
        else:
            loss = step(idx, tgt, spike)
        losses.append(float(loss))
        seconds.append(time.perf_counter() - t1)  # float(loss) waited for the step
        post = {"loss": f"{losses[-1]:.3f}"}
        if scaler is not None:
            skipped.append(int(scaler.get_num_skipped_steps()))
            post.update(scale=f"2^{math.log2(scales[-1]):.0f}", skipped=str(skipped[-1]))
        bar.set_postfix(post, refresh=False)
    bar.close()
    out: dict[str, Any] = {"start_loss": start_loss, "end_loss": _eval(model, held_out),
                           "first_train_loss": losses[0], "last_train_loss": losses[-1],
                           "losses": losses, "step_seconds": seconds}
    if scaler is not None:
        out.update(initial_scale=scales[0], final_scale=float(scaler.get_scale()),
                   skipped_steps=int(scaler.get_num_skipped_steps()), scales=scales,
                   skipped=skipped)
    return out, code, first_call


def _held_out(seed: int) -> tuple[Tensor, Tensor]:
    return copy_task_batch(_VOCAB, _BATCH, _SEQ, torch.Generator().manual_seed(seed + 10_000))


def _unscaled(steps: int, seed: int, quiet: bool,
              backend_compiler: str) -> tuple[dict[str, Any], list[str], float]:
    """The float16 run without loss scaling (in a second process under inductor)."""
    from dlspass.capture.compiled_step import compile as dls_compile

    torch.set_num_threads(1)
    model, opt = _model_and_optimizer(seed)
    plain = dls_compile(_step_fn(model, opt), optimizer=opt, fp16_type=_FORMAT,
                        backend_compiler=backend_compiler)
    return _run(_UNSCALED, plain, None, frozenset(), model, steps, seed, quiet, backend_compiler)


def _train(steps: int, seed: int, out_dir: str | Path | None, quiet: bool,
           spikes: frozenset[int], compare: bool, backend_compiler: str) -> dict[str, Any]:
    import torch._dynamo.utils as dynamo_utils

    from dlspass.capture.compiled_step import compile as dls_compile
    from dlspass.scaler import GradScaler

    t0 = time.perf_counter()
    breaks_before = sum(dynamo_utils.counters["graph_break"].values())
    result: dict[str, Any] = {"steps": steps, "seed": seed, "spikes": sorted(spikes),
                              "format": _FORMAT, "loss_weight": LOSS_WEIGHT,
                              "backend_compiler": backend_compiler}
    codes: dict[str, list[str]] = {}
    first_calls: dict[str, float] = {}
    # Each inductor compile runs on one core; the unscaled step compiles in a second process
    # while this one compiles the DLS step, so two cores take the time of one compile.
    aside = compare and backend_compiler == "inductor"
    with _second_process(aside) as run_aside:
        if compare:  # its progress bar would garble this process's: quiet when aside
            unscaled = run_aside(_unscaled, steps, seed, quiet or aside, backend_compiler)
            model, opt = _model_and_optimizer(seed)
            result["fp32"] = _run("fp32 (eager)", _step_fn(model, opt), None, frozenset(), model,
                                  steps, seed, quiet, backend_compiler)[0]
        model, opt = _model_and_optimizer(seed)
        scaler = GradScaler(loss_scale="dynamic", fp16_type=_FORMAT, steps_per_increase=_STEPS_PER_INCREASE)
        step = dls_compile(_step_fn(model, opt), optimizer=opt, scaler=scaler, fp16_type=_FORMAT,
                           backend_compiler=backend_compiler)
        out, codes[_DLS], first_calls["dls"] = _run(_DLS, step, scaler, spikes, model, steps, seed,
                                                    quiet, backend_compiler)
        if compare:
            result["unscaled"], codes[_UNSCALED], first_calls["unscaled"] = unscaled()
    result.update(out)
    result["graph_breaks"] = sum(dynamo_utils.counters["graph_break"].values()) - breaks_before
    result["kernels"] = _kernels(codes) if backend_compiler == "inductor" else None
    result["compile_seconds"] = round(first_calls["dls"], 3)
    if "unscaled" in first_calls:
        result["unscaled_compile_seconds"] = round(first_calls["unscaled"], 3)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    if out_dir is not None:
        from dlspass.debug.inspect_report import render, summarize_graph

        report = summarize_graph(step.graphs[0], name="dlspass demo: compiled TinyGPT step (float16, DLS)")
        # the demo's summary (the three runs, the spike, the kernel counts) above the DLS graph
        summary = (f"<h2>dlspass demo</h2>\n<pre>{html.escape(format_summary(result))}</pre>\n"
                   f"{report_plots(result)}\n")
        _write(Path(out_dir) / "report.html", render(report, "html").replace("<body>", "<body>\n" + summary, 1))
        _write(Path(out_dir) / "demo_metrics.json", json.dumps(result, indent=2) + "\n")
    return result


@contextmanager
def _second_process(wanted: bool) -> Iterator[Callable[..., Callable[[], Any]]]:
    """``run_aside(fn, *args)``, which starts ``fn(*args)`` and returns a function that waits
    for its result: in a one-worker process pool (spawned: a fork would copy this process's
    compile state) when ``wanted``, else here and now."""
    if not wanted:
        def run_here(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
            value = fn(*args)
            return lambda: value

        yield run_here
        return
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda fn, *args: pool.submit(fn, *args).result


_UNSCALED = "float16, no scaling"
_DLS = "float16 + DLS"
_COMPILED_RUNS = (_UNSCALED, _DLS)


def _first_call(step: Callable, backend_compiler: str, *args: Tensor) -> tuple[Tensor, list[str]]:
    """Call the compiled step the first time (it compiles), keeping inductor's output code."""
    if backend_compiler != "inductor":
        return step(*args), []
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(step, *args)


def _kernels(codes: dict[str, list[str]]) -> dict[str, Any]:
    from dlspass.debug.kernel_count import count_kernels

    counts = {label: count_kernels(c) for label, c in codes.items()}
    out: dict[str, Any] = {"dls": vars(counts[_DLS]) if _DLS in counts else None,
                           "no_dls": vars(counts[_UNSCALED]) if _UNSCALED in counts else None}
    if out["dls"] and out["no_dls"]:
        out["dls_added"] = out["dls"]["launches"] - out["no_dls"]["launches"]
    return out


def _write(path: Path, text: str) -> None:
    # a fixed `report.html.tmp` name would be written through a symlink planted under it
    from dlspass.files.atomic_write import write_text_atomic

    write_text_atomic(path, text)


@torch.no_grad()
def _eval(model: nn.Module, batch: tuple[Tensor, Tensor]) -> float:
    was_training = model.training
    model.eval()
    try:
        return float(gpt_loss(model, batch))
    finally:
        model.train(was_training)


def report_plots(result: dict[str, Any]) -> str:
    """The report's plots: each run's training loss, the DLS run's scale with its skipped steps
    marked, and each run's seconds per step (from the second step: the first compiles)."""
    from dlspass.debug.svg_plot import line_chart

    runs = {_DLS: result}
    if "fp32" in result:
        runs = {"float32 (eager torch)": result["fp32"], _UNSCALED: result["unscaled"], **runs}
    counts = result["skipped"]
    skipped = [i + 1 for i, c in enumerate(counts) if c > (counts[i - 1] if i else 0)]
    plots = [
        line_chart("training loss per step", {k: r["losses"] for k, r in runs.items()},
                   y_label="loss"),
        line_chart("loss scale per step (DLS run), skipped steps marked", {"loss scale": result["scales"]},
                   y_label="scale", log2_y=True, marks=skipped, mark_label="skipped step"),
        line_chart("seconds per step (from step 2; the first call compiles)",
                   {k: r["step_seconds"][1:] for k, r in runs.items()}, y_label="seconds", first_x=2),
    ]
    return "<section class='plots'>\n" + "\n".join(plots) + "\n</section>"


def _exp2(v: float) -> str:
    return f"2^{math.log2(v):g}"


def format_summary(result: dict[str, Any]) -> str:
    """The human summary ``dlspass demo`` prints to stdout."""
    lines = [
        f"dlspass demo: TinyGPT on a copy task, {result['format']} mixed precision (emulated), "
        f"loss weighted by {_exp2(result['loss_weight'])}",
        f"each {result['format']} step is one compiled graph ({result['graph_breaks']} graph breaks, "
        f"{result['backend_compiler']} kernels)",
        "",
        f"{'run':<22}{'held-out loss: start':>22}{'end':>9}{'skipped':>9}  final scale",
    ]
    rows = []
    if "fp32" in result:
        rows.append(("float32 (eager torch)", result["fp32"], "-", "-"))
        rows.append((_UNSCALED, result["unscaled"], "-", "none"))
    rows.append((_DLS, result, str(result["skipped_steps"]), _exp2(result["final_scale"])))
    for label, r, skipped, scale in rows:
        lines.append(f"{label:<22}{r['start_loss']:>22.4f}{r['end_loss']:>9.4f}{skipped:>9}  {scale}")
    if "fp32" in result:
        f32, u = result["fp32"]["end_loss"], result["unscaled"]
        learned = f32 < result["fp32"]["start_loss"]
        stalled = u["start_loss"] - u["end_loss"] < 0.25 * (result["fp32"]["start_loss"] - f32)
        verdict = ("its float16 gradients underflow to zero and it barely learns"
                   if learned and stalled else "compare its end loss with float32's")
        lines.append(f"without scaling {verdict}; with DLS the end loss is "
                     f"{result['end_loss']:.4f} against float32's {f32:.4f}")
    for s in result["spikes"]:
        lines.append(_spike_line(result, s))
    k = result.get("kernels")
    if k and k.get("dls"):
        extra = (f", {k['no_dls']['launches']} without DLS: DLS adds {k['dls_added']}"
                 if k.get("no_dls") else "")
        lines.append(f"kernels per step: {k['dls']['launches']} generated kernels with DLS{extra} "
                     f"(plus {k['dls']['extern_launches']} library matmul calls)")
    lines.append(f"time           {result['seconds']:.1f} s "
                 f"(the DLS step's first call, which compiles: {result['compile_seconds']:.1f} s"
                 + (f"; the step without scaling: {result['unscaled_compile_seconds']:.1f} s"
                    if "unscaled_compile_seconds" in result else "") + ")")
    return "\n".join(lines)


def _spike_line(result: dict[str, Any], spike: int) -> str:
    scales, skipped = result["scales"], result["skipped"]
    i = spike - 1
    was_skipped = skipped[i] > (skipped[i - 1] if i else 0)
    before = scales[i]
    text = f"loss spike at step {spike}: " + ("skipped" if was_skipped else "NOT skipped")
    if i + 1 < len(scales):
        text += f", scale {_exp2(before)} -> {_exp2(scales[i + 1])}"
        back = next((j + 1 for j in range(i + 1, len(scales)) if scales[j] >= before), None)
        text += f", back to {_exp2(before)} at step {back}" if back else ", not yet grown back"
    return text
