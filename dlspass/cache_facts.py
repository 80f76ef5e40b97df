"""The CPU facts that change inductor's code, in the cache key of every graph dlspass compiles.

torch 2.13's FX graph cache key holds the resolved thread count (``cpp_runtime_thread_count``,
pytorch/pytorch pull request 184444) but not the vector ISA inductor generates C++ for
(``torch._inductor.cpu_vec_isa.pick_vec_isa()``, chosen by the CPU and ``ATEN_CPU_CAPABILITY``).
An entry made under avx512 and read under avx2 from a shared ``TORCHINDUCTOR_CACHE_DIR`` runs
the avx512 wrapper against kernels rebuilt for avx2: wrong numbers (a DLS step then skips
every step) or a heap corruption. torch lets a custom pass name itself in that key
(``CustomGraphPass.uuid()``, read by ``FxGraphHashDetails`` and thus by AOTAutograd's cache
key too), so dlspass installs one whose uuid is these facts: an entry made under other facts
is a miss, never a wrong hit.

The mega-cache (``torch.compiler.save_cache_artifacts``) travels the same way:
`save_cache_artifacts` writes the facts beside torch's bytes and `load_cache_artifacts`
refuses them, in one line, where the facts differ.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import parallel_num_threads

from dlspass.errors import InputValueError

__all__ = ["CacheFactsError", "CacheFactsPass", "code_fingerprint", "cpu_facts",
           "inductor_key_config", "load_cache_artifacts", "save_cache_artifacts"]

# the inductor hook dlspass takes for its key: it runs on every post-grad graph, forward and
# backward alike, and no dlspass pass uses it for a rewrite
HOOK = "post_grad_custom_post_pass"
_MAGIC = b"dlspass-cache-artifacts-v1\n"


CacheFactsError = InputValueError
"""Cache artifacts made under other CPU facts (or not by dlspass) were refused."""


def cpu_facts() -> dict[str, Any]:
    """What inductor's C++ for this process depends on beyond the graph and inductor's config:
    the vector ISA it picks (with its width), ATen's CPU capability and the thread count the
    kernels are specialised for (and torch's version, for artifacts that leave the process)."""
    isa = pick_vec_isa()
    return {"vec_isa": str(isa), "vec_bits": isa.bit_width(),
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": parallel_num_threads(),
            "torch": str(torch.__version__)}


@functools.cache
def code_fingerprint() -> str:
    """A hash of dlspass's own source files (read once per process).

    A cache key that names what the dlspass passes did by their configuration alone would serve
    a graph rewritten by an older dlspass after an upgrade; with the code in the key an upgrade
    is a miss (torch keys its own caches on its version and its source the same way).
    """
    digest = hashlib.sha256()
    for root in code_roots():
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def code_roots() -> list[Path]:
    """The folders of dlspass's source: the package and its graph passes, which ship as
    ``dlspass.passes`` from a folder of their own (found without importing them)."""
    passes = importlib.util.find_spec("dlspass.passes")
    roots = [Path(__file__).resolve().parent]
    if passes is not None and passes.origin is not None:
        roots.append(Path(passes.origin).resolve().parent)
    return list(dict.fromkeys(roots))  # an install that nests passes/ inside dlspass/: once


class CacheFactsPass(CustomGraphPass):
    """inductor's ``post_grad_custom_post_pass`` for dlspass graphs: runs the pass that was
    installed there before (if any) and puts `cpu_facts` into the cache key through ``uuid``.

    A wrapped pass without a uuid keeps inductor's answer for it (no caching), as without
    dlspass.
    """

    def __init__(self, inner: Callable[[torch.fx.Graph], object] | None = None,
                 extra: str = "") -> None:
        self.inner = inner
        self.extra = extra

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> str | None:
        inner = None
        if self.inner is not None:
            inner = self.inner.uuid() if isinstance(self.inner, CustomGraphPass) else None
            if inner is None:
                return None
        text = json.dumps({"facts": cpu_facts(), "inner": repr(inner), "extra": self.extra},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def inductor_key_config(extra: str = "") -> dict[str, Any]:
    """The inductor config patch that puts the CPU facts (and ``extra``: what else the caller
    wants in the key) into the cache key of what inductor compiles under it."""
    inner = getattr(inductor_config, HOOK)
    if isinstance(inner, CacheFactsPass):  # nested dlspass compiles: one key, not a chain
        inner = inner.inner
    return {HOOK: CacheFactsPass(inner, extra)}


def save_cache_artifacts(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``torch.compiler.save_cache_artifacts()`` written to ``path`` behind this process's
    `cpu_facts`; returns the facts. Nothing compiled yet (no artifacts) is a ``CacheFactsError``."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise CacheFactsError("save_cache_artifacts: nothing was compiled in this process yet")
    artifacts, _info = saved
    facts = cpu_facts()
    with open(path, "wb") as f:
        f.write(_MAGIC + json.dumps(facts, sort_keys=True).encode() + b"\n" + artifacts)
    return facts


def load_cache_artifacts(path: str | os.PathLike[str]) -> Any:
    """Load what `save_cache_artifacts` wrote into torch's caches
    (``torch.compiler.load_cache_artifacts``), or raise ``CacheFactsError`` (one line) where the
    file was made under other CPU facts than this process's, or is not such a file."""
    with open(path, "rb") as f:
        data = f.read()
    head, sep, rest = data[len(_MAGIC):].partition(b"\n")
    if not data.startswith(_MAGIC) or not sep:
        raise CacheFactsError(f"{os.fspath(path)}: not a dlspass cache-artifacts file")
    try:
        theirs = json.loads(head)
    except ValueError:
        raise CacheFactsError(f"{os.fspath(path)}: not a dlspass cache-artifacts file") from None
    ours = cpu_facts()
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if differ:
        what = "; ".join(f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in differ)
        raise CacheFactsError(f"{os.fspath(path)}: cache artifacts made under other CPU facts "
                              f"({what}); compile here instead")
    return torch.compiler.load_cache_artifacts(rest)
