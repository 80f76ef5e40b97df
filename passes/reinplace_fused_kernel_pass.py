"""ReinplaceFusedKernelPass: a fused optimizer kernel whose every update is copied back into its own input runs in place instead (``_fused_adamw_``), without the copies."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dlspass.passes.base import GraphPass, GraphPassResult
from dlspass.passes.guard_fused_updates_pass import UPDATED_LISTS, peel

aten = torch.ops.aten

# the functional kernels AOTAutograd leaves, and the in-place ones torch.optim calls
IN_PLACE = {aten._fused_adam.default: aten._fused_adam_.default,
            aten._fused_adam.tensor_lr: aten._fused_adam_.tensor_lr,
            aten._fused_adamw.default: aten._fused_adamw_.default,
            aten._fused_adamw.tensor_lr: aten._fused_adamw_.tensor_lr}
GRADS = 1  # the kernel's gradient list: written by the in-place kernel, no update


class ReinplaceFusedKernelPass(GraphPass):
    """Run a functional fused optimizer kernel as torch.optim runs it: in place.

    After ``WriteUpdatesInPlacePass`` each update of the functional kernel is written back by
    ``copy_(placeholder, out[list][i])``. Where every such copy writes into the very input the
    kernel read at that place, for every parameter and state input of the kernel, and nothing
    after the kernel reads those inputs or its gradients, the in-place kernel computes the same
    values into the same tensors: the copies (a full read and write of every parameter and
    state tensor per step, and code for the compiler to generate) go, and the outputs become
    the inputs the kernel updated. Inductor runs the in-place kernel as a library call that
    mutates its inputs. Any other shape is left alone. ``stats["kernels"]`` counts the kernels
    rewritten, ``stats["copies"]`` the copies dropped.
    """

    name = "reinplace_fused_kernel"

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        kernels = copies = 0
        for kernel in [n for n in graph.nodes if n.op == "call_function" and n.target in IN_PLACE]:
            found = _copies_back(kernel, order)
            if found is None:
                continue
            with graph.inserting_before(kernel):
                in_place = graph.call_function(IN_PLACE[kernel.target], kernel.args, dict(kernel.kwargs))
            in_place.meta.update({k: v for k, v in kernel.meta.items() if k != "val"})
            for copy in reversed(found):  # each chain's last node first: it reads the one before
                copy.replace_all_uses_with(copy.args[0])
                graph.erase_node(copy)
            for outer in list(kernel.users):
                for inner in list(outer.users):
                    graph.erase_node(inner)
                graph.erase_node(outer)
            graph.erase_node(kernel)
            kernels += 1
            copies += sum(c.target is aten.copy_.default for c in found)
        return GraphPassResult(gm, bool(kernels), {"kernels": kernels, "copies": copies})


def _copies_back(kernel: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The ``copy_`` nodes writing each update of ``kernel`` back into its input, when the
    in-place kernel may replace them (class docstring); else None."""
    copies: list[fx.Node] = []
    written: set[fx.Node] = set()
    for outer in kernel.users:
        if outer.target is not operator.getitem:
            return None
        lst = outer.args[1]
        for inner in outer.users:
            if inner.target is not operator.getitem:
                return None
            if lst == GRADS or lst not in UPDATED_LISTS:
                if inner.users:
                    return None  # something reads the functional kernel's gradients out
                continue
            source = kernel.args[lst][inner.args[1]]
            chain = _chain_to_copy_back(inner, peel(source))
            if chain is None:
                return None
            copies += chain
            written.add(peel(source))
    ends = {c for c in copies if c.target is aten.copy_.default}
    for lst in (*UPDATED_LISTS, GRADS):
        inputs = kernel.args[lst] if lst < len(kernel.args) else []
        for x in inputs:
            if lst != GRADS and peel(x) not in written:
                return None  # an input the kernel would update in place that the step keeps
            if lst == GRADS and isinstance(x, fx.Node) and x.op == "placeholder":
                return None  # the in-place kernel writes its gradients: never a step input
            later = [u for u in x.users if u is not kernel and u not in copies and u not in ends
                     and order[u] > order[kernel]]
            if later:
                return None  # read after the kernel: it must see the value before the update
    return copies


def _chain_to_copy_back(value: fx.Node, source: fx.Node) -> list[fx.Node] | None:
    """The nodes from ``value`` (an update out of the kernel) to the ``copy_`` that writes it
    into ``source``, its input placeholder, through the functional ``copy(source, x)`` tracing
    leaves of ``param.copy_(new)``, each read once; None when the update goes anywhere else."""
    chain: list[fx.Node] = []
    node = value
    while True:
        users = list(node.users)
        if len(users) != 1:
            return None
        user = users[0]
        if not (user.target in (aten.copy.default, aten.copy_.default) and user.args[1] is node
                and isinstance(user.args[0], fx.Node) and peel(user.args[0]) is source):
            return None
        chain.append(user)
        if user.target is aten.copy_.default:
            return chain if user.args[0].op == "placeholder" else None
        node = user
