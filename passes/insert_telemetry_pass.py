"""InsertTelemetryPass: a ``dlspass_telemetry`` input buffer is added and the step ends with ``copy_(buffer, stack([value_counts(t) for t in watched]))`` over every gradient and lowered op output."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dlspass.format_ranges import COUNT_FIELDS, FormatRange, get_range, value_counts
from dlspass.formats import is_round_node, round_node_args
from dlspass.graph import roles
from dlspass.graph.splice import insert_op, splice
from dlspass.passes.base import DLSPass, PassContractError

BUFFER_TARGET = "dlspass_telemetry"  # the input (role INPUT) the counts are written into


class InsertTelemetryPass(DLSPass):
    """Count, in the step graph, where each gradient and lowered op output lands in ``fmt``.

    Watched tensors: every GRAD node (the gradient as backward produced it: scaled, once the
    DLS passes have run), and, in a lowered step, the float32 input of every rounding to a
    16-bit format (each lowered op's output before it is rounded). For each, the row
    ``[amax, flushed, subnormal, overflow]`` of `dlspass.format_ranges.value_counts` is written
    into one float64 device buffer ``[len(names), 4]`` by a ``copy_`` at the end of the graph:
    the counts stay on the device and `read` is the only host read.

    The buffer is the graph's last input (role ``input``, target ``dlspass_telemetry``); as a
    ``dlspass.compile`` graph pass, ``extra_inputs`` tells the compiled step to feed it.
    """

    name = "insert_telemetry"

    def __init__(self, fmt: str = "float16") -> None:
        super().__init__(None)
        self.range: FormatRange = get_range(fmt)
        self.names: list[str] = []
        self.buffer: Tensor | None = None
        self.extra_inputs = {BUFFER_TARGET: self._provide}

    def requires(self, gm: fx.GraphModule) -> None:
        if not self.applied(gm) and not roles.nodes_with_role(gm.graph, roles.GRAD):
            raise PassContractError("insert_telemetry: the graph has no grad node")

    def rewrite(self, gm: fx.GraphModule) -> bool:
        graph = gm.graph
        watched = [(f"grad:{roles.target_of(n)}", n) for n in roles.nodes_with_role(graph, roles.GRAD)]
        watched += [(f"lowered:{src.name}", src) for src in _lowered_outputs(graph)]
        self.names = [name for name, _ in watched]
        out = graph.output_node()
        r = self.range
        (stats,) = splice(graph, lambda *ts: [torch.stack([value_counts(t, r) for t in ts])],
                          [n for _, n in watched], role=roles.TELEMETRY, by_pass=self.name, before=out)
        buf = self._add_buffer(graph, stats)
        insert_op(graph, torch.ops.aten.copy_.default, (buf, stats), before=out, role=roles.TELEMETRY,
                  by_pass=self.name, target_name=BUFFER_TARGET)
        graph.lint()
        gm.recompile()
        return True

    def _add_buffer(self, graph: fx.Graph, stats: fx.Node) -> fx.Node:
        phs = list(graph.find_nodes(op="placeholder"))
        with graph.inserting_after(phs[-1]):
            buf = graph.placeholder(BUFFER_TARGET)
        roles.set_role(buf, roles.INPUT, BUFFER_TARGET)
        val = stats.meta["val"]
        with unset_fake_temporarily():  # a compiler hook may run this under a fake mode
            self.buffer = torch.zeros(val.shape, dtype=val.dtype, device=val.device)
        fake_mode = detect_fake_mode([p.meta.get("val") for p in phs])
        buf.meta["val"] = fake_mode.from_tensor(self.buffer) if fake_mode is not None else self.buffer
        return buf

    def _provide(self) -> Tensor:
        if self.buffer is None:
            raise PassContractError("insert_telemetry: the buffer is read before the pass ran")
        return self.buffer

    def read(self) -> dict[str, dict[str, float]]:
        """``{tensor name: {amax, flushed, subnormal, overflow}}`` of the last step (one host read)."""
        rows = self._provide().tolist()
        return {n: dict(zip(COUNT_FIELDS, row, strict=True)) for n, row in zip(self.names, rows, strict=True)}


def _lowered_outputs(graph: fx.Graph) -> list[fx.Node]:
    """The float32 values a lowered step rounds to a 16-bit format, each once."""
    seen: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if is_round_node(node):
            src = round_node_args(node)[0]
            val = src.meta.get("val")
            if isinstance(val, Tensor) and val.dtype == torch.float32 and src.op != "placeholder":
                seen.setdefault(src)
    return list(seen)
