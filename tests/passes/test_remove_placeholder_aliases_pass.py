"""RemovePlaceholderAliasesPass: input roles move from their alias holders onto the placeholders; the graph computes the same."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.graph import roles
from dlspass.graph.marks import mark, resolve_marks
from dlspass.passes.remove_placeholder_aliases_pass import RemovePlaceholderAliasesPass

ALIAS = torch.ops.aten.alias.default


def _step(p: torch.Tensor, x: torch.Tensor, marked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    if marked:
        p = mark(p, roles.PARAM, "w")
        x = mark(x, roles.INPUT, "batch.0")
        g = mark(x, roles.GRAD, "x")  # an input that is also a gradient: its alias must stay
    else:
        g = x
    return (p * x).sum(), g * 3


def test_input_roles_move_onto_placeholders_and_values_do_not_change() -> None:
    p, x = torch.randn(4), torch.randn(4)
    gm = make_fx(lambda p, x: _step(p, x))(p, x)
    resolve_marks(gm)
    aliases = [n for n in gm.graph.nodes if n.target is ALIAS]
    assert len(aliases) == 3

    assert RemovePlaceholderAliasesPass()(gm).modified
    ph_p, ph_x = gm.graph.find_nodes(op="placeholder")
    assert (roles.role_of(ph_p), roles.target_of(ph_p)) == (roles.PARAM, "w")
    assert (roles.role_of(ph_x), roles.target_of(ph_x)) == (roles.INPUT, "batch.0")
    (kept,) = [n for n in gm.graph.nodes if n.target is ALIAS]
    assert roles.role_of(kept) == roles.GRAD and kept.args[0] is ph_x
    for got, want in zip(gm(p, x), _step(p, x, marked=False), strict=True):
        assert torch.equal(got, want)
    assert not RemovePlaceholderAliasesPass()(gm).modified
