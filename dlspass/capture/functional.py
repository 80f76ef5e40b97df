"""Capture one training step (forward, backward, optimizer update) as one pure ATen FX graph.

``trace_step`` builds the role-tagged graph with ``make_fx`` over ``torch.func`` (the capture
contract is in ``dlspass/graph/roles.py``); ``capture_step`` adds the DLS rewrite and returns a
callable that runs the graph and writes parameters, buffers, optimizer state and scaler state
back into the user's objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._decomp import get_decompositions
from torch._dynamo.exc import Unsupported, UserError
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from dlspass.cache_facts import inductor_key_config
from dlspass.capture import step_pipeline
from dlspass.capture.aot import step_inductor_config
from dlspass.capture.optim import functionalize
from dlspass.capture.runner import StepRunner
from dlspass.capture.step_config import resolve_config
from dlspass.capture.step_pipeline import (
    DataParallel,
    GraphPass,
    StepCaptureError,
    param_targets,
)
from dlspass.capture.step_plan import StepPlan
from dlspass.capture.telemetry import step_telemetry
from dlspass.config import DLSConfig, FP16Type, PrecisionMode
from dlspass.distributed import DistributedSetupError
from dlspass.errors import DLSPassError
from dlspass.formats import INDUCTOR_CONFIG
from dlspass.graph import roles
from dlspass.graph.clone import clone_step_graph
from dlspass.graph.marks import resolve_marks
from dlspass.graph.step_io import StepIO, mark_backward, mark_grads, safe_name, tag_step_io
from dlspass.passes.base import PassContractError
from dlspass.passes.decompose_rounding_pass import DecomposeRoundingPass
from dlspass.passes.drop_copy_back_pass import DropCopyBackPass
from dlspass.passes.write_updates_in_place_pass import WriteUpdatesInPlacePass
from dlspass.scale_policy import STATE_FIELDS, ScalerState, init_state
from dlspass.scaler import GradScaler

LossFn = Callable[[nn.Module, Any], Tensor]
"""``loss_fn(model, batch) -> loss``: what a captured step differentiates."""

# native_batch_norm mutates its running statistics without declaring it in its schema, so
# functionalization cannot see the mutation; its decomposition makes the update explicit.
_DECOMPOSITIONS = get_decompositions([torch.ops.aten.native_batch_norm.default])


CaptureError = StepCaptureError
"""The name ``capture_step``'s error had before `StepCaptureError` (the same class)."""


def _tracing_errors() -> tuple[type[BaseException], ...]:
    """What torch raises when it cannot trace a step that runs eagerly: the step's fault."""
    return (Unsupported, UserError, torch.fx.proxy.TraceError, GuardOnDataDependentSymNode,
            DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


class _LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap in tensors."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Tensor:
        return self.loss_fn(self.model, batch)


@dataclass
class StepLayout:
    """Names of every placeholder group, in graph order, and the batch structure."""

    params: list[str]
    trainable: list[str]
    buffers: list[str]
    opt_state: list[str]
    hyper: list[str]
    batch_spec: pytree.TreeSpec
    batch_consts: list[Any]  # non-tensor leaves of the batch, baked into the graph
    batch_is_tensor: list[bool]
    updated_params: list[str]

    @property
    def io(self) -> StepIO:
        """The graph's input and output layout (batch tensors named ``batch.<i>``)."""
        return StepIO(params=self.params, buffers=self.buffers, opt_state=self.opt_state,
                      hyper=self.hyper, batch=[f"batch.{i}" for i in range(sum(self.batch_is_tensor))],
                      updated_params=self.updated_params)

    @property
    def n_inputs(self) -> int:
        return (len(self.params) + len(self.buffers) + len(self.opt_state) + len(STATE_FIELDS)
                + len(self.hyper) + sum(self.batch_is_tensor))


def _check_params(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise StepCaptureError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be trained")


def _split_batch(batch: Any) -> tuple[list[Any], pytree.TreeSpec, list[bool]]:
    leaves, spec = pytree.tree_flatten(batch)
    return leaves, spec, [isinstance(x, Tensor) for x in leaves]


def trace_step(model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
               example_batch: Any, config: DLSConfig | None = None,
               ) -> tuple[fx.GraphModule, StepLayout, Any]:
    """The un-rewritten, role-tagged step graph, its input layout and the functional optimizer.

    Parameters the loss does not use get no gradient in eager PyTorch (``p.grad is None``) and
    torch.optim skips them; ``vjp`` gives them zeros instead, so they are found in a first trace
    and left out of the update in a second one (Adam would otherwise move them).
    """
    gm, layout, fopt = _trace(model, loss_fn, optimizer, example_batch, config, frozenset())
    unused = frozenset(
        roles.target_of(n) for n in gm.graph.nodes
        if roles.role_of(n) == roles.GRAD and n.target is torch.ops.aten.zeros_like.default
        and n.args[0].op == "placeholder")
    if unused:
        gm, layout, fopt = _trace(model, loss_fn, optimizer, example_batch, config, unused)
    return gm, layout, fopt


def _trace(model: nn.Module, loss_fn: LossFn,
           optimizer: torch.optim.Optimizer, example_batch: Any, config: DLSConfig | None,
           unused: frozenset[str]) -> tuple[fx.GraphModule, StepLayout, Any]:
    _check_params(model)
    names = param_targets(optimizer, model)
    fopt = functionalize(optimizer, names)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    opt_state = fopt.state_tensors()
    hyper = fopt.hyper_tensors()
    in_opt = {names[id(p)] for g in optimizer.param_groups for p in g["params"]}
    trainable = [n for n, p in params.items() if p.requires_grad]
    updated = [n for n in params if n in in_opt]
    leaves, spec, is_tensor = _split_batch(example_batch)
    if not any(is_tensor):
        raise StepCaptureError("the example batch holds no tensor")
    layout = StepLayout(
        params=list(params), trainable=trainable, buffers=list(buffers), opt_state=list(opt_state),
        hyper=list(hyper), batch_spec=spec, batch_consts=[x for x, t in zip(leaves, is_tensor, strict=True) if not t],
        batch_is_tensor=is_tensor, updated_params=updated,
    )
    state0 = init_state(config or DLSConfig(loss_scale=None))
    wrapper = _LossModule(model, loss_fn)
    io = layout.io

    def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
        p_in, b_in, o_in, s_list, h_in, batch_tensors = io.split(flat)
        s_in = ScalerState(*s_list)
        tensors, consts = iter(batch_tensors), iter(layout.batch_consts)
        batch = pytree.tree_unflatten(
            [next(tensors) if t else next(consts) for t in layout.batch_is_tensor], layout.batch_spec)
        frozen = {k: v for k, v in p_in.items() if k not in trainable}

        def forward(p_train: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
            # clones inside the transform: BatchNorm may update running statistics in place
            b = {k: v.clone() for k, v in b_in.items()}
            state = {f"model.{k}": v for k, v in {**p_train, **frozen, **b}.items()}
            with _users_code("the loss function"):
                loss = torch.func.functional_call(wrapper, state, (batch,))
            return loss, b

        loss, vjp_fn, new_b = torch.func.vjp(forward, {k: p_in[k] for k in trainable}, has_aux=True)
        if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            raise StepCaptureError(
                f"loss_fn must return a scalar floating-point tensor, got "
                f"{type(loss).__name__ if not isinstance(loss, Tensor) else f'{loss.dtype} of shape {tuple(loss.shape)}'}")
        loss, seed = mark_backward(loss)
        with _users_code("the backward of the loss"):
            (grads,) = vjp_fn(seed)
        grads = mark_grads({k: g for k, g in grads.items() if k in in_opt and k not in unused})
        new_p, new_o = fopt.update({k: p_in[k] for k in updated}, grads, o_in, h_in)
        return (*[new_p[k] for k in updated], *[new_b[k] for k in layout.buffers],
                *[new_o[k] for k in layout.opt_state], *s_in, loss)

    flat_in = [*params.values(), *buffers.values(), *opt_state.values(), *state0, *hyper.values(),
               *[x for x in leaves if isinstance(x, Tensor)]]
    flat_in = [x.detach() for x in flat_in]
    try:
        gm = make_fx(torch.func.functionalize(flat_step, remove="mutations"),
                     tracing_mode="fake", decomposition_table=_DECOMPOSITIONS)(*flat_in)
    except _tracing_errors() as e:  # anything else raised here is dlspass's own (internal)
        raise _trace_error(e) from e
    try:
        DropCopyBackPass()(gm)
    except PassContractError as e:  # a copy functionalize could not remove: the user's step
        raise StepCaptureError(str(e)) from e
    resolve_marks(gm)
    tag_step_io(gm, io, name=lambda role, target: safe_name(f"{role}__{target}"))
    return gm, layout, fopt


@contextlib.contextmanager
def _users_code(what: str) -> Iterator[None]:
    """Report what the user's code (``what``) raised while traced as a `StepCaptureError`."""
    try:
        yield
    except DLSPassError:  # dlspass's own errors keep their family (an input or internal error)
        raise
    except Exception as e:  # the user's model and loss raise whatever they raise
        raise _trace_error(e, what) from e


def _trace_error(e: BaseException, what: str = "torch") -> StepCaptureError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "data-dependent" in msg.lower() or "DataDependent" in type(e).__name__:
        return StepCaptureError(
            "the step uses Python control flow on tensor values (e.g. `if loss > 0:`), which "
            f"one graph cannot capture; use torch.where instead ({type(e).__name__}: {msg})")
    return StepCaptureError(f"could not trace the training step: {what} raised "
                            f"{type(e).__name__}: {msg}")


class CapturedStep(StepRunner):
    """One training step as a graph: ``loss = step(batch)`` updates everything in place.

    Attributes: ``graph_module`` (the rewritten FX GraphModule), ``scaler`` (a
    ``dlspass.GradScaler`` holding the DLS state), ``config``, ``layout``, ``num_calls`` (the
    calls so far; advanced before the graph runs, so a provider reads the step index + 1).

    Hooks, as on ``dlspass.compile``'s step (`run_step_pipeline` runs both):

    - ``graph_passes``: callables ``pass(gm)`` that rewrite the role-tagged step graph in
      place before the collectives and ``apply_dls`` (``dlspass.debug.faults`` adds one), or
      after ``apply_dls`` where the pass's ``pipeline_phase`` is ``"after_dls"``;
    - ``extra_inputs``: ``{target: provider}``. A pass may append placeholders (role
      ``input``, target ``target``); the graph then gets ``provider()`` for each at every call.

    ``telemetry``: the ``dlspass.capture.telemetry.Telemetry`` the step feeds (the config's
    ``telemetry=True`` adds one to ``graph_passes``, or the one passed there), or None;
    ``step.telemetry.read()`` gives the last call's counts.

    Changing them takes effect at the next call, or at once with `rebuild` (which runs the
    pipeline again on the traced graph and, with ``compile``, compiles the result).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, traced: fx.GraphModule,
                 layout: StepLayout, fopt: Any, plan: StepPlan, *, compile: bool = False) -> None:
        super().__init__(plan, optimizer)
        self.model = model
        self.layout = layout
        self.compile = compile
        self._fopt = fopt
        self._static = fopt.static_signature()
        self._names = param_targets(optimizer, model)
        self._traced = traced  # tagged, before any pass: what `rebuild` starts from
        # (graph, runner, the hooks it was built for) by the hooks' ids; holding the hooks
        # keeps their ids from being reused
        self._builds: dict[tuple, tuple[fx.GraphModule, Callable[..., Any], tuple]] = {}
        self._built_for: tuple = ()
        self.rebuild()

    def _param_names(self) -> dict[int, str]:
        return self._names

    def _hooks(self) -> tuple[tuple, tuple]:
        """The hooks a build depends on, and a key for them (by identity: a pass need not be
        hashable)."""
        hooks = (*self.graph_passes, *self.extra_inputs.values())
        return hooks, (tuple(map(id, hooks)), tuple(self.extra_inputs), self.compile)

    def rebuild(self) -> None:
        """Run the step pipeline for the current ``graph_passes``, ``extra_inputs`` and
        ``compile`` (a combination built before is reused, not rebuilt)."""
        hooks, key = self._hooks()
        if key not in self._builds:
            inputs = self.plan.inputs()
            gm, added = step_pipeline.run_step_pipeline(clone_step_graph(self._traced), self.plan)
            providers = [inputs[t] for t in added]
            runner: Callable[..., Any] = gm
            if self.compile:
                runner = _inductor(gm, [*self._example_inputs(), *(p() for p in providers)])
            if providers:
                runner = _feeding(runner, providers)
            self._builds[key] = (gm, runner, hooks)
        self.graph_module, self._runner, _ = self._builds[key]
        self._built_for = key

    def _example_inputs(self) -> list[Tensor]:
        """Inputs like the captured example's (zeros for the batch), to compile with."""
        vals = [ph.meta["val"] for ph in self._traced.graph.find_nodes(op="placeholder")
                if roles.role_of(ph) == roles.INPUT]
        return self._inputs_for([torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                                     device=v.device).zero_() for v in vals])

    def _inputs_for(self, batch_leaves: list[Tensor]) -> list[Tensor]:
        model = self.model
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        ost = self._fopt.state_tensors()
        hyp = self._fopt.hyper_tensors()
        if list(ost) != self.layout.opt_state or list(hyp) != self.layout.hyper:
            raise StepCaptureError("the optimizer's state layout changed since capture; capture the step again")
        return [*(params[k].detach() for k in self.layout.params),
                *(buffers[k] for k in self.layout.buffers), *ost.values(), *self.scaler.state,
                *hyp.values(), *batch_leaves]

    def _batch_leaves(self, batch: Any) -> list[Tensor]:
        leaves, spec, is_tensor = _split_batch(batch)
        if spec != self.layout.batch_spec or is_tensor != self.layout.batch_is_tensor:
            raise StepCaptureError(f"batch structure {spec} differs from the captured {self.layout.batch_spec}")
        consts = [x for x, t in zip(leaves, is_tensor, strict=True) if not t]
        if consts != self.layout.batch_consts:
            raise StepCaptureError("non-tensor batch values differ from the captured ones; capture again")
        return [x for x in leaves if isinstance(x, Tensor)]

    def __call__(self, batch: Any) -> Tensor:
        if self._fopt.static_signature() != self._static:
            raise StepCaptureError("an optimizer option baked into the graph changed (e.g. nesterov, "
                                   "amsgrad); capture the step again")
        if self._hooks()[1] != self._built_for:
            self.rebuild()
        flat = self._inputs_for(self._batch_leaves(batch))
        self.num_calls += 1
        skipped = self.scaler.state.num_skipped_steps
        if self.compile:  # the compiled graph writes the scaler state in place (`_inductor`)
            skipped = skipped.clone()
        with torch.no_grad():
            out = list(self._runner(*flat))
        self._write_back(out)
        # found_inf, stepped() and the scale log follow the step, as after update()
        self._record(skipped)
        return out[-1]

    def _write_back(self, out: list[Tensor]) -> None:
        lay = self.layout
        it = iter(out)
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for k in lay.updated_params:
                params[k].copy_(next(it))
            for k in lay.buffers:
                buffers[k].copy_(next(it))
        self._fopt.write_back({k: next(it) for k in lay.opt_state})
        self.scaler.state = ScalerState(*[next(it) for _ in STATE_FIELDS])


def _feeding(runner: Callable[..., Any], providers: list[Callable[[], Tensor]]) -> Callable[..., Any]:
    """``runner`` with each provider's value appended to its inputs at every call (read when
    the graph runs, so changing them never recompiles)."""
    def run(*flat: Tensor) -> Any:
        return runner(*flat, *(p() for p in providers))

    return run


def _inductor(gm: fx.GraphModule, example: list[Tensor]) -> Callable[..., Any]:
    gm = clone_step_graph(gm)  # the rewritten graph stays inspectable, with its rounding op
    DecomposeRoundingPass(form="cast")(gm)
    # the updates land in the inputs' storage, inside the update kernels, as in dlspass.compile's
    # step: a functional graph allocates every new parameter and state tensor while the old
    # ones are alive and the runner copies them back (above torch's peak). Only this compiled
    # copy: `graph_module` keeps the functional outputs that inspect, localize and ONNX read.
    WriteUpdatesInPlacePass()(gm)
    # the CPU facts in the cache key (dlspass.cache_facts)
    # and the whole-step settings dlspass.compile's step gets (weight gradients where the
    # backward computes them, contiguous convolutions on CPU: dlspass.capture.aot)
    with inductor_config.patch({**INDUCTOR_CONFIG, **inductor_key_config(), **step_inductor_config(example)}):
        return compile_fx(gm, example)


def _make_scaler(config: DLSConfig | None, summary_writer: Any = None) -> Any:
    return GradScaler(config=config or DLSConfig(loss_scale=None, mixed_precision=False),
                      summary_writer=summary_writer)


def capture_step(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    example_batch: Any,
    config: DLSConfig | None = None,
    *,
    fp16_type: FP16Type | None = None,
    mixed_precision: bool | None = None,
    max_gradient_norm: float | None = None,
    precision_mode: PrecisionMode | None = None,
    compile: bool = False,
    graph_passes: Sequence[GraphPass] = (),
    process_group: Any = None,
    agree_flag: bool = True,
    broadcast_params: bool = True,
    summary_writer: Any = None,
) -> CapturedStep:
    """Capture ``loss_fn(model, batch)`` + backward + ``optimizer`` as one graph, with DLS.

    ``config=None`` means fp32 with no scaling (the pipeline only captures). The keyword
    overrides (``fp16_type``, ``mixed_precision``, ``max_gradient_norm``, ``precision_mode``;
    None: not given) merge into ``config`` by ``DLSConfig.with_overrides``, as in every entry
    point (without a config, naming an ``fp16_type`` asks for lowering to it). The returned
    step runs eagerly by default and through inductor with ``compile=True`` (the compiled graph
    writes parameters, optimizer state and scaler state into their own storage, as
    ``dlspass.compile``'s step does; ``step.graph_module`` keeps the functional outputs). ``graph_passes``
    rewrite the role-tagged step graph before DLS, or after it (``pipeline_phase``; see
    `CapturedStep`). With the config's ``telemetry`` the step counts, per scaled gradient and
    lowered op output, the amax and the values flushed, subnormal and overflowing in
    ``fp16_type``, on the device: ``step.telemetry.read()``. With
    ``process_group`` (e.g. ``torch.distributed.group.WORLD``) the graph averages gradients
    over the group and agrees on the overflow flag with functional collectives, so one graph
    is one data-parallel step (``None``: no collectives): every rank captures the same step on
    its own batch shard, the graph averages the gradients over the group before DLS unscales
    and checks them, so ranks stay identical as under DDP; as DDP does at construction,
    ``broadcast_params`` first copies the parameters and buffers of the group's first rank to
    all ranks, and ``agree_flag`` all-reduces the overflow flag too. Parameters that are
    DTensors (FSDP2, tensor parallelism) are refused here, before any collective or trace, with
    `UnsupportedParallelismError`: use the eager scalers there (docs/DISTRIBUTED.md).
    The step's scaler (``step.scaler``) logs the scale after each step that scales when the
    config has ``log_loss_scale`` or a ``summary_writer`` is given (`GradScaler.log_scale`).

    Example:
        >>> import torch, dlspass
        >>> from dlspass.models import MLP, mse_loss
        >>> model = MLP(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> batch = (torch.randn(4, 8), torch.randn(4, 4))
        >>> step = dlspass.capture_step(model, mse_loss, opt, batch,
        ...                             config=dlspass.DLSConfig(mixed_precision=False))
        >>> loss = step(batch)
        >>> float(step.scaler.get_scale())
        32768.0
    """
    step_pipeline.refuse_dtensor_params("capture_step", [
        *model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])])
    config = resolve_config(config, default=None, fp16_type=fp16_type,
                            mixed_precision=mixed_precision, max_gradient_norm=max_gradient_norm,
                            precision_mode=precision_mode)
    data_parallel = None
    if process_group is not None:
        _join_group(model, process_group, broadcast_params)
        data_parallel = DataParallel(process_group, agree_flag)
    return build_step(model, loss_fn, optimizer, example_batch, config, compile=compile,
                      graph_passes=graph_passes, data_parallel=data_parallel,
                      summary_writer=summary_writer)


def capture_step_distributed(*args: Any, process_group: Any = None, **kwargs: Any) -> CapturedStep:
    """`capture_step` for data parallelism: one graph = step + gradient all-reduce over
    ``process_group`` (default: the world), with `capture_step`'s arguments."""
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedSetupError("capture_step_distributed: torch.distributed is not initialised")
    group = process_group if process_group is not None else dist.group.WORLD
    return capture_step(*args, process_group=group, **kwargs)


def _join_group(model: nn.Module, group: Any, broadcast_params: bool) -> None:
    """Check ``torch.distributed`` is up and, with ``broadcast_params``, copy the parameters and
    buffers of the group's first rank to every rank (as DDP does at construction)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedSetupError("capture_step: process_group was given but torch.distributed "
                                    "is not initialised")
    if broadcast_params:
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=src, group=group)


def build_step(model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
               example_batch: Any, config: DLSConfig | None, *, compile: bool = False,
               graph_passes: Sequence[GraphPass] = (), data_parallel: DataParallel | None = None,
               summary_writer: Any = None) -> CapturedStep:
    """Trace the step and wrap it as a ``CapturedStep``, which runs the step pipeline
    (`run_step_pipeline`) on it: the one assembly line of every captured step."""
    gm, layout, fopt = trace_step(model, loss_fn, optimizer, example_batch, config)
    passes = list(graph_passes)
    plan = StepPlan(config=config, scaler=_make_scaler(config, summary_writer), graph_passes=passes,
                    telemetry=step_telemetry(config, passes), data_parallel=data_parallel,
                    backend_compiler="inductor" if compile else "eager")
    return CapturedStep(model, optimizer, gm, layout, fopt, plan, compile=compile)
