"""MergePlaceholdersPass: each placeholder named in ``merge`` is erased and its uses read the placeholder it maps to."""

from __future__ import annotations

import torch.fx as fx

from dlspass.passes.base import GraphPass, GraphPassResult, PassContractError


class MergePlaceholdersPass(GraphPass):
    """Merge graph inputs that hold one tensor: ``merge`` maps a placeholder's name to the
    name of the placeholder that replaces it (tied parameters of an exported program, which
    torch.export lists once per name, become one input with every use). ``stats["merged"]``:
    the placeholders removed."""

    name = "merge_placeholders"

    def __init__(self, merge: dict[str, str]) -> None:
        self.merge = dict(merge)

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
        missing = sorted({*self.merge, *self.merge.values()} - set(placeholders))
        if missing:
            raise PassContractError(f"merge_placeholders: no placeholder named {missing}")
        for name, keep in self.merge.items():
            node = placeholders[name]
            node.replace_all_uses_with(placeholders[keep])
            graph.erase_node(node)
        return GraphPassResult(gm, bool(self.merge), {"merged": len(self.merge)})
