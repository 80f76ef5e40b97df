"""What dynamo traced, read back: the roles of ``dlspass.compile``'s AOT step graph.

dynamo traces the user's eager step (with ``trace_autograd_ops``) and AOTAutograd turns it into
one graph; ``dlspass.graph.marks`` left role markers on the values the step's optimizer
touched. `tag_aot_graph` moves them onto placeholders and outputs, and finds the backward seed
(`find_seed`) and where ``loss.backward()`` stored each gradient (`tag_backward_grads`): the
role contract ``apply_dls`` reads (``dlspass.graph.roles``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

from dlspass.capture.step_pipeline import StepCaptureError
from dlspass.graph import roles
from dlspass.graph.marks import resolve_marks
from dlspass.passes.remove_placeholder_aliases_pass import RemovePlaceholderAliasesPass

__all__ = ["find_seed", "tag_aot_graph", "tag_backward_grads"]


def find_seed(graph: fx.Graph) -> fx.Node:
    """The backward seed: the ``ones_like`` of a 0-d value that every gradient depends on."""
    grads = roles.nodes_with_role(graph, roles.GRAD)
    if not grads:
        raise StepCaptureError("the step computes no gradients: call loss.backward() before optimizer.step()")
    # the nodes every gradient depends on
    ancestors = set.intersection(*(roles.ancestors([g]) for g in grads))
    # a ones_like/full_like of a non-scalar (``x * torch.ones_like(x)`` in the model) is
    # model arithmetic, not a seed: loss.backward() seeds with a 0-d ones_like(loss)
    seeds = [n for n in ancestors if n.op == "call_function"
             and n.target in roles.SEED_OPS
             and _is_scalar(n)]
    if len(seeds) != 1:
        raise StepCaptureError(f"expected one backward seed (ones_like(loss)) in the step, found {len(seeds)}: "
                           "call loss.backward() exactly once on a scalar loss (to accumulate "
                           "micro-batches, sum their losses and call backward on the sum)")
    return seeds[0]


def _is_scalar(node: fx.Node) -> bool:
    """True when ``node``'s value (its fake value, else its first argument's) is 0-d."""
    val = node.meta.get("val")
    if not isinstance(val, Tensor) and node.args and isinstance(node.args[0], fx.Node):
        val = node.args[0].meta.get("val")
    return isinstance(val, Tensor) and val.dim() == 0


def tag_aot_graph(gm: fx.GraphModule) -> None:
    """Give the AOTAutograd step graph the role contract ``apply_dls`` reads (dlspass.graph.roles).

    Placeholder roles move from their markers onto the placeholders; the outputs AOT returns
    for mutated inputs (``copy(placeholder, new)``) get the update role of their placeholder,
    the rest are user outputs (LOSS); the backward seed gets SEED.
    """
    resolve_marks(gm)
    RemovePlaceholderAliasesPass()(gm)
    graph = gm.graph
    for node in graph.find_nodes(op="placeholder"):
        if roles.role_of(node) is None:
            roles.set_role(node, roles.INPUT, node.name)
    out_roles: list[tuple[str, str | None]] = []
    for val in roles.output_values(graph):
        ph = val.args[0] if (isinstance(val, fx.Node) and val.target is torch.ops.aten.copy.default) else None
        if isinstance(ph, fx.Node) and ph.op == "placeholder" and roles.role_of(ph) in roles.UPDATE_OF_SOURCE:
            out_roles.append((roles.UPDATE_OF_SOURCE[roles.role_of(ph)], roles.target_of(ph)))
        else:
            out_roles.append((roles.LOSS, None))
    roles.set_output_roles(graph, out_roles)
    seed = find_seed(graph)
    roles.set_role(seed, roles.SEED)
    tag_backward_grads(graph, seed)
    graph.lint()
    gm.recompile()


def tag_backward_grads(graph: fx.Graph, seed: fx.Node) -> None:
    """Tag BACKWARD_GRAD on what ``loss.backward()`` stored in the ``.grad`` of each parameter
    the optimizer steps, where the step's own code changed it before ``optimizer.step`` (a
    ``clip_grad_norm_``): the GRAD node marked at ``optimizer.step`` is then that code's result,
    and the DLS passes must unscale the gradient before that code reads it.

    dynamo traces backward's store into ``.grad`` as ``copy(empty_like(param), grad)``
    (``torch._dynamo.polyfills.accumulate_grad``, ``.grad`` being None: ``zero_grad`` sets it
    so); the first such node after the seed is backward's.
    """
    after_seed = roles.descendants([seed])
    stored: dict[str | None, fx.Node] = {}  # parameter name -> backward's store
    for node in after_seed:
        empty = node.args[0] if node.target is torch.ops.aten.copy.default else None
        if isinstance(empty, fx.Node) and empty.target is torch.ops.aten.empty_like.default:
            param = empty.args[0]
            if isinstance(param, fx.Node) and roles.role_of(param) == roles.PARAM:
                stored.setdefault(roles.target_of(param), node)
    for grad in roles.nodes_with_role(graph, roles.GRAD):
        name = roles.target_of(grad)
        if name not in stored and grad in after_seed:
            # never silently: the step's code would read scaled gradients
            raise StepCaptureError(f"dlspass.compile: cannot find where loss.backward() stored "
                                   f"the gradient of {name!r} (this torch version traces it "
                                   f"otherwise); report it with your torch version")
    for name, node in stored.items():
        # untagged when the optimizer reads it unchanged: then it is the GRAD node itself
        if roles.role_of(node) is None:
            roles.set_role(node, roles.BACKWARD_GRAD, name)
