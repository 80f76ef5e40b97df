"""RecomputeForBackwardPass: the backward recomputes cheap pointwise values from what it keeps anyway, instead of keeping them from the forward."""

from __future__ import annotations

import torch
import torch.fx as fx

from dlspass.graph import roles
from dlspass.graph.splice import insert_op
from dlspass.passes.base import GraphPass, GraphPassResult

aten = torch.ops.aten

# One arithmetic op per element: recomputing one inside a backward kernel (inductor fuses it
# into its reader) costs a few instructions, keeping it costs a tensor from the forward to the
# backward. Transcendentals (tanh, exp) stay saved, as in the values torch's partitioner saves
# for a tanh GELU; casts too (the native lowering casts each tensor once per dtype, and the
# 16-bit weight copies the backward's matmuls read are saved under autocast as well).
CHEAP_POINTWISE = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default,
})


class RecomputeForBackwardPass(GraphPass):
    """Keep fewer forward values alive for the backward of a whole-step graph.

    A captured step is one graph: every forward value the backward reads stays alive from the
    forward to its last backward reader (what autograd saves), and no partitioner decides what
    to recompute, as AOTAutograd's min-cut partitioner does for ``torch.compile(model)``. A tanh
    GELU, ``0.5 * h * (1 + tanh(c * (h + 0.044715 * h**3)))``, leaves its backward four
    activation-sized values besides ``h``; torch's partitioner saves ``h`` and the tanh.

    This pass gives each saved value that is one of `CHEAP_POINTWISE` and reads only values
    the backward has anyway (inputs of the graph, other saved values, or values recomputed so)
    a copy in the backward, placed before its first backward reader, and points the backward's
    reads at the copy: the forward's value then dies with its last forward reader. The set of
    forward values alive in the backward only shrinks. Forward and backward are told apart by
    the seed (role ``backward_seed``): in graph order, which is the order the step runs in, the
    backward starts there (a copy depends on forward values only, so its place, not its
    inputs, makes it part of the backward). A graph without a seed (no backward) is left alone. The copies compute the same op on the same
    values (bit-identical in eager execution; a compiler that fuses the copy into its reader
    may skip the rounding of a 16-bit intermediate, as it does for torch's recomputed values).

    ``stats["recomputed"]``: the values the backward now recomputes.
    """

    name = "recompute_for_backward"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        seeds = roles.nodes_with_role(graph, roles.SEED)
        if not seeds:
            return GraphPassResult(gm, False, {"recomputed": 0})
        order = {n: i for i, n in enumerate(graph.nodes)}
        start = min(order[s] for s in seeds)
        bwd = {n for n in graph.nodes if order[n] >= start}
        saved = {n for n in graph.nodes if n.op == "call_function" and n not in bwd
                 and any(u in bwd for u in n.users) and isinstance(n.meta.get("val"), torch.Tensor)}
        recompute = _recomputable(graph, saved)
        if not recompute:
            return GraphPassResult(gm, False, {"recomputed": 0})
        # where each copy goes: before its first backward reader, or before the copy of a value
        # computed from it, whichever comes first (reverse graph order settles the chains)
        at: dict[fx.Node, fx.Node] = {}
        for n in sorted(recompute, key=order.__getitem__, reverse=True):
            readers = [u for u in n.users if u in bwd]
            readers += [at[u] for u in n.users if u in at]
            at[n] = min(readers, key=order.__getitem__)
        copies: dict[fx.Node, fx.Node] = {}
        for n in sorted(recompute, key=order.__getitem__):  # inputs' copies first
            args = fx.node.map_arg(n.args, lambda x: copies.get(x, x))
            kwargs = fx.node.map_arg(n.kwargs, lambda x: copies.get(x, x))
            copies[n] = insert_op(graph, n.target, args, dict(kwargs), before=at[n], role=None,
                                  by_pass=self.name, source=n)
        for n, copy in copies.items():
            n.replace_all_uses_with(copy, delete_user_cb=lambda u: u in bwd)
        return GraphPassResult(gm, True, {"recomputed": len(copies)})


def _recomputable(graph: fx.Graph, saved: set[fx.Node]) -> set[fx.Node]:
    """The saved values the backward can recompute from what it has anyway, in graph order, so
    a chain of them (a * 0.5, then that + 1) is recomputed whole."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n not in saved or n.target not in CHEAP_POINTWISE:
            continue
        if roles.role_of(n) is not None:
            continue  # a value of the step's contract (a loss) or a cast stays as it is
        if all(x.op == "placeholder" or x in saved for x in n.all_input_nodes):
            out.add(n)
    return out
