"""dlspass.graph.splice: grafting traced helpers and single ops into a graph, checked against eager.

Every case that computes something runs the rewritten graph on real tensors and compares it
with the same math done eagerly.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.graph import roles
from dlspass.graph.splice import SpliceError, graft, insert_op, insertion_point, splice

STACK = {"L__self___fc1": ("fc1", "torch.nn.modules.linear.Linear")}
TRACE = 'File "model.py", line 12, in forward\n    y = self.fc1(x)'


def host(fn, *example: Tensor, mode: str = "fake") -> fx.GraphModule:
    """``fn`` traced with make_fx: every node has a fake value, as in a captured step."""
    return make_fx(fn, tracing_mode=mode)(*example)


def computed(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def set_output(gm: fx.GraphModule, values: list[fx.Node]) -> None:
    gm.graph.output_node().args = (tuple(values),)
    gm.graph.lint()
    gm.recompile()


def test_constant_made_by_the_helper_moves_onto_the_module() -> None:
    gm = host(lambda x: [torch.sin(x)], torch.randn(3))
    (sin,) = computed(gm)
    weights = torch.tensor([1.0, -2.0, 0.5])

    def helper(s: Tensor) -> Tensor:
        return s * torch.tensor([1.0, -2.0, 0.5]) + 1.0

    (out,) = splice(gm.graph, helper, [sin], role="scaled", by_pass="test")
    set_output(gm, [out])
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(consts) == 1
    # a non-persistent buffer: it follows the module across devices, not into its state dict
    assert consts[0].target in dict(gm.named_buffers()) and consts[0].target not in gm.state_dict()
    # read at the top, before any computed node
    assert consts[0].prev.op == "placeholder"
    x = torch.randn(3)
    (got,) = gm(x)
    assert torch.equal(got, torch.sin(x) * weights + 1.0)


def test_constants_of_two_splices_do_not_collide() -> None:
    gm = host(lambda x: [torch.sin(x)], torch.randn(3))
    (sin,) = computed(gm)
    (a,) = splice(gm.graph, lambda s: s + torch.tensor([1.0, 2.0, 3.0]), [sin], role="r", by_pass="p")
    (b,) = splice(gm.graph, lambda s: s * torch.tensor([4.0, 5.0, 6.0]), [a], role="r", by_pass="p")
    set_output(gm, [b])
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len({n.target for n in consts}) == 2
    assert consts[0].prev.op == "placeholder" and consts[0].next is consts[1]  # both at the top
    x = torch.randn(3)
    assert torch.equal(gm(x)[0], (torch.sin(x) + torch.tensor([1.0, 2.0, 3.0])) * torch.tensor([4.0, 5.0, 6.0]))


def test_two_constants_of_one_helper_keep_their_order() -> None:
    gm = host(lambda x: [torch.sin(x)], torch.randn(3))
    (sin,) = computed(gm)
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])
    outs = splice(gm.graph, lambda s: (s + torch.tensor([1.0, 2.0, 3.0])) * torch.tensor([4.0, 5.0, 6.0]),
                  [sin], role="r", by_pass="p")
    set_output(gm, list(outs))
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert [torch.equal(getattr(gm, n.target), t) for n, t in zip(consts, (a, b), strict=True)] == [True, True]
    assert outs.inserted == [n for n in gm.graph.nodes if n in set(outs.inserted)]  # graph order
    x = torch.randn(3)
    assert torch.equal(gm(x)[0], (torch.sin(x) + a) * b)


def test_output_roles_and_arguments_returned_as_they_are() -> None:
    gm = host(lambda x, y: [x + y], torch.randn(4), torch.randn(4))
    (add,) = computed(gm)
    roles.set_role(add, "sum", "s")

    def helper(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return a * 2.0, a.abs().max(), a

    outs = splice(gm.graph, helper, [add], role="helper", by_pass="test",
                  output_roles=[("doubled", "d"), None, ("ignored", "i")])
    doubled, peak, same = outs
    assert (roles.role_of(doubled), roles.target_of(doubled)) == ("doubled", "d")
    assert roles.role_of(peak) == "helper" and roles.target_of(peak) is None
    # an output that is an argument is the argument itself and keeps its role
    assert same is add and (roles.role_of(add), roles.target_of(add)) == ("sum", "s")
    assert all(roles.pass_of(n) == "test" for n in outs.inserted)
    set_output(gm, [doubled, peak, same])
    x, y = torch.randn(4), torch.randn(4)
    got = gm(x, y)
    assert torch.equal(got[0], (x + y) * 2.0) and torch.equal(got[1], (x + y).abs().max())
    assert torch.equal(got[2], x + y)


def test_insertion_point_goes_past_the_placeholders() -> None:
    gm = host(lambda x, y, z: [x * y + z], torch.randn(2), torch.randn(2), torch.randn(2))
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    first_computed = computed(gm)[0]
    assert insertion_point(gm.graph, [x]) is first_computed
    (sq,) = splice(gm.graph, lambda t: t * t, [x], role="sq", by_pass="test")
    ops = [n.op for n in gm.graph.nodes]
    # placeholders stay together at the top; the new node is the first computed one
    assert ops[:3] == ["placeholder"] * 3 and ops[3] == "call_function"
    assert sq.next is first_computed
    set_output(gm, [sq, *gm.graph.output_node().args[0]])
    a, b, c = torch.randn(2), torch.randn(2), torch.randn(2)
    got = gm(a, b, c)
    assert torch.equal(got[0], a * a) and torch.equal(got[1], a * b + c)


def test_explicit_anchor_and_returned_inserted_nodes() -> None:
    gm = host(lambda x: [torch.exp(torch.sin(x))], torch.randn(5))
    sin, exp = computed(gm)
    before = list(gm.graph.nodes)
    outs = splice(gm.graph, lambda s: (s - 1.0) * 3.0, [sin], role="r", by_pass="test", before=exp)
    added = [n for n in gm.graph.nodes if n not in before]
    # exactly the new nodes, in graph order, all before the anchor
    assert outs.inserted == added and len(added) == 2
    assert outs[0] is added[-1] and added[-1].next is exp
    assert isinstance(outs, list) and len(outs) == 1
    exp.replace_input_with(sin, outs[0])
    gm.recompile()
    x = torch.randn(5)
    assert torch.equal(gm(x)[0], torch.exp((torch.sin(x) - 1.0) * 3.0))


def test_inserted_nodes_inherit_provenance_of_the_value_they_transform() -> None:
    gm = host(lambda x: [torch.relu(torch.sin(x))], torch.randn(3))
    sin, relu = computed(gm)
    sin.meta["nn_module_stack"] = dict(STACK)
    sin.meta["stack_trace"] = TRACE
    outs = splice(gm.graph, lambda s: (s * 2.0).clamp(max=1.0), [sin], role="r", by_pass="test")
    assert len(outs.inserted) == 2
    for node in outs.inserted:
        assert node.meta["nn_module_stack"] == STACK and node.meta["stack_trace"] == TRACE
        # copies: retagging one node's module does not retag the source
        assert node.meta["nn_module_stack"] is not sin.meta["nn_module_stack"]
    from dlspass.debug.localize import _module_of

    assert _module_of(outs[0]) == ("fc1", "nn_module_stack")


def test_insert_op_takes_the_provenance_of_the_node_it_feeds() -> None:
    gm = host(lambda x, w: [torch.mm(torch.sin(x), w)], torch.randn(2, 3), torch.randn(3, 4))
    sin, mm = computed(gm)
    sin.meta["stack_trace"] = "previous layer"
    mm.meta["stack_trace"] = TRACE
    mm.meta["nn_module_stack"] = dict(STACK)
    # a cast of the matmul's input belongs to the matmul (its layer), not to the producer
    cast = insert_op(gm.graph, torch.ops.aten.mul.Tensor, (sin, 0.5), before=mm, role="cast",
                     by_pass="test")
    assert cast.meta["stack_trace"] == TRACE and cast.meta["nn_module_stack"] == STACK
    # an op after a value that the next node does not read belongs to that value
    after = insert_op(gm.graph, torch.ops.aten.neg.default, (mm,), before=gm.graph.output_node(),
                      role="neg", by_pass="test", source=None)
    assert after.meta["stack_trace"] == TRACE
    # an explicit source wins
    chosen = insert_op(gm.graph, torch.ops.aten.abs.default, (sin,), before=mm, role="abs",
                       by_pass="test", source=sin)
    assert chosen.meta["stack_trace"] == "previous layer" and "nn_module_stack" not in chosen.meta
    mm.replace_input_with(sin, cast)
    set_output(gm, [after, chosen])
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    got = gm(x, w)
    assert torch.equal(got[0], -torch.mm(torch.sin(x) * 0.5, w))
    assert torch.equal(got[1], torch.sin(x).abs())
    assert cast.meta["val"].shape == (2, 3) and roles.role_of(cast) == "cast"


def test_own_stack_trace_is_kept() -> None:
    gm = host(lambda x: [torch.sin(x)], torch.randn(3))
    (sin,) = computed(gm)
    sin.meta["stack_trace"] = TRACE
    sub = make_fx(lambda t: t + 1.0)(torch.randn(3))
    (add,) = [n for n in sub.graph.nodes if n.op == "call_function"]
    add.meta["stack_trace"] = "helper frame"
    (out,), inserted = graft(gm.graph, sub, [sin], gm.graph.output_node(), source=sin)
    assert inserted == [out] and out.meta["stack_trace"] == "helper frame"


def test_symbolic_shapes() -> None:
    gm = host(lambda x: [torch.tanh(x)], torch.randn(4, 3), mode="symbolic")
    (tanh,) = computed(gm)

    def helper(t: Tensor) -> Tensor:
        return (t * t).sum(0) / t.shape[0]

    (mean_sq,) = splice(gm.graph, helper, [tanh], role="r", by_pass="test")
    # the new fake value speaks the host graph's symbols (its column count), no new ones
    assert str(mean_sq.meta["val"].shape[0]) == str(tanh.meta["val"].shape[1])
    set_output(gm, [mean_sq])
    for rows, cols in ((7, 3), (2, 5)):
        x = torch.randn(rows, cols)
        t = torch.tanh(x)
        torch.testing.assert_close(gm(x)[0], (t * t).sum(0) / rows, rtol=0, atol=0)


def test_graft_and_splice_errors() -> None:
    gm = host(lambda x: [torch.sin(x)], torch.randn(3))
    (sin,) = computed(gm)
    sub = make_fx(lambda a, b: a + b)(torch.randn(3), torch.randn(3))
    with pytest.raises(SpliceError, match="takes 2 inputs, 1 given"):
        graft(gm.graph, sub, [sin], gm.graph.output_node())
    sin.meta.pop("val")
    with pytest.raises(SpliceError, match="no fake value"):
        splice(gm.graph, lambda s: s + 1.0, [sin], role="r", by_pass="test")
    unfaked = fx.symbolic_trace(lambda x: torch.sin(x))
    ph = next(iter(unfaked.graph.find_nodes(op="placeholder")))
    ph.meta["val"] = torch.zeros(3)  # a real tensor: nothing to trace it with
    with pytest.raises(SpliceError, match="carry no fake tensors"):
        splice(unfaked.graph, lambda s: s + 1.0, [ph], role="r", by_pass="test")


def test_role_holder_made_by_resolve_marks_keeps_the_marker_provenance() -> None:
    from dlspass.graph.marks import MARK_OP, mark, resolve_marks

    gm = host(lambda x: [mark(x, "input_copy", "x") * 2.0], torch.randn(3))
    (marker,) = [n for n in gm.graph.nodes if n.target is MARK_OP]
    marker.meta["stack_trace"] = TRACE
    assert resolve_marks(gm) == 1
    (holder,) = [n for n in gm.graph.nodes if roles.role_of(n) == "input_copy"]
    # a placeholder cannot hold the role: an alias node does, with the marker's provenance
    assert holder.target is torch.ops.aten.alias.default and holder.meta["stack_trace"] == TRACE
    x = torch.randn(3)
    assert torch.equal(gm(x)[0], x * 2.0)
