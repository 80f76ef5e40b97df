"""The hand-off from dynamo to AOTAutograd and inductor, for every graph dlspass compiles.

`aot_backend` is inductor's own aot path with a rewrite of each AOT graph before it is
compiled. `lowering_backend` is ``backend="dlspass"``'s and ``make_backend``'s
(``dlspass.capture.dynamo_backend`` checks the options and hands over the config): it makes the
16-bit lowering and, with a scaler, the backward's loss scaling here, so control runs down.
`step_backend` is ``dlspass.compile``'s backend: it runs the step pipeline on the AOT step
graph itself (``run_step_pipeline(gm, plan)``, the step's `StepPlan`), feeds the extra inputs
the graph passes added, and compiles the result, so the entry point only builds the plan and
hands ``functools.partial(step_backend, plan=...)`` to ``torch.compile``: control runs down.

Every inductor compile here carries the CPU facts in its cache key
(``dlspass.cache_facts``); a step whose plan has a cache key is AOTAutograd-cacheable as a
whole (`step_backend`: a second process skips the joint trace, the pipeline and inductor).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch import Tensor
from torch._dynamo import compiled_autograd
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch._inductor import compile_fx as cfx
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.output_code import OutputCode
from torch._inductor.virtualized import V
from torch._subclasses import FakeTensorMode
from torch.fx.experimental.proxy_tensor import enable_python_dispatcher

from dlspass.cache_facts import inductor_key_config
from dlspass.capture import step_pipeline
from dlspass.capture.dynamo_source import tag_aot_graph
from dlspass.capture.step_plan import StepPlan
from dlspass.config import DLSConfig
from dlspass.cudagraph_policy import cudagraph_decision, inductor_options, step_facts
from dlspass.errors import InternalRuntimeError
from dlspass.formats import INDUCTOR_CONFIG  # keeps the rounding casts
from dlspass.graph import roles
from dlspass.passes.decompose_for_inductor_pass import DecomposeForInductorPass
from dlspass.passes.lower_matmuls_to_float8_pass import LowerMatmulsToFloat8Pass
from dlspass.passes.lower_precision_pass import LowerPrecisionPass
from dlspass.passes.scale_backward_pass import ScaleBackwardPass

# A rewrite of one AOT graph, in place: it returns the example inputs the rewritten graph takes
# and a wrapper for the compiled callable (the identity unless the graph's signature changed).
Rewrite = Callable[[fx.GraphModule, list[Any]], tuple[list[Any], Callable[[Callable], Callable]]]


def aot_backend(gm: fx.GraphModule, example_inputs: list[Any], fw_rewrite: Rewrite,
                bw_rewrite: Rewrite, backend_compiler: str, *, mutations_in_graph: bool = True,
                inductor_config_extra: dict[str, Any] | None = None,
                joint_rewrite: Callable[[fx.GraphModule], object] | None = None,
                graph_config: Callable[[fx.GraphModule], dict[str, Any]] | None = None,
                cache_key: str | None = None) -> Callable:
    """AOTAutograd over dynamo's graph, each AOT graph rewritten, then compiled.

    ``mutations_in_graph``: an inference graph keeps its input mutations as ``copy_`` nodes
    (inductor's own setting); False returns them as outputs (the step graph's contract, which
    ``tag_aot_graph`` reads). ``inductor_config_extra``: settings inductor compiles the graphs with,
    besides ``dlspass.formats.INDUCTOR_CONFIG``. ``joint_rewrite``: a rewrite, in place, of the
    joint forward-backward graph of a training graph before it is partitioned (after inductor's
    joint-graph passes), so the partitioner chooses what to save among the rewritten values;
    the joint graph's outputs (the forward's and the gradients) must keep their traced
    dtypes. An inference graph has no joint graph: only ``fw_rewrite`` sees it.
    ``graph_config``: inductor settings read from each rewritten graph, on top of the others
    (the step's CUDA-graph decision); an empty dict leaves the compile as it was.
    ``cache_key``: what the rewrites do, as a stable string (a `StepPlan`'s ``cache_key()``):
    with it (and inductor) the compiled graphs are AOTAutograd-cacheable. The compilers are
    then ``SerializableAOTDispatchCompiler``s returning inductor's ``OutputCode``, and the key
    goes into inductor's config (the uuid of the CPU-facts pass, ``dlspass.cache_facts``) for
    the whole AOTAutograd call, so AOTAutograd's key (dynamo's graph, its inputs, the configs)
    names it: a warm process skips the joint trace, the rewrites and inductor. The rewrites
    must then keep the graph's signature (a wrapper would be lost on a cache hit).

    For inductor this is inductor's own hand-off (``compile_fx``'s aot path): the joint graph
    is traced once with inductor's decompositions and partitioner, and the rewritten forward
    and backward graphs go to ``compile_fx_forward``/``compile_fx_backward`` (which call
    ``compile_fx_inner`` with the output-stride and static-input bookkeeping inductor needs).
    Handing an already-AOT'd graph to the top-level ``compile_fx`` instead re-traces it with
    other decompositions, and a recorded ``view`` of a value whose strides changed fails
    ("Cannot view a tensor ...", or a stride assertion in the generated code).
    """
    kwargs: dict[str, Any] = {}
    cacheable = cache_key is not None and backend_compiler != "eager"
    # the CPU facts in every cache key (dlspass.cache_facts): an entry made under another vector
    # ISA or thread count is a miss, never a wrong hit; with ``cache_key`` the rewrites too
    key_config = {**INDUCTOR_CONFIG, **inductor_key_config(cache_key or ""),
                  **(inductor_config_extra or {})}
    if backend_compiler == "eager":
        def compile_graph(g: fx.GraphModule, ex: list[Any], is_backward: bool,
                          is_inference: bool) -> Callable:
            return make_boxed_func(g.forward)

        if joint_rewrite is not None:  # aot_autograd's own default partitioner after it
            kwargs["partition_fn"] = _after(joint_rewrite, default_partition)
    else:
        extra = compiler_config_extra(cfx, gm, inductor_config)
        n_outputs, n_inputs = cfx.get_num_model_outputs(gm), len(example_inputs)

        def compile_graph(g: fx.GraphModule, ex: list[Any], is_backward: bool,
                          is_inference: bool) -> Callable:
            DecomposeForInductorPass()(g)
            per_graph = graph_config(g) if graph_config is not None else {}
            with inductor_config.patch({**key_config, **per_graph}):
                # inductor reads its CUDA-graph switch into the per-graph settings when they
                # are made: made again under the graph's own settings when it has any
                graph_extra = compiler_config_extra(cfx, gm, inductor_config) if per_graph else extra
                if is_backward:
                    return cfx.compile_fx_backward(g, ex, compiler_config_extra=graph_extra)
                return cfx.compile_fx_forward(g, ex, num_orig_model_outputs=n_outputs,
                                              num_example_inputs=n_inputs,
                                              compiler_config_extra=graph_extra, is_inference=is_inference)

        # ones_like/full_like stay whole through the trace: the step's backward seed is found as
        # one (dynamo_source.find_seed); so does empty_like, by which backward's store into a
        # parameter's .grad is found (dynamo_source.tag_backward_grads). DecomposeForInductorPass
        # decomposes them afterwards
        kept = (*roles.SEED_OPS, torch.ops.aten.empty_like.default)
        table = {op: fn for op, fn in select_decomp_table().items() if op not in kept}
        kwargs = {"decompositions": table, "partition_fn": cfx.partition_fn}
        if joint_rewrite is not None:
            # inductor's partition_fn runs its joint-graph passes, then (the override) the
            # rewrite and the partitioner it would run (min-cut, unless configured otherwise)
            partitioner = inductor_config.custom_partitioner_fn or min_cut_rematerialization_partition
            kwargs["partition_fn"] = functools.partial(
                cfx.partition_fn, partitioner_fn_override=_after(
                    joint_rewrite, functools.partial(partitioner, compiler="inductor")))
        if cacheable:  # the settings a loaded entry is post-compiled with, and keyed on
            kwargs["compiler_config_extra"] = extra
    kwargs["keep_inference_input_mutations"] = mutations_in_graph and backend_compiler != "eager"

    def compiler(rewrite: Rewrite, is_backward: bool, is_inference: bool = False) -> Callable:
        def run(g: fx.GraphModule, ex: Any) -> Callable:
            ex, wrap = rewrite(g, list(ex))
            compiled = compile_graph(g, ex, is_backward, is_inference)
            wrapped = wrap(compiled)
            if cacheable and wrapped is not compiled:
                # a cache hit would run the compiled graph without the wrapper
                raise InternalRuntimeError("a cacheable rewrite changed the graph's signature")
            return wrapped

        # torch's marker of a compiler whose output (inductor's OutputCode) AOTAutograd caches
        return SerializableAOTDispatchCompiler(OutputCode, run) if cacheable else run

    backend = aot_autograd(fw_compiler=compiler(fw_rewrite, False), bw_compiler=compiler(bw_rewrite, True),
                           inference_compiler=compiler(fw_rewrite, False, True), **kwargs)
    if backend_compiler == "eager":
        return backend(gm, example_inputs)
    # AOTAutograd's key reads inductor's config before anything compiles
    with inductor_config.patch(key_config) if cacheable else contextlib.nullcontext():
        return _inductor_context(example_inputs, lambda: backend(gm, example_inputs))


def compiler_config_extra(cfx: Any, gm: fx.GraphModule, inductor_config: Any) -> Any:
    """inductor's per-graph compile settings. torch 2.13 reads them from the graph module (its
    meta can turn cudagraphs off); earlier releases (torch 2.11, the CUDA image the GPU
    benchmark runs on) read inductor's config module instead."""
    first = next(iter(inspect.signature(cfx.create_compiler_config_extra).parameters))
    return cfx.create_compiler_config_extra(inductor_config if first == "config" else gm)


def _after(joint_rewrite: Callable[[fx.GraphModule], object], partition: Callable) -> Callable:
    """A ``partition_fn``: ``partition`` of the joint graph once ``joint_rewrite`` rewrote it."""
    def run(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        joint_rewrite(joint)
        return partition(joint, joint_inputs, **kwargs)

    return run


def _inductor_context(example_inputs: list[Any], build: Callable[[], Callable]) -> Callable:
    """``build()`` inside the context inductor's ``_compile_fx_main`` sets up around its aot
    call (inductor's joint-graph passes read the fake mode from ``V``)."""
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    with (enable_python_dispatcher(), V.set_fake_mode(fake_mode), compiled_autograd._disable(),
          functorch_config.patch(unlift_effect_tokens=True,
                                 selective_decompose=inductor_config.selective_decompose)):
        return build()


# ---- backend="dlspass" and make_backend --------------------------------------------------------

def lowering_backend(gm: fx.GraphModule, example_inputs: list[Any], *, config: DLSConfig,
                     backend_compiler: str, scaler: Any | None = None,
                     keep: Callable[[fx.GraphModule], object] | None = None) -> Callable:
    """The ``dlspass`` backend's hand-off (``dlspass.capture.dynamo_backend.DLSBackend``):
    AOTAutograd, each AOT graph lowered to ``config``'s 16 bits (and its float8 recipe), with a
    ``scaler`` (a ``dlspass.GradScaler``) the backward's loss scaling too, then inductor (or
    eager). The rewrites are made here, as `step_backend` runs the step pipeline here, so the
    entry point hands over its config and control runs down. ``keep`` receives each rewritten
    graph (``DLSBackend.graphs``).
    """
    rewrites = _Lowering(config, scaler, keep)
    if not (config.mixed_precision and config.lowering_mode == "native"):
        bw = rewrites.lower if scaler is None else rewrites.scale_and_lower
        return aot_backend(gm, example_inputs, rewrites.lower, bw, backend_compiler)
    # Native: a training graph is lowered as one joint graph before it is partitioned, so
    # what the forward saves for the backward is 16-bit where the lowering made it so (a
    # forward lowered on its own would hand its backward the traced float32 values). Its
    # forward and backward then are lowered already; an inference graph, which has no
    # joint graph, is lowered on its own.
    joint_lowered = False

    def lower_joint(g: fx.GraphModule) -> None:
        nonlocal joint_lowered
        rewrites.lowering()(g)
        rewrites.float8(g)
        joint_lowered = True

    def fw(g: fx.GraphModule, ex: list[Any]) -> tuple[list[Any], Callable]:
        return rewrites.lower(g, ex, lowered=joint_lowered)

    def bw(g: fx.GraphModule, ex: list[Any]) -> tuple[list[Any], Callable]:
        if scaler is None:
            return rewrites.lower(g, ex, lowered=True)
        return rewrites.scale_and_lower(g, ex, lowered=True)

    return aot_backend(gm, example_inputs, fw, bw, backend_compiler, joint_rewrite=lower_joint)


class _Lowering:
    """The `lowering_backend`'s rewrites of one AOT graph (`Rewrite`s), for one config and scaler."""

    def __init__(self, config: DLSConfig, scaler: Any | None,
                 keep: Callable[[fx.GraphModule], object] | None) -> None:
        self.config, self.scaler, self.keep = config, scaler, keep

    def lowering(self) -> LowerPrecisionPass:
        return LowerPrecisionPass(self.config.fp16_type, self.config.lowering_mode)

    def float8(self, gm: fx.GraphModule) -> None:
        """The config's float8 recipe on ``gm``'s matmuls, after the 16-bit lowering (as in
        ``apply_dls``); the gradients are what the ``tangents`` placeholders feed."""
        if self.config.float8 is not None:
            LowerMatmulsToFloat8Pass.for_config(self.config)(gm)

    def lower(self, gm: fx.GraphModule, example_inputs: list[Any],
              lowered: bool = False) -> tuple[list[Any], Callable]:
        """``gm`` lowered (unless it comes ``lowered`` from a lowered joint graph) and kept."""
        if self.config.mixed_precision and not lowered:
            self.lowering()(gm)
        if not lowered:
            self.float8(gm)
        if self.keep is not None:
            self.keep(gm)
        return example_inputs, lambda compiled: compiled

    def scale_and_lower(self, gm: fx.GraphModule, example_inputs: list[Any],
                        lowered: bool = False) -> tuple[list[Any], Callable]:
        """The backward graph takes the scale as one more input and returns the finite flag as
        one more output (``ScaleBackwardPass``); the wrapper feeds the one and keeps the other.

        The scaling reads the backward's float32 tangents and gradients (every lowering keeps a
        graph's inputs and outputs in their traced dtypes), so it is the same whether the graph
        is lowered after it (emulate) or came ``lowered`` from the joint graph (native)."""
        scaler = self.scaler
        # No scaler.scale(loss) is called (the seed is scaled here), and that is where torch.amp
        # sets its scale up: set it up on the gradients' device before the graph reads it.
        device = next((t.device for t in example_inputs if isinstance(t, Tensor)), None)
        if device is not None:
            scaler._lazy_init_scale_growth_tracker(device)
        ScaleBackwardPass(self.config)(gm)
        example_inputs, _ = self.lower(gm, example_inputs, lowered)

        def wrap(inner: Callable) -> Callable:
            def run(args: list[Any]) -> Any:
                res = inner([*args, scaler.state.loss_scale])
                # A graph break gives one backward graph per piece, and gradient accumulation
                # one backward call per micro-batch: the step is finite only if every one of
                # them was. The scaler's update() resets the flag, once per step.
                seen = scaler.backend_found_finite
                scaler.backend_found_finite = res[-1] if seen is None else seen & res[-1]
                return res[:-1]

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return [*example_inputs, _fake_like(example_inputs, scaler.state.loss_scale)], wrap


def _fake_like(example_inputs: list[Any], t: Tensor) -> Any:
    mode = detect_fake_mode(example_inputs)
    return mode.from_tensor(t) if mode is not None else t


# ---- dlspass.compile's backend ---------------------------------------------------------------

def step_backend(gm: fx.GraphModule, example_inputs: list[Any], *, plan: StepPlan,
                 keep: Callable[[fx.GraphModule], object] | None = None,
                 on_cache_hit: Callable[[Callable[[], fx.GraphModule]], object] | None = None,
                 cache: bool = True) -> Callable:
    """``dlspass.compile``'s ``torch.compile`` backend: AOTAutograd, the step pipeline of
    ``plan`` on the AOT step graph, then inductor (or eager, ``plan.backend_compiler``).

    The step has no backward graph of its own (its backward is traced into the forward), and
    the step graph keeps its mutations as outputs (``tag_aot_graph`` reads them). ``keep``
    receives each rewritten graph (``CompiledStep.graphs``, for inspection).

    Warm start: where the plan has a cache key (``StepPlan.cache_key``), ``cache`` is on and
    the step runs on the CPU, AOTAutograd's cache serves the whole compiled step
    (``aot_backend``'s ``cache_key``). Not on CUDA yet: the step's CUDA-graph settings are
    decided from the rewritten graph (`step_cudagraph_config`), which a cache hit never sees,
    so a hit would post-compile the step under other settings than its cold compile. A
    hit runs neither the pipeline nor ``keep``: ``on_cache_hit`` then receives a function that
    makes the rewritten graph again and returns it (the trace and the pipeline, without the
    AOTAutograd cache; inductor's FX-graph cache serves the compile), for whoever asks for it.
    """
    kept: list[fx.GraphModule] = []

    def keep_graph(g: fx.GraphModule) -> None:
        kept.append(g)
        if keep is not None:
            keep(g)

    rewrite = functools.partial(_rewrite_step, plan=plan, keep=keep_graph)
    compiled = aot_backend(gm, example_inputs, rewrite, rewrite, plan.backend_compiler,
                           mutations_in_graph=False,
                           inductor_config_extra=step_inductor_config(example_inputs),
                           graph_config=step_cudagraph_config,
                           cache_key=plan.cache_key() if cache and _on_cpu(example_inputs) else None)
    if not kept and on_cache_hit is not None:
        on_cache_hit(functools.partial(_graph_again, gm, list(example_inputs), plan))
    return compiled


def _graph_again(gm: fx.GraphModule, example_inputs: list[Any], plan: StepPlan) -> fx.GraphModule:
    """The rewritten step graph of a step AOTAutograd's cache served, made again
    (`step_backend`), outside dynamo: in a tracing context of its own, as inductor's
    ``compile_fx`` does for a graph it is handed directly."""
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    context = torch._guards.TracingContext.try_get() or torch._guards.TracingContext(fake_mode)
    made: list[fx.GraphModule] = []
    with torch._guards.tracing(context):
        step_backend(gm, example_inputs, plan=plan, keep=made.append, cache=False)
    return made[-1]


def step_cudagraph_config(gm: fx.GraphModule) -> dict[str, Any]:
    """The inductor settings of the CUDA-graph decision for the rewritten step graph ``gm``
    (``dlspass.cudagraph_policy``): cudagraph trees when the whole step can be recorded; on
    CUDA when it cannot, CUDA graphs off and one warning with the reason; on CPU nothing (the
    CPU compile, and its cache key, stay as they were)."""
    decision = cudagraph_decision(step_facts(gm.graph))
    if not decision.on_cuda:
        return {}
    if not decision.record:
        warnings.warn(f"dlspass.compile: the step runs without a CUDA graph: {decision.reason}",
                      UserWarning, stacklevel=2)
    return inductor_options(decision)


def _rewrite_step(gm: fx.GraphModule, example_inputs: list[Any], *, plan: StepPlan,
                  keep: Callable[[fx.GraphModule], object] | None
                  ) -> tuple[list[Any], Callable[[Callable], Callable]]:
    """The step pipeline on the AOT step graph (tagging, graph passes, collectives, DLS,
    verify, the in-place updates), then the extra inputs the graph passes asked for."""
    inputs = plan.inputs()
    gm, extra = step_pipeline.run_step_pipeline(gm, plan, tag=tag_aot_graph)
    if keep is not None:
        keep(gm)
    if not extra:
        return example_inputs, lambda compiled: compiled
    providers = [inputs[t] for t in extra]
    fake_mode = detect_fake_mode(example_inputs)
    extra_examples = [p() for p in providers]
    if fake_mode is not None:
        extra_examples = [fake_mode.from_tensor(t) for t in extra_examples]

    def wrap(compiled: Callable) -> Callable:
        # the extra inputs are read when the graph runs, so changing them never recompiles
        def run(args: list[Any]) -> Any:
            return compiled([*args, *(p() for p in providers)])

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return [*example_inputs, *extra_examples], wrap


def step_inductor_config(example_inputs: list[Any]) -> dict[str, Any]:
    """Inductor settings for a whole training step.

    On CPU, inductor gives every convolution channels-last inputs whenever oneDNN is available
    (``GraphLowering.decide_layout_opt``, an inference heuristic). A training step then converts
    weights, activations and gradients between layouts at every convolution, and the optimizer
    update, which the step graph holds, reads channels-last gradients beside contiguous
    parameters: a ResNet-18 step took 623 ms against 341 ms without it (tools/bench/RESULTS.md).

    On every device, inductor's ``reorder_for_locality`` (a post-grad pass that moves each node's
    producers next to it when nothing earlier reads them) is off. In a whole step it moves every
    weight-gradient matmul, whose only reader is the optimizer update, to that update at the end
    of the step: each activation and output gradient a weight gradient reads then stays alive
    through the rest of the backward. With it, GPT-2's bfloat16 step held 1.14x autocast's peak
    memory (torch's separate backward graph returns its weight gradients, which keeps them in
    place); without it, 0.96x (tools/bench/RESULTS.md).
    """
    return {"reorder_for_locality": False,
            **({"layout_optimization": False} if _on_cpu(example_inputs) else {})}


def _on_cpu(example_inputs: list[Any]) -> bool:
    """True when every tensor input of the step is on the CPU."""
    return all(t.device.type == "cpu" for t in example_inputs if isinstance(t, Tensor))
