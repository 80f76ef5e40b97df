"""In-graph numerics telemetry at run time: `Telemetry` is a ``graph_passes`` hook that inserts
``InsertTelemetryPass`` into the step it is given to, feeds the pass's buffer to the step at
every call, and reads it back when asked (the only host read).

    step = dlspass.compile(train_step, optimizer=opt, config=DLSConfig(telemetry=True))
    step(x, y)
    step.telemetry.read()  # {"grad:fc1.weight": {"amax": ..., "flushed": ..., ...}, ...}

``DLSConfig(telemetry=True)`` makes the step front ends (``dlspass.compile``, ``capture_step``)
add one in ``config.fp16_type`` watching the default list (the gradients and, in a float8 step,
each matmul operand's float8 cast); ``telemetry="all"`` adds every lowered op's output
(`step_telemetry`). A hook passed by hand works the same::

    telemetry = Telemetry("float16", watch="all")
    step = dlspass.compile(train_step, optimizer=opt, graph_passes=[telemetry])

The step front ends feed the inputs a pass object lists in ``extra_inputs``, and run a pass
whose ``pipeline_phase`` is ``"after_dls"`` after the DLS passes, so the telemetry sees the
lowered 16-bit ops (dlspass.capture.step_pipeline).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dlspass.config import DLSConfig, TelemetryWatch
from dlspass.format_ranges import COUNT_FIELDS
from dlspass.passes.base import GraphPassResult, PassContractError
from dlspass.passes.insert_telemetry_pass import (
    BUFFER_TARGET,
    FLOAT8_FIELDS,
    FLOAT8_ROW,
    InsertTelemetryPass,
    buffer_node,
    telemetry_names,
    telemetry_sizes,
)

__all__ = ["Telemetry", "step_telemetry"]


class Telemetry:
    """Per-tensor ``amax``, ``flushed``, ``subnormal`` and ``overflow`` counts in ``fmt`` of the
    last step run, and per float8 matmul operand what its cast saturated and flushed
    (`InsertTelemetryPass` says what ``watch`` watches: ``"default"`` or ``"all"``).
    ``names``: the rows; ``sizes``: each row's number of values; ``buffer``: the device tensor
    the step writes (``[len(names), 4]``, float64). The last graph the hook rewrote is the one
    it feeds and reads. It runs after the DLS passes (``pipeline_phase``)."""

    pipeline_phase = InsertTelemetryPass.pipeline_phase

    def __init__(self, fmt: str = "float16", watch: TelemetryWatch = "default") -> None:
        self.fmt = fmt
        self.watch = watch
        self._pass = InsertTelemetryPass(fmt, watch=watch)
        self.names: list[str] = []
        self.sizes: list[int | None] = []
        self.buffer: Tensor | None = None
        self.extra_inputs = {BUFFER_TARGET: self._provide}

    def __call__(self, gm: fx.GraphModule) -> GraphPassResult:
        result = self._pass(gm)
        if not result.modified:  # the graph had a buffer: another hook's, which this one would starve
            raise PassContractError("insert_telemetry: the step has two telemetry hooks (a Telemetry in "
                                    "graph_passes and DLSConfig(telemetry=True)?); keep one")
        node = cast(fx.Node, buffer_node(gm.graph))  # the pass added it, or refused the graph
        val = node.meta["val"]
        with unset_fake_temporarily():  # a compiler hook may call this under a fake mode
            self.buffer = torch.zeros(val.shape, dtype=val.dtype, device=val.device)
        self.names = telemetry_names(gm.graph)
        self.sizes = telemetry_sizes(gm.graph)
        return result

    def _provide(self) -> Tensor:
        if self.buffer is None:
            raise PassContractError("insert_telemetry: the buffer is read before the pass ran")
        return self.buffer

    def read(self) -> dict[str, dict[str, float]]:
        """``{tensor name: {amax, flushed, subnormal, overflow}}`` of the last step (one host read).

        A row of values a kernel already rounded to the format (a native 16-bit op's output)
        has ``flushed`` NaN: what the kernel flushed is not in the graph to count. A float8
        operand's row (``float8:<matmul>.a`` / ``.b``) is ``{amax, flushed, subnormal,
        saturated}`` of its float8 cast, with ``saturated_fraction`` and ``flushed_fraction``
        (of its values)."""
        rows = self._provide().tolist()
        out = {}
        for name, size, row in zip(self.names, self.sizes, rows, strict=True):
            if not name.startswith(FLOAT8_ROW):
                out[name] = dict(zip(COUNT_FIELDS, row, strict=True))
                continue
            counts = dict(zip(FLOAT8_FIELDS, row, strict=True))
            n = float("nan") if not size else float(size)
            out[name] = {**counts, "saturated_fraction": counts["saturated"] / n,
                         "flushed_fraction": counts["flushed"] / n}
        return out


def step_telemetry(config: DLSConfig | None, graph_passes: list) -> Telemetry | None:
    """The `Telemetry` a step front end feeds and shows as ``step.telemetry``: the one in
    ``graph_passes``, else, with ``config.telemetry``, a new one in ``config.fp16_type``,
    appended to ``graph_passes`` (which the front end runs), watching
    ``config.telemetry_watch``; None without either."""
    given = [p for p in graph_passes if isinstance(p, Telemetry)]
    if given:
        return given[0]
    if config is None or config.telemetry_watch is None:
        return None
    telemetry = Telemetry(config.fp16_type, watch=config.telemetry_watch)
    graph_passes.append(telemetry)
    return telemetry
