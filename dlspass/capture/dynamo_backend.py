"""The ``dlspass`` torch.compile backend: 16-bit lowering of forward and backward graphs.

``torch.compile(model, backend="dlspass", options={"fp16_type": "cbfloat16"})`` (registered
through the ``torch_dynamo_backends`` entry point) runs AOTAutograd (with inductor's
decompositions for inductor) and lowers it with ``dlspass.passes.LowerPrecisionPass`` (the same
pass ``apply_dls`` runs) in the config's precision mode:

- native 16-bit kernels (float16, bfloat16 by default): the joint forward-backward graph is
  lowered before it is partitioned (after inductor's joint-graph passes), so the partitioner
  chooses what the forward saves for the backward among the lowered values and the saved
  activations are 16-bit where the lowering made them 16-bit, as under autocast and as in a
  ``dlspass.compile`` step; the forward's outputs to the user and the gradients keep their
  traced dtypes. An inference graph (no gradients) is lowered on its own.
- the emulated format: the forward and the backward graph are lowered each on its own after
  partitioning, rounded with ``dlspass::round_to_format`` (float32 values, so what crosses
  between them is float32 either way) and then decomposed into fusable int32 bit ops
  (``DecomposeForInductorPass``).

The graphs go to inductor (or run eagerly). Loss scaling stays in the eager
``dlspass.GradScaler``. The backend is a `DLSBackend` object, which keeps the forward and
backward graphs it rewrote.

``make_backend(scaler=...)`` returns a backend that also scales the backward seed
(``tangents_1``) by the scaler's loss scale and unscales and checks the gradients inside the
partitioned backward graph (``dlspass.passes.scale_backward_pass.ScaleBackwardPass``, the
``dlspass.scale_policy`` math the scaler runs eagerly). The scale enters and the overflow flag leaves through an extra placeholder and
output that a boxed wrapper threads (no host sync): the flag lands in
``scaler.backend_found_finite`` (a 0-d bool tensor) for the scaler's ``step``/``update``. The
flags of every backward graph run since the scaler's last ``update`` (several graphs after a
graph break, several backward calls under gradient accumulation) combine with AND, so an
overflow in any of them skips the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import Tensor

from dlspass.capture.cache_facts import inductor_key_config
from dlspass.capture.step_config import resolve_config
from dlspass.config import ConfigError, DLSConfig
from dlspass.graph import roles
from dlspass.passes.decompose_for_inductor_pass import DecomposeForInductorPass
from dlspass.passes.lower_precision_pass import LowerPrecisionPass
from dlspass.passes.scale_backward_pass import ScaleBackwardPass

if TYPE_CHECKING:
    from dlspass.scaler import GradScaler

# the DLSConfig keys the backend reads (the loss scaling is the scaler's: make_backend(scaler=))
CONFIG_OPTIONS = ("fp16_type", "mixed_precision", "precision_mode")
OPTIONS = ("config", *CONFIG_OPTIONS, "backend_compiler")
# what compiles the rewritten graphs (``dlspass.compile`` takes the same choices)
BACKEND_COMPILERS = ("inductor", "eager")
LOWERING = DLSConfig(loss_scale=None)
"""The backend's config when given none: float16 lowering, no loss scaling."""


def validate_options(options: dict[str, Any] | None,
                     scaler: GradScaler | None = None) -> tuple[DLSConfig, str]:
    """The backend's config and backend compiler from its options (and ``scaler``).

    ``config`` (a ``DLSConfig``; with a scaler, the scaler's), the `CONFIG_OPTIONS` keys
    merged into it as every entry point merges overrides (``dlspass.capture.step_config``),
    and ``backend_compiler``. Unknown keys and bad values raise ``ConfigError``.
    """
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"dlspass backend: unknown option(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(OPTIONS)}")
    backend_compiler = opts.pop("backend_compiler", "inductor")
    if backend_compiler not in BACKEND_COMPILERS:
        raise ConfigError(f"dlspass backend: backend_compiler: expected one of "
                          f"{', '.join(map(repr, BACKEND_COMPILERS))}, got {backend_compiler!r}")
    config = opts.pop("config", None)
    if config is not None and not isinstance(config, DLSConfig):
        raise ConfigError(f"dlspass backend: config: expected a dlspass.DLSConfig, "
                          f"got {type(config).__name__}")
    resolved = resolve_config(config, scaler, default=LOWERING, **opts)
    if resolved is not None and resolved.telemetry:
        # the backend sees the model's graphs, not the step's: its gradients and lowered ops
        # are not one buffer a step could feed and read
        raise ConfigError("dlspass backend: telemetry=True is not supported by backend='dlspass' "
                          "or make_backend; use dlspass.compile or dlspass.capture_step")
    return resolved or LOWERING, backend_compiler


# ---- backends ----------------------------------------------------------------------------------

# A rewrite of one AOT graph, in place: it returns the example inputs the rewritten graph takes
# and a wrapper for the compiled callable (the identity unless the graph's signature changed).
Rewrite = Callable[[fx.GraphModule, list[Any]], tuple[list[Any], Callable[[Callable], Callable]]]


def aot_backend(gm: fx.GraphModule, example_inputs: list[Any], fw_rewrite: Rewrite,
                bw_rewrite: Rewrite, backend_compiler: str, *, mutations_in_graph: bool = True,
                inductor_config_extra: dict[str, Any] | None = None,
                joint_rewrite: Callable[[fx.GraphModule], object] | None = None) -> Callable:
    """AOTAutograd over dynamo's graph, each AOT graph rewritten, then compiled.

    ``mutations_in_graph``: an inference graph keeps its input mutations as ``copy_`` nodes
    (inductor's own setting); False returns them as outputs (the step graph's contract, which
    ``tag_aot_graph`` reads). ``inductor_config_extra``: settings inductor compiles the graphs with,
    besides ``dlspass.formats.INDUCTOR_CONFIG``. ``joint_rewrite``: a rewrite, in place, of the
    joint forward-backward graph of a training graph before it is partitioned (after inductor's
    joint-graph passes), so the partitioner chooses what to save among the rewritten values;
    the joint graph's outputs (the forward's and the gradients) must keep their traced
    dtypes. An inference graph has no joint graph: only ``fw_rewrite`` sees it.

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
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    kwargs: dict[str, Any] = {}
    if backend_compiler == "eager":
        def compile_graph(g: fx.GraphModule, ex: list[Any], is_backward: bool,
                          is_inference: bool) -> Callable:
            return make_boxed_func(g.forward)

        if joint_rewrite is not None:  # aot_autograd's own default partitioner after it
            kwargs["partition_fn"] = _after(joint_rewrite, default_partition)
    else:
        from torch._inductor import compile_fx as cfx
        from torch._inductor import config as inductor_config
        from torch._inductor.decomposition import select_decomp_table

        from dlspass.formats import INDUCTOR_CONFIG  # keeps the rounding casts

        extra = _compiler_config_extra(cfx, gm, inductor_config)
        n_outputs, n_inputs = cfx.get_num_model_outputs(gm), len(example_inputs)

        def compile_graph(g: fx.GraphModule, ex: list[Any], is_backward: bool,
                          is_inference: bool) -> Callable:
            DecomposeForInductorPass()(g)
            # the CPU facts in the cache key (dlspass.capture.cache_facts): a cache entry made
            # under another vector ISA or thread count is a miss, never a wrong hit
            with inductor_config.patch({**INDUCTOR_CONFIG, **inductor_key_config(),
                                        **(inductor_config_extra or {})}):
                if is_backward:
                    return cfx.compile_fx_backward(g, ex, compiler_config_extra=extra)
                return cfx.compile_fx_forward(g, ex, num_orig_model_outputs=n_outputs,
                                              num_example_inputs=n_inputs, compiler_config_extra=extra,
                                              is_inference=is_inference)

        # ones_like/full_like stay whole through the trace: the step's backward seed is found as
        # one (compiled_step.find_seed); so does empty_like, by which backward's store into a
        # parameter's .grad is found (compiled_step.tag_backward_grads). DecomposeForInductorPass
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
    kwargs["keep_inference_input_mutations"] = mutations_in_graph and backend_compiler != "eager"

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


def _compiler_config_extra(cfx: Any, gm: fx.GraphModule, inductor_config: Any) -> Any:
    """inductor's per-graph compile settings. torch 2.13 reads them from the graph module (its
    meta can turn cudagraphs off); earlier releases (torch 2.11, the CUDA image the GPU
    benchmark runs on) read inductor's config module instead."""
    import inspect

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


class DLSBackend:
    """A ``torch.compile`` backend: AOTAutograd, its graphs lowered to 16 bits (native: the
    joint graph before it is partitioned; emulate: the forward and backward graphs), then
    inductor (or eager); with a scaler, also the loss scaling of the backward.

    ``graphs`` holds the AOT graphs this backend rewrote, newest last (for inspection, like
    ``CompiledStep.graphs``); each call of ``torch.compile``'d code that compiles adds its
    forward and, at its first backward, its backward graph.
    """

    def __init__(self, options: dict[str, Any], scaler: GradScaler | None = None) -> None:
        self.config, self.backend_compiler = validate_options(options, scaler)
        self.scaler = scaler
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        config = self.config
        if not (config.mixed_precision and config.lowering_mode == "native"):
            bw = self._lower if self.scaler is None else self._scale_and_lower
            return aot_backend(gm, example_inputs, self._lower, bw, self.backend_compiler)
        # Native: a training graph is lowered as one joint graph before it is partitioned, so
        # what the forward saves for the backward is 16-bit where the lowering made it so (a
        # forward lowered on its own would hand its backward the traced float32 values). Its
        # forward and backward then are lowered already; an inference graph, which has no
        # joint graph, is lowered on its own.
        joint_lowered = False

        def lower_joint(g: fx.GraphModule) -> None:
            nonlocal joint_lowered
            self._lowering()(g)
            joint_lowered = True

        def fw(g: fx.GraphModule, ex: list[Any]) -> tuple[list[Any], Callable]:
            return self._lower(g, ex, lowered=joint_lowered)

        def bw(g: fx.GraphModule, ex: list[Any]) -> tuple[list[Any], Callable]:
            if self.scaler is None:
                return self._lower(g, ex, lowered=True)
            return self._scale_and_lower(g, ex, lowered=True)

        return aot_backend(gm, example_inputs, fw, bw, self.backend_compiler,
                           joint_rewrite=lower_joint)

    def _lowering(self) -> LowerPrecisionPass:
        return LowerPrecisionPass(self.config.fp16_type, self.config.lowering_mode)

    def _lower(self, gm: fx.GraphModule, example_inputs: list[Any],
               lowered: bool = False) -> tuple[list[Any], Callable]:
        """``gm`` lowered (unless it comes ``lowered`` from a lowered joint graph) and kept."""
        if self.config.mixed_precision and not lowered:
            self._lowering()(gm)
        self.graphs.append(gm)
        return example_inputs, lambda compiled: compiled

    def _scale_and_lower(self, gm: fx.GraphModule, example_inputs: list[Any],
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
        example_inputs, _ = self._lower(gm, example_inputs, lowered)

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


def dls_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                mode: str | None = None) -> Callable:
    """The ``backend="dlspass"`` entry point: lowered forward and backward graphs via AOTAutograd.

    ``options``: ``config`` (a ``DLSConfig``; default: float16 lowering), its keys
    ``fp16_type`` (float16 | bfloat16 | cbfloat16), ``mixed_precision`` (False: no lowering)
    and ``precision_mode`` merged into it by ``DLSConfig.with_overrides`` as in every entry
    point, and ``backend_compiler`` (inductor | eager). A bad option is a ``ConfigError``;
    raised while dynamo compiles, it reaches the caller as torch's ``BackendCompilerFailed``
    (its ``inner_exception``); ``make_backend`` checks the options when it is called instead.
    """
    if mode not in (None, "default"):
        raise ConfigError(f"dlspass backend: mode={mode!r} is not supported; use options=")
    return DLSBackend(options or {})(gm, example_inputs)


def make_backend(scaler: GradScaler | None = None, config: DLSConfig | None = None,
                 **options: Any) -> DLSBackend:
    """A torch.compile backend: 16-bit lowering, plus in-graph seed scaling and overflow check.

    With ``scaler`` (a ``dlspass.GradScaler``), the backward graph multiplies the seed by
    ``scaler.state.loss_scale``, returns unscaled gradients and ANDs its finite flag into
    ``scaler.backend_found_finite``, which every ``scaler.unscale_`` (or ``step``) of the step
    reads and ``scaler.update`` resets (so every backward graph of a model with graph breaks, and every backward
    call of an accumulated step, counts); clipping, if configured, happens there. The gradients
    autograd accumulates are already unscaled, so do not call ``scaler.scale(loss)``; call
    ``scaler.step(optimizer)`` and ``scaler.update()`` as usual. The config is the scaler's
    (or ``config``), with ``options`` as for ``dls_backend``, checked here (``ConfigError``;
    an option that changes what the scaler's state was built for is refused, as in
    ``dlspass.compile``). The returned `DLSBackend` keeps the graphs it rewrote in ``graphs``.

    Example:
        >>> backend = dlspass.make_backend(scaler=scaler, fp16_type="float16")
        >>> cmodel = torch.compile(model, backend=backend)
    """
    return DLSBackend({"config": config, **options}, scaler)


def _fake_like(example_inputs: list[Any], t: Tensor) -> Any:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    return mode.from_tensor(t) if mode is not None else t
