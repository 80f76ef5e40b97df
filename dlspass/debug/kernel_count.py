"""Counting the kernels in inductor's generated code, to check what fused.

``torch._inductor.utils.run_and_get_code(step, *args)`` returns the Python wrapper inductor wrote
for a compiled graph. Its ``call`` function launches the generated kernels (``cpp_fused_*`` on
CPU, ``triton_*`` on GPU) and the library kernels (``extern_kernels.mm`` ...). Launches are what
a step pays for; definitions are fewer, because inductor reuses one kernel for identical code
(the same layer repeated).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

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
