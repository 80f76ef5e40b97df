"""``dlspass.compile``: a whole training step compiled as one graph, dynamic loss scaling included.

The user writes an ordinary eager step (forward, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad()``, ``return loss.detach()``). torch 2.13 can trace that as one graph only
with ``trace_autograd_ops`` on and without ``torch.optim``'s own ``step`` (it graph-breaks on
purpose), so while the compiled step runs:

1. ``optimizer.step`` / ``optimizer.zero_grad`` are replaced on the instance by torch.optim's
   math in functional form (``dlspass.capture.optim.update_one``: SGD, Adam, AdamW) that reads
   the hyperparameters from float64 tensors (graph inputs: a scheduler changing lr does not
   recompile) and writes parameters, optimizer state and the (passed-through) scaler state back
   in place, which AOTAutograd turns into graph outputs;
2. parameters, gradients, optimizer state, scaler state, hyperparameters and updates are
   wrapped in ``dlspass.graph.marks.mark`` so the AOTAutograd graph carries roles;
3. the AOT forward compiler (``tag_aot_graph``) moves those roles onto placeholders and
   outputs, tags the backward seed (the ``ones_like(loss)`` every gradient depends on) and runs
   the step pipeline (``dlspass.capture.step_pipeline``, the one ``capture_step`` runs):
   ``dlspass.passes.apply_dls``: 16-bit lowering, seed scaling, unscale and overflow check,
   clipping, ``where``-guarded updates (a skipped step leaves parameters and optimizer state
   bit-identical, with no clones) and the scale update, all on device with no host sync;
4. ``WriteUpdatesInPlacePass`` ends the graph with ``copy_`` into each updated input, so the
   updates land in the parameters' own storage inside the fused kernels instead of being
   copied back one tensor at a time by AOTAutograd; the graph then goes to inductor (or runs
   as is with ``backend_compiler="eager"``).

Hooks on that AOT graph (the same as ``CapturedStep``'s): ``graph_passes`` run between tagging
and ``apply_dls`` (or after it, for a pass whose ``pipeline_phase`` is ``"after_dls"``) and may
add inputs that the step feeds at every call (``CompiledStep.extra_inputs``; fault injection
uses this), and ``process_group`` makes the graph one data-parallel step (gradient all-reduce
before DLS, overflow-flag all-reduce after it). ``DLSConfig(telemetry=True)`` adds the numerics
telemetry (``step.telemetry.read()``; dlspass.capture.telemetry).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from dlspass.capture.aot import step_backend
from dlspass.capture.dynamo_backend import BACKEND_COMPILERS
from dlspass.capture.dynamo_source import find_seed, tag_aot_graph, tag_backward_grads
from dlspass.capture.live_optimizer import SUPPORTED_NAMES, LiveOptimizer, functionalize_live
from dlspass.capture.runner import StepRunner
from dlspass.capture.saved_step import SavedStepMismatchError, kernel_settings, load_step, save_step
from dlspass.capture.step_pipeline import StepCaptureError, param_targets, refuse_dtensor_params
from dlspass.capture.step_plan import StepPlan, resolve_plan
from dlspass.config import ConfigError, DLSConfig, FP16Type, PrecisionMode
from dlspass.errors import DLSPassError, InputTypeError
from dlspass.passes.base import GraphPass

CompileError = StepCaptureError
"""The name ``dlspass.compile``'s error had before `StepCaptureError` (the same class)."""


class StepNotCallableError(InputTypeError):
    """``dlspass.compile`` was given something that is not callable as the step (an input
    TypeError: one builtin base per error class, ``tests/test_errors.py``)."""


# the AOT graph's tagging lives in dlspass.capture.dynamo_source (these names stay importable here)
__all__ = ["CompileError", "CompiledStep", "StepNotCallableError", "compile", "find_seed",
           "tag_aot_graph", "tag_backward_grads"]


# ---- public entry point ----------------------------------------------------------------------

class CompiledStep(StepRunner):
    """The callable ``dlspass.compile`` returns: call it like the original step.

    Hooks on the AOT graph (both read when the step is first called, which compiles it):

    - ``graph_passes``: callables ``pass(gm)`` that rewrite the role-tagged AOT step graph in
      place, after ``tag_aot_graph`` and before ``apply_dls`` (``dlspass.debug.faults`` uses one),
      or after it where the pass's ``pipeline_phase`` is ``"after_dls"`` (the telemetry);
    - ``extra_inputs``: ``{target: provider}``. A pass may append placeholders (role
      ``input``, ``dlspass_target`` = target); the graph then gets ``provider()`` (a tensor on
      the parameters' device) for each of them at every call, so their values change without
      recompiling.

    ``telemetry``: the ``dlspass.capture.telemetry.Telemetry`` the step feeds (the config's
    ``telemetry=True`` adds one to ``graph_passes``, or the one passed there), or None;
    ``step.telemetry.read()`` gives the last call's counts.

    ``num_calls`` counts the calls (a step index for the providers; it is advanced before the
    graph runs). With ``process_group`` the graph averages gradients over the group and agrees
    on the overflow flag (see `compile`).
    """

    def __init__(self, fn: Callable, optimizer: torch.optim.Optimizer, plan: StepPlan,
                 broadcast_params: bool = True, model: torch.nn.Module | None = None) -> None:
        functionalize_live(optimizer, param_targets(optimizer, model))  # an unsupported optimizer fails here
        super().__init__(plan, optimizer)
        self.fn = fn
        self.backend_compiler = plan.backend_compiler
        # the rewritten AOT graphs, for inspection, in compile order; a compile AOTAutograd's
        # cache served holds the function that makes its graph until it is asked for
        self._graphs: list[fx.GraphModule | Callable[[], fx.GraphModule]] = []
        dp = plan.data_parallel
        self.process_group = None if dp is None else dp.group
        self._broadcast_pending = broadcast_params and self.process_group is not None
        self._ctx = LiveOptimizer(optimizer, plan.scaler, plan.config, model)
        # the plan goes down to the backend, which runs the pipeline itself (dlspass.capture.aot)
        backend = functools.partial(step_backend, plan=plan, keep=self._graphs.append,
                                    on_cache_hit=self._graphs.append)
        self._compiled = torch.compile(_own_frame(fn), backend=backend, fullgraph=True)
        self._aot: Any = None  # the step saved or loaded ahead of time (`save`, `load`), or None
        functools.update_wrapper(self, fn)
        self.__signature__ = inspect.signature(fn)

    @property
    def graphs(self) -> list[fx.GraphModule]:
        """The rewritten AOT step graphs, one per compile, for inspection.

        A compile that AOTAutograd's cache served (a warm start, ``docs/COMPILE_TIME.md``) ran
        no pipeline: its graph is made again here, on first access (a trace and the pipeline;
        inductor's FX-graph cache serves the compile), so the list reads as after a cold start.
        """
        for i, graph in enumerate(self._graphs):
            if not isinstance(graph, fx.GraphModule):
                self._graphs[i] = graph()
        return self._graphs  # type: ignore[return-value]  # every entry made above

    def _param_names(self) -> dict[int, str]:
        return self._ctx.names

    def _broadcast(self) -> None:
        group = self.process_group
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    dist.broadcast(p.data, src=src, group=group)
        self._broadcast_pending = False

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        """While the step's frame is traced or run: the optimizer's live state refreshed and
        ``optimizer.step`` / ``optimizer.zero_grad`` replaced by the functional update
        (`LiveOptimizer`), with dynamo's settings for a whole step; restored afterwards."""
        opt = self.optimizer
        if self.num_calls == 0:
            # a list, not a generator: step_pipeline would resume this module's generator
            # frame, a call back up into this module (tests/test_compile_path.py)
            refuse_dtensor_params(
                "dlspass.compile", [p for g in opt.param_groups for p in g["params"]])
        if self._broadcast_pending:
            self._broadcast()
        self._ctx.refresh()
        had = {k: opt.__dict__[k] for k in ("step", "zero_grad") if k in opt.__dict__}
        opt.step = self._ctx.step
        opt.zero_grad = self._ctx.zero_grad
        try:
            with torch._dynamo.config.patch(trace_autograd_ops=True,
                                            ignore_logging_functions=_ignored_logging_functions()):
                yield
        finally:
            for k in ("step", "zero_grad"):
                if k in had:
                    setattr(opt, k, had[k])
                else:
                    opt.__dict__.pop(k, None)

    def live_optimizer(self) -> LiveOptimizer:
        """The `LiveOptimizer` the traced step calls, refreshed to the optimizer's structure."""
        self._ctx.refresh()
        return self._ctx

    def aot_compile(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """torch's ahead-of-time compile of the step's frame for ``args``/``kwargs`` (inside
        `live`); see ``dlspass.capture.saved_step``."""
        return self._translate(lambda: self._compiled.aot_compile((tuple(args), dict(kwargs))))

    def save(self, path: str | Path, *args: Any, **kwargs: Any) -> None:
        """Compile the step ahead of time for the example inputs ``args``/``kwargs`` and save it
        to ``path`` (a ``.dlstep`` file); the step then runs what was saved. Nothing is run.

        A process that builds the same step (same function, model and optimizer classes and
        shapes, scaler config, dlspass, torch) loads it with `load` and skips dynamo,
        AOTAutograd, the dlspass passes and inductor; loading under another plan is refused
        (``dlspass.capture.saved_step``). CPU steps compiled with inductor only, without
        telemetry, fault injection or a process group (`StepNotSaveableError` otherwise).

        Example (the step saved in one process, loaded in another)::

            >>> import torch, dlspass
            >>> from dlspass.models import MLP, mse_train_step
            >>> def make():
            ...     torch.manual_seed(0)
            ...     model = MLP(d_in=8, d_hidden=16, d_out=8)
            ...     opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            ...     return dlspass.compile(mse_train_step(model, opt), optimizer=opt,
            ...                            config=dlspass.DLSConfig(fp16_type="float16"))
            >>> x, y = torch.randn(4, 8), torch.randn(4, 8)
            >>> make().save("step.dlstep", x, y)   # process 1: compiles and saves
            >>> step = make().load("step.dlstep")  # process 2: nothing compiles
            >>> loss = step(x, y)
        """
        self._aot = save_step(self, path, args, kwargs)

    def load(self, path: str | Path) -> CompiledStep:
        """Run the step saved at ``path`` by `save` instead of compiling it; returns the step.

        The saved step runs on this step's own function, model, optimizer and scaler; a file
        saved under another plan (DLS config, graph passes, optimizer type or static options,
        parameters, a changed source, another dlspass, torch or Python) is refused with one
        line (``SavedStepMismatchError``), never run; so is a later call that the saved
        guards refuse (e.g. a parameter group added). Nothing is traced, so ``graphs`` stays
        empty. Load only files you trust (the file holds a pickle). Example: see `save`.
        """
        self._aot = load_step(self, path)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        opt = self.optimizer
        with self.live():
            self.num_calls += 1
            # found_inf, stepped() and the scale log follow every step that scales, as after update()
            skipped = self.scaler.state.num_skipped_steps.clone() if self._scales() else None
            run = self._compiled if self._aot is None else self._run_saved
            out = self._translate(lambda: run(*args, **kwargs))
        # the step was this optimizer's step: LR schedulers check the flag to warn about
        # lr_scheduler.step() before optimizer.step()
        opt._opt_called = True  # type: ignore[attr-defined]
        self._record(skipped)
        return out

    def _run_saved(self, *args: Any, **kwargs: Any) -> Any:
        """The saved step; its guards (dynamo's, rebuilt at load) failing is a refusal."""
        aot = self._aot
        if not aot.guard_check(*args, **kwargs):
            reason = aot._artifacts.guard_manager.check_verbose(aot.prepare_f_locals(*args, **kwargs))
            raise SavedStepMismatchError(
                "dlspass: the saved step does not fit this call (its guards failed: "
                f"{' '.join(str(p) for p in reason.verbose_code_parts)[:300]}); "
                "compile and save it again for these inputs and this optimizer")
        with kernel_settings():  # the kernels may be built from their source at the first call
            return aot.fn(*args, **kwargs)

    def _translate(self, run: Callable[[], Any]) -> Any:
        """``run()``, with dynamo's errors turned into dlspass's."""
        try:
            return run()
        except torch._dynamo.exc.BackendCompilerFailed as e:
            # dynamo wraps whatever the AOT compiler raised; a dlspass error (CompileError,
            # a pass's PassContractError, a graph pass's FaultError) is the one to see
            if isinstance(e.inner_exception, DLSPassError):
                raise e.inner_exception.with_traceback(e.inner_exception.__traceback__) from None
            raise
        except torch._dynamo.exc.Unsupported as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StepCaptureError(
                f"dlspass.compile: the training step is not one graph (graph break: {first}); "
                "dlspass never compiles a step partially. Take what the graph break names out "
                "of the step (e.g. Python control flow on a tensor's value, a call dynamo cannot "
                "trace), call loss.backward() once and return loss.detach()"
            ) from e


def _own_frame(fn: Callable) -> Callable:
    """``fn``, called from a function whose code object belongs to one `CompiledStep` alone.

    dynamo keeps its compiled graphs on the code object of the frame it compiles and counts
    recompiles per code object (``torch._dynamo.config.recompile_limit``, 8). Every
    `CompiledStep` guards on its own optimizer and backend, so ten ``dlspass.compile`` calls of
    one step function (a sweep, k-fold, a notebook cell run again) were ten recompiles of one
    frame, and the ninth failed (``FailOnRecompileLimitHit`` under ``fullgraph``). With its own
    code object each step's first compile is a first compile, and its graphs go with it.
    """

    def step(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    step.__code__ = step.__code__.replace()  # a copy: a code object of its own
    return step


_LOGGING_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")


def _ignored_logging_functions() -> set[Callable[..., Any]]:
    """dynamo's ``ignore_logging_functions`` plus ``logging.Logger``'s logging methods.

    A logging call in the step is a graph break on torch 2.13 unless its function is in that
    set; then the compiled step skips it. Libraries add methods to ``logging.Logger`` itself
    (transformers 5's ``warning_once``, called in every GPT-2 forward), so the class is read
    at each call. The set is patched in only while the step runs.
    """
    added = {getattr(logging.Logger, name) for name in vars(logging.Logger)
             if name in _LOGGING_METHODS or name.endswith("_once") or name == "warning_advice"}
    return set(torch._dynamo.config.ignore_logging_functions) | {f for f in added if callable(f)}


def compile(
    fn: Callable,
    *,
    optimizer: torch.optim.Optimizer,
    scaler: Any | None = None,
    config: DLSConfig | None = None,
    # overrides of the config's fields (None: not given), merged by DLSConfig.with_overrides
    fp16_type: FP16Type | None = None, mixed_precision: bool | None = None,
    max_gradient_norm: float | None = None, precision_mode: PrecisionMode | None = None,
    backend_compiler: str = "inductor",
    graph_passes: Sequence[GraphPass] = (),
    process_group: Any = None,
    broadcast_params: bool = True,
    model: torch.nn.Module | None = None,
    summary_writer: Any = None,
) -> CompiledStep:
    """Compile a whole eager training step (forward, backward, optimizer, DLS) as one graph.

    ``fn`` must call ``loss.backward()``, ``optimizer.step()`` and ``optimizer.zero_grad()`` and
    return ``loss.detach()`` (or other detached values). Model parameters, optimizer state and
    ``scaler.state`` are updated in place on every call; on overflow the step is skipped.
    The optimizer math is torch.optim's (``dlspass.capture.optim``); every hyperparameter is a
    graph input read at each call (an LR scheduler never recompiles), while changing a static
    option (momentum on/off, nesterov, amsgrad, adding a param group) recompiles.
    ``scaler.found_inf`` and ``scaler.stepped(optimizer)`` follow each call without a host sync.
    ``backend_compiler="eager"`` runs the rewritten graph without inductor (fast, for tests).

    The config: the scaler's, or ``config`` (a scaler is then made from it when it scales),
    with the keyword overrides (``fp16_type``, ``mixed_precision``, ``max_gradient_norm``,
    ``precision_mode``; None: not given) merged by ``DLSConfig.with_overrides``, as in every
    entry point. An override that changes what a scaler's state was built for (e.g. an
    ``fp16_type`` with another scale range) is a ``ConfigError``: build the scaler with it.
    Without a scaler or config the step runs in float32 without loss scaling; naming an
    ``fp16_type`` then lowers to it. ``mixed_precision=False`` keeps the step in float32.

    ``graph_passes``: rewrites of the role-tagged AOT step graph run before ``apply_dls``, or
    after it for a pass with ``pipeline_phase = "after_dls"`` (see `CompiledStep`;
    ``dlspass.debug.faults.install_faults`` adds one). With the config's ``telemetry`` the
    step counts, per scaled gradient and lowered op output, the amax and the values flushed,
    subnormal and overflowing in ``fp16_type``, on the device: ``step.telemetry.read()``. ``model``: the
    graph names the parameters of ``model`` by its parameter names (``fc1.weight``) instead of
    ``group{i}.param{j}``, as ``capture_step`` does.

    Scale logging: with the config's ``log_loss_scale`` or a ``summary_writer`` (a
    ``torch.utils.tensorboard.SummaryWriter``) the scaler logs the scale and the skipped steps
    after the graph ran, every ``log_steps`` steps, with no host sync on the other steps
    (`GradScaler.log_scale`).

    Data parallelism: with ``process_group`` (a ``torch.distributed`` group, or ``True`` for
    the world) every rank runs the step on its own batch shard and the one compiled graph also
    averages the gradients over the group (``AllReduceGradsPass``, one bucketed functional
    all-reduce per dtype, before DLS unscales and checks them) and, for a dynamic scale,
    all-reduces the overflow flag (``AllReduceFlagPass``), so all ranks skip together and
    keep identical parameters and scaler state, with no graph break and no host sync. Do not
    wrap the model in DDP (the step's single-graph backward bypasses DDP's hooks). With
    ``broadcast_params`` (default) the first call copies the optimizer's parameters from the
    group's first rank to the others, as DDP does at construction; buffers and optimizer state
    are not broadcast, so they must start identical (e.g. the same seed).

    Example:
        >>> step = dlspass.compile(train_step, optimizer=opt, scaler=dlspass.GradScaler())
        >>> loss = step(x, y)
    """
    if backend_compiler not in BACKEND_COMPILERS:
        raise ConfigError(
            f"backend_compiler: expected one of {', '.join(BACKEND_COMPILERS)}, got {backend_compiler!r}"
        )
    if not callable(fn):
        raise StepNotCallableError(f"dlspass.compile: fn must be callable, got {type(fn).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise StepCaptureError(
            f"optimizer: expected a torch.optim optimizer, got {type(optimizer).__name__}; "
            f"supported: {SUPPORTED_NAMES}"
        )
    plan = resolve_plan(config=config, scaler=scaler, graph_passes=graph_passes,
                        process_group=process_group, write_in_place=True,
                        backend_compiler=backend_compiler, summary_writer=summary_writer,
                        fp16_type=fp16_type, mixed_precision=mixed_precision,
                        max_gradient_norm=max_gradient_norm, precision_mode=precision_mode)
    return CompiledStep(fn, optimizer, plan, broadcast_params, model)
