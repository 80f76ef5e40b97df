"""The step as a value: what a step entry point decided, made once, before anything is traced.

A `StepPlan` holds the merged config, the scaler, the graph passes (with the telemetry the
config asks for among them), data parallelism, the extra inputs the graph is fed, whether the
updates are written into their inputs, and what compiles the graph. ``dlspass.compile`` builds
it with `resolve_plan` and hands it down: ``dlspass.capture.aot.step_backend`` runs the step
pipeline (``run_step_pipeline(gm, plan)``) and inductor with it, so control runs down from the
entry point and never calls back into it.

The plan is frozen: its fields are never reassigned. Two of them are the step's hooks, which
the user (and ``dlspass.debug.faults``) may change until the step is first called:
``graph_passes`` (a list) and ``extra_inputs`` (a dict) are those very objects, read when the
graph is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from dlspass.cache_facts import code_fingerprint
from dlspass.capture.step_config import NO_SCALING, resolve_config
from dlspass.capture.telemetry import Telemetry, step_telemetry
from dlspass.config import ConfigError, DLSConfig
from dlspass.scaler import GradScaler

GraphPass = Callable[[fx.GraphModule], object]
"""A rewrite of the role-tagged step graph, in place (its return value is ignored)."""
Provider = Callable[[], torch.Tensor]
"""What feeds one extra graph input at every call."""


@dataclass(frozen=True)
class DataParallel:
    """Make the step one data-parallel step over ``group`` (None: the default group).

    The gradients are averaged before DLS; with ``agree_flag`` a dynamic scale's overflow flag
    is all-reduced after it (averaged gradients are already identical on every rank, so the
    flag's all-reduce is insurance).
    """

    group: Any = None
    agree_flag: bool = True


def step_inputs(graph_passes: Sequence[GraphPass],
                extra_inputs: Mapping[str, Provider]) -> dict[str, Provider]:
    """The input providers a front end feeds: its own ``extra_inputs``, and those a graph pass
    object brings for the placeholders it adds (its ``extra_inputs`` attribute, as
    ``dlspass.capture.telemetry.Telemetry`` has), so ``graph_passes=[pass]`` needs no access to the step."""
    inputs = dict(extra_inputs)
    for graph_pass in graph_passes:
        inputs.update(getattr(graph_pass, "extra_inputs", {}))
    return inputs


@dataclass(frozen=True)
class StepPlan:
    """Everything the step pipeline and the compiler read, decided once (module docstring)."""

    config: DLSConfig | None
    scaler: Any = None
    graph_passes: list[GraphPass] = field(default_factory=list)
    extra_inputs: dict[str, Provider] = field(default_factory=dict)
    telemetry: Telemetry | None = None
    data_parallel: DataParallel | None = None
    write_in_place: bool = False
    backend_compiler: str = "inductor"

    def inputs(self) -> dict[str, Provider]:
        """The providers of every extra input the graph passes may add (`step_inputs`)."""
        return step_inputs(self.graph_passes, self.extra_inputs)

    def cache_key(self) -> str | None:
        """What the step pipeline does beyond the traced graph, as a stable hash; None where the
        plan has no stable identity, so the compiled step must not be cached by it.

        AOTAutograd's cache key hashes dynamo's graph (which holds the optimizer's math and the
        role markers), its inputs' metadata and inductor's config; it cannot see what the
        dlspass passes do to the graph afterwards. This key names that: the whole config
        (format, scale policy, float8 recipe, precision mode, telemetry), the graph passes by
        their ``uuid()`` and phase, the write-back and dlspass's own source
        (``dlspass.cache_facts.code_fingerprint``), so another plan is a miss, never a wrong hit.

        None (no caching) for a plan whose outcome the key cannot name or a cache hit could not
        reproduce: a graph pass without a ``uuid()`` returning a string, extra inputs (their
        providers feed the compiled graph through a wrapper a cache hit would not re-apply;
        telemetry and fault injection add them), data parallelism (a process group is not a
        value across processes) and a compiler other than inductor.
        """
        if (self.backend_compiler != "inductor" or self.data_parallel is not None
                or self.inputs() or self.config is None):
            return None
        passes = []
        for graph_pass in self.graph_passes:
            uuid = getattr(graph_pass, "uuid", None)
            uuid = uuid() if callable(uuid) else None
            if not isinstance(uuid, str):
                return None
            passes.append([type(graph_pass).__qualname__, uuid,
                           getattr(graph_pass, "pipeline_phase", None)])
        try:
            config = json.dumps(dataclasses.asdict(self.config), sort_keys=True)
        except TypeError:  # a field that is not plain data: no stable identity
            return None
        text = json.dumps({"config": config, "passes": passes,
                           "write_in_place": self.write_in_place, "code": code_fingerprint()},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def resolve_process_group(process_group: Any) -> Any:
    """The group to average over, or None; a group needs an initialised torch.distributed."""
    if process_group is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("process_group: torch.distributed is not initialised "
                          "(call torch.distributed.init_process_group first)")
    if process_group is True:
        return dist.group.WORLD
    return process_group


def resolve_plan(*, config: DLSConfig | None, scaler: Any, graph_passes: Sequence[GraphPass],
                 process_group: Any = None, write_in_place: bool = True,
                 backend_compiler: str = "inductor", summary_writer: Any = None,
                 **overrides: Any) -> StepPlan:
    """``dlspass.compile``'s plan: the config (the scaler's, or ``config``, with ``overrides``
    merged by ``DLSConfig.with_overrides``; neither: float32 without scaling), a scaler made
    from ``config`` when it scales and none was given (with the scale log when asked), the
    telemetry the config asks for, and the data parallelism of ``process_group``."""
    resolved = resolve_config(config, scaler, **overrides) or NO_SCALING
    passes = list(graph_passes)
    bad = [p for p in passes if not callable(p)]
    if bad:
        raise ConfigError(f"graph_passes: expected callables taking a GraphModule, got {bad[0]!r}")
    if scaler is None and config is not None and resolved.enabled:
        scaler = GradScaler(config=resolved, summary_writer=summary_writer)
    elif scaler is not None and resolved.enabled and (
            summary_writer is not None or (resolved.log_loss_scale and scaler.scale_log is None)):
        scaler.log_scale(summary_writer)
    group = resolve_process_group(process_group)
    return StepPlan(config=resolved, scaler=scaler, graph_passes=passes,
                    telemetry=step_telemetry(resolved, passes),
                    data_parallel=None if group is None else DataParallel(group),
                    write_in_place=write_in_place, backend_compiler=backend_compiler)
