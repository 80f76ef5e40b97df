"""Counting the kernels in inductor's generated code, to check what fused.

``torch._inductor.utils.run_and_get_code(step, *args)`` returns the Python wrapper inductor wrote
for a compiled graph. Its ``call`` function launches the generated kernels (``cpp_fused_*`` on
CPU, ``triton_*`` on GPU) and the library kernels (``extern_kernels.mm`` ...). Launches are what
a step pays for; definitions are fewer, because inductor reuses one kernel for identical code
(the same layer repeated).

A step that also runs ATen ops outside compiled graphs (torch's ``GradScaler``, a fused
optimizer, a loss computed eagerly) launches those too: `eager_ops` finds them in a
``torch.profiler`` trace, each counted once at its outermost call, views and metadata ops left
out. `compiled_launches` plus `eager_ops` per step count two different steps the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

_DEFINITION = re.compile(r"^(cpp_fused_\w+|triton_\w+) = async_compile\.", re.M)
_LAUNCH = re.compile(r"^\s+(cpp_fused_\w+|triton_\w+)(?:\.run)?\(", re.M)
_EXTERN = re.compile(r"^\s+extern_kernels\.\w+\(", re.M)


@dataclass(frozen=True)
class KernelCount:
    """Generated-kernel launches and definitions, and library (extern) kernel launches."""

    launches: int
    definitions: int
    extern_launches: int


def count_kernels(codes: Iterable[str] | str) -> KernelCount:
    """Count the kernels in inductor output code (one string or the list ``run_and_get_code`` gives).

    Only launches inside each wrapper's ``call`` function count (the autotuning and benchmark
    harness code inductor appends launches nothing at run time).
    """
    texts = [codes] if isinstance(codes, str) else list(codes)
    launches = definitions = extern = 0
    for text in texts:
        definitions += len(set(_DEFINITION.findall(text)))
        body = _call_body(text)
        launches += len(_LAUNCH.findall(body))
        extern += len(_EXTERN.findall(body))
    return KernelCount(launches, definitions, extern)


def _call_body(text: str) -> str:
    start = text.find("\ndef call(")
    if start < 0:
        start = text.find("    def call(self")  # the class-based wrapper of newer inductors
    if start < 0:
        return ""
    end = text.find("\ndef ", start + 1)
    return text[start:end if end > 0 else len(text)]


# ATen ops that launch no kernel by themselves (views, metadata, allocation, host reads)
_NO_KERNEL = re.compile(
    r"aten::(view|_unsafe_view|reshape|_reshape_alias|detach|detach_|alias|as_strided|t|transpose"
    r"|permute|expand|squeeze|unsqueeze|select|slice|split|unbind|chunk|narrow|empty|empty_like"
    r"|empty_strided|new_empty|new_empty_strided|resize_|set_|lift_fresh|result_type|item"
    r"|_local_scalar_dense|is_nonzero|to|size|stride|numel|dim|record_stream"
    r"|_has_compatible_shallow_copy_type)$")
# profiler ranges of compiled code (dynamo's frame, AOT autograd's forward and backward)
_COMPILED = re.compile(r"Torch-Compiled Region|CompiledFunction|CompiledFxGraph")


def compiled_launches(step: Callable[..., Any], *args: Any) -> KernelCount:
    """Call ``step(*args)`` once, compiling it, and count the kernels in all the code inductor
    generated during the call (the forward and backward graphs of a compiled model, or the
    whole step)."""
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(step, *args)
    return count_kernels(codes)


def eager_ops(events: Iterable[Any]) -> list[str]:
    """The ATen ops in profiler ``events`` (``prof.events()``) that ran outside compiled code and
    do work, each at its outermost ATen call (``aten::to`` that copies counts once, a view
    not at all)."""
    out = []
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        if any(a.name.startswith("aten::") or _COMPILED.search(a.name) for a in _ancestors(e)):
            continue
        if _does_work(e):
            out.append(e.name)
    return out


def _ancestors(evt: Any) -> list[Any]:
    out = []
    p = evt.cpu_parent
    while p is not None:
        out.append(p)
        p = p.cpu_parent
    return out


def _does_work(evt: Any) -> bool:
    """Itself, or one of the ATen ops it calls, is not a view, metadata or allocation op."""
    if not _NO_KERNEL.match(evt.name):
        return True
    return any(_does_work(c) for c in evt.cpu_children if c.name.startswith("aten::"))
