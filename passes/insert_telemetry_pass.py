"""InsertTelemetryPass: a ``dlspass_telemetry`` input buffer is added and the step ends with ``copy_(buffer, stack([value_counts(t) for t in watched]))`` over every gradient and lowered op output."""

from __future__ import annotations

import json

import torch
import torch.fx as fx
from torch import Tensor
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dlspass.format_ranges import FormatRange, get_range, value_counts
from dlspass.formats import is_round_node, round_node_args
from dlspass.graph import roles
from dlspass.graph.splice import insert_op, splice
from dlspass.passes.base import GraphPass, GraphPassResult, PassContractError

BUFFER_TARGET = "dlspass_telemetry"  # the input (role INPUT) the counts are written into
NAMES_KEY = "dlspass_telemetry_names"  # on the buffer placeholder: the JSON list of its rows


class InsertTelemetryPass(GraphPass):
    """Count, in the step graph, where each gradient and lowered op output lands in ``fmt``.

    Watched tensors: every GRAD node (the gradient as backward produced it: scaled, once the
    DLS passes have run), and, in a lowered step, the float32 input of every rounding to a
    16-bit format (each lowered op's output before it is rounded). For each, the row
    ``[amax, flushed, subnormal, overflow]`` of `dlspass.format_ranges.value_counts` is written
    into one float64 buffer ``[len(watched), 4]`` by a ``copy_`` at the end of the graph: the
    counts stay on the device until the caller reads the buffer.

    The buffer is the graph's last input (role ``input``, target ``dlspass_telemetry``; its
    ``meta["val"]`` has the shape and device) and its rows are named on it (`telemetry_names`:
    ``grad:<target>``, ``lowered:<node>``). ``dlspass.debug.telemetry.Telemetry`` runs this
    pass as a ``graph_passes`` hook and feeds and reads the buffer. A graph that has the buffer
    already is left alone. ``stats["watched"]``: the rows.
    """

    name = "insert_telemetry"

    def __init__(self, fmt: str = "float16") -> None:
        self.range: FormatRange = get_range(fmt)

    def requires(self, gm: fx.GraphModule) -> None:
        if buffer_node(gm.graph) is None and not roles.nodes_with_role(gm.graph, roles.GRAD):
            raise PassContractError("insert_telemetry: the graph has no grad node")

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        if buffer_node(graph) is not None:
            return GraphPassResult(gm, False, skipped="already applied")
        watched = [(f"grad:{roles.target_of(n)}", n) for n in roles.nodes_with_role(graph, roles.GRAD)]
        watched += [(f"lowered:{src.name}", src) for src in _lowered_outputs(graph)]
        out = graph.output_node()
        r = self.range
        (stats,) = splice(graph, lambda *ts: [torch.stack([value_counts(t, r) for t in ts])],
                          [n for _, n in watched], role=roles.TELEMETRY, by_pass=self.name, before=out)
        buf = _add_buffer(graph, stats.meta["val"])
        buf.meta.setdefault("custom", {})[NAMES_KEY] = json.dumps([name for name, _ in watched])
        insert_op(graph, torch.ops.aten.copy_.default, (buf, stats), before=out, role=roles.TELEMETRY,
                  by_pass=self.name, target_name=BUFFER_TARGET)
        return GraphPassResult(gm, True, {"watched": len(watched)})


def buffer_node(graph: fx.Graph) -> fx.Node | None:
    """The telemetry buffer's placeholder, or None when the pass has not run on ``graph``."""
    return next((n for n in graph.find_nodes(op="placeholder")
                 if roles.role_of(n) == roles.INPUT and roles.target_of(n) == BUFFER_TARGET), None)


def telemetry_names(graph: fx.Graph) -> list[str]:
    """The names of the buffer's rows, in order (empty when the pass has not run)."""
    node = buffer_node(graph)
    return [] if node is None else json.loads(node.meta["custom"][NAMES_KEY])


def _add_buffer(graph: fx.Graph, like: Tensor) -> fx.Node:
    phs = list(graph.find_nodes(op="placeholder"))
    # a new graph input: splice inserts computed nodes only
    with graph.inserting_after(phs[-1]):
        buf = graph.placeholder(BUFFER_TARGET)
    roles.set_role(buf, roles.INPUT, BUFFER_TARGET)
    with unset_fake_temporarily():  # a compiler hook may run this under a fake mode
        value = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    fake_mode = detect_fake_mode([p.meta.get("val") for p in phs])
    buf.meta["val"] = fake_mode.from_tensor(value) if fake_mode is not None else value
    return buf


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
