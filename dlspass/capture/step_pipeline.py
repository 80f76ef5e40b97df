"""The one assembly line from a traced training step to the rewritten step graph.

Every front end that makes a whole training step (``capture_step``, ``dlspass.compile``, the
``.pt2`` transform) runs its step graph through `run_step_pipeline`::

    tag -> pre-passes -> apply_dls -> post-passes -> after-DLS passes -> verify
        -> fused-kernel guard -> write-back

- **tag**: the front end's own tagging, when its graph does not come tagged (``dlspass.compile``
  passes ``tag_aot_graph``; ``trace_step`` tags while it traces; a ``.pt2`` step is tagged by
  ``joint_to_step_graph``);
- **pre-passes**: the user's ``graph_passes`` (fault injection is one), then, for a
  data-parallel step, ``AllReduceGradsPass``: both see the functional step graph before DLS, so
  DLS unscales and checks the gradients they leave (averaged, or faulted). A graph pass may
  append placeholders (role ``input``); their targets come back to the front end, which feeds
  them (from its ``extra_inputs`` or the pass object's own, `step_inputs`);
- **apply_dls**: the six DLS passes for the config (``precision_mode`` included), verified;
- **post-passes**: ``AllReduceFlagPass`` (a dynamic scale agreed over the group);
- **after-DLS passes**: the ``graph_passes`` whose ``pipeline_phase`` attribute is
  ``"after_dls"`` (`AFTER_DLS`; the default, no attribute, is ``"before_dls"``), in their
  order: they see the step as DLS and the lowering left it, its 16-bit ops included. The
  numerics telemetry is one (``dlspass.capture.telemetry.Telemetry``, which
  ``DLSConfig(telemetry=True)`` adds): it counts the float8 casts and, with ``telemetry="all"``,
  the lowered ops' outputs. A config asking for
  telemetry without a telemetry hook to feed and read it (the ``.pt2`` transform) is refused;
- **verify**: ``dlspass.verify`` again whenever a post-pass or an after-DLS pass ran, so a
  rewrite after DLS that breaks an invariant is caught in every front end alike;
- **fused-kernel guard**: ``GuardFusedUpdatesPass``: a fused optimizer kernel (an optimizer built
  ``fused=True``) gets the overflow flag as its ``found_inf`` and its outputs lose their
  ``where`` guards (the kernel returns its inputs on overflow); after ``verify``, whose contract
  is the ``where`` form;
- **write-back**: ``WriteUpdatesInPlacePass`` where the front end wants its updates written
  into its inputs (``dlspass.compile``). It comes after ``verify``, which reads the functional
  outputs: the ``copy_`` epilogue changes where an update lands, not what it is. Then
  ``ReinplaceFusedKernelPass``: a fused optimizer kernel whose updates are all copied back into
  its own inputs runs in place, as torch.optim runs it, without the copies.

This module also holds what the two step front ends share besides the line itself: their error
(`StepCaptureError`), their refusal of DTensor parameters (`refuse_dtensor_params`) and how they
name parameters in the graph (`param_targets`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

import torch
import torch.fx as fx

# DataParallel and step_inputs live with the plan; the names stay importable here
from dlspass.capture.step_plan import DataParallel, GraphPass, StepPlan, step_inputs  # noqa: F401
from dlspass.capture.telemetry import Telemetry
from dlspass.config import ConfigError, DLSConfig
from dlspass.distributed import is_dtensor
from dlspass.errors import InputRuntimeError
from dlspass.graph import roles
from dlspass.graph.invariants import verify
from dlspass.passes import apply_dls, check_graph
from dlspass.passes.all_reduce_flag_pass import AllReduceFlagPass
from dlspass.passes.all_reduce_grads_pass import AllReduceGradsPass

# the phases are GraphPass's class attribute (dlspass.passes.base); the names stay importable here
from dlspass.passes.base import AFTER_DLS, BEFORE_DLS, PIPELINE_PHASES
from dlspass.passes.guard_fused_updates_pass import GuardFusedUpdatesPass
from dlspass.passes.reinplace_fused_kernel_pass import ReinplaceFusedKernelPass
from dlspass.passes.write_updates_in_place_pass import WriteUpdatesInPlacePass


def pipeline_phase(graph_pass: GraphPass) -> str:
    """The phase ``graph_pass`` runs in (module docstring); an unknown one is a `ConfigError`."""
    phase = getattr(graph_pass, "pipeline_phase", BEFORE_DLS)
    if phase not in PIPELINE_PHASES:
        raise ConfigError(f"graph_passes: {graph_pass!r} has pipeline_phase {phase!r}; expected one "
                          f"of {', '.join(PIPELINE_PHASES)}")
    return phase


class StepCaptureError(InputRuntimeError):
    """The training step cannot be captured or compiled as one dlspass graph; the message says why."""


class UnsupportedParallelismError(StepCaptureError):
    """The step's parameters are DTensors (FSDP2, tensor parallelism, a device mesh): a step
    graph supports replicated parameters only (``process_group=``, DDP-style)."""


def refuse_dtensor_params(entry: str, params: Iterable[torch.Tensor]) -> None:
    """Raise `UnsupportedParallelismError`, in one line that starts with ``entry`` (the front
    end's name), when any of ``params`` is a DTensor.

    Both step front ends call it before a collective or a trace sees such a parameter: the
    parameter broadcast has no DTensor sharding strategy, dynamo breaks the graph on FSDP2's
    hooks, and the graph's gradient all-reduce would average shards as if they were replicas.
    """
    if any(is_dtensor(p) for p in params):
        raise UnsupportedParallelismError(
            f"{entry}: the parameters are DTensors (FSDP2, tensor parallelism or another "
            "device-mesh layout), which a captured or compiled step does not support; it "
            "supports data parallelism over plain replicated parameters (an unwrapped model and "
            "process_group=, DDP-style). With FSDP2 or a device mesh use the eager "
            "dlspass.GradScaler or dlspass.TorchGradScaler (docs/DISTRIBUTED.md)")


def run_step_pipeline(
    gm: fx.GraphModule,
    plan: StepPlan | DLSConfig | None,
    *,
    tag: Callable[[fx.GraphModule], None] | None = None,
    graph_passes: Sequence[GraphPass] = (),
    data_parallel: DataParallel | None = None,
    write_in_place: bool = False,
    extra_inputs: Collection[str] = (),
) -> tuple[fx.GraphModule, list[str]]:
    """Rewrite the step graph ``gm`` in place (module docstring) and return it, with the
    targets of the placeholders ``graph_passes`` appended, in graph order. Each such target
    must be one of ``extra_inputs`` (what the front end can feed), else `StepCaptureError`.

    ``plan``: the step's `StepPlan` (its config, graph passes, data parallelism, extra inputs
    and write-back; the keywords other than ``tag`` are then not given), or the bare config.
    """
    if isinstance(plan, StepPlan):
        config, graph_passes, data_parallel = plan.config, plan.graph_passes, plan.data_parallel
        write_in_place, extra_inputs = plan.write_in_place, plan.inputs()
    else:
        config = plan
    phases = [pipeline_phase(p) for p in graph_passes]
    if config is not None and config.telemetry and not any(isinstance(p, Telemetry) for p in graph_passes):
        # never silently without it: the user asked for counts
        raise StepCaptureError(f"telemetry={config.telemetry!r}: this step front end has no telemetry buffer to feed "
                               "and read (dlspass.compile and capture_step have; a .pt2 step file "
                               "has not): set telemetry to false")
    if tag is not None:
        tag(gm)
    n_inputs = len(gm.graph.find_nodes(op="placeholder"))
    for graph_pass, phase in zip(graph_passes, phases, strict=True):
        if phase == BEFORE_DLS:
            graph_pass(gm)
    added = _check_added(gm, n_inputs, extra_inputs)
    if data_parallel is not None:
        if roles.nodes_with_role(gm.graph, roles.BACKWARD_GRAD):
            # the gradients would be averaged after that code, which DDP's clip reads averaged
            raise StepCaptureError(
                "a data-parallel step (process_group=) cannot yet change the gradients between "
                "loss.backward() and optimizer.step() (e.g. clip_grad_norm_): pass "
                "max_gradient_norm= or max_gradient_value= to the scaler instead")
        AllReduceGradsPass(data_parallel.group)(gm)
    gm = apply_dls(gm, config)
    post: list[GraphPass] = []
    if data_parallel is not None and data_parallel.agree_flag and config is not None and config.dynamic:
        post.append(AllReduceFlagPass(data_parallel.group))
    for graph_pass in post:
        graph_pass(gm)
        check_graph(gm)
    after = [p for p, phase in zip(graph_passes, phases, strict=True) if phase == AFTER_DLS]
    n_inputs = len(gm.graph.find_nodes(op="placeholder"))
    for graph_pass in after:
        graph_pass(gm)
        check_graph(gm)
    added += _check_added(gm, n_inputs, extra_inputs)
    if post or after:
        verify(gm)
    # after verify, whose contract is the where() form: a fused optimizer kernel skips by itself
    if GuardFusedUpdatesPass()(gm).modified:
        check_graph(gm)
    if write_in_place:
        WriteUpdatesInPlacePass()(gm)
        check_graph(gm)
        # a fused optimizer kernel whose updates all land in its own inputs: in place, no copies
        if ReinplaceFusedKernelPass()(gm).modified:
            check_graph(gm)
    return gm, added


def _check_added(gm: fx.GraphModule, n_inputs: int, extra_inputs: Collection[str]) -> list[str]:
    """The targets of the placeholders after the first ``n_inputs`` (those graph passes added),
    each one the front end can feed, else `StepCaptureError`."""
    added = [roles.target_of(n) for n in gm.graph.find_nodes(op="placeholder")[n_inputs:]]
    missing = [t for t in added if t not in extra_inputs]
    if missing:
        raise StepCaptureError(f"a graph pass added input(s) {missing} that the step's extra_inputs "
                               f"does not provide (it provides: {sorted(extra_inputs)})")
    return added


def param_targets(optimizer: torch.optim.Optimizer,
                  model: torch.nn.Module | None = None) -> dict[int, str]:
    """``{id(param): graph target}`` for the parameters of ``model`` and ``optimizer``.

    A parameter of ``model`` is named as the model names it (``fc1.weight``); any other
    parameter of the optimizer is ``group{i}.param{j}`` (its place in ``param_groups``). Both
    step front ends name their PARAM, GRAD and optimizer-state nodes with this.
    """
    names = {} if model is None else {id(p): name for name, p in model.named_parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            names.setdefault(id(p), f"group{gi}.param{pi}")
    return names


def graph_targets(names: dict[int, str], model: torch.nn.Module | None) -> dict[str, str]:
    """``{name: graph target}``: the targets themselves, or with ``model`` its parameter names
    (for the parameters the graph names), so a caller can name a parameter either way."""
    if model is None:
        return {t: t for t in names.values()}
    return {n: names[id(p)] for n, p in model.named_parameters() if id(p) in names}

