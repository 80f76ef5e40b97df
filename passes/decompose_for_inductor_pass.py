"""DecomposeForInductorPass: the rounding op becomes plain aten ops (a cast round trip for float16/bfloat16, int32 bit ops otherwise) and every node whose op is in inductor's decomposition table is replaced by that op's decomposition, traced alone on its fake values."""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.graph.splice import graft
from dlspass.passes.base import GraphPass, GraphPassResult
from dlspass.passes.decompose_rounding_pass import DecomposeRoundingPass


class DecomposeForInductorPass(GraphPass):
    """Bring the ops dlspass added to an AOT graph into inductor's op set, in place.

    ``compile_fx_inner`` lowers only decomposed graphs, and AOTAutograd traced the rest of the
    graph with the same table, so only what the dlspass passes added after it is left to do
    (``isfinite``, ``clamp``, the rounding op, ...). A node is left for inductor's fallback when
    it has no fake values to trace with, returns several values, or decomposes into constants.
    The new nodes take the provenance of the node they replace. ``stats["replaced"]`` is the
    number of nodes replaced (rounding ops included).
    """

    name = "decompose_for_inductor"

    def __init__(self, table: dict[Any, Any] | None = None) -> None:
        self.table = table

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        table = self.table if self.table is not None else select_decomp_table()
        count = DecomposeRoundingPass("cast", table)(gm).stats["replaced"]
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in table and _replace(graph, node, table):
                count += 1
        return GraphPassResult(gm, bool(count), {"replaced": count})


def _replace(graph: fx.Graph, node: fx.Node, table: dict[Any, Any]) -> bool:
    """Replace ``node`` by its decomposition under ``table``; False when it is left as it is."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    inputs = [a for a in leaves if isinstance(a, fx.Node)]
    vals = [a.meta.get("val") for a in inputs]
    mode = detect_fake_mode(vals)
    if mode is None or not isinstance(node.meta.get("val"), Tensor):
        return False  # no fake values to trace with, or a multi-output op: inductor falls back
    target = node.target

    def call(*xs: Tensor) -> Tensor:
        it = iter(xs)
        args, kwargs = pytree.tree_unflatten([next(it) if isinstance(a, fx.Node) else a for a in leaves], spec)
        return target(*args, **kwargs)

    # symbolic when the values carry symbolic shapes (dynamo's fake mode has a shape env), so
    # the decomposition's size arithmetic is traced instead of baked in
    with mode:
        sub = make_fx(call, decomposition_table=table,
                      tracing_mode="symbolic" if mode.shape_env is not None else "fake")(*vals)
    if any(n.op == "get_attr" for n in sub.graph.nodes):
        return False  # a decomposition that makes constants: leave the op to inductor's fallback
    (out,), _ = graft(graph, sub, inputs, node, source=node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True
