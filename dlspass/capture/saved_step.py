"""Saving a ``dlspass.compile`` step ahead of time and loading it in another process.

torch 2.13 compiles a whole frame ahead of time (``torch.compile(f, fullgraph=True)
.aot_compile(((args), kwargs))``) into a value it can serialize: dynamo's rewritten bytecode,
the guards (rebuilt from a pickle of the frame's scope) and the compiled graph (AOTAutograd's
bundled cache entry with inductor's code). A process that loads it runs none of dynamo,
AOTAutograd, the dlspass passes or inductor. `save_step` and `load_step` do that for a
`CompiledStep` (``CompiledStep.save`` / ``CompiledStep.load`` call them); three things make a
step saveable:

- the frame's closure (the user's step function) is passed as torch's external data, so the
  loaded step runs on the new process's model, optimizer and scaler, never on pickled copies;
- the optimizer is pickled into the guard state with its whole ``__dict__``, the patched
  ``step`` included (torch.optim's own ``__getstate__`` keeps three keys and its
  ``__setstate__`` reads tensors the guard pickler stubbed out), so the guards dynamo placed
  on the traced ``LiveOptimizer`` rebuild and are checked at every call of the loaded step
  (`_pickled_for_guards`);
- the traced ``LiveOptimizer`` reads names and flags by position, not by ``id(param)``.

Safety: the file starts with a header carrying the body's checksum (a truncated or damaged
file is refused with one line) and naming everything the compiled graph depends on that
dynamo's guards cannot see (the DLS config and graph passes, dlspass's source, the torch and
Python versions, the optimizer's type and static options, the parameters, the checksums of
every source the trace read). A load whose step differs in any of them is refused with one
line (`SavedStepMismatchError`), before anything is unpickled. What torch cannot serialize
is refused at save (`StepNotSaveableError`). The rest of the file is a pickle: load only
files you trust, as with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import pickle
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.aot_compile import AOTCompiledFunction
from torch._dynamo.package import _hash_sourcelines
from torch._inductor import config as inductor_config

from dlspass.cache_facts import code_fingerprint
from dlspass.errors import InputNotImplementedError, InputValueError
from dlspass.files.atomic_write import write_atomic
from dlspass.files.paths import check_input_file
from dlspass.formats import INDUCTOR_CONFIG

__all__ = ["SavedStepMismatchError", "StepNotSaveableError", "kernel_settings", "load_step", "save_step"]

MAGIC = b"dlspass-saved-step 1\n"
"""The first line of a saved step (the format's version is part of it)."""
SUFFIX = ".dlstep"
"""The file suffix `load_step` takes (``check_input_file``)."""
_EMPTY = object()  # stands for an empty closure cell (`_callables`)
_FN_KEY = "dlspass_step_fn"
"""The external-data key of the frame's closure: the user's step function."""


class SavedStepMismatchError(InputValueError):
    """A saved step was made for another plan than the step that loads it (another config,
    optimizer, parameters, source, torch or dlspass), or is not a saved step at all."""


class StepNotSaveableError(InputNotImplementedError):
    """The step cannot be saved ahead of time (a feature torch's serialization cannot carry)."""


def save_step(step: Any, path: str | Path, args: tuple, kwargs: dict[str, Any]) -> AOTCompiledFunction:
    """Compile ``step`` (a `CompiledStep`) ahead of time for ``args``/``kwargs`` and write it to
    ``path`` (suffix ``.dlstep``); returns torch's compiled function, which the step then runs.
    Nothing is run: parameters and optimizer state are unchanged."""
    path = Path(path)
    if path.suffix != SUFFIX:
        raise InputValueError(f"{path}: a saved step's file name must end in {SUFFIX}")
    refuse_unsaveable(step)
    with step.live(), _pickled_for_guards(step.optimizer, step.live_optimizer()):
        try:
            compiled = step.aot_compile(args, kwargs)
            data = AOTCompiledFunction.serialize(compiled, {_FN_KEY: step.fn}).serialized_data
        except (torch._dynamo.exc.PackageError, RuntimeError, TypeError, AttributeError,
                pickle.PicklingError) as e:
            if isinstance(e, torch._dynamo.exc.BackendCompilerFailed):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StepNotSaveableError(f"dlspass: the step cannot be saved ahead of time: {first}") from e
    sources = _sources(compiled)
    header = {**fingerprint(step), "sources": sources,
              "module_constants": module_constants(sorted({s[0] for s in sources})),
              "body": hashlib.sha256(data).hexdigest()}
    text = json.dumps(header, sort_keys=True).encode()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(MAGIC + text + b"\n" + data)

    write_atomic(path, write)
    return compiled


def load_step(step: Any, path: str | Path) -> AOTCompiledFunction:
    """The compiled function saved at ``path`` by `save_step`, bound to ``step``'s own function
    (and so its model, optimizer and scaler); `SavedStepMismatchError` when it was saved under
    another plan, or when a source it traced has changed since."""
    p = check_input_file(path, (SUFFIX,))
    blob = p.read_bytes()
    if not blob.startswith(MAGIC):
        raise SavedStepMismatchError(f"{p}: not a step saved by this dlspass (no {MAGIC.strip().decode()!r} header)")
    line, _, data = blob[len(MAGIC):].partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError as e:
        raise SavedStepMismatchError(f"{p}: the saved step's header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SavedStepMismatchError(f"{p}: the saved step's header is not a JSON object")
    body = header.pop("body", None)
    refuse_unsaveable(step)
    saved_sources = header.pop("sources", None)
    saved_constants = header.pop("module_constants", None)
    here = fingerprint(step)
    for key in sorted(set(here) | set(header)):
        saved, now = header.get(key), here.get(key)
        if saved != now:
            what = _what(key)
            if isinstance(saved, dict) and isinstance(now, dict):  # name the config's field
                field = next(k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k))
                what, saved, now = f"{what} field {field}", saved.get(field), now.get(field)
            raise SavedStepMismatchError(
                f"{p}: saved for another step ({what}: saved {_short(saved)}, this step "
                f"{_short(now)}); compile and save it again")
    changed = _changed_source(saved_sources) or _changed_constants(saved_constants)
    if changed is not None:
        raise SavedStepMismatchError(f"{p}: the source the saved step traced, or a constant it read, has changed since "
                                     f"({changed}); compile and save it again")
    # after the plan's checks (they name what differs), before pickle reads the body: a
    # truncated pickle fails deep in torch's loader, a damaged one may load and run damaged
    # kernel source
    if body != hashlib.sha256(data).hexdigest():
        raise SavedStepMismatchError(f"{p}: the saved step is truncated or damaged (its body does not "
                                     "match the checksum its header records); save it again")
    with step.live(), kernel_settings():  # dynamo's settings of the save while its guards are rebuilt
        compiled = AOTCompiledFunction.deserialize(data, None, {_FN_KEY: step.fn})
    return compiled


def kernel_settings() -> contextlib.AbstractContextManager:
    """Inductor's settings while a loaded step builds its kernels from the C++ source the file
    carries: g++'s flags come from this process's inductor config, and its unsafe math
    (``TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG=1``) would fold the emulated rounding
    (``formats.round_split``'s ``c - (c - a)``) away; pinned off as for every dlspass compile
    (``formats.INDUCTOR_CONFIG``)."""
    return inductor_config.patch(INDUCTOR_CONFIG)


def refuse_unsaveable(step: Any) -> None:
    """`StepNotSaveableError` for what a saved step could not reproduce or torch cannot save."""
    plan = step.plan
    reason = None
    if plan.backend_compiler != "inductor":
        reason = (f"backend_compiler={plan.backend_compiler!r}: torch serializes inductor's "
                  "compiled code only; compile with backend_compiler='inductor'")
    elif plan.data_parallel is not None:
        reason = "a process group is not a value another process can load"
    elif plan.inputs():
        reason = (f"extra inputs ({', '.join(sorted(plan.inputs()))}: telemetry or fault "
                  "injection) are fed around the compiled graph, which a loaded step would skip")
    elif plan.cache_key() is None:
        reason = "a graph pass has no uuid() naming what it does"
    elif any(p.device.type != "cpu" for g in step.optimizer.param_groups for p in g["params"]):
        reason = ("only CPU steps: on CUDA the step's CUDA-graph settings are decided from the "
                  "rewritten graph, which a loaded step never sees")
    else:
        reason = _global_state(step.fn)
    if reason is not None:
        raise StepNotSaveableError(f"dlspass: the step cannot be saved ahead of time: {reason}")


def _global_state(fn: Any) -> str | None:
    """Why ``fn`` cannot be saved when it reads a module or optimizer from its module's globals:
    torch's ``aot_compile`` drops every guard on a global, so nothing would check them at load."""
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    for name in getattr(code, "co_names", ()):
        value = scope.get(name)
        if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
            return (f"the step function reads {type(value).__name__} {name!r} from its module's "
                    "globals, which a saved step's guards do not cover; pass it in by closure "
                    "(a function that returns the step) instead")
    return None


def fingerprint(step: Any) -> dict[str, Any]:
    """What the saved graph depends on beyond dynamo's guards, as plain JSON values."""
    live = step.live_optimizer()
    opt = step.optimizer
    params = [[name, list(p.shape), str(p.dtype), str(p.device)]
              for ps, names in zip(live.params, live.param_names, strict=True)
              for p, name in zip(ps, names, strict=True)]
    config = step.plan.config
    return {
        "config": json.loads(json.dumps(dataclasses.asdict(config), sort_keys=True, default=repr)),
        "plan": step.plan.cache_key(),
        "dlspass": code_fingerprint(),
        "torch": torch.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
        "optimizer": f"{type(opt).__module__}.{type(opt).__qualname__}",
        "optimizer_options": repr(live.fopt.static_signature()),
        "params": params,
        "scaler": step.scaler is not None,
        "step_fn": getattr(step.fn, "__qualname__", type(step.fn).__qualname__),
        "globals": _global_constants(step.fn),
        "callables": _callables(step.fn),
    }


def _callables(fn: Any, depth: int = 3) -> dict[str, str]:
    """The functions ``fn`` reaches through its closure cells and the globals its code names
    (and theirs, ``depth`` levels down), by name, each as its qualified name and a hash of its
    code: dynamo inlines them into the graph and torch's ``aot_compile`` keeps no guard on
    which function a cell or global holds, so a step built around another loss function
    (``make_step(F.l1_loss)`` where the save had ``F.mse_loss``) would run the saved one.
    Modules and optimizers are left out: dynamo's guards on their types and attributes are kept."""
    found: dict[str, str] = {}

    def walk(f: Any, prefix: str, left: int) -> None:
        code = getattr(f, "__code__", None)
        if code is None or left == 0:
            return
        cells = {n: _cell(c) for n, c in zip(code.co_freevars, f.__closure__ or (), strict=True)}
        scope = getattr(f, "__globals__", {})
        named = {**{n: scope[n] for n in code.co_names if n in scope}, **cells}
        for name, value in sorted(named.items()):
            if value is _EMPTY:
                continue
            ident = _callable_identity(value)
            if ident is not None:
                found[f"{prefix}{name}"] = ident
                walk(value.func if isinstance(value, functools.partial) else value,
                     f"{prefix}{name}.", left - 1)

    walk(fn, "", depth)
    return found


def _callable_identity(value: Any) -> str | None:
    """A plain function's (or a partial's) qualified name and code hash; None for anything else
    (a module, an optimizer, a tensor, a number)."""
    if isinstance(value, functools.partial):
        inner = _callable_identity(value.func)
        return None if inner is None else f"partial({inner}, {value.args!r}, {value.keywords!r})"
    if isinstance(value, types.BuiltinFunctionType):
        return f"{getattr(value, '__module__', None)}.{value.__qualname__}"
    if not isinstance(value, types.FunctionType | types.MethodType):
        return None
    code = value.__code__
    # the bytecode, constants and names: not the file name or line numbers (another checkout
    # of the same code loads the step)
    text = repr((code.co_code, _consts(code), code.co_names)).encode()
    return f"{value.__module__}.{value.__qualname__}:{hashlib.sha256(text).hexdigest()[:16]}"


def _consts(code: types.CodeType) -> tuple:
    """``code``'s constants, nested code as its bytecode, a frozenset sorted (its order follows
    the process's string hashing)."""
    return tuple((c.co_code, _consts(c), c.co_names) if isinstance(c, types.CodeType)
                 else sorted(map(repr, c)) if isinstance(c, frozenset) else c for c in code.co_consts)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell the function assigns later is still empty
        return _EMPTY


def _global_constants(fn: Any) -> dict[str, str]:
    """The plain constants ``fn``'s own code reads from its module's globals, by name: dynamo
    bakes them into the graph and torch's ``aot_compile`` drops its guards on globals, so the
    header carries them (a changed ``LOSS_WEIGHT = ...`` line is outside the traced lines)."""
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    return {name: repr(scope[name]) for name in getattr(code, "co_names", ())
            if name in scope and isinstance(scope[name], int | float | complex | str | bytes | type(None))}


def _what(key: str) -> str:
    return {"config": "DLS config", "plan": "DLS config or graph passes", "dlspass": "dlspass source",
            "torch": "torch version", "python": "Python version", "optimizer": "optimizer type",
            "optimizer_options": "optimizer static options", "params": "parameters",
            "scaler": "loss scaler", "step_fn": "step function",
            "globals": "constants the step function reads",
            "callables": "functions the step function calls"}.get(key, key)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 120 else text[:117] + "..."


def _sources(compiled: AOTCompiledFunction) -> list[list[Any]]:
    """``[module, first line, last line, checksum]`` of every source dynamo traced."""
    return sorted([s.module, s.firstlineno, s.lastlineno, s.checksum]
                  for s in compiled.source_info().inlined_sources)


def module_constants(modules: list[str]) -> dict[str, dict[str, str]]:
    """The plain constants (numbers, strings, None) and imported or aliased functions in the
    globals of each module the trace read, by module and name; torch's and dlspass's own left out (their versions are in the header).
    Dynamo bakes a constant that traced code reads from its module's globals into the graph
    and torch's ``aot_compile`` keeps no guard on globals: a model whose ``forward`` reads
    ``SCALE = 1.0`` would otherwise load and run with the saved value after the line changed
    to ``SCALE = 3.0`` (a line outside the traced lines, so outside their checksums)."""
    found: dict[str, dict[str, str]] = {}
    for name in modules:
        if name.split(".")[0] in ("torch", "dlspass"):
            continue
        module = sys.modules.get(name)
        if module is None:
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
        scope = vars(module) if module is not None else {}
        found[name] = {k: repr(v) for k, v in scope.items() if not k.startswith("__")
                       and isinstance(v, bool | int | float | complex | str | bytes | type(None))}
        # and a function bound under another name (``ACT = F.gelu``): which one, by its code
        # (one defined in the module itself is under its traced lines' checksums)
        found[name].update({k: ident for k, v in scope.items() if not k.startswith("__")
                            and getattr(v, "__module__", name) != name
                            and (ident := _callable_identity(v)) is not None})
    return found


def _changed_constants(saved: Any) -> str | None:
    """The first module constant (`module_constants`) whose value differs from the save's."""
    if not isinstance(saved, dict):
        return "no module constants in the header"
    now = module_constants(sorted(saved))
    for module in sorted(saved):
        for name in sorted(set(saved[module]) | set(now.get(module, {}))):
            if saved[module].get(name) != now.get(module, {}).get(name):
                return (f"{module}.{name}: saved {_short(saved[module].get(name))}, "
                        f"now {_short(now.get(module, {}).get(name))}")
    return None


def _changed_source(sources: list[list[Any]] | None) -> str | None:
    """The first traced source whose lines no longer hash as they did at save, or None."""
    if not isinstance(sources, list):
        return "no source list in the header"
    for module_name, first, last, checksum in sources:
        try:
            module = importlib.import_module(module_name)
            now = _hash_sourcelines(module, first, last)
        except (ImportError, OSError, TypeError) as e:
            return f"{module_name}: {e}"
        if now != checksum:
            return f"{module_name}, lines {first}-{last}"
    return None


@contextlib.contextmanager
def _pickled_for_guards(optimizer: torch.optim.Optimizer, live: Any) -> Iterator[None]:
    """While saving, how the guard state pickles the optimizer and its ``LiveOptimizer``.

    The optimizer with its whole ``__dict__`` (the patched ``step`` included; torch.optim's
    ``__getstate__`` keeps three keys); the ``LiveOptimizer`` without the scaler, the model and
    the created buffers, which the traced step never reads (a scaler's SummaryWriter does not
    pickle). Each is made empty first and filled after, as pickle does for plain objects, so
    the reference cycle between the two resolves to one object each.
    """
    dropped = {"scaler": None, "model": None, "_created": {}}
    patched = [(optimizer, {k: v for k, v in vars(optimizer).items() if k != "__reduce_ex__"}),
               (live, {**{k: v for k, v in vars(live).items() if k != "__reduce_ex__"}, **dropped})]
    for obj, state in patched:
        obj.__reduce_ex__ = functools.partial(_reduce, type(obj), state)  # this instance only
    try:
        yield
    finally:
        for obj, _ in patched:
            del obj.__reduce_ex__


def _reduce(cls: type, state: dict[str, Any], protocol: int) -> tuple:
    return (object.__new__, (cls,), state, None, None, _set_dict)


def _set_dict(obj: object, state: dict[str, Any]) -> None:
    """Restore an object's ``__dict__`` without its class's ``__setstate__`` (torch.optim's reads
    the state's tensors, which the guard state holds as stubs)."""
    obj.__dict__.update(state)
