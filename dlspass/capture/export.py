"""Export a user's loss model as a joint forward-backward ``.pt2`` program.

``export_factory("pkg.mod:make")`` imports ``make``, calls it for ``(model, example_inputs)``,
runs ``torch.export.export`` and turns the program into a joint one
(``torch.export.experimental._export_forward_backward``) with ``joint_with_ties``. Two things
that export's joint trace gets wrong are fixed on the way: tied parameters (one tensor under
several names) are merged into one parameter (``merge_tied_parameters``), and
``scaled_dot_product_attention`` is decomposed into torch's math attention above autograd
(``_attention_in_math_ops``). A failure of torch on the user's model is the model's problem:
an ``InputValueError`` (CLI exit 2) naming torch's exception.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import io
from typing import Any

import torch
from torch import Tensor
from torch._decomp import core_aten_decompositions
from torch.export.experimental import _copy_graph_module_and_signature, _remove_detach_pass
from torch.export.exported_program import _decompose_exported_program
from torch.export.graph_signature import InputKind

from dlspass.errors import InputValueError
from dlspass.files.paths import cwd_searched_last
from dlspass.files.quiet import quiet_torch
from dlspass.graph import roles
from dlspass.passes.merge_placeholders_pass import MergePlaceholdersPass


def _resolve_factory(spec: str) -> Any:
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise InputValueError(f"{spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:make_model")
    mod_name, attr = spec.split(":")
    try:
        # the current folder is searched, but last: a module found nowhere else resolves from
        # it, a file there named like an installed module (filelock.py) replaces nothing
        with cwd_searched_last():
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise InputValueError(f"{spec!r}: cannot import module {mod_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InputValueError(f"{spec!r}: module {mod_name!r} has no callable {attr!r}")
    return fn


def _torch_error(exc: BaseException) -> str:
    """``Type: first line`` of a torch exception, without torch's pointers to its logs."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__


def export_factory(spec: str) -> tuple[torch.export.ExportedProgram, dict[str, str]]:
    """Export ``FACTORY()``'s ``(model, example_inputs)`` as a joint forward-backward program.

    Returns the program and its tied parameters merged into one, ``{dropped_name: kept_name}``
    (empty when the model ties none; see ``merge_tied_parameters``).

    A failure of torch on the user's model (in ``torch.export.export`` or while tracing its
    backward) is the model's problem, not dlspass's: it raises ``InputValueError`` (CLI exit 2)
    with torch's exception type and first line.
    """
    factory = _resolve_factory(spec)
    try:
        made = factory()
    except Exception as e:
        raise InputValueError(f"{spec!r}: the factory raised {_torch_error(e)}") from e
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise InputValueError(f"{spec!r}: the factory must return (model, example_inputs), got {type(made).__name__}")
    model, inputs = made
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    try:
        # torch prints the partial graph of a failed export to stderr: the error names it
        with quiet_torch(), contextlib.redirect_stderr(io.StringIO()):
            ep = torch.export.export(model, inputs)
    except Exception as e:
        raise InputValueError(f"{spec}: torch.export.export failed on the model ({_torch_error(e)})") from e
    return joint_with_ties(ep, source=spec)


def joint_with_ties(ep: torch.export.ExportedProgram, source: str
                    ) -> tuple[torch.export.ExportedProgram, dict[str, str]]:
    """``ep`` (a model returning a scalar loss) as a joint program with parameter gradients,
    and the tied parameter names it merged, ``{dropped_name: kept_name}``.

    Tied parameters (one tensor under several names, e.g. an embedding shared with the output
    layer) become one parameter with one gradient, the sum over every use, as
    ``model.parameters()`` and torch.optim see them; it keeps the first name.
    """
    outs = [s for s in ep.graph_signature.output_specs
            if s.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT]
    vals = [n.meta.get("val") for n in roles.output_values(ep.graph)]
    user_vals = vals[len(vals) - len(outs):] if outs else []
    if not (len(outs) >= 1 and isinstance(user_vals[0], Tensor) and user_vals[0].dim() == 0
            and user_vals[0].is_floating_point()):
        raise InputValueError(f"{source}: not a training model: its first output is not a scalar "
                              "floating-point loss (inference-only models cannot be trained)")
    if not ep.graph_signature.parameters:
        raise InputValueError(f"{source}: the model has no parameters to train")
    ep, tied = merge_tied_parameters(ep)
    try:
        with quiet_torch():
            return _export_forward_backward(ep), tied
    except Exception as e:
        raise InputValueError(f"{source}: torch could not trace the model's backward "
                          f"({_torch_error(e)})") from e


def merge_tied_parameters(ep: torch.export.ExportedProgram
                          ) -> tuple[torch.export.ExportedProgram, dict[str, str]]:
    """``ep`` with each group of PARAMETER inputs holding the same tensor merged into one input,
    and the merge as ``{dropped_name: kept_name}`` (fully qualified parameter names, the
    ``InputSpec.target``s; empty when nothing is tied).

    ``torch.export`` lists a tied parameter once per name but routes every use through one of
    the placeholders, so the joint trace finds a parameter without a gradient (pytorch#101192).
    The merged input keeps the first name (``model.named_parameters()`` order) and all uses.
    The dropped names vanish from the program, so the caller records the returned mapping in
    the file's metadata: it is the only place that says ``lm_head.weight`` is ``wte.weight``.
    """
    sig = ep.graph_signature
    groups: dict[tuple, list[Any]] = {}
    for spec in sig.input_specs:
        if spec.kind == InputKind.PARAMETER:
            t = ep.state_dict[spec.target]
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            groups.setdefault(key, []).append(spec)
    tied = [g for g in groups.values() if len(g) > 1]
    if not tied:
        return ep, {}
    names = {s.target: group[0].target for group in tied for s in group[1:]}
    placeholders = {n.name: n for n in ep.graph_module.graph.find_nodes(op="placeholder")}
    merge: dict[str, str] = {}
    renamed: dict[str, str] = {}
    for group in tied:
        keep = next((s for s in group if placeholders[s.arg.name].users), group[0])
        merge.update({spec.arg.name: keep.arg.name for spec in group if spec is not keep})
        renamed[keep.arg.name] = group[0].target
    gm = copy.deepcopy(ep.graph_module)
    MergePlaceholdersPass(merge)(gm)
    dropped = set(merge)
    specs = [dataclasses.replace(s, target=renamed.get(s.arg.name, s.target))
             for s in sig.input_specs if s.arg.name not in dropped]
    new_sig = dataclasses.replace(sig, input_specs=specs)
    kept = {s.target for s in specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)}
    state = {k: v for k, v in ep.state_dict.items() if k in kept}
    return ep._update(gm, new_sig, state_dict=state), names


def _attention_in_math_ops(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                           enable_gqa: bool = False) -> Tensor:
    """``scaled_dot_product_attention`` as torch's math attention, laid out as the CPU kernel.

    Left to itself, the joint trace differentiates the CPU flash-attention op and then
    decomposes its forward into the math form, whose second output is not the logsumexp the
    flash backward reads: the query/key/value gradients come out wrong. Its output layout also
    differs from the kernel's (``query``'s strides), which export relied on when it dropped the
    model's ``.contiguous()``, so a later ``view`` fails (pytorch#136543). Decomposing the op
    above autograd into the math ops, laid out in ``query``'s memory order, fixes both.
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # as the public op does before it picks a backend: the math kernel adds the mask
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    out, _ = torch.ops.aten._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)
    order = sorted(range(query.dim()), key=lambda d: -query.stride(d))  # outermost first
    back = sorted(range(query.dim()), key=order.__getitem__)
    return out.permute(order).contiguous().permute(back)


def _export_forward_backward(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``torch.export.experimental._export_forward_backward(ep, 0)`` with attention decomposed
    by ``_attention_in_math_ops``."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    if any(n.target is sdpa for n in ep.graph.nodes):
        # first attention alone, so that autograd below sees only math ops
        ep = ep.run_decompositions({sdpa: _attention_in_math_ops})
    ep = _decompose_exported_program(ep, cia_to_decomp={}, python_decomp_table=core_aten_decompositions(),
                                     joint_loss_index=0, decompose_custom_triton_ops=False)
    gm, sig = _copy_graph_module_and_signature(ep)
    _remove_detach_pass(gm, sig)
    return ep._update(gm, sig)
