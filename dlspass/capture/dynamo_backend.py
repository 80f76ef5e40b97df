"""The ``dlspass`` torch.compile backend: 16-bit lowering of forward and backward graphs.

``torch.compile(model, backend="dlspass", options={"fp16_type": "cbfloat16"})`` (registered
through the ``torch_dynamo_backends`` entry point) runs AOTAutograd without decompositions and,
in the forward and the backward graph, rounds the inputs and outputs of every matmul-like op
to the 16-bit format with ``dlspass::round_to_format`` (``dlspass.passes.LowerPrecisionPass``,
the same pass ``apply_dls`` runs); the rounding is
then decomposed into fusable int32 bit ops and the graph goes to inductor. Loss scaling stays
in the eager ``dlspass.GradScaler``.

``make_backend(scaler=...)`` returns a backend that also scales the backward seed
(``tangents_1``) by the scaler's loss scale and unscales and checks the gradients inside the
backward graph. The scale enters and the overflow flag leaves through an extra placeholder and
output that a boxed wrapper threads (no host sync): the flag lands in
``scaler.backend_found_finite`` (a 0-d bool tensor) for the scaler's ``step``/``update``. The
flags of every backward graph run since the scaler last consumed it (several graphs after a
graph break, several backward calls under gradient accumulation) combine with AND, so an
overflow in any of them skips the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from dlspass.config import FP16_TYPES, ConfigError, DLSConfig
from dlspass.graph import roles

# the most recent graphs the backends rewrote (for inspection and tests), newest last
recent_graphs: list[fx.GraphModule] = []
_KEEP = 8

OPTIONS = ("fp16_type", "mixed_precision", "backend_compiler")
aten = torch.ops.aten


def validate_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The backend options with defaults filled in; unknown keys and bad values raise ConfigError."""
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"dlspass backend: unknown option(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(OPTIONS)}")
    opts.setdefault("fp16_type", "float16")
    opts.setdefault("mixed_precision", True)
    opts.setdefault("backend_compiler", "inductor")
    if opts["fp16_type"] not in FP16_TYPES:
        raise ConfigError(f"dlspass backend: fp16_type: unknown format {opts['fp16_type']!r}; "
                          f"choose one of {', '.join(FP16_TYPES)}")
    if opts["backend_compiler"] not in ("inductor", "eager"):
        raise ConfigError("dlspass backend: backend_compiler: expected 'inductor' or 'eager', "
                          f"got {opts['backend_compiler']!r}")
    if not isinstance(opts["mixed_precision"], bool):
        raise ConfigError("dlspass backend: mixed_precision: expected a bool, "
                          f"got {opts['mixed_precision']!r}")
    return opts


# ---- precision lowering ----------------------------------------------------------------------

def _is_f32(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, Tensor) and val.dtype == torch.float32


def lower_precision(gm: fx.GraphModule, fp16_type: str) -> fx.GraphModule:
    """Round inputs and outputs of matmul-like ops in ``gm`` to ``fp16_type`` (LowerPrecisionPass).

    The values are emulated in float32 containers (dlspass.formats), so the graph keeps its
    dtypes and accumulation stays float32.
    """
    from dlspass.passes import LowerPrecisionPass

    return LowerPrecisionPass(fp16_type, "emulate")(gm).graph_module


def finish(gm: fx.GraphModule, example_inputs: list[Any], backend_compiler: str) -> Callable:
    """A boxed callable for ``gm``: inductor after bit-level rounding, or the graph as is."""
    from functorch.compile import make_boxed_func

    if backend_compiler == "eager":
        return make_boxed_func(gm.forward)
    from torch._inductor.compile_fx import compile_fx

    from dlspass.formats import decompose_rounding

    decompose_rounding(gm)
    compiled = compile_fx(gm, example_inputs)

    # compile_fx hands back AOTAutograd's forward, which takes unpacked arguments
    def run(args: list[Any]) -> Any:
        return compiled(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def decompose_for_inductor(gm: fx.GraphModule) -> int:
    """Bring the ops dlspass added to an AOT graph into inductor's op set, in place.

    The rounding op becomes int32 bit ops and every node whose op inductor's decomposition table
    decomposes (``isfinite``, ``clamp``, ...) is re-traced alone with that table and spliced in;
    ``compile_fx_inner`` lowers only decomposed graphs. The rest of the graph, traced with the
    same table by AOTAutograd, is left as it is. Returns the number of nodes replaced.
    """
    import torch.utils._pytree as pytree
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from dlspass.formats import decompose_rounding

    table = select_decomp_table()
    count = decompose_rounding(gm, decompositions=table)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in table:
            continue
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        inputs = [a for a in leaves if isinstance(a, fx.Node)]
        vals = [a.meta.get("val") for a in inputs]
        mode = detect_fake_mode(vals)
        if mode is None or not isinstance(node.meta.get("val"), Tensor):
            continue  # no fake values to trace with, or a multi-output op: inductor falls back

        def call(*xs: Tensor, leaves: list[Any] = leaves, spec: Any = spec, target: Any = node.target) -> Tensor:
            it = iter(xs)
            args, kwargs = pytree.tree_unflatten(
                [next(it) if isinstance(a, fx.Node) else a for a in leaves], spec)
            return target(*args, **kwargs)

        with mode:
            sub = make_fx(call, decomposition_table=table,
                          tracing_mode="symbolic" if mode.shape_env is not None else "fake")(*vals)
        if any(n.op == "get_attr" for n in sub.graph.nodes):
            continue  # a decomposition that makes constants: leave the op to inductor's fallback
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        with graph.inserting_before(node):
            out = graph.graph_copy(sub.graph, dict(zip(placeholders, inputs, strict=True)))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


# ---- backends ----------------------------------------------------------------------------------

def _remember(gm: fx.GraphModule) -> None:
    recent_graphs.append(gm)
    del recent_graphs[:-_KEEP]


# A rewrite of one AOT graph, in place: it returns the example inputs the rewritten graph takes
# and a wrapper for the compiled callable (the identity unless the graph's signature changed).
Rewrite = Callable[[fx.GraphModule, list[Any]], tuple[list[Any], Callable[[Callable], Callable]]]


def _lowering(opts: dict[str, Any]) -> Rewrite:
    def rewrite(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[list[Any], Callable]:
        if opts["mixed_precision"]:
            lower_precision(gm, opts["fp16_type"])
        _remember(gm)
        return example_inputs, lambda compiled: compiled

    return rewrite


def _aot_backend(gm: fx.GraphModule, example_inputs: list[Any], fw_rewrite: Rewrite,
                 bw_rewrite: Rewrite, backend_compiler: str) -> Callable:
    """AOTAutograd over dynamo's graph, each AOT graph rewritten, then compiled.

    For inductor this is inductor's own hand-off (``compile_fx``'s aot path): the joint graph
    is traced once with inductor's decompositions and partitioner, and the rewritten forward
    and backward graphs go to ``compile_fx_forward``/``compile_fx_backward`` (which call
    ``compile_fx_inner`` with the output-stride and static-input bookkeeping inductor needs).
    Handing an already-AOT'd graph to the top-level ``compile_fx`` instead re-traces it with
    other decompositions, and a recorded ``view`` of a value whose strides changed fails
    ("Cannot view a tensor ...", or a stride assertion in the generated code).
    """
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    kwargs: dict[str, Any] = {}
    if backend_compiler == "eager":
        def compile_graph(g: fx.GraphModule, ex: list[Any], is_backward: bool,
                          is_inference: bool) -> Callable:
            return make_boxed_func(g.forward)
    else:
        from torch._inductor import compile_fx as cfx
        from torch._inductor.decomposition import select_decomp_table

        extra = cfx.create_compiler_config_extra(gm)
        n_outputs, n_inputs = cfx.get_num_model_outputs(gm), len(example_inputs)

        def compile_graph(g: fx.GraphModule, ex: list[Any], is_backward: bool,
                          is_inference: bool) -> Callable:
            decompose_for_inductor(g)
            if is_backward:
                return cfx.compile_fx_backward(g, ex, compiler_config_extra=extra)
            return cfx.compile_fx_forward(g, ex, num_orig_model_outputs=n_outputs,
                                          num_example_inputs=n_inputs, compiler_config_extra=extra,
                                          is_inference=is_inference)

        kwargs = {"decompositions": select_decomp_table(), "partition_fn": cfx.partition_fn,
                  "keep_inference_input_mutations": True}

    def compiler(rewrite: Rewrite, is_backward: bool, is_inference: bool = False) -> Callable:
        def run(g: fx.GraphModule, ex: Any) -> Callable:
            ex, wrap = rewrite(g, list(ex))
            return wrap(compile_graph(g, ex, is_backward, is_inference))

        return run

    backend = aot_autograd(fw_compiler=compiler(fw_rewrite, False), bw_compiler=compiler(bw_rewrite, True),
                           inference_compiler=compiler(fw_rewrite, False, True), **kwargs)
    if backend_compiler == "eager":
        return backend(gm, example_inputs)
    return _inductor_context(example_inputs, lambda: backend(gm, example_inputs))


def _inductor_context(example_inputs: list[Any], build: Callable[[], Callable]) -> Callable:
    """``build()`` inside the context inductor's ``_compile_fx_main`` sets up around its aot
    call (inductor's joint-graph passes read the fake mode from ``V``)."""
    from torch._dynamo import compiled_autograd
    from torch._functorch import config as functorch_config
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import enable_python_dispatcher

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    with (enable_python_dispatcher(), V.set_fake_mode(fake_mode), compiled_autograd._disable(),
          functorch_config.patch(unlift_effect_tokens=True,
                                 selective_decompose=inductor_config.selective_decompose)):
        return build()


def dls_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                mode: str | None = None) -> Callable:
    """The ``backend="dlspass"`` entry point: lowered forward and backward graphs via AOTAutograd.

    ``options``: ``fp16_type`` (float16 | bfloat16 | cbfloat16, default float16),
    ``mixed_precision`` (False: no lowering), ``backend_compiler`` (inductor | eager).
    """
    if mode not in (None, "default"):
        raise ConfigError(f"dlspass backend: mode={mode!r} is not supported; use options=")
    opts = validate_options(options)
    rewrite = _lowering(opts)
    return _aot_backend(gm, example_inputs, rewrite, rewrite, opts["backend_compiler"])


def _scale_and_check_backward(gm: fx.GraphModule, config: DLSConfig) -> None:
    """Add a loss-scale input, scale the tangents by it, unscale and check the gradients.

    Every tangent is scaled, not only the loss's: the backward is linear in its tangents, so
    this is the eager scaler's ``scale(loss).backward()`` also for a model that returns more
    than the loss (its other outputs' tangents are zeros) and for the backward of a graph that
    ends at a graph break (its tangents are the next graph's unscaled input gradients). The
    gradients leave the graph unscaled, and one extra output, the finite flag, is appended.
    """
    from torch._guards import detect_fake_mode

    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tangents = [n for n in placeholders if n.name.startswith("tangents")
                and isinstance(n.meta.get("val"), Tensor) and n.meta["val"].is_floating_point()]
    if not tangents:
        raise ConfigError("dlspass backend: the backward graph has no floating-point tangent to "
                          "scale (the compiled model returns no differentiable output)")
    with graph.inserting_after(placeholders[-1]):
        # inductor takes the backward's inputs up to the first "tangents" name as saved
        # activations (static inputs); the scale changes every step, like a tangent
        scale = graph.placeholder("dls_loss_scale_tangents")
    mode = detect_fake_mode([t.meta["val"] for t in tangents])
    scale.meta["val"] = (mode.from_tensor(torch.empty((), dtype=torch.float32)) if mode is not None
                         else torch.empty((), dtype=torch.float32))
    roles.set_role(scale, roles.SCALER_STATE, "loss_scale")
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for seed in tangents:
        with graph.inserting_before(first):
            scaled = graph.call_function(aten.mul.Tensor, (seed, scale))
        scaled.meta["val"] = seed.meta.get("val")
        seed.replace_all_uses_with(scaled, delete_user_cb=lambda u, s=scaled: u is not s)
        roles.set_role(scaled, roles.SCALED_SEED, by_pass="make_backend")

    out = graph.output_node()
    vals = list(out.args[0])
    idx = [i for i, v in enumerate(vals) if isinstance(v, fx.Node) and _is_f32(v)]
    with graph.inserting_before(out):
        inv = graph.call_function(aten.reciprocal.default, (scale,))
        unscaled = [graph.call_function(aten.mul.Tensor, (vals[i], inv)) for i in idx]
        for u in unscaled:
            roles.set_role(u, roles.UNSCALE, by_pass="make_backend")
        # the same test the scaler applies (global norm for cerebras, all-finite otherwise)
        if config.overflow_check == "global_norm":
            sq = [graph.call_function(aten.sum.default, (graph.call_function(aten.mul.Tensor, (u, u)),))
                  for u in unscaled]
            total = sq[0]
            for s in sq[1:]:
                total = graph.call_function(aten.add.Tensor, (total, s))
            norm = graph.call_function(aten.sqrt.default, (total,))
            ok = graph.call_function(aten.lt.Scalar, (norm, float("inf")))
        else:
            flags = [graph.call_function(aten.all.default, (graph.call_function(aten.isfinite.default, (u,)),))
                     for u in unscaled]
            ok = flags[0]
            for f in flags[1:]:
                ok = graph.call_function(aten.logical_and.default, (ok, f))
    roles.set_role(ok, roles.ISFINITE, by_pass="make_backend")
    for i, u in zip(idx, unscaled, strict=False):
        vals[i] = u
    out.args = (tuple(vals) + (ok,),)
    graph.lint()
    gm.recompile()


def make_backend(scaler: Any | None = None, **options: Any) -> Callable:
    """A torch.compile backend: 16-bit lowering, plus in-graph seed scaling and overflow check.

    With ``scaler`` (a ``dlspass.GradScaler``), the backward graph multiplies the seed by
    ``scaler.state.loss_scale``, returns unscaled gradients and ANDs its finite flag into
    ``scaler.backend_found_finite``, which ``scaler.unscale_``/``step`` reads and resets once
    per step (so every backward graph of a model with graph breaks, and every backward call of
    an accumulated step, counts). The gradients autograd accumulates are already unscaled, so
    do not call ``scaler.scale(loss)``; call ``scaler.step(optimizer)`` and
    ``scaler.update()`` as usual. Options as for ``dls_backend``.

    Example:
        >>> backend = dlspass.make_backend(scaler=scaler, fp16_type="float16")
        >>> cmodel = torch.compile(model, backend=backend)
    """
    opts = validate_options(options)
    if scaler is None:
        return functools.partial(dls_backend, options=opts)
    config = getattr(scaler, "config", None)
    if not isinstance(config, DLSConfig) or not hasattr(scaler, "state"):
        raise ConfigError(f"make_backend: scaler must be a dlspass.GradScaler, got {type(scaler).__name__}")
    lowering = _lowering(opts)

    def bw_rewrite(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[list[Any], Callable]:
        _scale_and_check_backward(gm, config)
        example_inputs, _ = lowering(gm, example_inputs)

        def wrap(inner: Callable) -> Callable:
            def run(args: list[Any]) -> Any:
                res = inner([*args, scaler.state.loss_scale])
                # A graph break gives one backward graph per piece, and gradient accumulation
                # one backward call per micro-batch: the step is finite only if every one of
                # them was. The scaler's unscale_ (or step) consumes the flag and resets it,
                # once per step.
                seen = scaler.backend_found_finite
                scaler.backend_found_finite = res[-1] if seen is None else seen & res[-1]
                return res[:-1]

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return [*example_inputs, _fake_like(example_inputs, scaler.state.loss_scale)], wrap

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return _aot_backend(gm, example_inputs, lowering, bw_rewrite, opts["backend_compiler"])

    return backend


def _fake_like(example_inputs: list[Any], t: Tensor) -> Any:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    return mode.from_tensor(t) if mode is not None else t
