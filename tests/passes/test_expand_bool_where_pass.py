"""ExpandBoolWherePass: bool ``where`` becomes logic ops with the same truth table; other wheres stay."""

from __future__ import annotations

import itertools

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.passes.expand_bool_where_pass import ExpandBoolWherePass

aten = torch.ops.aten


def _f(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    flag = torch.where(c, a, b)                 # bool: rewritten
    value = torch.where(flag, x, y)             # float: kept (ORT has a float Where)
    return flag, value


def _trace():
    # distinct tensors: make_fx would trace one tensor passed three times as one placeholder
    ex = (*(torch.zeros(4, dtype=torch.bool) for _ in range(3)), torch.zeros(4), torch.zeros(4))
    gm = make_fx(_f, tracing_mode="fake")(*ex)
    where = next(n for n in gm.graph.nodes if n.target is aten.where.self and n.meta["val"].dtype == torch.bool)
    where.meta["custom"] = {"dlspass_role": "marker"}
    return gm


def _truth_table() -> tuple[torch.Tensor, ...]:
    rows = torch.tensor(list(itertools.product([False, True], repeat=3)))  # every (c, a, b)
    c, a, b = rows.T
    return c, a, b, torch.arange(8.0), -torch.arange(8.0)


def test_bool_where_becomes_logic_ops_with_the_same_results():
    gm = _trace()
    args = _truth_table()
    before = [t.clone() for t in gm(*args)]
    assert ExpandBoolWherePass()(gm).modified
    after = gm(*args)
    for want, have in zip(before, after, strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want)
    # the reference: torch.where in eager mode
    c, a, b, x, y = args
    assert torch.equal(after[0], torch.where(c, a, b))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [aten.logical_and.default, aten.logical_not.default, aten.logical_and.default,
                   aten.logical_or.default, aten.where.self]
    out = next(n for n in gm.graph.nodes if n.target is aten.logical_or.default)
    assert out.meta["custom"] == {"dlspass_role": "marker"}  # roles move to the replacement
    assert all(n.meta["val"].dtype == torch.bool for n in gm.graph.nodes
               if n.op == "call_function" and n.target is not aten.where.self)


def test_no_bool_where_is_left_unchanged():
    gm = _trace()
    ExpandBoolWherePass()(gm)
    code = gm.code
    assert not ExpandBoolWherePass()(gm).modified and gm.code == code
