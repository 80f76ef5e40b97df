"""dlspass.capture.program: a hand-assembled ExportedProgram runs its graph like the source program."""

from __future__ import annotations

import copy

import torch

from dlspass.capture.program import flat_tuple_spec, make_program, user_outputs


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y.relu(), y.sum()


def test_relabelled_program_runs_as_the_model() -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 3)
    ep = torch.export.export(model, (x,))
    gm = copy.deepcopy(ep.graph_module)
    outs = user_outputs(gm.graph)
    old = ep.module_call_graph[0].signature
    prog = make_program(gm, ep.graph_signature.input_specs, outs, state_dict=dict(ep.state_dict),
                        constants=dict(ep.constants), in_spec=old.in_spec,
                        out_spec=flat_tuple_spec(len(outs)), forward_arg_names=old.forward_arg_names)
    assert [s.arg.name for s in prog.graph_signature.output_specs] == \
        [s.arg.name for s in ep.graph_signature.output_specs]
    got = prog.module()(x)
    want = model(x)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want, strict=True):
        # bit equality: the exported graph calls the ATen ops the eager forward dispatches, so
        # both sides run the same kernels in the same order
        torch.testing.assert_close(g, w.detach(), rtol=0, atol=0)
