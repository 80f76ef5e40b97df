"""LowerMatmulsToFloat8Pass: every admitted mm/addmm/bmm of the step (forward and backward) runs in float8 with current per-tensor or per-row scaling."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from dlspass.config import FLOAT8_RECIPES, PRECISION_MODES, ConfigError, DLSConfig, PrecisionMode
from dlspass.float8_policy import (
    DEFAULT_FILTER,
    EPS,
    RECIPES,
    Float8Filter,
    Float8Recipe,
    MatmulSite,
)
from dlspass.graph import roles
from dlspass.graph.splice import insert_op
from dlspass.passes.base import DLSPass, PassContractError
from dlspass.precision_policy import DEFAULT_LOWER_OPS, WHOLE_VIEW_OPS

aten = torch.ops.aten
_CET = torch.ops.prims.convert_element_type.default
_ROUND_NAME = "dlspass.round_to_format.default"

MATMUL_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
"""The ATen matmuls a captured step spells ``nn.Linear``, ``F.linear``, ``x @ w``, ``matmul``
and ``nn.MultiheadAttention``'s projections and batched products with (forward and backward)."""

FLOAT8_KEY = "dlspass_float8"
"""On each matmul's output (``meta["custom"]``): the recipe it was converted with, or
``"skipped: why"``; on the output and seed nodes (torch.export keeps the seed's) the decisions
of all of them as JSON (`float8_decisions`)."""

FLOAT8_CAST_KEY = "dlspass_float8_cast"
"""On each float8 cast (the ``convert_element_type`` to float8; ``meta["custom"]``): JSON
``{"amax": the amax node's name, "axis": the rowwise axis or null}``; the cast reads
``clamp(mul(x32, scale), -max, max)`` (`float8_casts` reads it back for the telemetry)."""

FLOAT8_OPERANDS_KEY = "dlspass_float8_operands"
"""On each converted matmul's output: JSON ``{"matmul": the name of the matmul it replaced,
"a": the first operand's float8 cast's name, "b": the second's}`` (a cast read transposed is
the cast of the tensor itself; one cast may feed several matmuls)."""


@dataclass
class _Operand:
    """One operand cast to float8: its data, its float32 scale (``x * scale`` is in range) and
    the float8 cast node itself (``data`` may be a transposed view of it)."""

    data: fx.Node
    scale: fx.Node
    cast: fx.Node


class LowerMatmulsToFloat8Pass(DLSPass):
    """Cast both operands of every matmul the filter admits to float8 with a scale from their
    current amax (``dlspass.float8_policy``: torchao's recipes), and multiply them in float8.

    ``native`` runs ``torch._scaled_mm`` on the float8 tensors (``bmm``: one per batch entry,
    so a graph grows with batch x heads), the first operand row-major and the second
    column-major, pinned with ``as_strided`` so that inductor keeps those layouts;
    ``emulate`` runs torchao's emulation: dequantize (``data.float() / scale``) and a float32
    matmul, so a step of ``nn.Linear`` layers matches torchao's ``Float8Linear(emulate=True)``
    bit for bit. The output is the matmul's own dtype (the step's 16-bit dtype after the
    precision lowering, float32 without it); ``addmm`` adds its bias after the product, as
    ``Float8Linear`` does. An operand that depends on the backward seed is a gradient (e5m2 in
    ``tensorwise``). Every matmul records its decision (`FLOAT8_KEY`; `float8_decisions`).
    """

    name = "lower_matmuls_to_float8"

    def __init__(self, recipe: str, mode: PrecisionMode = "emulate",
                 matmul_filter: Float8Filter | None = None) -> None:
        if recipe not in FLOAT8_RECIPES:
            raise ConfigError(f"float8: unknown float8 recipe {recipe!r}; choose one of {', '.join(FLOAT8_RECIPES)}")
        if mode not in PRECISION_MODES:
            raise ConfigError(f"precision mode: expected one of {PRECISION_MODES}, got {mode!r}")
        super().__init__(None)
        self.recipe: Float8Recipe = RECIPES[recipe]
        self.mode = mode
        self.filter = matmul_filter or DEFAULT_FILTER

    @classmethod
    def for_config(cls, config: DLSConfig) -> LowerMatmulsToFloat8Pass:
        """The pass ``config`` asks for: its ``float8`` recipe, its precision mode, the filter of
        its ``float8_filter`` (``config.float8`` must be set)."""
        return cls(str(config.float8), config.lowering_mode, Float8Filter.from_spec(config.float8_filter))

    def check_preconditions(self, gm: fx.GraphModule) -> None:
        bare = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in MATMUL_OPS
                and not all("val" in a.meta for a in [n, *n.all_input_nodes])]
        if bare:
            raise PassContractError(f"{self.name}: matmuls {bare} or their inputs have no fake value")

    def rewrite(self, gm: fx.GraphModule) -> bool:
        graph = gm.graph
        grad_side = roles.descendants(_grad_sources(graph))
        decisions: dict[str, dict[str, Any]] = {}
        cache: dict[tuple[fx.Node, torch.dtype, int | None], _Operand] = {}
        weights = _weight_sizes(graph, grad_side)
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or not (node.target in MATMUL_OPS or node.target in DEFAULT_LOWER_OPS):
                continue
            why, site = self._reason_to_skip(node, weights)
            decisions[node.name] = {"float8": None if why else self.recipe.name, "why": why,
                                    "op": _op_name(node), "module": site.module if site else "",
                                    "mkn": [site.m, site.k, site.n] if site else None}
            if why is not None:
                node.meta.setdefault("custom", {})[FLOAT8_KEY] = f"skipped: {why}"
                continue
            self._convert(graph, node, grad_side, cache)
            changed = True
        text = json.dumps(decisions, sort_keys=True)
        for node in (graph.output_node(), *roles.nodes_with_role(graph, roles.SEED)):
            node.meta.setdefault("custom", {})[FLOAT8_KEY] = text
        return changed

    def ensures(self, gm: fx.GraphModule) -> None:
        left = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in MATMUL_OPS
                and roles.pass_of(n) != self.name
                and not str(n.meta.get("custom", {}).get(FLOAT8_KEY, "")).startswith("skipped")]
        if left:
            raise PassContractError(f"{self.name}: matmuls {left} neither converted nor skipped with a reason")

    # -- the decision --------------------------------------------------------------------------
    def _reason_to_skip(self, node: fx.Node, weights: dict[str, tuple[int, int]]
                        ) -> tuple[str | None, MatmulSite | None]:
        """Why ``node`` stays as it is (None: convert it), and what the filter saw of it
        (``weights``: `_weight_sizes`)."""
        if node.target not in MATMUL_OPS:
            return f"{_op_name(node)} has no float8 form here (only mm, addmm, bmm)", None
        a, b = _operands(node)
        va, vb = a.meta["val"], b.meta["val"]
        param = _param_of(node)
        module = param.rpartition(".")[0] if param else _stack_path(node)
        site = MatmulSite(module, _op_name(node), _dim(va.shape[-2]), _dim(va.shape[-1]), _dim(vb.shape[-1]),
                          weights.get(param) if param else None)
        if node.target is aten.addmm.default and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
            return "addmm with beta or alpha other than 1", site
        if not (va.is_floating_point() and vb.is_floating_point()):
            return "integer operands", site
        if va.numel() == 0 or vb.numel() == 0:
            return "empty operand", site
        if self.mode == "native" and node.target is aten.bmm.default and not isinstance(va.shape[0], int):
            return "bmm with a symbolic batch size (native runs one torch._scaled_mm per batch entry)", site
        return self.filter.reason_to_skip(site, self.recipe), site

    # -- the rewrite ---------------------------------------------------------------------------
    def _convert(self, graph: fx.Graph, node: fx.Node, grad_side: dict[fx.Node, None],
                 cache: dict[tuple[fx.Node, torch.dtype, int | None], _Operand]) -> fx.Node:
        a, b = _operands(node)
        batched = node.target is aten.bmm.default
        rank = 3 if batched else 2
        out_dtype = node.meta["val"].dtype
        # rowwise: scale along the contraction, A's last dim and B's first (matrix) dim
        axis_a = rank - 1 if self.recipe.rowwise else None
        axis_b = rank - 2 if self.recipe.rowwise else None

        def op(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
            return insert_op(graph, target, args, kwargs, before=node, role=None, by_pass=self.name, source=node)

        def cast(x: fx.Node, axis: int | None) -> _Operand:
            src = _transposed_source(x)
            if src is not None:
                # cast the tensor itself and read it transposed (a view): a weight is cast once
                # for t(w) in the forward and w in the backward, and the float8 operand has the
                # layout torchao's (a transposed view of the cast weight) has, so the emulated
                # matmul runs the same BLAS path
                rank = len(x.meta["val"].shape)
                inner = cast(src, None if axis is None else 2 * rank - 3 - axis)
                return _Operand(op(aten.transpose.int, inner.data, -2, -1),
                                inner.scale if axis is None else op(aten.transpose.int, inner.scale, -2, -1),
                                inner.cast)
            dtype = self.recipe.dtype_for(_is_grad(x, grad_side))
            key = (x, dtype, axis)
            if key not in cache:
                cache[key] = self._cast(op, x, dtype, axis)
            return cache[key]

        qa, qb = cast(a, axis_a), cast(b, axis_b)
        if self.mode == "emulate":
            # torchao's emulation: torch.mm(a._data.float() / a._scale, b._data.float() / b._scale)
            deq_a = op(aten.div.Tensor, op(_CET, qa.data, torch.float32), qa.scale)
            deq_b = op(aten.div.Tensor, op(_CET, qb.data, torch.float32), qb.scale)
            out = op(aten.bmm.default if batched else aten.mm.default, deq_a, deq_b)
            if out_dtype != torch.float32:
                out = op(_CET, out, out_dtype)
        else:
            out = self._scaled_mm(op, qa, qb, out_dtype, batched)
        if node.target is aten.addmm.default:
            out = op(aten.add.Tensor, out, node.args[0])  # the bias after the product, as Float8Linear
        role = roles.role_of(node)
        if role is not None:
            custom = node.meta["custom"]
            roles.set_role(out, role, custom.get(roles.TARGET_KEY))
        out.meta.setdefault("custom", {})[FLOAT8_KEY] = self.recipe.name
        out.meta["custom"][FLOAT8_OPERANDS_KEY] = json.dumps({"matmul": node.name, "a": qa.cast.name,
                                                              "b": qb.cast.name})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        return out

    def _cast(self, op: Any, x: fx.Node, dtype: torch.dtype, axis: int | None) -> _Operand:
        """torchao's ``hp_tensor_to_float8_dynamic``, op for op: amax, scale
        ``fp8_max / clamp(amax, EPS)`` in float64 (``float / tensor`` is ``reciprocal() * float``
        in torch), stored in float32 (rounded down to a power of 2 where the recipe says), then
        ``clamp(x.float() * scale, ±fp8_max).to(float8)``."""
        fp8_max = torch.finfo(dtype).max
        magnitude = op(aten.abs.default, x)
        if axis is None:
            raw_amax = op(aten.max.default, magnitude)
        else:
            raw_amax = op(aten.amax.default, magnitude, [axis], True)
        amax = op(aten.clamp.default, op(_CET, raw_amax, torch.float64), EPS)
        scale = op(_CET, op(aten.mul.Tensor, op(aten.reciprocal.default, amax), fp8_max), torch.float32)
        if self.recipe.pow2_scales:
            scale = op(aten.exp2.default, op(aten.floor.default, op(aten.log2.default, scale)))
        x32 = x if x.meta["val"].dtype == torch.float32 else op(_CET, x, torch.float32)
        scaled = op(aten.clamp.default, op(aten.mul.Tensor, x32, scale), -fp8_max, fp8_max)
        cast = op(_CET, scaled, dtype)
        cast.meta.setdefault("custom", {})[FLOAT8_CAST_KEY] = json.dumps({"amax": raw_amax.name, "axis": axis})
        return _Operand(cast, scale, cast)

    def _scaled_mm(self, op: Any, qa: _Operand, qb: _Operand, out_dtype: torch.dtype, batched: bool) -> fx.Node:
        """``torch._scaled_mm`` on the float8 operands (it takes the inverse scales); the second
        operand column-major, as the GPU kernels require."""
        inv_a = op(aten.reciprocal.default, qa.scale)
        inv_b = op(aten.reciprocal.default, qb.scale)

        def one(a: fx.Node, b: fx.Node, sa: fx.Node, sb: fx.Node) -> fx.Node:
            def dim(x: fx.Node, d: int) -> int | fx.Node:
                # a symbolic size (dynamic shapes) is read from the tensor in the graph
                size = x.meta["val"].shape[d]
                return size if isinstance(size, int) else op(aten.sym_size.int, x, d)

            m, k, n = dim(a, 0), dim(a, 1), dim(b, 1)
            if not a.meta["val"].is_contiguous():
                a = op(aten.clone.default, a, memory_format=torch.contiguous_format)
            b_t = b
            if not b.meta["val"].t().is_contiguous():
                b_t = op(aten.clone.default, op(aten.t.default, b), memory_format=torch.contiguous_format)
            else:
                b_t = op(aten.t.default, b)
            # as_strided pins the layouts: inductor may lay out a flexible buffer (a clone, a
            # cast) as it likes and then refuses a row-major second operand; as_strided makes
            # it keep the buffer contiguous and read it through these strides (eager: a view)
            a = op(aten.as_strided.default, a, [m, k], [k, 1])
            b_cols = op(aten.as_strided.default, b_t, [k, n], [1, k])
            if self.recipe.rowwise:
                # the kernel wants the [M, 1] and [1, N] scales contiguous; a scale read through a
                # transpose (the weight's, cast once) is a view inductor may lay out otherwise
                sa = op(aten.as_strided.default, op(aten.clone.default, sa, memory_format=torch.contiguous_format),
                        [m, 1], [1, 1])
                sb = op(aten.as_strided.default, op(aten.clone.default, sb, memory_format=torch.contiguous_format),
                        [1, n], [n, 1])
            return op(aten._scaled_mm.default, a, b_cols, sa, sb, None, None, out_dtype)

        if not batched:
            return one(qa.data, qb.data, inv_a, inv_b)
        outs = []
        for i in range(qa.data.meta["val"].shape[0]):
            sa = inv_a if not self.recipe.rowwise else op(aten.select.int, inv_a, 0, i)
            sb = inv_b if not self.recipe.rowwise else op(aten.select.int, inv_b, 0, i)
            outs.append(one(op(aten.select.int, qa.data, 0, i), op(aten.select.int, qb.data, 0, i), sa, sb))
        return op(aten.stack.default, outs)


def float8_decisions(graph: fx.Graph) -> dict[str, dict[str, Any]]:
    """``{matmul node name: {"float8": recipe or None, "why": why not or None, "op", "module",
    "mkn": [M, K, N]}}`` as `LowerMatmulsToFloat8Pass` recorded it on ``graph`` (the names are
    those of the matmuls before the rewrite; empty when the pass did not run)."""
    raw = roles.recorded(graph, FLOAT8_KEY)
    return json.loads(raw) if raw else {}


@dataclass(frozen=True)
class Float8Cast:
    """One float8 cast the pass inserted: ``x32`` (the operand in float32), ``scaled``
    (``x32 * scale``, before the saturating clamp), ``cast`` (the float8 tensor), ``amax`` (the
    operand's ``max |x|``: a scalar, or per row with ``axis``)."""

    x32: fx.Node
    scaled: fx.Node
    cast: fx.Node
    amax: fx.Node
    axis: int | None


def float8_casts(graph: fx.Graph) -> list[tuple[str, str, Float8Cast]]:
    """``[(matmul name, "a" or "b", its operand's cast)]`` for every matmul `LowerMatmulsToFloat8Pass`
    converted in ``graph``, in graph order (empty when it converted none)."""
    by_name = {n.name: n for n in graph.nodes}
    casts: dict[str, Float8Cast] = {}

    def cast_named(name: str) -> Float8Cast:
        if name not in casts:
            node = by_name.get(name)
            record = None if node is None else node.meta.get("custom", {}).get(FLOAT8_CAST_KEY)
            if record is None:
                raise PassContractError(f"float8: the cast {name!r} a converted matmul names is not in the graph")
            info = json.loads(record)
            scaled = node.args[0].args[0]  # cast(clamp(mul(x32, scale), ...)), as _cast builds it
            casts[name] = Float8Cast(scaled.args[0], scaled, node, by_name[info["amax"]], info["axis"])
        return casts[name]

    found = []
    for node in graph.nodes:
        record = node.meta.get("custom", {}).get(FLOAT8_OPERANDS_KEY)
        if record is not None:
            info = json.loads(record)
            found += [(info["matmul"], side, cast_named(info[side])) for side in ("a", "b")]
    return found


def _dim(size: int | torch.SymInt) -> int:
    """A size as the filter judges and the decisions record it: a symbolic size (a dynamic-shape
    graph, e.g. ``dlspass.compile`` after a recompile) at its example value, with no guard: the
    choice of float8 is an optimisation, as inductor's uses of the hint are."""
    return optimization_hint(size)


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    a, b = node.args[1:3] if node.target is aten.addmm.default else node.args[:2]
    return a, b


_TRANSPOSES = (aten.t.default, aten.t_copy.default)
_TRANSPOSE_DIMS = (aten.transpose.int, aten.transpose_copy.int)


def _transposed_source(x: fx.Node) -> fx.Node | None:
    """The tensor ``x`` is the transpose of (its last two dims swapped), or None."""
    if x.op != "call_function" or not x.args or not isinstance(x.args[0], fx.Node):
        return None
    src = x.args[0]
    if "val" not in src.meta:
        return None
    rank = len(src.meta["val"].shape)
    if x.target in _TRANSPOSES and rank == 2:
        return src
    if x.target in _TRANSPOSE_DIMS and rank >= 2:
        dims = {d % rank for d in x.args[1:3]}
        return src if dims == {rank - 2, rank - 1} else None
    return None


def _op_name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _grad_sources(graph: fx.Graph) -> list[fx.Node]:
    """Where the gradients start: the step's backward seed, or an AOT graph's ``tangents_*``
    placeholders (the ``dlspass`` torch.compile backend's joint and backward graphs)."""
    tangents = [n for n in graph.find_nodes(op="placeholder") if str(n.target).startswith("tangents")]
    return [*roles.nodes_with_role(graph, roles.SEED), *tangents]


def _is_grad(x: fx.Node, grad_side: dict[fx.Node, None]) -> bool:
    """A gradient operand: it depends on the backward seed (torchao's ``grad_output``)."""
    return x in grad_side


def _is_view_or_cast(x: fx.Node) -> bool:
    return x.op == "call_function" and bool(x.args) and isinstance(x.args[0], fx.Node) and (
        x.target in WHOLE_VIEW_OPS or x.target is _CET or str(x.target) == _ROUND_NAME)


def _through_views(x: fx.Node) -> fx.Node:
    """``x`` past the whole views and the precision casts in front of it."""
    while _is_view_or_cast(x):
        x = x.args[0]
    return x


def _param_operand(node: fx.Node) -> fx.Node | None:
    """The parameter placeholder ``node`` multiplies (past views, casts and transposes)."""
    for x in _operands(node):
        src = _through_views(x)
        if src.op == "placeholder" and roles.role_of(src) == roles.PARAM and roles.target_of(src):
            return src
    return None


def _param_of(node: fx.Node) -> str | None:
    """The parameter a matmul belongs to: the one it multiplies (``blocks.0.fc.weight``), or the
    one whose gradient it computes; None when neither shows (no step roles on the graph: the
    ``dlspass`` torch.compile backend's AOT graphs)."""
    src = _param_operand(node)
    if src is not None:
        return roles.target_of(src)
    front = [node]
    for _ in range(8):  # the gradient's views and casts after the weight-gradient matmul
        for y in front:
            if roles.role_of(y) in (roles.GRAD, roles.BACKWARD_GRAD) and roles.target_of(y):
                return roles.target_of(y)
        front = [u for y in front for u in y.users if _is_view_or_cast(u) and u.args[0] is y]
    return None


def _stack_path(node: fx.Node) -> str:
    """The module dynamo recorded for ``node`` (``""`` when none did)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        return str(path[0] if isinstance(path, tuple) else path)
    return ""


def _weight_sizes(graph: fx.Graph, grad_side: dict[fx.Node, None]) -> dict[str, tuple[int, int]]:
    """``{parameter: (N, K)}`` for each 2-D parameter a forward matmul multiplies: ``K`` the
    dim that matmul contracts, ``N`` the other (an ``nn.Linear``'s ``weight.shape``; a weight
    used as ``x @ w`` reads transposed), so that the filter judges the three matmuls of a
    linear by the one size torchao's module filter sees."""
    sizes: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in MATMUL_OPS or node in grad_side:
            continue
        src = _param_operand(node)
        if src is None or "val" not in src.meta or src.meta["val"].dim() != 2:
            continue
        p0, p1 = map(_dim, src.meta["val"].shape)
        k = _dim(_operands(node)[0].meta["val"].shape[-1])
        sizes.setdefault(roles.target_of(src), (p0, p1) if p1 == k else (p1, p0))
    return sizes
