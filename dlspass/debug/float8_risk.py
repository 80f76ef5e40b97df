"""Which matmuls of a step can run in float8, and which to leave in 16 bits? (``dlspass analyze
--fp16-type float8``)

One float32 calibration step (forward and backward) runs under a dispatch mode that sees every
ATen matmul the float8 pass converts (``mm``, ``addmm``, ``bmm``: ``LowerMatmulsToFloat8Pass``'s
``MATMUL_OPS``), forward and backward, in order. Each operand is cast to float8 exactly as the
pass casts it (``float8_policy``'s recipe: amax, scale ``fp8_max / max(amax, EPS)`` in float64
stored in float32, power-of-two scales for ``rowwise``, the saturating cast), and the report
gives, per matmul and operand, the amax and the fraction of its non-zero values that the cast
flushes to zero or saturates at ``±fp8_max``.

With current scaling nothing overflows: the amax maps onto the format's largest value. What is
lost is the bottom of the range: a tensor with a few large outliers (an activation spike, a
gradient whose mass is far below its maximum) puts its other values below the format's smallest
subnormal. A matmul ``fits`` where no operand loses more than ``threshold`` of its non-zero
values; otherwise the verdict is ``leave in 16 bits`` and names the operand. An operand is a
gradient (``float8_e5m2`` in ``tensorwise``) where it was made by the backward: its storage is
not one the forward made or read (every forward tensor is kept alive for the step, so no
backward tensor reuses its memory).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from dlspass.config import FLOAT8_RECIPES
from dlspass.debug.precision_risk import DEFAULT_THRESHOLD, AnalyzeError
from dlspass.files.bounded_text import printable
from dlspass.float8_policy import EPS, RECIPES, Float8Recipe
from dlspass.passes.lower_matmuls_to_float8_pass import MATMUL_OPS


@dataclass
class OperandRisk:
    """One operand of one matmul cast to float8: its format, amax and what the cast loses."""

    role: str  # "a" or "b": the matmul's first or second factor
    gradient: bool
    dtype: str
    amax: float
    flushed: float  # fraction of the non-zero values cast to 0
    saturated: float  # fraction of the non-zero values clamped to ±fp8_max


@dataclass
class MatmulRisk:
    """One matmul of the step and the verdict: ``fits`` or ``leave in 16 bits: ...``."""

    name: str  # "forward addmm #0 (fc1)", "backward mm #3"
    op: str
    phase: str
    module: str
    operands: list[OperandRisk] = field(default_factory=list)
    fits: bool = True
    verdict: str = "fits"


def cast_losses(x: Tensor, recipe: Float8Recipe, gradient: bool, axis: int | None) -> OperandRisk:
    """``x`` cast as the float8 pass casts it (``axis``: the rowwise amax's axis; None: one
    scale for the tensor) and what that loses; ``role`` is left for the caller to set."""
    dtype = recipe.dtype_for(gradient)
    fp8_max = torch.finfo(dtype).max
    x32 = x.detach().float()
    amax = x32.abs().amax() if axis is None else x32.abs().amax(dim=axis, keepdim=True)
    scale = (amax.double().clamp(min=EPS).reciprocal() * fp8_max).float()
    if recipe.pow2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = x32 * scale
    cast = scaled.clamp(-fp8_max, fp8_max).to(dtype).float()
    nonzero = x32 != 0
    n = max(int(nonzero.sum()), 1)
    return OperandRisk("", gradient, str(dtype).removeprefix("torch."), float(x32.abs().max()) if x32.numel() else 0.0,
                       int((nonzero & (cast == 0)).sum()) / n,
                       int((nonzero & (scaled.abs() > fp8_max)).sum()) / n)


class _MatmulRecorder(TorchDispatchMode):
    """Every mm/addmm/bmm of the step, judged as it runs (inside ``__torch_dispatch__`` the
    mode is off, so the judging ops are not recorded)."""

    def __init__(self, recipe: Float8Recipe, threshold: float, modules: list[str]) -> None:
        super().__init__()
        self.recipe, self.threshold, self.modules = recipe, threshold, modules
        self.phase = "forward"
        self.forward_storages: set[int] = set()
        self.keep: list[Tensor] = []  # forward tensors kept alive: no backward tensor reuses them
        self.matmuls: list[MatmulRisk] = []

    def _remember(self, values: Any) -> None:
        for t in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(t, Tensor):
                self.forward_storages.add(t.untyped_storage().data_ptr())
                self.keep.append(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.phase == "forward":
            self._remember(args)
            self._remember(out)
        if func in MATMUL_OPS:
            self._judge(func, args)
        return out

    def _judge(self, func: Any, args: tuple) -> None:
        a, b = args[-2], args[-1]  # addmm(bias, a, b)
        op = func._opname
        module = self.modules[-1] if self.phase == "forward" and self.modules else ""
        name = f"{self.phase} {op} #{len(self.matmuls)}" + (f" ({module})" if module else "")
        row = MatmulRisk(name, op, self.phase, module)
        for role, x, axis in (("a", a, -1), ("b", b, -2)):
            grad = self.phase == "backward" and x.untyped_storage().data_ptr() not in self.forward_storages
            risk = cast_losses(x, self.recipe, grad, axis if self.recipe.rowwise else None)
            risk.role = role
            row.operands.append(risk)
        worst = max(row.operands, key=lambda r: r.flushed)
        if worst.flushed > self.threshold:
            row.fits = False
            kind = "gradient" if worst.gradient else "operand"
            row.verdict = (f"leave in 16 bits: {kind} {worst.role} ({worst.dtype}, amax {worst.amax:.3g}) "
                           f"flushes {worst.flushed:.1%} of its values to zero")
        self.matmuls.append(row)


def analyze_float8(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], batch: Any, *,
                   recipe: str = "tensorwise", threshold: float = DEFAULT_THRESHOLD) -> list[MatmulRisk]:
    """Per matmul of one float32 step of ``loss_fn(model, batch)`` (forward and backward), what
    the float8 ``recipe`` loses and whether to leave it in 16 bits (module docstring)."""
    if recipe not in FLOAT8_RECIPES:
        raise AnalyzeError(f"float8 recipe: expected one of {', '.join(FLOAT8_RECIPES)}, got {recipe!r}")
    if not (isinstance(threshold, (int, float)) and 0 <= threshold < 1):
        raise AnalyzeError(f"threshold: expected a fraction in [0, 1), got {threshold!r}")
    stack: list[str] = []

    def enter(_m: nn.Module, _i: Any, path: str) -> None:
        stack.append(path)

    def leave(_m: nn.Module, _i: Any, _o: Any) -> None:  # None: the output stays the module's
        stack.pop()

    handles = []
    for path, mod in model.named_modules():
        if path:  # the innermost module running names the forward matmul
            handles.append(mod.register_forward_pre_hook(functools.partial(enter, path=path)))
            handles.append(mod.register_forward_hook(leave))
    rec = _MatmulRecorder(RECIPES[recipe], float(threshold), stack)
    try:
        with rec:
            loss = loss_fn(model, batch)
            if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise AnalyzeError("loss_fn: expected a scalar loss that requires grad, got "
                                   f"{type(loss).__name__}")
            rec.phase = "backward"
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    for p in model.parameters():
        p.grad = None
    return rec.matmuls


def render_float8(rows: list[MatmulRisk], recipe: str, fmt: str = "text") -> str:
    """The per-matmul report as ``text`` or ``json``."""
    if fmt == "json":
        return json.dumps({"recipe": recipe, "matmuls": [
            {"name": r.name, "op": r.op, "phase": r.phase, "module": r.module, "fits": r.fits,
             "verdict": r.verdict, "operands": [o.__dict__ for o in r.operands]} for r in rows]}, indent=2) + "\n"
    if fmt != "text":
        raise AnalyzeError(f"format: the float8 report is text or json, got {fmt!r}")
    keep = [r for r in rows if not r.fits]
    lines = [f"float8 {recipe}: {len(rows) - len(keep)} of {len(rows)} matmuls fit; "
             f"{len(keep)} to leave in 16 bits"]
    for r in rows:
        ops = "; ".join(f"{o.role} {o.dtype} amax {o.amax:.3g} flushed {o.flushed:.2%} saturated {o.saturated:.2%}"
                        for o in r.operands)
        lines.append(f"{r.name}: {r.verdict} [{ops}]")
    # module paths come from the user's model: escaped, as the other reports' names are
    return "\n".join(printable(line) for line in lines) + "\n"
