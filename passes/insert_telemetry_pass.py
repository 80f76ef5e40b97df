"""InsertTelemetryPass: a ``dlspass_telemetry`` input buffer is added and the step ends with ``copy_(buffer, stack(rows))``: a count row per gradient, float8 matmul operand and (watch ``all``) lowered op output."""

from __future__ import annotations

import json
import operator
from typing import ClassVar

import torch
import torch.fx as fx
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dlspass.config import TELEMETRY_WATCHES, ConfigError, TelemetryWatch
from dlspass.format_ranges import FormatRange, get_range, value_counts
from dlspass.formats import is_round_node, round_node_args
from dlspass.graph import roles
from dlspass.graph.splice import add_input, insert_op, splice
from dlspass.passes.base import AFTER_DLS, GraphPass, GraphPassResult, PassContractError
from dlspass.passes.lower_matmuls_to_float8_pass import float8_casts
from dlspass.precision_policy import NATIVE_DTYPES, VALUE_PRESERVING_OPS, PrecisionPolicy

BUFFER_TARGET = "dlspass_telemetry"  # the input (role INPUT) the counts are written into
NAMES_KEY = "dlspass_telemetry_names"  # on the buffer placeholder: the JSON list of its rows
SIZES_KEY = "dlspass_telemetry_sizes"  # on the buffer placeholder: the JSON list of each row's numel
FLOAT8_ROW = "float8:"  # the name prefix of a float8 operand's row: float8:<matmul>.a / .b
FLOAT8_FIELDS = ("amax", "flushed", "subnormal", "saturated")
"""The columns of a ``float8:`` row: the operand's ``max |x|``, its nonzero values the cast
made 0, the values it made float8 subnormals, the values it clamped (``|x * scale| > max``)."""
_HALF = tuple(NATIVE_DTYPES.values())
_CET = torch.ops.prims.convert_element_type.default
_COPY = torch.ops.aten.copy.default


class InsertTelemetryPass(GraphPass):
    """Count, in the step graph, where each gradient (and, watching ``all``, each lowered op
    output) lands in ``fmt``, and what each float8 matmul operand's cast did.

    Watched tensors, ``watch="default"`` (``DLSConfig(telemetry=True)``): every GRAD node (the
    gradient as backward produced it: scaled, once the DLS passes have run; the unscale pass
    reroutes only the optimizer's reads), and, in a step ``LowerMatmulsToFloat8Pass``
    converted, both operands of each converted matmul. ``watch="all"`` adds, in a step
    ``LowerPrecisionPass`` lowered, each output of the policy's 16-bit ops: in ``emulate`` mode
    the float32 value the output rounding reads (so a value the rounding flushes is counted as
    flushed), in ``native`` mode the 16-bit tensor the kernel wrote; each is one more read of
    an activation-sized tensor, which is what made telemetry cost 1.18x a plain step
    (tools/bench/RESULTS.md), so it is asked for, not the default.

    A gradient's or lowered output's row is ``[amax, flushed, subnormal, overflow]`` of
    `dlspass.format_ranges.value_counts`. A float8 operand's row (`FLOAT8_FIELDS`) is
    ``[amax, flushed, subnormal, saturated]`` of its cast, read from the cast's own nodes
    (``x32``, ``x32 * scale``, the float8 tensor, the amax the scale came from): the nonzero
    values that became 0, the values that became float8 subnormals, the values the saturating
    clamp caught. A cast that feeds several matmuls (a weight in the forward and the
    backward) is counted once and its row repeated. All rows go into one float64 buffer
    ``[rows, 4]`` by a ``copy_`` at the end of the graph: the counts stay on the device until
    the caller reads the buffer.

    A tensor that already holds values rounded to ``fmt`` (a native 16-bit output, a float32
    cast of one, as a native step's gradient of a 16-bit matmul is, or an emulated rounding's
    result, as an emulated step's gradient of a lowered matmul is) cannot show what the
    rounding flushed: its ``flushed`` is NaN (unknown), never a 0 that reads as none. In
    emulate mode the ``lowered:`` row of the op that made it has that count.

    The pass must run after the lowerings to see the lowered ops: the step pipeline runs it
    after ``apply_dls`` (``pipeline_phase = "after_dls"``, dlspass.capture.step_pipeline).

    The buffer is the graph's last input (role ``input``, target ``dlspass_telemetry``; its
    ``meta["val"]`` has the shape and device) and its rows are named on it (`telemetry_names`:
    ``grad:<target>``, ``float8:<matmul>.a`` / ``.b`` (the matmul's name as
    ``float8_decisions`` gives it), ``lowered:<node>``; `telemetry_sizes`: each row's number of
    values). ``dlspass.capture.telemetry.Telemetry`` runs this pass as a ``graph_passes`` hook
    and feeds and reads the buffer. A graph that has the buffer already is left alone.
    ``stats["watched"]``: the rows.
    """

    name = "insert_telemetry"
    pipeline_phase: ClassVar[str] = AFTER_DLS

    def __init__(self, fmt: str = "float16", policy: PrecisionPolicy | None = None,
                 watch: TelemetryWatch = "default") -> None:
        if watch not in TELEMETRY_WATCHES:
            raise ConfigError(f"telemetry: unknown watch list {watch!r}; choose one of {', '.join(TELEMETRY_WATCHES)}")
        self.range: FormatRange = get_range(fmt)
        self.policy = policy or PrecisionPolicy(fmt)
        self.watch = watch

    def requires(self, gm: fx.GraphModule) -> None:
        if buffer_node(gm.graph) is None and not roles.nodes_with_role(gm.graph, roles.GRAD):
            raise PassContractError("insert_telemetry: the graph has no grad node")

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        if buffer_node(graph) is not None:
            return GraphPassResult(gm, False, skipped="already applied")
        watched = [(f"grad:{roles.target_of(n)}", n) for n in roles.nodes_with_role(graph, roles.GRAD)]
        if self.watch == "all":
            watched += [(f"lowered:{y.name}", y) for y in _lowered_outputs(graph, self.policy)]
        unknown_flush = [_rounded_by_kernel(n, self.range) for _, n in watched]
        operands = float8_casts(graph)
        casts = list(dict.fromkeys(c for _, _, c in operands))
        rows_of_casts = [casts.index(c) for _, _, c in operands]
        out = graph.output_node()
        r = self.range

        def counts(*ts: Tensor) -> list[Tensor]:
            rows = [value_counts(t, r) for t in ts[:len(watched)]]
            rows = [torch.cat([row[:1], torch.full_like(row[1:2], float("nan")), row[2:]]) if unknown
                    else row for row, unknown in zip(rows, unknown_flush, strict=True)]
            parts = ts[len(watched):]
            cast_rows = [_float8_counts(*parts[4 * i:4 * i + 4]) for i in range(len(casts))]
            return [torch.stack(rows + [cast_rows[i] for i in rows_of_casts])]

        args = [n for _, n in watched] + [n for c in casts for n in (c.x32, c.scaled, c.cast, c.amax)]
        (stats,) = splice(graph, counts, args, role=roles.TELEMETRY, by_pass=self.name, before=out)
        names = [name for name, _ in watched] + [f"{FLOAT8_ROW}{mm}.{side}" for mm, side, _ in operands]
        sizes = [_numel(n) for _, n in watched] + [_numel(c.x32) for _, _, c in operands]
        buf = _add_buffer(graph, stats.meta["val"])
        custom = buf.meta.setdefault("custom", {})
        custom[NAMES_KEY], custom[SIZES_KEY] = json.dumps(names), json.dumps(sizes)
        insert_op(graph, torch.ops.aten.copy_.default, (buf, stats), before=out, role=roles.TELEMETRY,
                  by_pass=self.name, target_name=BUFFER_TARGET)
        return GraphPassResult(gm, True, {"watched": len(names)})


def _float8_counts(x32: Tensor, scaled: Tensor, cast: Tensor, amax: Tensor) -> Tensor:
    """``[amax, flushed, subnormal, saturated]`` (float64) of one float8 cast: ``cast`` is
    ``clamp(scaled, ±max).to(float8)`` of ``scaled = x32 * scale``; ``amax`` is ``max |x|``
    (per row for a rowwise cast: its max is the tensor's)."""
    finfo = torch.finfo(cast.dtype)
    q = cast.to(torch.float32)  # exact: float32 holds every float8 value
    q_abs = q.abs()
    flushed = (x32 != 0) & (q == 0)
    subnormal = (q_abs > 0) & (q_abs < finfo.tiny)
    saturated = scaled.abs() > finfo.max
    counts = torch.stack([m.sum(dtype=torch.int64) for m in (flushed, subnormal, saturated)])
    return torch.cat([amax.amax().to(torch.float64).reshape(1), counts.to(torch.float64)])


def _numel(node: fx.Node) -> int | None:
    """The number of values of ``node``'s tensor, None when its shape is symbolic."""
    n = node.meta["val"].numel()
    return n if isinstance(n, int) else None


def buffer_node(graph: fx.Graph) -> fx.Node | None:
    """The telemetry buffer's placeholder, or None when the pass has not run on ``graph``."""
    return next((n for n in graph.find_nodes(op="placeholder")
                 if roles.role_of(n) == roles.INPUT and roles.target_of(n) == BUFFER_TARGET), None)


def telemetry_names(graph: fx.Graph) -> list[str]:
    """The names of the buffer's rows, in order (empty when the pass has not run)."""
    node = buffer_node(graph)
    return [] if node is None else json.loads(node.meta["custom"][NAMES_KEY])


def telemetry_sizes(graph: fx.Graph) -> list[int | None]:
    """The number of values each row counts over, in order (None: a symbolic shape)."""
    node = buffer_node(graph)
    return [] if node is None else json.loads(node.meta["custom"][SIZES_KEY])


def _add_buffer(graph: fx.Graph, like: Tensor) -> fx.Node:
    with unset_fake_temporarily():  # a compiler hook may run this under a fake mode
        value = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return add_input(graph, BUFFER_TARGET, value, role=roles.INPUT, target=BUFFER_TARGET)


def _lowered_outputs(graph: fx.Graph, policy: PrecisionPolicy) -> list[fx.Node]:
    """The outputs of the policy's ops that a lowering put in 16 bits, in graph order: a 16-bit
    output (native mode) or a float32 one that a ``round_to_format`` reads (emulate mode). An
    op the lowering left alone (``mixed_precision=False``, or no lowering yet) has none."""
    found: list[fx.Node] = []
    for op in graph.nodes:
        if op.op != "call_function" or not policy.lowers(op.target):
            continue
        for y in _outputs(op):
            val = y.meta.get("val")
            if val.dtype in _HALF or (val.dtype == torch.float32 and any(map(is_round_node, y.users))):
                found.append(y)
    return found


def _outputs(op: fx.Node) -> list[fx.Node]:
    """The tensor values ``op`` produces: itself, or the getitems of its tuple result."""
    if isinstance(op.meta.get("val"), Tensor):
        return [op]
    return [u for u in op.users if u.target is operator.getitem and isinstance(u.meta.get("val"), Tensor)]


def _rounded_by_kernel(node: fx.Node, r: FormatRange) -> bool:
    """``node`` holds values already rounded to ``r``: followed back through casts, views and
    copies (a compiled step's gradient is ``copy(empty_like(g), g)``), it reaches a tensor of
    ``r``'s dtype (a native 16-bit kernel's output) or a ``round_to_format`` to ``r``."""
    n: object = node
    while isinstance(n, fx.Node) and n.op == "call_function":
        val = n.meta.get("val")
        if r.torch_dtype is not None and isinstance(val, Tensor) and val.dtype == r.torch_dtype:
            return True
        if is_round_node(n):
            return round_node_args(n)[1] == r.name
        if n.target is _COPY:
            n = n.args[1]
        elif n.target is _CET or n.target in VALUE_PRESERVING_OPS:
            n = n.args[0]
        else:
            return False
    return False
