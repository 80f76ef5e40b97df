"""``dlspass demo``: train the bundled TinyGPT through ``dlspass.compile`` in emulated cbfloat16.

The whole training step (forward, backward, dynamic loss scaling, Adam) is one graph made by
``dlspass.compile``: the precision pass rounds every matmul's inputs and outputs, forward and
backward, to cbfloat16 (emulated in fp32 containers), the DLS passes scale the backward seed,
unscale and check the gradients, guard the update and update the scale, with no host sync. The
same compiled graph then trains a fresh copy of the model with the scale held at 1 (the
unscaled run), so one compile serves both, and an inspect report of the rewritten graph is
written next to the metrics.

``emulate_format`` (eager hooks that round nn.Linear inputs, outputs and their gradients) is
kept for eager studies that compare against torch.amp.GradScaler.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .models import TinyGPT, copy_task_batch, gpt_loss

__all__ = ["emulate_format", "format_summary", "run_demo"]

# Small enough for ~0.05 s per step on one CPU core, big enough to learn the copy task.
_VOCAB, _DIM, _LAYERS, _HEADS, _SEQ, _BATCH = 16, 32, 2, 2, 16, 16
_LR = 1e-2
_STEPS_PER_INCREASE = 10
# A loss spike: 2**31 * 2**24 pushes the gradients far past cbfloat16's max (~2**32).
_SPIKE = 2.0**24


@contextmanager
def emulate_format(model: nn.Module, fmt: str = "cbfloat16"):
    """Round the inputs, outputs and their gradients of every ``nn.Linear`` in ``model`` to ``fmt``.

    Installs forward pre/post hooks for the duration of the ``with`` block. Rounding uses
    `dlspass.formats.round_to_format`, whose gradient is straight-through, so the tensor hooks
    registered on the rounded tensors are what puts the backward's gradients into ``fmt``.
    """
    from .formats import get_format, round_to_format

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


def _progress(steps: int, quiet: bool, label: str = "dlspass demo"):
    from tqdm import tqdm

    # tqdm writes plain carriage-return updates when stderr is not a terminal (CI), and
    # `disable` keeps it silent for --quiet.
    return tqdm(range(steps), file=sys.stderr, disable=quiet, desc=label,
                unit="step", mininterval=0.25, leave=True, ascii=not sys.stderr.isatty())


def run_demo(steps: int = 100, seed: int = 0, out_dir: str | Path | None = None,
             quiet: bool = False, spikes: Sequence[int] = (), *, compare: bool = True,
             backend_compiler: str = "eager") -> dict[str, Any]:
    """Train TinyGPT on the copy task for ``steps`` steps through ``dlspass.compile`` with DLS.

    Returns the numbers of the run: ``start_loss``/``end_loss`` (fp32 loss of one fixed held-out
    batch before and after training), ``first_train_loss``/``last_train_loss``,
    ``initial_scale``, ``final_scale``, ``skipped_steps``, ``steps``, ``seed``, ``seconds``,
    the per-step ``losses``/``scales``/``skipped`` lists, ``graph_breaks`` and, with
    ``compare``, ``unscaled`` (the same numbers for the run at scale 1). With ``out_dir`` the
    dict goes to ``out_dir/demo_metrics.json`` and the inspect report of the rewritten graph to
    ``out_dir/report.html``. ``backend_compiler="inductor"`` compiles fused kernels (about two
    minutes of compile time on 2 cores); the default runs the same graph with eager kernels.

    ``spikes`` lists 1-based steps whose loss is multiplied by 2**24 before the backward, a
    loss spike whose cbfloat16 gradients overflow: DLS skips those steps and halves the scale.

    Example:
        >>> r = run_demo(steps=5, quiet=True, compare=False)  # doctest: +SKIP
        >>> r["graph_breaks"]  # doctest: +SKIP
        0
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected a positive integer, got {steps!r}")
    bad = [s for s in spikes if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= steps]
    if bad:
        raise ValueError(f"spikes: expected steps between 1 and {steps}, got {bad[0]!r}")
    if backend_compiler not in ("eager", "inductor"):
        raise ValueError(f"backend_compiler: expected 'eager' or 'inductor', got {backend_compiler!r}")
    if out_dir is not None:
        # Fail on an unusable output folder before training, not after it.
        try:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"out_dir: cannot create {str(out_dir)!r}: {exc.strerror} "
                             f"({exc.filename})") from None

    threads = torch.get_num_threads()
    # Tensors this small run fastest on one thread; extra intra-op threads only contend.
    torch.set_num_threads(1)
    try:
        return _train(steps, seed, out_dir, quiet, frozenset(spikes), compare, backend_compiler)
    finally:
        torch.set_num_threads(threads)


def _hold_scale_at_one(scaler: Any) -> None:
    """Make the compiled step run unscaled: scale 1, and a growth counter so far below
    ``steps_per_increase`` that the cerebras policy never grows it during the demo (the
    policy only shrinks on overflow, which scale 1 does not provoke here)."""
    st = scaler.state
    scaler.state = st._replace(loss_scale=torch.ones_like(st.loss_scale),
                               non_clamped_scale=torch.ones_like(st.loss_scale),
                               steps_since_rescale=torch.full_like(st.steps_since_rescale, -(2**40)),
                               overflows_since_rescale=torch.zeros_like(st.overflows_since_rescale),
                               num_skipped_steps=torch.zeros_like(st.num_skipped_steps))


def _reset(model: nn.Module, opt: torch.optim.Optimizer, params: dict[str, Tensor]) -> None:
    """Back to the initial weights and a fresh optimizer, in place (the compiled graph keeps
    references to these tensors)."""
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(params[k])
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()


def _train(steps: int, seed: int, out_dir: str | Path | None, quiet: bool,
           spikes: frozenset[int], compare: bool, backend_compiler: str) -> dict[str, Any]:
    import torch._dynamo.utils as dynamo_utils
    import torch.nn.functional as F

    from .compile_step import compile as dls_compile
    from .scaler import GradScaler

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = TinyGPT(vocab=_VOCAB, d=_DIM, n_layer=_LAYERS, n_head=_HEADS, block_size=_SEQ)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=_LR)
    scaler = GradScaler(loss_scale="dynamic", fp16_type="cbfloat16",
                        steps_per_increase=_STEPS_PER_INCREASE)

    def train_step(idx: Tensor, tgt: Tensor, spike: Tensor) -> Tensor:
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        (loss * spike).backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = dls_compile(train_step, optimizer=opt, scaler=scaler, fp16_type="cbfloat16",
                       backend_compiler=backend_compiler)
    held_out = copy_task_batch(_VOCAB, _BATCH, _SEQ, torch.Generator().manual_seed(seed + 10_000))
    breaks_before = sum(dynamo_utils.counters["graph_break"].values())

    def run(label: str) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        losses: list[float] = []
        scales: list[float] = []
        skipped: list[int] = []
        start_loss = _eval(model, held_out)
        initial_scale = float(scaler.get_scale())
        bar = _progress(steps, quiet, label)
        for i in bar:
            idx, tgt = copy_task_batch(_VOCAB, _BATCH, _SEQ, gen)
            scales.append(float(scaler.get_scale()))  # the scale this step's backward uses
            spike = torch.tensor(_SPIKE if i + 1 in spikes else 1.0)
            loss = step(idx, tgt, spike)
            losses.append(float(loss))
            skipped.append(int(scaler.get_num_skipped_steps()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"2^{math.log2(scales[-1]):.0f}",
                            skipped=skipped[-1], refresh=False)
        bar.close()
        return {"start_loss": start_loss, "end_loss": _eval(model, held_out),
                "first_train_loss": losses[0], "last_train_loss": losses[-1],
                "initial_scale": initial_scale, "final_scale": float(scaler.get_scale()),
                "skipped_steps": int(scaler.get_num_skipped_steps()),
                "losses": losses, "scales": scales, "skipped": skipped}

    dls = run("DLS")
    result: dict[str, Any] = {"steps": steps, "seed": seed, "spikes": sorted(spikes),
                              "format": "cbfloat16", "backend_compiler": backend_compiler, **dls}
    if compare:
        _reset(model, opt, initial)
        _hold_scale_at_one(scaler)
        unscaled = run("scale 1")
        result["unscaled"] = {k: v for k, v in unscaled.items() if k not in ("scales",)}
    result["graph_breaks"] = sum(dynamo_utils.counters["graph_break"].values()) - breaks_before
    result["seconds"] = round(time.perf_counter() - t0, 3)
    if out_dir is not None:
        from .inspect_report import render, summarize_graph

        report = summarize_graph(step.graphs[0], name="dlspass demo: compiled TinyGPT step")
        _write(Path(out_dir) / "report.html", render(report, "html"))
        _write(Path(out_dir) / "demo_metrics.json", json.dumps(result, indent=2) + "\n")
    return result


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


@torch.no_grad()
def _eval(model: nn.Module, batch: tuple[Tensor, Tensor]) -> float:
    was_training = model.training
    model.eval()
    try:
        return float(gpt_loss(model, batch))
    finally:
        model.train(was_training)


def format_summary(result: dict[str, Any]) -> str:
    """The human summary ``dlspass demo`` prints to stdout."""
    scale = result["final_scale"]
    lines = [
        f"dlspass demo: TinyGPT, copy task, emulated {result['format']}, dynamic loss scaling, "
        f"one compiled graph per step ({result['graph_breaks']} graph breaks, "
        f"{result['backend_compiler']} kernels)",
        f"steps          {result['steps']}",
        f"start loss     {result['start_loss']:.4f}   (held-out batch, fp32)",
        f"end loss       {result['end_loss']:.4f}",
        f"initial scale  {result['initial_scale']:g} (2^{math.log2(result['initial_scale']):g})",
        f"final scale    {scale:g} (2^{math.log2(scale):g})",
        f"skipped steps  {result['skipped_steps']}"
        + (f"   (loss spikes at steps {', '.join(map(str, result['spikes']))})" if result["spikes"] else ""),
    ]
    if "unscaled" in result:
        u = result["unscaled"]
        lines.append(f"unscaled run   end loss {u['end_loss']:.4f}, skipped {u['skipped_steps']} "
                     f"(same compiled graph, scale held at 1) vs DLS end loss {result['end_loss']:.4f}")
    lines.append(f"time           {result['seconds']:.1f} s")
    return "\n".join(lines)
