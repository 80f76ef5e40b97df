"""Role markers: an identity custom op that survives tracing, turned into node roles afterwards.

Tracing (make_fx, dynamo + AOTAutograd) creates nodes we cannot name from Python. Wrapping a
value in ``mark(x, role, target)`` while tracing leaves a ``dlspass::mark`` node in the graph;
``resolve_marks(gm)`` then moves the role onto the marked value's producer and removes the
marker, so the rewritten graph contains no trace of it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

from dlspass.graph import roles
from dlspass.graph.splice import port_provenance


@torch.library.custom_op("dlspass::mark", mutates_args=())
def _mark(x: Tensor, role: str, target: str) -> Tensor:
    return x.clone()


@_mark.register_fake
def _(x: Tensor, role: str, target: str) -> Tensor:
    return torch.empty_like(x)


def _mark_backward(ctx, grad: Tensor):
    return grad, None, None


_mark.register_autograd(_mark_backward)

MARK_OP = torch.ops.dlspass.mark.default


def mark(x: Tensor, role: str, target: str | None = None) -> Tensor:
    """``x`` unchanged, with a marker node carrying ``role`` when traced."""
    return _mark(x, role, target or "")


def resolve_marks(gm: fx.GraphModule) -> int:
    """Move every marker's role onto its input node and delete the markers; returns the count.

    A marked value that is a placeholder or already carries another role gets an explicit
    ``aten.alias`` node to hold the role, so one node never has two roles.
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not MARK_OP:
            continue
        src, role, target = node.args
        holder = src
        if src.op == "placeholder" or roles.role_of(src) not in (None, role):
            with gm.graph.inserting_before(node):
                holder = gm.graph.call_function(torch.ops.aten.alias.default, (src,))
            holder.meta.update({k: v for k, v in src.meta.items() if k in ("val", "tensor_meta")})
            # the marker was written where the value was named: that is where the holder comes from
            port_provenance(node, [holder])
        roles.set_role(holder, role, target or None)
        node.replace_all_uses_with(holder)
        gm.graph.erase_node(node)
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count
