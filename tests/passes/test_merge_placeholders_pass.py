"""MergePlaceholdersPass: merged inputs read their twin; the graph computes f(a, a, ...)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from dlspass.passes.base import PassContractError
from dlspass.passes.merge_placeholders_pass import MergePlaceholdersPass


def _f(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return a @ x + b * x.sum()


def test_a_merged_input_is_gone_and_its_uses_read_the_kept_one() -> None:
    torch.manual_seed(0)
    a, x = torch.randn(3, 3), torch.randn(3)
    gm = fx.symbolic_trace(_f)
    assert MergePlaceholdersPass({"b": "a"})(gm).modified
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["a", "x"]
    # a tied weight: one tensor, both uses. Bit equality: symbolic_trace keeps _f's calls, so both
    # sides run the same kernels in the same order
    torch.testing.assert_close(gm(a, x), _f(a, a, x), rtol=0, atol=0)


def test_a_tied_parameter_of_an_exported_model_merges() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 4)
            self.out = torch.nn.Linear(4, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(idx)).logsumexp(-1).mean()

    torch.manual_seed(0)
    model, idx = Tied(), torch.tensor([[0, 3, 4]])
    ep = torch.export.export(model, (idx,))
    params = [s.arg.name for s in ep.graph_signature.input_specs if s.target in ("emb.weight", "out.weight")]
    assert len(params) == 2
    gm = ep.graph_module
    MergePlaceholdersPass({params[1]: params[0]})(gm)
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == [params[0], "idx"]
    (loss,) = gm(model.emb.weight.detach(), idx)
    # bit equality: a forward only; the exported graph calls the ATen ops eager dispatches
    torch.testing.assert_close(loss, model(idx).detach(), rtol=0, atol=0)


def test_an_unknown_name_is_a_contract_error() -> None:
    with pytest.raises(PassContractError, match=r"no placeholder named \['c'\]"):
        MergePlaceholdersPass({"c": "a"})(fx.symbolic_trace(_f))
