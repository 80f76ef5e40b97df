"""The step-graph contract: what a pass author may rely on and must keep.

A captured training step is one FX graph, a pure function

    (params, buffers, optimizer_state, scaler_state, hyperparameters, batch)
        -> (new_params, new_buffers, new_optimizer_state, new_scaler_state, loss)

that every front end tags the same way (`tag_step_io`, `StepIO`). The passes in
``dlspass.passes`` rewrite it; `check` holds between any two passes and `verify` proves the
loss-scaling invariants at the end. The rules:

1. **Fake values.** Every placeholder and every computed node that something reads carries
   ``meta["val"]`` (a fake tensor; symbolic shapes allowed). A pass computes them for what it
   adds: new nodes come through `splice` (trace a Python function, e.g. ``scale_policy``'s, on
   the fake values and graft it in), `insert_op` (one op) or `graft` (a traced graph), never
   through raw ``graph.call_function``; a new graph input through `add_input`. They also record the pass (``roles.PASS_KEY``) and take
   the provenance (``stack_trace``, ``nn_module_stack``) of the node they stand for.
2. **Roles.** What a node is lives in ``meta["custom"]`` (the one meta dict ``torch.export``
   keeps): ``roles.ROLE_KEY``, ``roles.TARGET_KEY`` (the parameter or state entry), set with
   ``roles.set_role``. A node has one role: when a traced value needs a second one, `mark` /
   `resolve_marks` give it an ``aten.alias`` holder. Every role, target with a fixed meaning
   and metadata key is a constant of ``roles``; passes do not spell the strings.
3. **Placeholders and outputs.** Placeholders come in the order above, each with its
   placeholder role. Output roles are positional: ``roles.output_roles`` lists ``(role,
   target)`` per output position, because one node may be returned twice or a placeholder
   passed through unchanged. There is exactly one backward seed (``roles.SEED``) and one
   ``roles.GRAD`` node per parameter, as the optimizer reads it; where the step's own code
   changed it after backward (a clip inside ``dlspass.compile``), what backward produced is
   its ``roles.BACKWARD_GRAD`` node, where the gradient is unscaled.
4. **Functional until the epilogue.** The graph has no in-place op: ``copy_`` into an input
   appears only once ``WriteUpdatesInPlacePass`` (the last pass, after ``apply_dls``) has
   written the updates back; no pass reads the graph after it.
5. **Recorded state.** ``apply_dls`` records its config, precision mode, applied passes and
   skip reasons as JSON on the output node and on the seed node (whose meta survives
   ``torch.export``, which rebuilds the output node): read them with ``roles.recorded`` and
   ``roles.recorded_config``. Running a pass twice changes nothing.
6. **Loss-scaling invariants** (`verify`, once the DLS passes ran): the seed is read only
   through one SCALED_SEED node that multiplies by the ``loss_scale`` placeholder; every path
   from the seed to a parameter or optimizer-state output crosses exactly one UNSCALE node;
   with a dynamic scale each such output is ``where(isfinite, new, old)`` with ``old`` its own
   placeholder.
7. **Errors.** A graph that breaks this contract is a ``GraphContractError`` (internal, CLI exit
   3; a pass raises its subclass ``PassContractError``); a graph that is wrong because the
   user's program is (no backward seed in a joint program, a fault naming no node) is an input
   error (``dlspass.errors.InputValueError``), raised by the pass that finds it.

A new pass subclasses ``dlspass.passes.base.GraphPass`` (a ``name``; ``run`` returns a
``GraphPassResult`` with ``stats``) or ``DLSPass`` (``skip_reason``/``rewrite``), lives in
``passes/verb_noun_pass.py`` and is tested against an eager reference in
``tests/passes/test_verb_noun_pass.py``. Mutating a graph anywhere else is refused by
``tests/test_layout.py``.
"""

from dlspass.graph import roles, splice
from dlspass.graph.clone import clone_step_graph
from dlspass.graph.invariants import VerificationError, check, verify
from dlspass.graph.marks import mark, resolve_marks
from dlspass.graph.splice import add_input, graft, insert_op
from dlspass.graph.step_io import StepIO, tag_step_io

# `splice` is the module (``splice.splice`` traces a function in): a function of that name here
# would shadow the submodule for ``import dlspass.graph.splice``
__all__ = [
    "StepIO", "VerificationError", "add_input", "check", "clone_step_graph", "graft", "insert_op", "mark",
    "resolve_marks", "roles",
    "splice", "tag_step_io", "verify",
]
