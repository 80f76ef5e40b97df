"""SelectAttentionKernelPass: memory-efficient attention forward and backward on 16-bit inputs become flash attention where SDPA would pick it."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dlspass.graph.splice import insert_op
from dlspass.passes.base import GraphPass, GraphPassResult
from dlspass.precision_policy import FLASH, attention_kernel

aten = torch.ops.aten
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default
FLASH_FORWARD = aten._scaled_dot_product_flash_attention.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default

# output positions: efficient (output, log_sumexp, philox_seed, philox_offset); flash (output,
# logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask), whose
# backward takes rng_state and unused as its philox_seed and philox_offset
_OUT, _LSE, _SEED, _OFFSET = 0, 1, 2, 3
_FLASH_MAX_Q, _FLASH_MAX_K, _FLASH_RNG, _FLASH_UNUSED = 4, 5, 6, 7


class SelectAttentionKernelPass(GraphPass):
    """Make the attention kernel choice from the 16-bit inputs the native lowering gives it.

    SDPA picks its kernel when the op is traced, from the inputs' dtype: a step traced in
    float32 on CUDA gets the memory-efficient kernel (flash attention takes no float32), and the
    native lowering's casts keep that op on 16-bit inputs. torch's autocast, which casts before
    SDPA dispatches, gets flash attention there. This pass rewrites each
    ``_scaled_dot_product_efficient_attention`` whose q, k, v are 16-bit, and for which the
    policy (`dlspass.precision_policy.attention_kernel`) says SDPA would pick flash, into
    ``_scaled_dot_product_flash_attention``, together with every backward that reads its
    softmax statistics (``_scaled_dot_product_efficient_attention_backward`` ->
    ``_scaled_dot_product_flash_attention_backward``, given the forward's output, logsumexp,
    sequence lengths and random state as flash's backward expects). A forward whose statistics
    are read by anything else, or whose backward is in another graph, is left alone (the pair
    must change together: the two kernels' statistics have different shapes).

    ``capability``: the GPU's compute capability; None asks torch (no CUDA device: no change).
    ``stats["swapped"]``: the forward ops rewritten.
    """

    name = "select_attention_kernel"

    def __init__(self, capability: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.capability = capability

    def _capability(self) -> tuple[int, int] | None:
        if self.capability is not None:
            return self.capability
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None

    def run(self, gm: fx.GraphModule) -> GraphPassResult:
        cap = self._capability()
        swapped = 0
        for fwd in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is EFFICIENT]:
            plan = _plan(fwd, cap)
            if plan is not None:
                _swap(gm.graph, fwd, *plan, self.name)
                swapped += 1
        if swapped:
            gm.graph.eliminate_dead_code()
        return GraphPassResult(gm, bool(swapped), {"swapped": swapped})


def _arg(node: fx.Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _outputs(node: fx.Node) -> dict[int, list[fx.Node]]:
    """``{index: [getitem nodes]}`` of a tuple-valued node; None when read other than by getitem."""
    out: dict[int, list[fx.Node]] = {}
    for u in node.users:
        if u.target is not operator.getitem:
            return {-1: [u]}
        out.setdefault(u.args[1], []).append(u)
    return out


def _plan(fwd: fx.Node, cap: tuple[int, int] | None) -> tuple[dict, list[fx.Node]] | None:
    """The forward's getitems and its backwards when the swap applies, else None."""
    q, k, v = (fwd.args[i] for i in range(3))
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in vals):
        return None
    qv, kv, vv = vals
    if len({t.dtype for t in vals}) != 1 or not (qv.shape[-1] == kv.shape[-1] == vv.shape[-1]):
        return None
    if any(isinstance(s, torch.SymInt) for t in vals for s in t.shape):
        return None  # flash's backward takes the sequence lengths as ints
    outs = _outputs(fwd)
    if -1 in outs:
        return None
    backwards = {u for g in outs.get(_LSE, []) for u in g.users}
    if any(b.target is not EFFICIENT_BACKWARD or b.args[6] not in outs[_LSE]
           or b.args[5] not in outs.get(_OUT, []) for b in backwards):
        return None  # the statistics go somewhere a flash logsumexp would not fit
    for i in (_SEED, _OFFSET):
        if any(u not in backwards for g in outs.get(i, []) for u in g.users):
            return None
    if any(-1 in _outputs(b) or any(g.users for g in _outputs(b).get(3, [])) for b in backwards):
        return None  # a gradient of the bias is read: the flash backward has none
    if any(b.args[4] is not None for b in backwards):
        return None
    choice = attention_kernel(
        qv.device.type, qv.dtype, qv.shape[-1], has_bias=_arg(fwd, 3, "attn_bias", None) is not None,
        dropout_p=float(_arg(fwd, 5, "dropout_p", 0.0)), is_causal=bool(_arg(fwd, 6, "is_causal", False)),
        q_len=qv.shape[-2], k_len=kv.shape[-2], capability=cap, needs_grad=bool(backwards))
    return (outs, sorted(backwards, key=_order)) if choice == FLASH else None


def _order(node: fx.Node) -> int:
    return list(node.graph.nodes).index(node)


def _swap(graph: fx.Graph, fwd: fx.Node, outs: dict[int, list[fx.Node]], backwards: list[fx.Node],
          by_pass: str) -> None:
    q, k, v = fwd.args[:3]
    dropout_p = _arg(fwd, 5, "dropout_p", 0.0)
    is_causal = _arg(fwd, 6, "is_causal", False)
    scale = fwd.kwargs.get("scale")
    flash = insert_op(graph, FLASH_FORWARD, (q, k, v, dropout_p, is_causal, False), {"scale": scale},
                      before=fwd, role=None, by_pass=by_pass, source=fwd)
    items = {i: insert_op(graph, operator.getitem, (flash, i), before=fwd, role=None, by_pass=by_pass,
                          source=fwd)
             for i in (_OUT, _LSE, _FLASH_RNG, _FLASH_UNUSED)}
    max_q, max_k = flash.meta["val"][_FLASH_MAX_Q], flash.meta["val"][_FLASH_MAX_K]
    for g in outs.get(_OUT, []):
        _move_role(g, items[_OUT])
        g.replace_all_uses_with(items[_OUT])
    for bwd in backwards:
        grad_out, bq, bk, bv = bwd.args[:4]
        new = insert_op(graph, FLASH_BACKWARD,
                        (grad_out, bq, bk, bv, items[_OUT], items[_LSE], None, None, max_q, max_k,
                         _arg(bwd, 9, "dropout_p", 0.0), _arg(bwd, 11, "is_causal", False),
                         items[_FLASH_RNG], items[_FLASH_UNUSED]),
                        {"scale": bwd.kwargs.get("scale")}, before=bwd, role=None, by_pass=by_pass,
                        source=bwd)
        for i, gs in _outputs(bwd).items():
            for g in gs:
                if i == 3:  # the bias gradient, unread (checked): flash's backward has none
                    graph.erase_node(g)
                    continue
                g.args = (new, i)
                g.meta["val"] = new.meta["val"][i]
        graph.erase_node(bwd)
    for gs in outs.values():
        for g in gs:
            if not g.users:
                graph.erase_node(g)
    graph.erase_node(fwd)


def _move_role(old: fx.Node, new: fx.Node) -> None:
    """The output's role and step-graph marks (its ``custom`` meta) go to the node replacing it."""
    custom = old.meta.get("custom")
    if custom:
        new.meta.setdefault("custom", {}).update({k: v for k, v in custom.items() if k not in new.meta["custom"]})
