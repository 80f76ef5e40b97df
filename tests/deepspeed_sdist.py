"""DeepSpeed's loss-scaling code of an older release, run from that release's sdist on PyPI.

DeepSpeed 0.17.0 does not install beside the pinned 0.19.8, so its files are read from its
source distribution instead: fetched at test time with ``sys.executable -m pip download`` into a
cache folder (one per version, reused across runs), checked against PyPI's sha256, read from the
tarball without unpacking it and executed under private module names. The installed deepspeed is
never touched: the release's own ``import deepspeed...`` lines are answered by small stubs (rank 0
without a process group, a logger), through the ``__import__`` of the loaded code's builtins.

What is run, from the release's files:

- ``deepspeed/runtime/fp16/loss_scaler.py``, whole: ``DynamicLossScaler``, ``CreateLossScaler``
  (what ZeRO stages 1-3 build);
- ``deepspeed/runtime/config.py``: the functions that read the ``fp16`` section
  (``get_fp16_enabled``, ``get_loss_scale``, ``get_initial_dynamic_scale``,
  ``get_dynamic_loss_scale_args``) with ``constants.py`` and ``config_utils.get_scalar_param``;
- ``deepspeed/runtime/fp16/fused_optimizer.py`` / ``unfused_optimizer.py``: ``_update_scale`` of
  ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` (DeepSpeed without ZeRO) and the branch of their
  ``__init__`` that sets the scale's state (the rest of ``__init__`` needs a device and flat
  fp16 groups).

Offline, with nothing in the cache, the fixture fails (it does not skip: a reference that quietly
goes missing is a check that cannot fail) with the command that pre-fetches the sdist.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path
from typing import Any

# PyPI's sha256 of each sdist read (https://pypi.org/project/deepspeed/<version>/#files)
SDIST_SHA256 = {"0.17.0": "0fd8e52e717ab9716e078d5d8e7544c7544cdef8cb1d9937a6891edc8217b8e0"}
CACHE_ENV = "DLSPASS_SDIST_CACHE"

_CONFIG_READERS = ("get_fp16_enabled", "get_bfloat16_enabled", "get_loss_scale", "get_initial_dynamic_scale",
                   "get_dynamic_loss_scale_args")
_OPTIMIZERS = {"fused": ("fused_optimizer.py", "FP16_Optimizer"),
               "unfused": ("unfused_optimizer.py", "FP16_UnfusedOptimizer")}


class SdistUnavailable(RuntimeError):
    """The sdist is neither cached nor downloadable; the message says how to pre-fetch it."""


def cache_dir(version: str) -> Path:
    """Where the sdist of ``version`` is kept: ``$DLSPASS_SDIST_CACHE/deepspeed-<version>``, by
    default under ``$XDG_CACHE_HOME`` (``~/.cache``)/dlspass/sdists."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(base) / "dlspass" / "sdists")
    return Path(root) / f"deepspeed-{version}"


def _download_command(version: str, dest: Path) -> list[str]:
    # --no-build-isolation: preparing the sdist's metadata runs its setup.py, which imports torch;
    # an isolated build environment would download torch first. Needs setuptools >= 70.1 (its own
    # bdist_wheel), pinned in pyproject's test extra.
    return [sys.executable, "-m", "pip", "download", f"deepspeed=={version}", "--no-deps",
            "--no-binary", ":all:", "--no-build-isolation", "--disable-pip-version-check",
            "-d", str(dest)]


def sdist(version: str) -> Path:
    """The verified sdist of DeepSpeed ``version``, downloaded into `cache_dir` once."""
    want = SDIST_SHA256[version]
    folder = cache_dir(version)
    path = folder / f"deepspeed-{version}.tar.gz"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        # download beside the cache, then move in whole: parallel test workers see a complete
        # file or none
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            cmd = _download_command(version, Path(tmp))
            env = {**os.environ, "DS_BUILD_OPS": "0"}  # metadata only: build no DeepSpeed op
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            except subprocess.TimeoutExpired:
                done = None
            got = Path(tmp) / path.name
            if done is None or done.returncode != 0 or not got.is_file():
                tail = "timed out" if done is None else \
                    (done.stderr.strip().splitlines() or ["no output"])[-1]
                shown = " ".join(_download_command(version, folder))
                raise SdistUnavailable(
                    f"DeepSpeed {version}'s sdist is not in {folder} and pip could not fetch it "
                    f"({tail}). Pre-fetch it where PyPI is reachable: {shown} (or put "
                    f"deepspeed-{version}.tar.gz, sha256 {want}, in $"
                    f"{CACHE_ENV}/deepspeed-{version}/)")
            os.replace(got, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != want:
        raise SdistUnavailable(f"{path}: sha256 {digest}, expected PyPI's {want}; delete the file "
                               "to fetch it again")
    return path


def _stub_import(version: str):
    """An ``__import__`` that answers the release's ``deepspeed`` imports with stubs and every
    other import as usual; an import the stubs do not cover fails loudly."""
    comm = types.SimpleNamespace(get_rank=lambda: 0)  # rank 0, without a process group
    logger = logging.getLogger(f"tests.deepspeed-{version}")
    stubs = {"deepspeed": types.SimpleNamespace(comm=comm),
             "deepspeed.utils": types.SimpleNamespace(logger=logger)}

    def imp(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (name == "deepspeed" or name.startswith("deepspeed.")):
            if name not in stubs or any(not hasattr(stubs[name], f) for f in fromlist or ()):
                raise ImportError(f"DeepSpeed {version} file imports {name} {fromlist}: no stub")
            return stubs[name]
        return builtins.__import__(name, globals, locals, fromlist, level)

    return imp, logger


class Release:
    """The loss-scaling code of one DeepSpeed release, read from its sdist (module docstring)."""

    def __init__(self, version: str, tarball: Path) -> None:
        self.version = version
        self._tar = tarball
        self._builtins = dict(vars(builtins))
        self._builtins["__import__"], self.logger = _stub_import(version)
        self.loss_scaler = self._module("deepspeed/runtime/fp16/loss_scaler.py")
        constants = self._namespace("deepspeed/runtime/constants.py")
        utils = self._namespace("deepspeed/runtime/config_utils.py", ("get_scalar_param",))
        names = {**constants, "get_scalar_param": utils["get_scalar_param"],
                 **self._scaler_keys()}
        self.config = types.SimpleNamespace(**{
            k: v for k, v in self._namespace("deepspeed/runtime/config.py", _CONFIG_READERS,
                                             names).items() if k in _CONFIG_READERS})
        self._optimizers = {kind: self._optimizer_parts(*spec) for kind, spec in _OPTIMIZERS.items()}

    # ---- reading the tarball ------------------------------------------------------------------
    def source(self, member: str) -> tuple[str, str]:
        """``(text, name)`` of ``member`` (a path inside the release's tree)."""
        name = f"deepspeed-{self.version}/{member}"
        with tarfile.open(self._tar, "r:gz") as tar:
            data = tar.extractfile(name)
            assert data is not None, name
            return data.read().decode("utf-8"), f"<deepspeed {self.version} sdist>/{member}"

    def _globals(self, name: str) -> dict[str, Any]:
        return {"__name__": name, "__builtins__": self._builtins}

    def _module(self, member: str) -> types.ModuleType:
        text, filename = self.source(member)
        mod = types.ModuleType(f"_deepspeed_{self.version.replace('.', '_')}_"
                               f"{Path(member).stem}")
        mod.__file__ = filename
        mod.__builtins__ = self._builtins
        exec(compile(text, filename, "exec"), vars(mod))
        return mod

    def _namespace(self, member: str, only: tuple[str, ...] | None = None,
                   names: dict[str, Any] | None = None) -> dict[str, Any]:
        """Execute ``member`` (or only its top-level functions named in ``only``)."""
        text, filename = self.source(member)
        tree = ast.parse(text, filename)
        if only is not None:
            tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in only]
            missing = set(only) - {n.name for n in tree.body}
            assert not missing, f"{filename} has no {sorted(missing)}"
        ns = {**self._globals(filename), **(names or {})}
        exec(compile(tree, filename, "exec"), ns)
        return ns

    def _scaler_keys(self) -> dict[str, Any]:
        keys = ("INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT", "CONSECUTIVE_HYSTERESIS",
                "MIN_LOSS_SCALE")
        return {k: getattr(self.loss_scaler, k) for k in keys}

    def _optimizer_parts(self, file: str, cls: str) -> tuple[Any, Any]:
        """``(init_branch, _update_scale)`` of class ``cls`` in fp16/``file``: the ``if
        dynamic_loss_scale:`` statement of its ``__init__`` (compiled alone) and the method."""
        text, filename = self.source(f"deepspeed/runtime/fp16/{file}")
        tree = ast.parse(text, filename)
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        init = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        branch = next(n for n in init.body if isinstance(n, ast.If)
                      and isinstance(n.test, ast.Name) and n.test.id == "dynamic_loss_scale")
        update = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == "_update_scale")
        ns = {**self._globals(filename), "logger": self.logger, **self._scaler_keys()}
        exec(compile(ast.Module([update], []), filename, "exec"), ns)
        return compile(ast.Module([branch], []), filename, "exec"), ns["_update_scale"]

    # ---- what the tests drive -----------------------------------------------------------------
    def fp16_optimizer(self, fused: bool, *, static_loss_scale: float = 1.0,
                       dynamic_loss_scale: bool = True, initial_dynamic_scale: float = 2**32,
                       dynamic_loss_args: dict | None = None):
        """A stand-in for ``FP16_Optimizer`` (``fused``) or ``FP16_UnfusedOptimizer`` whose scale
        state was set by the release's own ``__init__`` branch, and the release's
        ``_update_scale`` bound to it (call it with the overflow flag)."""
        branch, update = self._optimizers["fused" if fused else "unfused"]
        opt = types.SimpleNamespace(verbose=False)
        scope = {**self._globals("__init__"), **self._scaler_keys()}
        local = {"self": opt, "dynamic_loss_scale": dynamic_loss_scale,
                 "static_loss_scale": static_loss_scale,
                 "initial_dynamic_scale": initial_dynamic_scale,
                 "dynamic_loss_args": dynamic_loss_args}
        exec(branch, scope, local)
        return opt, types.MethodType(update, opt)


_LOADED: dict[str, Release] = {}


def release(version: str) -> Release:
    """The `Release` of ``version`` (loaded once per process)."""
    if version not in _LOADED:
        _LOADED[version] = Release(version, sdist(version))
    return _LOADED[version]
