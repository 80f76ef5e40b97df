"""The DLS pass pipeline: ``apply_dls(gm, config)`` rewrites a captured step for loss scaling.

Order (one pass per file, ``VerbNounPass`` in ``verb_noun_pass.py``):

1. ``LowerPrecisionPass``  mm/bmm/conv forward and backward in 16 bits (``mixed_precision``)
2. ``ScaleSeedPass``       backward seed × loss_scale
3. ``UnscaleGradsPass``    gradients × 1/loss_scale, one overflow flag (dynamic)
4. ``ClipGradNormPass``    global-norm / value clipping after the check
5. ``GuardUpdatesPass``    params and optimizer state: ``where(isfinite, new, old)`` (dynamic)
6. ``UpdateScalePass``     scaler-state outputs = ``update_state(state, isfinite)`` (dynamic)

then ``dlspass.graph.invariants.verify``. A pass that does not apply records why
(``skip_reasons``, shown by ``dlspass inspect``); ``log`` (this module's logger) tells at DEBUG,
per pass, the nodes it added and removed or why it skipped. The config is recorded as JSON on
the output node (``meta["custom"]["dlspass_config"]``; also on the seed node, whose meta
survives ``torch.export``, which rebuilds the output node), which makes the pipeline idempotent
and lets it refuse a graph already rewritten with a different config.

The other files here are the rewrites around the pipeline, imported where they are used (each
file's one-line docstring states its rewrite; README "Layout" groups them): capture and packaging
(``drop_copy_back``, ``mark_seed``, ``merge_placeholders``, ``drop_none_getitems``,
``lift_constants``, ``drop_unchanged_outputs``, ``clone_shared_outputs``,
``remove_placeholder_aliases``, ``write_updates_in_place``), backends (``scale_backward``,
``decompose_for_inductor``, ``decompose_rounding``), distributed and faults (``all_reduce_grads``,
``all_reduce_flag``, ``inject_faults``) and ONNX (``lower_precision_onnx``, ``insert_dls_onnx``,
``expand_bool_where``, ``expose_seed``).
"""

from __future__ import annotations

import json
import logging

import torch.fx as fx

from dlspass.config import DLSConfig, PrecisionMode
from dlspass.graph import roles
from dlspass.graph.roles import APPLIED_KEY, CONFIG_KEY, MODE_KEY
from dlspass.passes.base import DLSPass, PassContractError, applied_passes, skip_reasons
from dlspass.passes.clip_grad_norm_pass import ClipGradNormPass
from dlspass.passes.guard_updates_pass import GuardUpdatesPass
from dlspass.passes.lower_precision_pass import LowerPrecisionPass
from dlspass.passes.scale_seed_pass import ScaleSeedPass
from dlspass.passes.unscale_grads_pass import UnscaleGradsPass
from dlspass.passes.update_scale_pass import UpdateScalePass

log = logging.getLogger(__name__)

PASSES = {p.name: p for p in (LowerPrecisionPass, ScaleSeedPass, UnscaleGradsPass,
                              ClipGradNormPass, GuardUpdatesPass, UpdateScalePass)}

__all__ = [
    "APPLIED_KEY", "CONFIG_KEY", "PASSES", "ClipGradNormPass", "DLSPass", "GuardUpdatesPass",
    "LowerPrecisionPass", "PassContractError", "ScaleSeedPass", "UnscaleGradsPass",
    "UpdateScalePass", "apply_dls", "applied_passes", "check_graph", "default_passes",
    "recorded_config", "run_passes", "skip_reasons",
]


def default_passes(config: DLSConfig | None) -> list[DLSPass]:
    """The passes ``apply_dls`` runs for ``config``, in order."""
    passes: list[DLSPass] = []
    if config is not None and config.mixed_precision:
        passes.append(LowerPrecisionPass(config.fp16_type, config.precision_mode))
    if config is not None:
        passes += [ScaleSeedPass(config), UnscaleGradsPass(config), ClipGradNormPass(config),
                   GuardUpdatesPass(config), UpdateScalePass(config)]
    return passes


def check_graph(gm: fx.GraphModule) -> None:
    """Invariants between passes: lint, roles present, fake values on every computed node."""
    graph = gm.graph
    graph.lint()
    if len(roles.nodes_with_role(graph, roles.SEED)) != 1:
        raise PassContractError("the graph needs exactly one backward_seed node")
    out_roles = roles.output_roles(graph)
    if not out_roles:
        raise PassContractError("the output node records no output roles (dlspass_outputs)")
    if len(out_roles) != len(roles.output_values(graph)):
        raise PassContractError(f"{len(out_roles)} output roles for "
                                f"{len(roles.output_values(graph))} outputs")
    for node in graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta and node.users:
            raise PassContractError(f"node {node.name!r} has no fake value (meta['val'])")


def _config_json(config: DLSConfig | None) -> str:
    return json.dumps(None if config is None else config.to_dict(), sort_keys=True)


def recorded_config(gm: fx.GraphModule) -> DLSConfig | None:
    """The config ``apply_dls`` recorded on ``gm`` (None when none or no config was given)."""
    raw = roles.recorded(gm.graph, CONFIG_KEY)
    if raw is None:
        return None
    data = json.loads(raw)
    return None if data is None else DLSConfig(**data)


def run_passes(gm: fx.GraphModule, passes: list[DLSPass]) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``, checking the graph before the first and after each.

    A plain loop rather than torch's ``PassManager``, which re-raises any error inside a pass
    as a bare ``Exception`` and so hides the ``PassContractError`` (or ``ConfigError``) a
    caller is told to expect.
    """
    check_graph(gm)
    for p in passes:
        before = set(gm.graph.nodes) if log.isEnabledFor(logging.DEBUG) else None
        result = p(gm)
        gm = result.graph_module
        gm.recompile()
        check_graph(gm)
        if before is not None:
            _log_pass(p, gm, before)
    return gm


def _log_pass(p: DLSPass, gm: fx.GraphModule, before: set[fx.Node]) -> None:
    after = set(gm.graph.nodes)
    why = skip_reasons(gm.graph).get(p.name) if p.name not in applied_passes(gm.graph) else None
    if why is not None:
        log.debug("%s: skipped (%s)", p.name, why)
        return
    added = sorted(n.name for n in after - before)
    removed = sorted(n.name for n in before - after)
    log.debug("%s: added %d nodes %s, removed %d nodes %s", p.name, len(added), added,
              len(removed), removed)


def apply_dls(gm: fx.GraphModule, config: DLSConfig | None, *,
              precision_mode: PrecisionMode | None = None) -> fx.GraphModule:
    """Rewrite the captured step ``gm`` in place for ``config`` and return it, verified.

    ``config=None`` changes nothing; a config with scaling off (``loss_scale=None``, bfloat16)
    only lowers precision when ``mixed_precision`` is set; a static scale inserts seed scaling
    and unscaling but no check, guard or state update. Each pass that leaves the graph alone
    records why (``skip_reasons``). Applying it again with the same config leaves the graph
    unchanged; a graph rewritten with a different config is a ``PassContractError``, as is a
    graph without the step roles. The precision mode is ``config.precision_mode``;
    ``precision_mode=`` overrides it (``config.with_overrides``, so a bad one is the config's
    ``ConfigError``) and is kept for one release: put it in the config instead.

    Example:
        >>> gm = apply_dls(gm, DLSConfig(loss_scale="dynamic"))  # doctest: +SKIP
    """
    from dlspass.graph.invariants import verify

    if precision_mode is not None:
        # checked by the config, as every entry point's precision mode is
        resolved = (config or DLSConfig()).with_overrides(precision_mode=precision_mode)
        config = resolved if config is not None else None
    mode = config.precision_mode if config is not None else (precision_mode or "emulate")
    want = _config_json(config)
    have = roles.recorded(gm.graph, CONFIG_KEY)
    if have is not None:
        have_mode = roles.recorded(gm.graph, MODE_KEY)
        if have != want or have_mode != mode:
            raise PassContractError(
                f"this graph was already rewritten with config {have} (precision {have_mode}); "
                f"refusing to apply {want} (precision {mode}): rewrite the captured "
                "graph instead")
        return gm
    passes = default_passes(config)
    if passes:
        gm = run_passes(gm, passes)
    for node in (gm.graph.output_node(), *roles.nodes_with_role(gm.graph, roles.SEED)):
        custom = node.meta.setdefault("custom", {})
        custom[CONFIG_KEY] = want
        custom[MODE_KEY] = mode
    gm.recompile()
    verify(gm)
    return gm
