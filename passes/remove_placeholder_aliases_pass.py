"""RemovePlaceholderAliasesPass: each `aten.alias(placeholder)` that holds a placeholder role (left by `resolve_marks` for a marked input) is replaced by the placeholder, which takes the role if it has none."""

from __future__ import annotations

import torch
import torch.fx as fx

from dlspass.graph import roles
from dlspass.passes.base import GraphPass, GraphPassResult


class RemovePlaceholderAliasesPass(GraphPass):
    """Move input roles from their alias holders onto the placeholders themselves.

    ``resolve_marks`` gives a marked placeholder an ``aten.alias`` node to hold the role (one
    node never has two roles); an input role belongs on the placeholder, where the passes look
    for it, and the alias is only an extra op in the graph. An alias that holds another role
    (a gradient that is an input, say) stays. ``stats["removed"]``: the aliases removed.
    """

    name = "remove_placeholder_aliases"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        removed = 0
        for node in list(graph.nodes):
            src = node.args[0] if node.args else None
            if (node.op == "call_function" and node.target is torch.ops.aten.alias.default
                    and isinstance(src, fx.Node) and src.op == "placeholder"
                    and roles.role_of(node) in roles.PLACEHOLDER_ROLES):
                if roles.role_of(src) is None:
                    roles.set_role(src, roles.role_of(node), roles.target_of(node))
                node.replace_all_uses_with(src)
                graph.erase_node(node)
                removed += 1
        return GraphPassResult(gm, bool(removed), {"removed": removed})
