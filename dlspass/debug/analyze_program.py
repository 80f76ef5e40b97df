"""``dlspass analyze`` on an exported joint program (``.pt2`` from ``dlspass export``).

What runs: nothing before the checks ``inspect`` and ``verify`` make (``load_program``), then
nothing but tensor arithmetic: `check_runnable` refuses every operator that does more than
compute tensors (higher-order operators: loops that may never end, ``print``; operators outside
``aten``/``prims``/``dlspass``, which could be anything) and, from a run on fake tensors that
allocates nothing, any value larger than `MAX_VALUE_FACTOR` times the program's inputs
(example inputs, parameters, buffers and constants; at least `MIN_VALUE_ELEMENTS`) or values
adding up to more than `MAX_TOTAL_FACTOR` times them (at least `MIN_TOTAL_ELEMENTS`). Only then

the joint graph (forward, loss and backward) runs once in float32 under an FX ``Interpreter`` on
the example inputs the program was exported with; every floating-point value it makes becomes a
`precision_risk.Sample`: an *activation* upstream of the loss, an *activation gradient* downstream
of the backward seed, a *parameter gradient* for each gradient output (named by its parameter).
Exported joint graphs carry no module path, so a value is named by its node and, where the node
reads a parameter, by that parameter's module (``addmm_1 (net.fc1)``). The verdicts are
`precision_risk.judge`'s, as for a factory.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch._export.serde.serialize import _SYM_OPS
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from dlspass.capture.joint_step import joint_graph
from dlspass.capture.pt2_io import load_program
from dlspass.debug.precision_risk import AnalyzeError, Sample, sample
from dlspass.files.bounded_text import printable
from dlspass.graph import roles
from dlspass.graph.marks import MARK_OP
from dlspass.passes.mark_seed_pass import joint_seeds


def calibrate_program(path: Path) -> list[Sample]:
    """The samples of one float32 run of the joint program at ``path`` on its example inputs."""
    source = str(path)
    ep, meta = load_program(path)
    if meta is not None and meta.get("kind") == "step":
        raise AnalyzeError(f"{source}: a dlspass training step already; analyze the joint program "
                           "`dlspass export` wrote (or the factory)")
    jg = joint_graph(ep, source)
    example = ep.example_inputs
    if example is None:
        raise AnalyzeError(f"{source}: the program holds no example inputs to calibrate on")
    user = [t for t in pytree.tree_leaves(example) if isinstance(t, Tensor)]
    if len(user) != len(jg.inputs):
        raise AnalyzeError(f"{source}: {len(user)} example input tensors for {len(jg.inputs)} "
                           "graph inputs")
    state = {**ep.state_dict, **ep.constants}
    targets = _targets(jg)
    values = [next(iter_user) if k == "input" else state[t]
              for iter_user in [iter(user)] for k, t in zip(jg.kinds, targets, strict=True)]
    check_runnable(jg.gm, values, source)
    graph = jg.gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    param_of = {ph: t for ph, k, t in zip(placeholders, jg.kinds, targets, strict=True) if k == "param"}
    (out,) = graph.find_nodes(op="output")
    outputs = list(out.args[0])
    loss = next(n for n, (k, _) in zip(outputs, jg.out_kinds, strict=True) if k == "loss")
    forward = roles.ancestors([loss])
    seeds = joint_seeds(graph, loss.name)
    backward = roles.descendants(seeds)
    grads = {n: t for n, (k, t) in zip(outputs, jg.out_kinds, strict=True) if k == "grad"}

    seen: dict[fx.Node, Tensor] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if n.op == "call_function" and isinstance(result, Tensor) and result.is_floating_point():
                seen[n] = result.detach()
            return result

    with torch.no_grad():
        _Recorder(jg.gm).run(*values)
    samples = []
    for n, t in seen.items():
        if n in grads or n in seeds or n.target is MARK_OP:  # the seed is 1, not a gradient
            continue
        kind = "activation" if n in forward else "activation_grad" if n in backward else None
        if kind is not None:
            samples.append(sample(_name(n, param_of), kind, [t]))
    for n, target in grads.items():
        if isinstance(n, fx.Node) and n in seen:
            samples.append(sample(target, "param_grad", [seen[n]]))
    if not any(s.kind == "param_grad" for s in samples):
        raise AnalyzeError(f"{source}: the program computes no parameter gradient: nothing to analyze")
    return samples


MIN_VALUE_ELEMENTS = 2**22
"""Elements any one value may have whatever the inputs (16 MiB in float32)."""
MAX_VALUE_FACTOR = 64
"""How many times the elements of all inputs together one value may have."""
MIN_TOTAL_ELEMENTS = 2**26
"""Elements all values together may have whatever the inputs (256 MiB in float32; the run
keeps every floating-point value it makes)."""
MAX_TOTAL_FACTOR = 1024
"""How many times the elements of all inputs together all values may have."""
_NAMESPACES = frozenset({"aten", "prims", "dlspass"})
_EFFECTS = frozenset({"aten::_print"})


def _refusal(target: Any) -> str | None:
    if isinstance(target, torch._ops.HigherOrderOperator):
        return (f"higher-order operator {target.name()!r} (control flow that may loop without end, "
                "output, or code of its own)")
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace not in _NAMESPACES or target._schema.name in _EFFECTS:
            return f"operator {target._schema.name!r} (not plain tensor arithmetic)"
        return None
    if target is operator.getitem or target in _SYM_OPS:
        return None
    return f"call target {printable(str(target))[:80]!r}"


def check_runnable(gm: fx.GraphModule, values: list[Any], source: str) -> None:
    """Refuse (``AnalyzeError``) a graph ``analyze`` must not run on ``values``: an operator that
    does more than compute tensors, or a value (or all values together) above the bounds derived
    from the size of ``values`` (module doc). Shapes come from a run on fake tensors, which
    allocates nothing: the shapes the file records are not trusted."""
    for n in gm.graph.nodes:
        if n.op in ("call_module", "call_method"):
            raise AnalyzeError(f"{source}: analyze does not run a graph with {n.op} nodes")
        if n.op == "call_function":
            why = _refusal(n.target)
            if why is not None:
                raise AnalyzeError(f"{source}: analyze runs tensor arithmetic only; node "
                                   f"{printable(n.name)[:80]!r} calls {why}")
    inputs = sum(t.numel() for t in values if isinstance(t, Tensor))
    per_value = max(MIN_VALUE_ELEMENTS, MAX_VALUE_FACTOR * inputs)
    budget = max(MIN_TOTAL_ELEMENTS, MAX_TOTAL_FACTOR * inputs)
    total = 0
    refused: list[str] = []

    class _Sizer(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            nonlocal total
            result = super().run_node(n)
            if n.op == "placeholder":
                return result
            for t in pytree.tree_leaves(result):
                if isinstance(t, Tensor):
                    size = t.numel()
                    if size > per_value:
                        refused.append(
                            f"{source}: node {printable(n.name)[:80]!r} would allocate "
                            f"{size:,} elements, more than analyze allows for inputs of "
                            f"{inputs:,} ({per_value:,})")
                        raise AnalyzeError(refused[-1])
                    total += size
            if total > budget:
                refused.append(f"{source}: the values of the program would take more than "
                                   f"{budget:,} elements, more than analyze allows for inputs of "
                                   f"{inputs:,}")
                raise AnalyzeError(refused[-1])
            return result

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(v) if isinstance(v, Tensor) else v for v in values]
    try:
        with mode, torch.no_grad():
            _Sizer(gm).run(*fakes)
    except Exception as e:
        if refused:  # the Interpreter appends the node's text to what passes through it
            raise AnalyzeError(refused[0]) from None  # data-dependent shapes, a node fake tensors cannot run
        raise AnalyzeError(f"{source}: analyze cannot bound what the program allocates "
                           f"({type(e).__name__}); not run") from None


def _targets(jg: Any) -> list[str | None]:
    params, buffers, consts = iter(jg.params), iter(jg.buffers), iter(jg.consts)
    return [None if k == "input" else next({"param": params, "buffer": buffers, "const": consts}[k])
            for k in jg.kinds]


def _name(n: fx.Node, param_of: dict[fx.Node, str]) -> str:
    """The node's name and the modules of the parameters it reads (through views)."""
    mods = []
    for a in n.all_input_nodes:
        while a not in param_of and a.op == "call_function" and len(a.all_input_nodes) == 1 \
                and a.target in _VIEWS:
            a = a.all_input_nodes[0]
        if a in param_of:
            mods.append(param_of[a].rpartition(".")[0] or param_of[a])
    return f"{n.name} ({', '.join(dict.fromkeys(mods))})" if mods else n.name


_aten = torch.ops.aten
_VIEWS = {_aten.t.default, _aten.permute.default, _aten.view.default, _aten.alias.default,
          _aten.transpose.int, _aten.expand.default, _aten.reshape.default}
