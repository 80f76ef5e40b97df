"""In-graph numerics telemetry at run time: `Telemetry` is a ``graph_passes`` hook that inserts
``InsertTelemetryPass`` into the step it is given to, feeds the pass's buffer to the step at
every call, and reads it back when asked (the only host read).

    telemetry = Telemetry("float16")
    step = dlspass.compile(train_step, optimizer=opt, graph_passes=[telemetry])
    step(x, y)
    telemetry.read()  # {"grad:fc1.weight": {"amax": ..., "flushed": ..., ...}, ...}

It works the same with ``dlspass.capture_step(..., graph_passes=[telemetry])``: the step front
ends feed the inputs a pass object lists in ``extra_inputs``.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dlspass.format_ranges import COUNT_FIELDS
from dlspass.passes.base import GraphPassResult, PassContractError
from dlspass.passes.insert_telemetry_pass import (
    BUFFER_TARGET,
    InsertTelemetryPass,
    buffer_node,
    telemetry_names,
)

__all__ = ["Telemetry"]


class Telemetry:
    """Per-tensor ``amax``, ``flushed``, ``subnormal`` and ``overflow`` counts in ``fmt`` of the
    last step run (`InsertTelemetryPass` says what is watched). ``names``: the rows; ``buffer``:
    the device tensor the step writes (``[len(names), 4]``, float64). The last graph the hook
    rewrote is the one it feeds and reads."""

    def __init__(self, fmt: str = "float16") -> None:
        self.fmt = fmt
        self._pass = InsertTelemetryPass(fmt)
        self.names: list[str] = []
        self.buffer: Tensor | None = None
        self.extra_inputs = {BUFFER_TARGET: self._provide}

    def __call__(self, gm: fx.GraphModule) -> GraphPassResult:
        result = self._pass(gm)
        node = cast(fx.Node, buffer_node(gm.graph))  # the pass added it, or refused the graph
        val = node.meta["val"]
        with unset_fake_temporarily():  # a compiler hook may call this under a fake mode
            self.buffer = torch.zeros(val.shape, dtype=val.dtype, device=val.device)
        self.names = telemetry_names(gm.graph)
        return result

    def _provide(self) -> Tensor:
        if self.buffer is None:
            raise PassContractError("insert_telemetry: the buffer is read before the pass ran")
        return self.buffer

    def read(self) -> dict[str, dict[str, float]]:
        """``{tensor name: {amax, flushed, subnormal, overflow}}`` of the last step (one host read)."""
        rows = self._provide().tolist()
        return {n: dict(zip(COUNT_FIELDS, row, strict=True)) for n, row in zip(self.names, rows, strict=True)}
