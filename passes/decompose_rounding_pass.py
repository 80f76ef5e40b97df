"""DecomposeRoundingPass: each ``dlspass::round_to_format`` node becomes the plain aten ops of ``round_bits`` (or ``round_arith``, ``round_split``, a cast round trip), traced on its input's fake value."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.formats import FORMS, FormatError, is_round_node, round_fn, round_node_args
from dlspass.graph.roles import ROUNDED_KEY
from dlspass.graph.splice import graft
from dlspass.passes.base import GraphPass, GraphPassResult


class DecomposeRoundingPass(GraphPass):
    """Swap the rounding custom op for traced aten ops (``form``: "bits" fuses in inductor,
    "arith" has no bit-casts, for ONNX; "split" is ``round_split``, for cbfloat16 and float16).

    Each replacement is traced with ``make_fx`` on the input's fake value (so the new nodes
    carry valid ``meta["val"]``) under ``decompositions`` (inductor's table, for a graph that
    goes to ``compile_fx_inner`` as it is) and grafted where the op was. The last new node keeps
    the op's ``meta["custom"]`` plus ``dlspass_rounded`` (the rounding stays recognisable after
    ``torch.export.save``; `rounded_format` reads it); every new node gets the op's provenance.
    ``form="cast"``, what inductor gets: float16 and bfloat16 without switches become a cast
    there and back, cbfloat16 and float16 with switches ``round_split`` (15 float ops, no
    bitcast), bfloat16 with switches ``round_bits`` (``formats.round_fn``); compile it under
    ``formats.INDUCTOR_CONFIG``. ``stats["replaced"]`` counts the ops replaced.
    """

    name = "decompose_rounding"

    def __init__(self, form: str = "bits", decompositions: dict | None = None) -> None:
        if form not in FORMS:
            raise FormatError(f"form: expected one of {', '.join(map(repr, FORMS))}, got {form!r}")
        self.form = form
        self.decompositions = decompositions

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        graph = gm.graph
        count = 0
        # one trace per (format, switches, shape, stride): big graphs round thousands of values
        traced: dict[tuple, fx.GraphModule] = {}
        for node in list(graph.nodes):
            if not is_round_node(node):
                continue
            x_node, fmt, saturate, ftz = round_node_args(node)
            sub, has_fake = self._trace(x_node, fmt, saturate, ftz, traced)
            (out,), inserted = graft(graph, sub, [x_node], node,
                                     const_prefix="_dls_const_decompose_rounding", source=node)
            if not has_fake:
                # traced on a real stand-in: its values would be wrong for this graph
                for new in inserted:
                    new.meta.pop("val", None)
                    new.meta.pop("tensor_meta", None)
            if "custom" in node.meta and "custom" not in out.meta:
                out.meta["custom"] = copy.copy(node.meta["custom"])
            out.meta["custom"] = {**out.meta.get("custom", {}), ROUNDED_KEY: fmt}
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            count += 1
        return GraphPassResult(gm, bool(count), {"replaced": count})

    def _trace(self, x_node: Any, fmt: str, saturate: bool, ftz: bool,
               traced: dict[tuple, fx.GraphModule]) -> tuple[fx.GraphModule, bool]:
        """The rounding form traced for ``x_node``'s value; False when it has no fake value."""
        fn = round_fn(fmt, saturate, ftz, self.form)
        val = x_node.meta.get("val") if isinstance(x_node, fx.Node) else None
        mode = detect_fake_mode([val]) if isinstance(val, torch.Tensor) else None
        if mode is None:
            return make_fx(fn, decomposition_table=self.decompositions)(
                torch.zeros(1, dtype=torch.float32)), False
        # symbolic shapes: every trace needs its own symbols, so no cache
        symbolic = mode.shape_env is not None
        key = (fmt, saturate, ftz, tuple(val.shape), tuple(val.stride()), val.device)
        sub = None if symbolic else traced.get(key)
        if sub is None:
            with mode:
                sub = make_fx(fn, decomposition_table=self.decompositions,
                              tracing_mode="symbolic" if symbolic else "fake")(val)
            if not symbolic:
                traced[key] = sub
        return sub, True


def rounded_format(node: fx.Node) -> str | None:
    """The format ``node`` rounds to: a ``dlspass::round_to_format`` node, or the last node of
    one that `DecomposeRoundingPass` replaced; None for any other node."""
    if is_round_node(node):
        return round_node_args(node)[1]
    return node.meta.get("custom", {}).get(ROUNDED_KEY)
