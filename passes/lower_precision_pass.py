"""LowerPrecisionPass: the policy's ops (mm, bmm, conv, ... forward and backward) read and write 16-bit values."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

import dlspass.formats  # noqa: F401 - registers dlspass::round_to_format, the emulation's op
from dlspass.config import PRECISION_MODES, ConfigError, FP16Type, PrecisionMode
from dlspass.graph import roles
from dlspass.graph.splice import insert_op, set_fake_val
from dlspass.passes.base import DLSPass, PassContractError
from dlspass.precision_policy import (
    KEEP_DTYPE_ARGS,
    NATIVE_DTYPES,
    VALUE_PRESERVING_OPS,
    WHOLE_VIEW_OPS,
    PrecisionPolicy,
    policy_for,
)

_CET = torch.ops.prims.convert_element_type.default
_HALF = tuple(NATIVE_DTYPES.values())

_ROUND = torch.ops.dlspass.round_to_format.default


def _is_f32(node: object) -> bool:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32


class LowerPrecisionPass(DLSPass):
    """Round (emulate) or cast (native) every float input and output of the policy's ops.

    Two modes. ``emulate`` rounds the inputs and outputs of the policy's 16-bit ops to the format
    inside float32 tensors (``dlspass::round_to_format``): the numerics of 16-bit training, any
    format (cbfloat16 included), float32 kernels. ``native`` gives the graph the dtypes autocast
    would: the 16-bit ops read 16-bit casts of their inputs and write 16-bit outputs, the policy's
    float32 ops (softmax, norms, losses, reductions; exp/pow where the device's autocast widens
    them, ``policy_for``) read float32, every other op runs in
    the dtype type promotion gives it (so activations between 16-bit ops, and the values the
    backward reads, are 16-bit), and every node with a step role (gradient, seed, optimizer, DLS
    math) and every graph output keeps its float32. Each tensor is cast at most once per dtype.
    """

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
        # no policy given: the device's (``policy_for``), chosen in ``rewrite`` from where the
        # graph's 16-bit ops run; until then CUDA's lists (the lowered ops are alike everywhere)
        self._given = policy
        self.policy = policy or PrecisionPolicy(fmt)
        self._rewrote = False

    def _targets(self, graph: fx.Graph) -> list[fx.Node]:
        return [n for n in graph.nodes if n.op == "call_function" and self.policy.lowers(n.target)]

    def check_preconditions(self, gm: fx.GraphModule) -> None:
        # without its fake value an op's outputs (and their dtype) are unknown: they would
        # silently stay in float32
        # native mode re-derives every dtype from the fake values, so it needs all of them
        nodes = (gm.graph.nodes if self.mode == "native" else self._targets(gm.graph))
        bare = [op.name for op in nodes if op.op == "call_function" and "val" not in op.meta
                and (op.users or self.policy.lowers(op.target))]
        if bare:
            raise PassContractError(f"lower_precision: ops {bare} have no fake value (meta['val'])")

    def rewrite(self, gm: fx.GraphModule) -> bool:
        self._rewrote = True
        targets = self._targets(gm.graph)
        if self._given is None:
            self.policy = policy_for(self.fmt, _device_type(targets))
        lower = self._emulate if self.mode == "emulate" else self._native
        lower(gm.graph, targets)
        return bool(targets)

    def ensures(self, gm: fx.GraphModule) -> None:
        if not self._rewrote:  # skipped: a graph lowered before (in either mode) is not rechecked
            return
        if self.mode == "native":
            check_native(gm.graph, NATIVE_DTYPES[self.fmt], self.policy)
            return
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

    # -- native: real 16-bit kernels, dtypes propagated through the graph ---------------------
    def _native(self, graph: fx.Graph, targets: list[fx.Node]) -> None:
        _NativeLowering(graph, NATIVE_DTYPES[self.fmt], self.policy, self.name).run()

class _NativeLowering:
    """One walk over ``graph`` in order, giving each node the dtype native mixed precision runs it in.

    A node of the policy's 16-bit ops reads 16-bit casts of its float inputs; a node of its
    float32 ops, and every node with a step role, reads float32 casts of 16-bit inputs; any other
    node whose inputs changed dtype runs in their dtype, in float32 where they mix 16-bit and
    float32 tensors (type promotion, made explicit) or where its kernel refuses them. A 16-bit op carrying
    a role gives the role to a float32 cast of its output. Graph outputs get back their dtype.
    """

    def __init__(self, graph: fx.Graph, dtype: torch.dtype, policy: PrecisionPolicy, by_pass: str) -> None:
        self.graph = graph
        self.dtype = dtype
        self.policy = policy
        self.by_pass = by_pass
        self.casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.changed: set[fx.Node] = set()  # nodes whose dtype is no longer the traced one

    def run(self) -> None:
        graph = self.graph
        traced = {n: _dtypes(n) for n in graph.nodes}
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            role = roles.role_of(node)
            if self.policy.lowers(node.target):
                replaced = self._map_inputs(node, self._lower_input)
            elif self.policy.keeps_fp32(node.target) or role is not None:
                replaced = self._map_inputs(node, self._widen_input)
            else:
                replaced = self._promote(node)
            if not replaced and not any(a in self.changed for a in node.all_input_nodes):
                continue
            self._retype(node)
            for y in [node, *(u for u in node.users if u.target is operator.getitem)]:
                if _dtypes(y) != traced[y]:
                    self.changed.add(y)
            if role is not None and node in self.changed:
                self._give_role_to_cast(node, traced[node])
        out = graph.output_node()
        # the graph's contract (parameters, state, loss, or what a forward hands its backward)
        # keeps its dtypes
        out.args = fx.node.map_arg(out.args, lambda v: self.cast(v, traced[v][0], out)
                                   if v in self.changed and len(traced[v]) == 1 else v)

    def _map_inputs(self, node: fx.Node, convert: Any) -> bool:
        replaced = False
        keep = _keep_dtype_args(node)

        def one(x: fx.Node, name: str | None) -> fx.Node:
            nonlocal replaced
            if name in keep or not _is_float(x):
                return x
            y = convert(x, node)
            replaced = replaced or y is not x
            return y

        names = _arg_names(node)
        args = tuple(fx.node.map_arg(a, lambda x, i=i: one(x, names[i] if i < len(names) else None))
                     for i, a in enumerate(node.args))
        kwargs = {k: fx.node.map_arg(v, lambda x, k=k: one(x, k)) for k, v in node.kwargs.items()}
        if replaced:
            node.args, node.kwargs = args, kwargs
        return replaced

    def _lower_input(self, x: fx.Node, op: fx.Node) -> fx.Node:
        return self.cast(x, self.dtype, op)

    def _widen_input(self, x: fx.Node, op: fx.Node) -> fx.Node:
        return self.cast(x, torch.float32, op) if _dtype(x) in _HALF else x

    def _promote(self, node: fx.Node) -> bool:
        """Type promotion made explicit: an op that reads 16-bit and float32 tensors reads float32
        casts of the 16-bit ones (some kernels' fake and real implementations disagree on mixed
        dtypes, e.g. threshold_backward). 0-d tensors (scalars) do not take part, as in torch."""
        dims = {_dtype(x) for x in node.all_input_nodes if _is_float(x) and x.meta["val"].dim() > 0}
        if not (dims & set(_HALF)) or len(dims) < 2:
            return False
        return self._map_inputs(node, self._widen_input)

    def _retype(self, node: fx.Node) -> None:
        """Re-derive ``node``'s fake value; a kernel that refuses mixed dtypes reads float32."""
        try:
            set_fake_val(node)
            return
        except Exception as first:  # whatever the op's fake kernel raises on mixed dtypes
            if not self._map_inputs(node, self._widen_input):
                raise PassContractError(f"lower_precision: {node.name!r} ({node.target}) fails on "
                                        f"its native dtypes: {first}") from first
        set_fake_val(node)

    def _give_role_to_cast(self, node: fx.Node, traced: tuple[torch.dtype, ...]) -> None:
        """A 16-bit op that carries a role (a gradient that is an mm's output): its role moves
        to a cast back to the traced dtype, which every user then reads."""
        if len(traced) != 1:
            raise PassContractError(f"lower_precision: {node.name!r} has role {roles.role_of(node)!r} "
                                    "and several outputs")
        up = insert_op(self.graph, _CET, (node, traced[0]), before=node.next, role=roles.CAST,
                       by_pass=self.by_pass)
        node.replace_all_uses_with(up, delete_user_cb=lambda u: u is not up)
        custom = node.meta["custom"]
        roles.set_role(up, custom.pop(roles.ROLE_KEY), custom.pop(roles.TARGET_KEY, None))
        self.casts[(node, traced[0])] = up

    def cast(self, x: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        """``x`` in ``dtype``, cast once per (tensor, dtype) before its first reader ``before``.

        A whole view of another tensor is cast through that tensor (the view is replayed on its
        cast: a weight read as ``t(w)`` in the forward and as ``w`` in the backward is cast
        once); a widening cast of a value narrowed back gives that value (no cast pair)."""
        if _dtype(x) == dtype:
            return x
        key = (x, dtype)
        if key not in self.casts:
            src = x.args[0] if _is_native_cast(x) else None
            if isinstance(src, fx.Node) and _dtype(src) == dtype and _dtype(x) == torch.float32:
                self.casts[key] = src
            elif _whole_view_of_float(x):
                inner = self.cast(x.args[0], dtype, before)
                self.casts[key] = insert_op(self.graph, x.target, (inner, *x.args[1:]), dict(x.kwargs),
                                            before=before, role=roles.CAST, by_pass=self.by_pass)
            else:
                self.casts[key] = insert_op(self.graph, _CET, (x, dtype), before=before,
                                            role=roles.CAST, by_pass=self.by_pass)
        return self.casts[key]


def check_native(graph: fx.Graph, dtype: torch.dtype, policy: PrecisionPolicy) -> None:
    """The native lowering's contract on ``graph`` (a ``PassContractError`` naming the node):
    the 16-bit ops read ``dtype``, and the float32 ops and the role-carrying nodes (gradients,
    optimizer, DLS math) read and write no 16-bit value."""
    for node in graph.nodes:
        if node.op != "call_function" or _is_native_cast(node):
            continue
        if policy.lowers(node.target):
            keep = _keep_dtype_args(node)
            bad = [x.name for x, name in _named_inputs(node)
                   if name not in keep and _is_float(x) and _dtype(x) != dtype]
            if bad:
                raise PassContractError(f"lower_precision: {node.name!r} reads {bad} not in {dtype}")
        elif policy.keeps_fp32(node.target) or roles.role_of(node) not in (None, roles.CAST):
            half = [a.name for a in [*node.all_input_nodes, node] if _dtype(a) in _HALF]
            if half:
                raise PassContractError(f"lower_precision: float32 node {node.name!r} "
                                        f"({roles.role_of(node) or node.target}) sees 16-bit {half}")


def _device_type(ops: list[fx.Node]) -> str:
    """Where the policy's ops run: the device of the first one's output (its fake value); "cpu"
    when none has one (nothing is lowered then)."""
    for op in ops:
        for v in pytree.tree_leaves(op.meta.get("val")):
            if isinstance(v, torch.Tensor):
                return v.device.type
    return "cpu"


def _arg_names(node: fx.Node) -> list[str]:
    """The schema's names of ``node``'s positional arguments (empty for a non-ATen target)."""
    schema = getattr(node.target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def _named_inputs(node: fx.Node) -> list[tuple[fx.Node, str | None]]:
    """Every input node of ``node`` with the name of the argument it is passed as."""
    names = _arg_names(node)
    out: list[tuple[fx.Node, str | None]] = []
    for i, a in enumerate(node.args):
        fx.node.map_arg(a, lambda x, i=i: out.append((x, names[i] if i < len(names) else None)))
    for k, v in node.kwargs.items():
        fx.node.map_arg(v, lambda x, k=k: out.append((x, k)))
    return out


def _keep_dtype_args(node: fx.Node) -> frozenset[str]:
    return KEEP_DTYPE_ARGS if _arg_names(node) else frozenset()


def _is_native_cast(node: fx.Node) -> bool:
    """A cast this pass inserted (a role it moved onto the cast included)."""
    return node.target is _CET and roles.pass_of(node) == LowerPrecisionPass.name


def _dtype(node: object) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def _dtypes(node: fx.Node) -> tuple[torch.dtype, ...]:
    return tuple(v.dtype for v in pytree.tree_leaves(node.meta.get("val"))
                 if isinstance(v, torch.Tensor))


def _is_float(node: object) -> bool:
    d = _dtype(node)
    return d is not None and d.is_floating_point


def _whole_view_of_float(x: fx.Node) -> bool:
    """``x`` is a WHOLE_VIEW_OPS view of a floating-point value (casting its source casts it)."""
    src = x.args[0] if x.op == "call_function" and x.target in WHOLE_VIEW_OPS and x.args else None
    return isinstance(src, fx.Node) and _is_float(src)


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
