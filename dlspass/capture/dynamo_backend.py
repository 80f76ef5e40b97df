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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.fx as fx

# aot_backend and its hand-off live in dlspass.capture.aot; the names stay importable here
from dlspass.capture.aot import Rewrite, aot_backend, lowering_backend  # noqa: F401
from dlspass.capture.aot import compiler_config_extra as _compiler_config_extra  # noqa: F401
from dlspass.capture.step_config import resolve_config
from dlspass.config import ConfigError, DLSConfig

if TYPE_CHECKING:
    from dlspass.scaler import GradScaler

# the DLSConfig keys the backend reads (the loss scaling is the scaler's: make_backend(scaler=))
CONFIG_OPTIONS = ("fp16_type", "mixed_precision", "precision_mode", "float8", "float8_filter")
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
        raise ConfigError(f"dlspass backend: telemetry={resolved.telemetry!r} is not supported by backend='dlspass' "
                          "or make_backend; use dlspass.compile or dlspass.capture_step")
    return resolved or LOWERING, backend_compiler


# ---- backends ----------------------------------------------------------------------------------

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
        # the hand-off runs the lowering itself (``dlspass.capture.aot.lowering_backend``), so
        # control runs down from here and never comes back into this module while compiling
        return lowering_backend(gm, example_inputs, config=self.config, scaler=self.scaler,
                                backend_compiler=self.backend_compiler, keep=self.graphs.append)


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
