"""``dlspass demo``: train the bundled TinyGPT in emulated cbfloat16 with dynamic loss scaling.

cbfloat16 has no PyTorch dtype, so it is emulated in fp32 containers: every ``nn.Linear``
rounds its input and its output to cbfloat16 in the forward pass and, through tensor hooks, the
gradients that flow back through those two tensors in the backward pass. Activation gradients
therefore really live in 16 bits: too small and they flush to zero, too large and they become
inf. The eager `dlspass.GradScaler` (cerebras policy, cbfloat16 defaults: the first scale is
2**31) scales the loss, skips the steps whose gradients overflow and backs the scale off.
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


def _progress(steps: int, quiet: bool):
    from tqdm import tqdm

    # tqdm writes plain carriage-return updates when stderr is not a terminal (CI), and
    # `disable` keeps it silent for --quiet.
    return tqdm(range(steps), file=sys.stderr, disable=quiet, desc="dlspass demo",
                unit="step", mininterval=0.25, leave=True, ascii=not sys.stderr.isatty())


def run_demo(steps: int = 100, seed: int = 0, out_dir: str | Path | None = None,
             quiet: bool = False, spikes: Sequence[int] = ()) -> dict[str, Any]:
    """Train TinyGPT on the copy task for ``steps`` steps in emulated cbfloat16 with DLS.

    Returns the numbers of the run: ``start_loss``/``end_loss`` (the loss of one fixed held-out
    batch before and after training, same emulation), ``first_train_loss``/``last_train_loss``,
    ``initial_scale``, ``final_scale``, ``skipped_steps``, ``steps``, ``seed``, ``seconds`` and
    the per-step ``losses``/``scales``/``skipped`` lists. With ``out_dir`` the same dict is also
    written to ``out_dir/demo_metrics.json``. The progress bar goes to stderr (off if ``quiet``).

    ``spikes`` lists 1-based steps whose loss is multiplied by 2**24 before the backward, a
    loss spike whose cbfloat16 gradients overflow: DLS skips those steps and halves the scale.

    Example:
        >>> r = run_demo(steps=5, quiet=True)  # doctest: +SKIP
        >>> r["end_loss"] < r["start_loss"]  # doctest: +SKIP
        True
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected a positive integer, got {steps!r}")
    bad = [s for s in spikes if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= steps]
    if bad:
        raise ValueError(f"spikes: expected steps between 1 and {steps}, got {bad[0]!r}")
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
        return _train(steps, seed, out_dir, quiet, frozenset(spikes))
    finally:
        torch.set_num_threads(threads)


def _train(steps: int, seed: int, out_dir: str | Path | None, quiet: bool,
           spikes: frozenset[int]) -> dict[str, Any]:
    from .scaler import GradScaler

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyGPT(vocab=_VOCAB, d=_DIM, n_layer=_LAYERS, n_head=_HEADS, block_size=_SEQ)
    opt = torch.optim.Adam(model.parameters(), lr=_LR)
    scaler = GradScaler(loss_scale="dynamic", fp16_type="cbfloat16",
                        steps_per_increase=_STEPS_PER_INCREASE)
    held_out = copy_task_batch(_VOCAB, _BATCH, _SEQ, torch.Generator().manual_seed(seed + 10_000))
    losses: list[float] = []
    scales: list[float] = []
    skipped: list[int] = []
    with emulate_format(model, "cbfloat16"):
        start_loss = _eval(model, held_out)
        initial_scale = float(scaler.get_scale())
        bar = _progress(steps, quiet)
        for step in bar:
            batch = copy_task_batch(_VOCAB, _BATCH, _SEQ, gen)
            loss = gpt_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            scales.append(float(scaler.get_scale()))  # the scale this step's backward used
            spiked = loss * _SPIKE if step + 1 in spikes else loss
            scaler.scale(spiked).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
            skipped.append(int(scaler.get_num_skipped_steps()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"2^{math.log2(scales[-1]):.0f}",
                            skipped=skipped[-1], refresh=False)
        bar.close()
        end_loss = _eval(model, held_out)
    result: dict[str, Any] = {
        "steps": steps,
        "seed": seed,
        "spikes": sorted(spikes),
        "format": "cbfloat16",
        "start_loss": start_loss,
        "end_loss": end_loss,
        "first_train_loss": losses[0],
        "last_train_loss": losses[-1],
        "initial_scale": initial_scale,
        "final_scale": float(scaler.get_scale()),
        "skipped_steps": int(scaler.get_num_skipped_steps()),
        "seconds": round(time.perf_counter() - t0, 3),
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
    }
    if out_dir is not None:
        (Path(out_dir) / "demo_metrics.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


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
    return "\n".join([
        f"dlspass demo: TinyGPT, copy task, emulated {result['format']}, dynamic loss scaling",
        f"steps          {result['steps']}",
        f"start loss     {result['start_loss']:.4f}   (held-out batch)",
        f"end loss       {result['end_loss']:.4f}",
        f"initial scale  {result['initial_scale']:g} (2^{math.log2(result['initial_scale']):g})",
        f"final scale    {scale:g} (2^{math.log2(scale):g})",
        f"skipped steps  {result['skipped_steps']}"
        + (f"   (loss spikes at steps {', '.join(map(str, result['spikes']))})" if result["spikes"] else ""),
        f"time           {result['seconds']:.1f} s",
    ])
