"""The DLS pass pipeline: ``apply_dls(gm, config)`` rewrites a captured step for loss scaling.

Order (one pass per file, ``VerbNounPass`` in ``verb_noun_pass.py``):

1. ``LowerPrecisionPass``  mm/bmm/conv forward and backward in 16 bits (``mixed_precision``),
   then (native mode) ``SelectAttentionKernelPass``: flash attention where SDPA would pick it,
   then ``LowerMatmulsToFloat8Pass``: every admitted mm/addmm/bmm in float8 with current
   scaling (``float8``); the gradients it computes reach the passes below
2. ``ScaleSeedPass``       backward seed × loss_scale
3. ``UnscaleGradsPass``    gradients × 1/loss_scale, one overflow flag (dynamic)
4. ``ClipGradNormPass``    global-norm / value clipping after the check
5. ``GuardUpdatesPass``    params and optimizer state: ``where(isfinite, new, old)`` (dynamic)
6. ``UpdateScalePass``     scaler-state outputs = ``update_state(state, isfinite)`` (dynamic)

then ``dlspass.graph.invariants.verify``. A pass that does not apply records why
(``skip_reasons``, shown by ``dlspass inspect``); the ``dlspass.passes`` logger tells at DEBUG,
per pass, the nodes it added and removed or why it skipped (`GraphPass`). The config is
recorded as JSON on the output node (``meta["custom"]["dlspass_config"]``; also on the seed
node, whose meta survives ``torch.export``, which rebuilds the output node), which makes the
pipeline idempotent and lets it refuse a graph already rewritten with a different config.

The other files here are the rewrites around the pipeline, imported where they are used (each
file's one-line docstring states its rewrite; README "Layout" groups them): capture and packaging
(``drop_copy_back``, ``mark_seed``, ``merge_placeholders``, ``drop_none_getitems``,
``lift_constants``, ``drop_unchanged_outputs``, ``clone_shared_outputs``,
``remove_placeholder_aliases``, ``write_updates_in_place``), backends (``scale_backward``,
``decompose_for_inductor``, ``decompose_rounding``, ``guard_fused_updates``,
``reinplace_fused_kernel``), distributed and faults (``all_reduce_grads``,
``all_reduce_flag``, ``inject_faults``), numerics telemetry (``insert_telemetry``, a
``graph_passes`` pass) and ONNX (``lower_precision_onnx``, ``insert_dls_onnx``,
``expand_bool_where``, ``expose_seed``).
"""

from __future__ import annotations

import json
from typing import Any

import torch.fx as fx

from dlspass.config import DLSConfig, PrecisionMode, deprecated_precision_mode
from dlspass.errors import GraphContractError
from dlspass.graph import roles
from dlspass.graph.invariants import check, verify
from dlspass.graph.roles import APPLIED_KEY as APPLIED_KEY
from dlspass.graph.roles import CONFIG_KEY
from dlspass.graph.roles import recorded_config as recorded_config
from dlspass.passes.base import DLSPass, GraphPass, GraphPassResult, PassContractError
from dlspass.passes.base import applied_passes as applied_passes
from dlspass.passes.base import skip_reasons as skip_reasons
from dlspass.passes.clip_grad_norm_pass import ClipGradNormPass
from dlspass.passes.guard_updates_pass import GuardUpdatesPass
from dlspass.passes.lower_matmuls_to_float8_pass import LowerMatmulsToFloat8Pass
from dlspass.passes.lower_precision_pass import LowerPrecisionPass
from dlspass.passes.scale_seed_pass import ScaleSeedPass
from dlspass.passes.select_attention_kernel_pass import SelectAttentionKernelPass
from dlspass.passes.unscale_grads_pass import UnscaleGradsPass
from dlspass.passes.update_scale_pass import UpdateScalePass

PASSES = {p.name: p for p in (LowerPrecisionPass, LowerMatmulsToFloat8Pass, ScaleSeedPass, UnscaleGradsPass,
                              ClipGradNormPass, GuardUpdatesPass, UpdateScalePass)}

# the pipeline and its passes; the other passes are imported from their modules. The
# pipeline's internals (APPLIED_KEY, check_graph, run_passes, recorded_config, skip_reasons,
# applied_passes) stay importable from here without being part of the package's surface.
__all__ = [
    "ClipGradNormPass", "DLSPass", "GraphPass", "GraphPassResult", "GuardUpdatesPass",
    "LowerMatmulsToFloat8Pass", "LowerPrecisionPass", "PassContractError", "ScaleSeedPass",
    "SelectAttentionKernelPass", "UnscaleGradsPass", "UpdateScalePass", "apply_dls",
    "default_passes",
]


def default_passes(config: DLSConfig | None) -> list[DLSPass]:
    """The passes ``apply_dls`` runs for ``config``, in order."""
    passes: list[DLSPass] = []
    if config is not None and config.mixed_precision:
        passes.append(LowerPrecisionPass(config.fp16_type, config.lowering_mode))
        if config.lowering_mode == "native":
            # after the casts: the attention kernel chosen for the 16-bit inputs (on CUDA)
            passes.append(SelectAttentionKernelPass())
    if config is not None and config.float8 is not None:
        # after the 16-bit lowering: the matmuls' operands are then the 16-bit values torchao's
        # Float8Linear casts in a 16-bit model, and their outputs keep the lowered dtype
        passes.append(LowerMatmulsToFloat8Pass.for_config(config))
    if config is not None:
        passes += [ScaleSeedPass(config), UnscaleGradsPass(config), ClipGradNormPass(config),
                   GuardUpdatesPass(config), UpdateScalePass(config)]
    return passes


def check_graph(gm: fx.GraphModule) -> None:
    """`dlspass.graph.invariants.check` between passes: a broken contract is the pipeline's
    ``PassContractError``."""
    try:
        check(gm)
    except GraphContractError as e:
        raise PassContractError(str(e)) from None


def _mode_of(record: dict[str, Any] | None) -> str | None:
    """The precision mode a config record names (None: no config, nothing lowered)."""
    return None if record is None else record.get("precision_mode")


def run_passes(gm: fx.GraphModule, passes: list[GraphPass]) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``, checking the graph before the first and after each.

    A plain loop rather than torch's ``PassManager``, which re-raises any error inside a pass
    as a bare ``Exception`` and so hides the ``PassContractError`` (or ``ConfigError``) a
    caller is told to expect. Each pass lints, recompiles and logs itself (`GraphPass`).
    """
    check_graph(gm)
    for p in passes:
        gm = p(gm).graph_module
        check_graph(gm)
    return gm


def apply_dls(gm: fx.GraphModule, config: DLSConfig | None, *,
              precision_mode: PrecisionMode | None = None) -> fx.GraphModule:
    """Rewrite the captured step ``gm`` in place for ``config`` and return it, verified.

    ``config=None`` changes nothing; a config with scaling off (``loss_scale=None``, bfloat16)
    only lowers precision when ``mixed_precision`` is set; a static scale inserts seed scaling
    and unscaling but no check, guard or state update. Each pass that leaves the graph alone
    records why (``skip_reasons``). Applying it again with the same config leaves the graph
    unchanged; a graph rewritten with a different config is a ``PassContractError``, as is a
    graph without the step roles. The precision mode is ``config.lowering_mode``, recorded
    with the config (`roles.config_record`). ``precision_mode=`` is deprecated: pass
    ``config=DLSConfig(precision_mode=...)`` (it is merged into ``config`` with a
    ``DeprecationWarning``).

    Example:
        >>> gm = apply_dls(gm, DLSConfig(loss_scale="dynamic"))  # doctest: +SKIP
    """
    config = deprecated_precision_mode(config, precision_mode, "apply_dls")
    want_data = roles.config_record(config)
    want = json.dumps(want_data, sort_keys=True)
    if roles.recorded(gm.graph, CONFIG_KEY) is not None:
        have_data = roles.recorded_config_data(gm.graph)
        have = json.dumps(have_data, sort_keys=True)
        if have != want:
            raise PassContractError(
                f"this graph was already rewritten with config {have} (precision "
                f"{_mode_of(have_data)}); refusing to apply {want} (precision "
                f"{_mode_of(want_data)}): rewrite the captured graph instead")
        return gm
    passes = default_passes(config)
    if passes:
        gm = run_passes(gm, passes)
    for node in (gm.graph.output_node(), *roles.nodes_with_role(gm.graph, roles.SEED)):
        custom = node.meta.setdefault("custom", {})
        custom[CONFIG_KEY] = want
    gm.recompile()
    verify(gm)
    return gm
