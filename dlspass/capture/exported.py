"""``.pt2`` files for the CLI: export a loss model, load safely, build and re-package a DLS step.

``export_factory("pkg.mod:make")`` exports ``make()``'s ``(model, example_inputs)`` as a joint
forward-backward program (``torch.export.experimental._export_forward_backward``).
``transform_program(joint, config, optimizer)`` turns a joint program into a whole training step:

1. a copy of the joint graph module gets a ``dlspass::mark`` on its backward seed
   (``full_like(loss, 1)``);
2. ``make_fx`` traces ``joint(params, buffers, inputs)`` followed by the functional optimizer
   update, marking loss and gradients, which lays the graph out as ``dlspass.graph.roles`` describes;
3. ``dlspass.passes.apply_dls`` rewrites it;
4. the graph is re-packaged as an ``ExportedProgram``: parameters are PARAMETERs, optimizer
   state, scaler state and hyperparameters are BUFFERs, the model's inputs are USER_INPUTs;
   outputs are PARAMETER/BUFFER mutations followed by the LOSS_OUTPUT, so
   ``torch.export.load(f).module()(*inputs)`` under ``torch.no_grad()`` runs one step in place.

What ``torch.export.save`` does not keep (the output node's metadata) travels in the archive's
``dlspass.json`` extra file: config, precision mode, output roles and buffer names, so
``inspect`` and ``verify`` work from the file alone. Both a joint and a step record, as
``"tied"``, the parameter names merged into another one (``{dropped: kept}``; see
``merge_tied_parameters``): the program itself lists only the kept name, so without it a user
could not tell that ``lm_head.weight`` is trained as ``wte.weight``. A file written before
dlspass recorded it has no ``"tied"`` key (unknown, not "none").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import io
import json
import logging
import math
import os
import sys
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from dlspass.capture.optim import SUPPORTED_OPTIMIZERS
from dlspass.capture.program import make_program
from dlspass.config import DLSConfig
from dlspass.errors import DLSInputError
from dlspass.files.atomic_write import write_atomic  # also imported from here by cli and onnx_io
from dlspass.files.bounded_text import excerpt
from dlspass.files.file_meta import check_pt2_meta
from dlspass.files.pt2_archive import check_pt2_archive, save_pt2
from dlspass.graph import roles
from dlspass.graph.step_io import StepIO, mark_grads, safe_name, tag_step_io
from dlspass.passes.base import PassContractError
from dlspass.passes.clone_shared_outputs_pass import CloneSharedOutputsPass
from dlspass.passes.drop_none_getitems_pass import DropNoneGetitemsPass
from dlspass.passes.drop_unchanged_outputs_pass import DropUnchangedOutputsPass
from dlspass.passes.lift_constants_pass import LiftConstantsPass
from dlspass.passes.mark_seed_pass import MarkSeedPass, joint_seeds
from dlspass.passes.merge_placeholders_pass import MergePlaceholdersPass

META_FILE = "dlspass.json"
FORMAT_VERSION = 1
OPTIMIZERS = tuple(name.lower() for name in SUPPORTED_OPTIMIZERS)  # the CLI's spelling


class InputError(DLSInputError, ValueError):
    """The input file, factory or option is unusable; the message is one line naming it."""


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer ``transform`` appends to the joint graph (torch.optim semantics)."""

    kind: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        # The Python API gets the CLI's guarantee too: torch.optim accepts inf and nan, and the
        # first step would write them into every weight.
        for name in ("lr", "momentum", "weight_decay", "eps", "betas"):
            values = self.betas if name == "betas" else (getattr(self, name),)
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                       and math.isfinite(v) for v in values):
                raise InputError(f"--{name.replace('_', '-')}: expected finite numbers, "
                                 f"got {excerpt(getattr(self, name))}")
        if not self.eps >= 0:
            raise InputError(f"--eps: expected >= 0, got {self.eps!r}")
        if self.kind not in OPTIMIZERS:
            raise InputError(f"--optimizer: unknown optimizer {self.kind!r}; choose one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise InputError(f"--lr: expected a positive learning rate, got {self.lr!r}")
        if self.kind == "sgd" and self.momentum < 0:
            raise InputError(f"--momentum: expected >= 0, got {self.momentum!r}")
        if self.weight_decay < 0:
            raise InputError(f"--weight-decay: expected >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise InputError(f"--betas: expected two numbers in [0, 1), got {self.betas!r}")

    def make(self, params: list[Tensor]) -> torch.optim.Optimizer:
        """The torch optimizer this spec describes, over ``params``."""
        if self.kind == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay)
        cls = torch.optim.Adam if self.kind == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                   weight_decay=self.weight_decay)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


# ---- quiet, safe file handling --------------------------------------------------------------

@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Silence torch's loggers and warnings (``torch.export.load`` logs a traceback before raising)."""
    names = ["torch", "torch.export", "torch._export", "torch._export.serde.serialize",
             "torch.export._trace", "torch._dynamo", "torch.onnx", "onnxscript", "onnx_ir"]
    saved = {n: logging.getLogger(n).level for n in names}
    ctx = warnings.catch_warnings()
    try:
        ctx.__enter__()
        warnings.simplefilter("ignore")
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL + 1)
        yield
    finally:
        ctx.__exit__(None, None, None)
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


def check_input_file(path: str | Path, suffixes: tuple[str, ...] = (".pt2", ".onnx")) -> Path:
    """``path`` as a Path, or ``InputError`` when it is missing, empty or has another suffix."""
    p = Path(path)
    if p.suffix not in suffixes:
        raise InputError(f"{p}: unsupported file type {p.suffix or '(none)'!r}; expected {' or '.join(suffixes)}")
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if not p.is_file():
        raise InputError(f"{p}: not a regular file")
    if p.stat().st_size == 0:
        raise InputError(f"{p}: the file is empty")
    return p


def check_output_path(path: str | Path, suffixes: tuple[str, ...]) -> Path:
    """``path`` as a Path, or ``InputError`` when its suffix is wrong or its folder unwritable."""
    p = Path(path)
    if p.suffix not in suffixes:
        raise InputError(f"{p}: output must end in {' or '.join(suffixes)}, not {p.suffix or '(none)'!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{p}: output folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"{p}: output path is not writable")
    if p.is_dir():
        raise InputError(f"{p}: output path is a folder")
    return p


def load_program(path: str | Path) -> tuple[torch.export.ExportedProgram, dict[str, Any] | None]:
    """Load a ``.pt2``; returns the program and its ``dlspass.json`` (None when absent)."""
    p = check_input_file(path, (".pt2",))
    if not zipfile.is_zipfile(p):
        raise InputError(f"{p}: not a .pt2 archive (not a zip file; truncated or corrupt?)")
    check_pt2_archive(p)  # refuses what torch would unpickle, evaluate or inflate without bound
    import dlspass.formats  # noqa: F401 - registers dlspass::round_to_format for deserialisation

    extra = {META_FILE: ""}
    try:
        with quiet_torch():
            ep = torch.export.load(str(p), extra_files=extra)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "warnings above" in first:  # torch's pointer to the log lines silenced here
            first = "torch could not deserialize the program (not a torch.export archive?)"
        raise InputError(f"{p}: cannot load the .pt2 archive ({first[:200]})") from None
    raw = extra.get(META_FILE) or ""
    meta = None
    if raw:
        try:
            meta = json.loads(raw)
        except json.JSONDecodeError:
            raise InputError(f"{p}: its {META_FILE} is not valid JSON") from None
    check_pt2_meta(meta, str(p), len(ep.graph_signature.output_specs),  # shape of dlspass.json
                   check_config=roles.config_from_record)
    return ep, meta


def save_program(ep: torch.export.ExportedProgram, path: Path, meta: dict[str, Any] | None) -> None:
    """Save ``ep`` (and ``meta`` as ``dlspass.json``) atomically to ``path``."""
    extra = {META_FILE: json.dumps(meta, sort_keys=True)} if meta is not None else None
    write_atomic(path, lambda tmp: save_pt2(ep, tmp, extra))  # stable inner folder name


# ---- export -------------------------------------------------------------------------------

def _resolve_factory(spec: str) -> Any:
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise InputError(f"{spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:make_model")
    mod_name, attr = spec.split(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules beside the user resolve
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise InputError(f"{spec!r}: cannot import module {mod_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InputError(f"{spec!r}: module {mod_name!r} has no callable {attr!r}")
    return fn


class ExportError(InputError):
    """torch could not export the user's model (or its backward); the message names torch's error."""


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
    backward) is the model's problem, not dlspass's: it raises ``ExportError`` (CLI exit 2)
    with torch's exception type and first line.
    """
    factory = _resolve_factory(spec)
    try:
        made = factory()
    except Exception as e:
        raise InputError(f"{spec!r}: the factory raised {_torch_error(e)}") from e
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise InputError(f"{spec!r}: the factory must return (model, example_inputs), got {type(made).__name__}")
    model, inputs = made
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    try:
        # torch prints the partial graph of a failed export to stderr: the error names it
        with quiet_torch(), contextlib.redirect_stderr(io.StringIO()):
            ep = torch.export.export(model, inputs)
    except Exception as e:
        raise ExportError(f"{spec}: torch.export.export failed on the model ({_torch_error(e)})") from e
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
        raise InputError(f"{source}: not a training model: its first output is not a scalar "
                         "floating-point loss (inference-only models cannot be trained)")
    if not ep.graph_signature.parameters:
        raise InputError(f"{source}: the model has no parameters to train")
    ep, tied = merge_tied_parameters(ep)
    try:
        with quiet_torch():
            return _export_forward_backward(ep), tied
    except Exception as e:
        raise ExportError(f"{source}: torch could not trace the model's backward "
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
    from torch.export.graph_signature import InputKind

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
    from torch._decomp import core_aten_decompositions
    from torch.export.experimental import _copy_graph_module_and_signature, _remove_detach_pass
    from torch.export.exported_program import _decompose_exported_program

    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    if any(n.target is sdpa for n in ep.graph.nodes):
        # first attention alone, so that autograd below sees only math ops
        ep = ep.run_decompositions({sdpa: _attention_in_math_ops})
    ep = _decompose_exported_program(ep, cia_to_decomp={}, python_decomp_table=core_aten_decompositions(),
                                     joint_loss_index=0, decompose_custom_triton_ops=False)
    gm, sig = _copy_graph_module_and_signature(ep)
    _remove_detach_pass(gm, sig)
    return ep._update(gm, sig)


# ---- joint program -> training step graph ------------------------------------------------

@dataclass
class _Joint:
    gm: fx.GraphModule
    params: list[str]          # PARAMETER targets, joint placeholder order
    buffers: list[str]         # BUFFER targets
    inputs: list[str]          # USER_INPUT placeholder names
    consts: list[str]          # CONSTANT_TENSOR targets
    kinds: list[str]           # per joint placeholder: "param" | "buffer" | "input" | "const"
    out_kinds: list[tuple[str, str | None]]  # per joint output: (kind, target)


def _joint(ep: torch.export.ExportedProgram, source: str) -> _Joint:
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    bw = getattr(sig, "backward_signature", None)
    if bw is None or not bw.gradients_to_parameters:
        raise InputError(f"{source}: not a training graph: no loss output and no parameter "
                         "gradients (export it with `dlspass export MODULE:FACTORY`)")
    gm = copy.deepcopy(ep.graph_module)
    kinds, params, buffers, inputs, consts = [], [], [], [], []
    for spec in sig.input_specs:
        if spec.kind == InputKind.PARAMETER:
            kinds.append("param")
            params.append(spec.target)
        elif spec.kind == InputKind.BUFFER:
            kinds.append("buffer")
            buffers.append(spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            kinds.append("input")
            inputs.append(spec.arg.name)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            # a tensor the model creates in forward (lifted by export): traced in as a constant
            kinds.append("const")
            consts.append(spec.target)
        else:
            raise InputError(f"{source}: unsupported graph input kind {spec.kind.name} "
                             f"({spec.arg.name}); only parameters, buffers and user inputs are supported")
    out_kinds: list[tuple[str, str | None]] = []
    for spec in sig.output_specs:
        kind = {OutputKind.LOSS_OUTPUT: "loss", OutputKind.GRADIENT_TO_PARAMETER: "grad",
                OutputKind.BUFFER_MUTATION: "buffer", OutputKind.USER_OUTPUT: "other",
                OutputKind.GRADIENT_TO_USER_INPUT: "other"}.get(spec.kind)
        if kind is None:
            raise InputError(f"{source}: unsupported graph output kind {spec.kind.name}")
        out_kinds.append((kind, spec.target))
    # the seed: full_like(loss, 1) in the joint graph
    loss_name = bw.loss_output
    seeds = joint_seeds(gm.graph, loss_name)
    if len(seeds) != 1:
        raise InputError(f"{source}: cannot find the backward seed full_like({loss_name}, 1) "
                         f"(found {len(seeds)})")
    MarkSeedPass(loss_name)(gm)
    return _Joint(gm, params, buffers, inputs, consts, kinds, out_kinds)


@dataclass
class StepInfo:
    """What ``package_step`` needs besides the graph: names, initial values, output roles."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]       # model buffers, by joint target
    opt_state: dict[str, Tensor]     # by functional-optimizer key
    scaler: dict[str, Tensor]
    hyper: dict[str, Tensor]
    inputs: list[str]
    in_spec: Any
    forward_arg_names: list[str] | None


_NAME_PREFIX = {roles.PARAM: "p_", roles.BUFFER: "b_", roles.OPT_STATE: "opt_",
                roles.SCALER_STATE: "scaler_", roles.HYPER: "hyper_"}


def _placeholder_name(role: str, target: str) -> str:
    """``p_<param>``, ``b_<buffer>``, ...; user inputs keep the name export gave them."""
    return target if role == roles.INPUT else _NAME_PREFIX[role] + safe_name(target)


def joint_to_step_graph(ep: torch.export.ExportedProgram, optimizer: OptimizerSpec,
                        config: DLSConfig | None, source: str) -> tuple[fx.GraphModule, StepInfo]:
    """The role-tagged (not yet rewritten) training step of the joint program ``ep``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dlspass.capture.optim import functionalize
    from dlspass.graph.marks import mark, resolve_marks
    from dlspass.scale_policy import STATE_FIELDS, init_state

    j = _joint(ep, source)
    sd = ep.state_dict
    consts = ep.constants
    params = {k: torch.nn.Parameter(sd[k].detach().clone()) for k in j.params}
    buffers = {k: (sd[k] if k in sd else consts[k]).detach().clone() for k in j.buffers}
    const_values = [consts[k].detach().clone() for k in j.consts]
    opt = optimizer.make(list(params.values()))
    fopt = functionalize(opt, {id(p): k for k, p in params.items()})
    opt_state = {k: v.detach().clone() for k, v in fopt.state_tensors().items()}
    hyper = {k: v.detach().clone() for k, v in fopt.hyper_tensors().items()}
    scaler = dict(zip(STATE_FIELDS, init_state(config or DLSConfig(loss_scale=None)), strict=True))
    example = list(ep.example_inputs[0]) if ep.example_inputs else None
    if example is None or len(example) != len(j.inputs):
        raise InputError(f"{source}: the program carries no example inputs to trace with")
    grad_names = [t for k, t in j.out_kinds if k == "grad"]
    io = StepIO(params=list(params), buffers=list(buffers), opt_state=list(opt_state),
                hyper=list(hyper), batch=j.inputs)

    def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
        p, b, o, s, h, x = io.split(flat)
        sources = {"param": iter(p.values()), "buffer": iter(b.values()), "input": iter(x),
                   "const": iter(const_values)}
        args = [next(sources[k]) for k in j.kinds]
        outs = j.gm(*args)
        new_b, loss, grads = dict(b), None, {}
        for (kind, target), v in zip(j.out_kinds, outs, strict=True):
            if kind == "loss":
                loss = mark(v, roles.LOSS)
            elif kind == "grad":
                grads[target] = v
            elif kind == "buffer":
                new_b[target] = v
        new_p, new_o = fopt.update(p, mark_grads(grads), o, h)
        return (*new_p.values(), *new_b.values(), *new_o.values(), *s, loss)

    flat = [*(v.detach() for v in params.values()), *buffers.values(), *opt_state.values(),
            *scaler.values(), *hyper.values(), *example]
    with quiet_torch():
        # _allow_non_fake_inputs: lifted constants enter as real tensors (get_attr constants)
        gm = make_fx(flat_step, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)
    for node in gm.graph.nodes:
        # make_fx may share one "custom" dict between nodes; roles must stay per node
        if "custom" in node.meta:
            node.meta["custom"] = dict(node.meta["custom"])
    resolve_marks(gm)
    DropNoneGetitemsPass()(gm)
    missing = set(params) - set(grad_names)
    if missing == set(params):
        raise InputError(f"{source}: no parameter receives a gradient")
    tag_step_io(gm, io, name=_placeholder_name)
    sig = ep.module_call_graph[0].signature if ep.module_call_graph else None
    info = StepInfo(params, buffers, opt_state, scaler, hyper, j.inputs,
                    sig.in_spec if sig is not None else None,
                    getattr(sig, "forward_arg_names", None) if sig is not None else None)
    return gm, info


# ---- step graph -> ExportedProgram -----------------------------------------------------------

def _buffer_name(role: str, target: str) -> str:
    prefix = {roles.OPT_STATE: "dlspass_opt", roles.SCALER_STATE: "dlspass_scaler",
              roles.HYPER: "dlspass_hyper"}[role]
    return f"{prefix}_{safe_name(target)}"


def package_step(gm: fx.GraphModule, info: StepInfo) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """Re-package the rewritten step graph ``gm`` as an ``ExportedProgram`` (see module doc).

    Outputs that return their placeholder unchanged are dropped (nothing to mutate) and a
    value returned at two positions gets a clone, because the signature names outputs by node.
    Returns the program and the ``dlspass.json`` fields that describe its roles.
    """
    from torch.export.graph_signature import (
        InputKind,
        InputSpec,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )
    from torch.utils._pytree import tree_flatten

    gm = copy.deepcopy(gm)
    graph = gm.graph
    lift = LiftConstantsPass()
    try:
        lift(gm)
    except PassContractError as e:  # a constant the user's program made that is no tensor
        raise InputError(str(e)) from None
    consts = lift.constants
    placeholders = graph.find_nodes(op="placeholder")
    values = {roles.PARAM: info.params, roles.BUFFER: info.buffers, roles.OPT_STATE: info.opt_state,
              roles.SCALER_STATE: info.scaler, roles.HYPER: info.hyper}
    state_dict: dict[str, Tensor] = {}
    input_specs, buffer_names = [], {}
    for node in placeholders:
        role, target = roles.role_of(node), roles.target_of(node)
        if node.name in consts:
            input_specs.append(InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), node.name))
        elif role == roles.PARAM:
            state_dict[target] = torch.nn.Parameter(values[role][target].detach().clone())
            input_specs.append(InputSpec(InputKind.PARAMETER, TensorArgument(node.name), target))
        elif role in values:
            name = target if role == roles.BUFFER else _buffer_name(role, target)
            buffer_names[f"{role}:{target}"] = name
            state_dict[name] = values[role][target].detach().clone()
            input_specs.append(InputSpec(InputKind.BUFFER, TensorArgument(node.name), name, persistent=True))
        elif role == roles.INPUT:
            input_specs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(node.name), None))
        else:
            raise InputError(f"placeholder {node.name} has no role")
    DropUnchangedOutputsPass()(gm)  # nothing to mutate
    CloneSharedOutputsPass()(gm)  # the signature names outputs by node
    kept_vals, kept_roles = roles.output_values(graph), roles.output_roles(graph)
    output_specs = []
    for v, (role, target) in zip(kept_vals, kept_roles, strict=True):
        src = roles.SOURCE_OF_UPDATE.get(role)
        if role == roles.LOSS:
            spec_kind, spec_target = OutputKind.LOSS_OUTPUT, None
        elif src == roles.PARAM:
            spec_kind, spec_target = OutputKind.PARAMETER_MUTATION, target
        else:
            spec_kind = OutputKind.BUFFER_MUTATION
            spec_target = target if src == roles.BUFFER else _buffer_name(src, target)
        output_specs.append(OutputSpec(spec_kind, TensorArgument(v.name), spec_target))
    gm.recompile()
    ep = make_program(gm, input_specs, output_specs, state_dict=state_dict, constants=consts,
                      in_spec=info.in_spec, out_spec=tree_flatten(kept_vals[-1].meta["val"])[1],
                      forward_arg_names=info.forward_arg_names)
    # torch.export.save keeps node.meta["custom"] of computed nodes only
    meta = {"output_roles": [list(r) for r in kept_roles], "buffer_names": buffer_names,
            "placeholder_roles": {n.name: [roles.role_of(n), roles.target_of(n)]
                                  for n in placeholders if n.name not in consts}}
    return ep, meta


# ---- the whole transform -----------------------------------------------------------------------

ROUNDINGS = ("aten", "op")


def transform_program(ep: torch.export.ExportedProgram, meta: dict[str, Any] | None,
                      config: DLSConfig | None, optimizer: OptimizerSpec, *,
                      precision_mode: str = "emulate", source: str = "input",
                      rounding: str = "aten") -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """The DLS training step of the joint (or plain loss) program ``ep`` and its metadata.

    ``rounding="aten"`` writes each emulated rounding as core aten bit operations
    (``dlspass.formats.round_bits``), so the program loads and runs wherever torch does;
    ``"op"`` keeps the ``dlspass::round_to_format`` custom op (loading then needs
    ``import dlspass.formats``). A program that is already a dlspass step is returned unchanged
    when ``config``, optimizer, precision mode and rounding are the ones it was built with, and
    refused otherwise.
    """
    from dlspass.passes import apply_dls

    if rounding not in ROUNDINGS:
        raise InputError(f"--rounding: expected one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    wanted = {"config": None if config is None else config.to_dict(),
              "optimizer": optimizer.to_dict(), "precision_mode": precision_mode,
              "rounding": rounding}
    if meta is not None and meta.get("kind") == "step":
        # steps written before --rounding existed kept the custom op
        have = {k: meta.get(k, "op" if k == "rounding" else None) for k in wanted}
        if json.dumps(have, sort_keys=True) == json.dumps(wanted, sort_keys=True):
            return ep, meta
        raise InputError(f"{source}: already a dlspass training step built with "
                         f"{json.dumps(have, sort_keys=True)}; transform the original joint "
                         "program to change the settings")
    if getattr(ep.graph_signature, "backward_signature", None) is None:
        ep, tied = joint_with_ties(ep, source)
    else:
        # the joint's merge happened at export; None: a joint written before it was recorded
        tied = (meta or {}).get("tied")
    gm, info = joint_to_step_graph(ep, optimizer, config, source)
    gm = apply_dls(gm, config, precision_mode=precision_mode)
    if rounding == "aten":
        from dlspass.formats import decompose_rounding

        decompose_rounding(gm, form="bits")
    out, roles_meta = package_step(gm, info)
    full = {"format": "dlspass-step", "version": FORMAT_VERSION, "kind": "step", **wanted,
            **roles_meta, "inputs": info.inputs,
            "applied_passes": gm.graph.output_node().meta.get("custom", {}).get(roles.APPLIED_KEY, [])}
    if tied is not None:  # unknown stays absent rather than claiming nothing was tied
        full["tied"] = dict(tied)
    return out, full


def step_graph(ep: torch.export.ExportedProgram, meta: dict[str, Any] | None) -> fx.GraphModule:
    """The program's graph module with the dlspass output metadata restored (for verify/inspect)."""
    gm = ep.graph_module
    if meta is None or meta.get("kind") != "step":
        return gm
    ph_roles = meta.get("placeholder_roles", {})
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in ph_roles and roles.role_of(node) is None:
            roles.set_role(node, *ph_roles[node.name])
    custom = gm.graph.output_node().meta.setdefault("custom", {})
    custom[roles.OUTPUTS_KEY] = [list(r) for r in meta["output_roles"]]
    custom[roles.CONFIG_KEY] = json.dumps(meta["config"], sort_keys=True)
    custom[roles.MODE_KEY] = meta.get("precision_mode")
    custom[roles.APPLIED_KEY] = list(meta.get("applied_passes", []))
    return gm
