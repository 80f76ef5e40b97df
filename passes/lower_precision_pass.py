"""LowerPrecisionPass: the policy's ops (mm, bmm, conv, ... forward and backward) read and write 16-bit values."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import dlspass.formats  # noqa: F401 - registers dlspass::round_to_format, the emulation's op
from dlspass.config import PRECISION_MODES, ConfigError, FP16Type, PrecisionMode
from dlspass.graph import roles
from dlspass.graph.splice import insert_op, set_fake_val
from dlspass.passes.base import DLSPass, PassContractError
from dlspass.precision_policy import (
    NATIVE_DTYPES,
    VALUE_PRESERVING_OPS,
    WHOLE_VIEW_OPS,
    PrecisionPolicy,
)

_ROUND = torch.ops.dlspass.round_to_format.default


def _is_f32(node: object) -> bool:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32


class LowerPrecisionPass(DLSPass):
    """Round (emulate) or cast (native) every float input and output of the policy's ops."""

    name = "lower_precision"

    def __init__(self, fmt: FP16Type, mode: PrecisionMode = "emulate",
                 policy: PrecisionPolicy | None = None) -> None:
        # the format and mode come from the user (config, CLI flags): a wrong one is input
        if mode not in PRECISION_MODES:
            raise ConfigError(f"precision mode: expected one of {PRECISION_MODES}, got {mode!r}")
        if mode == "native" and fmt not in NATIVE_DTYPES:
            raise ConfigError(f"precision mode 'native' supports {sorted(NATIVE_DTYPES)}, not {fmt!r}; "
                              "use mode='emulate'")
        super().__init__(None)
        self.fmt = fmt
        self.mode = mode
        self.policy = policy or PrecisionPolicy(fmt)

    def _targets(self, graph: fx.Graph) -> list[fx.Node]:
        return [n for n in graph.nodes if n.op == "call_function" and self.policy.lowers(n.target)]

    def requires(self, gm: fx.GraphModule) -> None:
        if not self.will_run(gm):
            return
        # without its fake value an op's outputs (and their dtype) are unknown: they would
        # silently stay in float32
        bare = [op.name for op in self._targets(gm.graph) if "val" not in op.meta]
        if bare:
            raise PassContractError(f"lower_precision: ops {bare} have no fake value (meta['val'])")

    def rewrite(self, gm: fx.GraphModule) -> bool:
        targets = self._targets(gm.graph)
        lower = self._emulate if self.mode == "emulate" else self._native
        lower(gm.graph, targets)
        return bool(targets)

    def ensures(self, gm: fx.GraphModule) -> None:
        for op in gm.graph.nodes:
            if op.op != "call_function" or not self.policy.lowers(op.target):
                continue
            for y in _outputs(op):
                if any(roles.role_of(u) != roles.CAST for u in y.users):
                    raise PassContractError(f"lower_precision: output {y.name!r} of {op.name!r} is "
                                            "read without its cast")

    # -- emulate: fp32 containers holding values rounded to the format ------------------------
    def _emulate(self, graph: fx.Graph, targets: list[fx.Node]) -> None:
        rounded: dict[fx.Node, fx.Node] = {}
        known: dict[fx.Node, bool] = {}

        def is_rounded(n: fx.Node) -> bool:
            if n not in known:
                if roles.role_of(n) == roles.CAST:
                    known[n] = True
                elif n.op == "call_function" and (n.target in VALUE_PRESERVING_OPS
                                                  or n.target is operator.getitem):
                    src = n.args[0]
                    known[n] = isinstance(src, fx.Node) and is_rounded(src)
                else:
                    known[n] = False
            return known[n]

        def round_input(x: fx.Node, op: fx.Node) -> fx.Node:
            if x not in rounded:
                if is_rounded(x):
                    rounded[x] = x
                elif _whole_view_of_f32(x):
                    # round the viewed tensor once and replay the view on it: a weight read as
                    # t(w) in the forward and as w in the backward is rounded once, not twice
                    rounded[x] = self._replay_view(graph, x, round_input(x.args[0], op), op)
                else:
                    rounded[x] = insert_op(graph, _ROUND, (x, self.fmt, False, False), before=op,
                                           role=roles.CAST, by_pass=self.name)
            return rounded[x]

        def round_output(y: fx.Node) -> None:
            r = insert_op(graph, _ROUND, (y, self.fmt, False, False), before=y.next, role=roles.CAST,
                          by_pass=self.name)
            y.replace_all_uses_with(r, delete_user_cb=lambda u: u is not r)
            rounded[y] = r

        for op in targets:
            op.args, op.kwargs = fx.node.map_arg(
                (op.args, op.kwargs), lambda x, op=op: round_input(x, op) if _is_f32(x) else x)
            for y in _outputs(op):
                round_output(y)

    def _replay_view(self, graph: fx.Graph, view: fx.Node, src: fx.Node, op: fx.Node) -> fx.Node:
        """``view``'s op applied to the converted ``src`` instead of its own input, before ``op``."""
        return insert_op(graph, view.target, (src, *view.args[1:]), dict(view.kwargs), before=op,
                         role=roles.CAST, by_pass=self.name)

    # -- native: convert_element_type to the 16-bit dtype around the op and back --------------
    def _native(self, graph: fx.Graph, targets: list[fx.Node]) -> None:
        dtype = NATIVE_DTYPES[self.fmt]
        cet = torch.ops.prims.convert_element_type.default
        down: dict[fx.Node, fx.Node] = {}

        def to16(x: fx.Node, op: fx.Node) -> fx.Node:
            if x not in down:
                if _whole_view_of_f32(x):  # cast the viewed tensor once, as in _emulate
                    down[x] = self._replay_view(graph, x, to16(x.args[0], op), op)
                else:
                    down[x] = insert_op(graph, cet, (x, dtype), before=op, role=roles.CAST,
                                        by_pass=self.name)
            return down[x]

        for op in targets:
            op.args, op.kwargs = fx.node.map_arg(
                (op.args, op.kwargs), lambda x, op=op: to16(x, op) if _is_f32(x) else x)
            set_fake_val(op)
            for y in _outputs(op):
                if y is not op:
                    set_fake_val(y)
                up = insert_op(graph, cet, (y, torch.float32), before=y.next, role=roles.CAST,
                               by_pass=self.name)
                y.replace_all_uses_with(up, delete_user_cb=lambda u, up=up: u is not up)


def _whole_view_of_f32(x: fx.Node) -> bool:
    """``x`` is a WHOLE_VIEW_OPS view of a float32 value (converting its source converts it)."""
    src = x.args[0] if x.op == "call_function" and x.target in WHOLE_VIEW_OPS and x.args else None
    return isinstance(src, fx.Node) and _is_f32(src)


def _outputs(op: fx.Node) -> list[fx.Node]:
    """The tensor values ``op`` produces: itself, or the getitems of its tuple result."""
    val = op.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [op]
    outs = []
    for user in list(op.users):
        if user.target is operator.getitem and isinstance(user.meta.get("val"), torch.Tensor):
            outs.append(user)
    return outs
