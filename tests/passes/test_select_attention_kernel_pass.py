"""SelectAttentionKernelPass: efficient -> flash attention, forward and backward together, where
SDPA would pick flash for the 16-bit inputs.

No GPU here: the graphs are traced on fake CUDA tensors (``FakeTensorMode`` makes them on a
CPU-only torch; the CUDA attention ops have fake kernels), so the rewrite, its shapes and its
dtypes are checked as a CUDA step would have them. The numerics of the rewritten wiring (which
argument goes where: grad_out, q, k, v, out, logsumexp, is_causal, scale) are checked by running
both graphs on CPU tensors with each CUDA attention op played by torch's CPU flash attention
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward), against eager autograd of
``F.scaled_dot_product_attention``. The kernels themselves run in tools/bench/gpu_check.sh.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dlspass.config import DLSConfig
from dlspass.passes import default_passes
from dlspass.passes.lower_precision_pass import LowerPrecisionPass
from dlspass.passes.select_attention_kernel_pass import (
    EFFICIENT,
    EFFICIENT_BACKWARD,
    FLASH_BACKWARD,
    FLASH_FORWARD,
    SelectAttentionKernelPass,
)
from dlspass.precision_policy import FLASH, KEEP, attention_kernel

aten = torch.ops.aten
H100 = (9, 0)
SCALE = 0.3  # not 1/sqrt(head_dim): a dropped scale changes the result


def _step(q, k, v, g, bias=None, causal=True):
    """An attention forward and backward as a CUDA trace in float32 spells them."""
    out, lse, seed, off = aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=SCALE)
    gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, bias, out, lse, seed, off, 0.0, [True, True, True, False], causal, scale=SCALE)
    return out, gq, gk, gv


def _fake_cuda_graph(dtype=torch.float16, shape=(2, 2, 16, 32), fn=_step, **kw) -> fx.GraphModule:
    with FakeTensorMode():
        args = [torch.empty(shape, device="cuda", dtype=dtype) for _ in range(4)]
        return make_fx(lambda q, k, v, g: fn(q, k, v, g, **kw))(*args)


def _targets(gm: fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def test_efficient_attention_on_16_bit_cuda_inputs_becomes_flash_forward_and_backward():
    gm = _fake_cuda_graph()
    before = [n.meta["val"] for n in gm.graph.output_node().args[0]]
    result = SelectAttentionKernelPass(capability=H100)(gm)
    assert result.modified and result.stats == {"swapped": 1}
    assert _targets(gm) == [FLASH_FORWARD, FLASH_BACKWARD]
    after = [n.meta["val"] for n in gm.graph.output_node().args[0]]
    # the graph's outputs keep their shapes, dtypes and device
    assert [(t.shape, t.dtype, t.device.type) for t in after] == \
        [(t.shape, t.dtype, t.device.type) for t in before]
    flash = next(n for n in gm.graph.nodes if n.target is FLASH_FORWARD)
    assert flash.kwargs["scale"] == SCALE and flash.args[4] is True  # is_causal
    gm.graph.lint()


def test_bfloat16_is_swapped_too():
    gm = _fake_cuda_graph(torch.bfloat16)
    SelectAttentionKernelPass(capability=H100)(gm)
    assert _targets(gm) == [FLASH_FORWARD, FLASH_BACKWARD]


@pytest.mark.parametrize(("build", "cap"), [
    (lambda: _fake_cuda_graph(torch.float32), H100),  # flash takes no float32
    (lambda: _fake_cuda_graph(), (7, 5)),  # Turing: no flash attention
    (lambda: _fake_cuda_graph(), None),  # no GPU to ask: the trace's choice stays
    (lambda: _fake_cuda_graph(shape=(2, 2, 16, 36)), H100),  # head dim not a multiple of 8
    (lambda: _fake_cuda_graph(shape=(2, 2, 16, 512)), H100),  # head dim above 256
], ids=["float32", "sm75", "no-gpu", "head-dim-36", "head-dim-512"])
def test_the_traced_kernel_stays_where_sdpa_would_not_pick_flash(build, cap):
    gm = build()
    result = SelectAttentionKernelPass(capability=cap)(gm)
    assert not result.modified
    assert _targets(gm) == [EFFICIENT, EFFICIENT_BACKWARD]


def test_a_bias_keeps_the_efficient_kernel():
    def with_bias(q, k, v, g):
        b = torch.zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2], device=q.device, dtype=q.dtype)
        return _step(q, k, v, g, bias=b, causal=False)

    gm = _fake_cuda_graph(fn=with_bias)
    assert not SelectAttentionKernelPass(capability=H100)(gm).modified


def test_statistics_read_elsewhere_keep_the_pair():
    def lse_out(q, k, v, g):
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
        return out, lse

    gm = _fake_cuda_graph(fn=lse_out)
    assert not SelectAttentionKernelPass(capability=H100)(gm).modified


def test_cpu_graphs_are_left_alone():
    # on CPU the native step already calls the CPU flash kernel on 16-bit inputs, as autocast does
    gm = make_fx(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True))(
        torch.randn(1, 2, 8, 16, dtype=torch.bfloat16))
    assert not SelectAttentionKernelPass(capability=H100)(gm).modified


# ---- the wiring's numerics, with the CUDA ops played by CPU flash attention ----------------

class _CpuAttention(fx.Interpreter):
    """Runs a graph of CUDA attention ops on CPU tensors: each op is computed by CPU flash
    attention with the arguments the op received at its own schema positions."""

    def call_function(self, target, args, kwargs):
        cpu = aten._scaled_dot_product_flash_attention_for_cpu.default
        cpu_bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        scale = kwargs.get("scale")
        if target is EFFICIENT:
            q, k, v, bias, _, dropout, causal = args
            out, lse = cpu(q, k, v, dropout, causal, attn_mask=bias, scale=scale)
            return out, lse, torch.tensor(0), torch.tensor(0)
        if target is EFFICIENT_BACKWARD:
            g, q, k, v, bias, out, lse, _, _, dropout, _, causal = args
            return (*cpu_bwd(g, q, k, v, out, lse, dropout, causal, attn_mask=bias, scale=scale), None)
        if target is FLASH_FORWARD:
            q, k, v, dropout, causal, _ = args
            out, lse = cpu(q, k, v, dropout, causal, scale=scale)
            return out, lse, None, None, q.shape[-2], k.shape[-2], torch.tensor(0), torch.tensor(0), None
        if target is FLASH_BACKWARD:
            g, q, k, v, out, lse, _, _, _, _, dropout, causal, _, _ = args
            return cpu_bwd(g, q, k, v, out, lse, dropout, causal, scale=scale)
        return super().call_function(target, args, kwargs)


def test_the_swapped_graph_computes_sdpa_forward_and_backward():
    # the graphs are traced for float16 (the swap's condition) and run on float32 CPU tensors:
    # the wiring is what is checked, and CPU flash attention runs float32 to float32 round-off
    plain = _fake_cuda_graph(torch.float16)
    swapped = _fake_cuda_graph(torch.float16)
    assert SelectAttentionKernelPass(capability=H100)(swapped).modified
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 2, 16, 32, generator=gen) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=SCALE)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), g)
    for graph in (plain, swapped):
        got = _CpuAttention(graph).run(q, k, v, g)
        # CPU flash attention against SDPA's CPU dispatch of the same float32 problem (the same
        # kernel on CPU): equal to float32 round-off
        torch.testing.assert_close(got[0], ref)
        for a, b in zip(got[1:], ref_grads, strict=True):
            torch.testing.assert_close(a, b)


# ---- policy and pipeline ---------------------------------------------------------------------

def test_policy_follows_sdpa_dispatch_rules():
    kw = {"has_bias": False, "dropout_p": 0.0, "is_causal": True, "q_len": 64, "k_len": 64}
    assert attention_kernel("cuda", torch.float16, 64, capability=H100, **kw) == FLASH
    assert attention_kernel("cuda", torch.bfloat16, 256, capability=(8, 0), **kw) == FLASH
    assert attention_kernel("cuda", torch.float32, 64, capability=H100, **kw) == KEEP
    assert attention_kernel("cpu", torch.float16, 64, capability=H100, **kw) == KEEP
    assert attention_kernel("cuda", torch.float16, 64, capability=H100, **{**kw, "has_bias": True}) == KEEP
    assert attention_kernel("cuda", torch.float16, 64, capability=H100, **{**kw, "dropout_p": 0.1}) == KEEP
    assert attention_kernel("cuda", torch.float16, 64, capability=H100, **{**kw, "k_len": 32}) == KEEP
    assert attention_kernel("cuda", torch.float16, 64, capability=H100,
                            **{**kw, "k_len": 32, "is_causal": False}) == FLASH
    # sm86/sm89: flash backward up to head dim 192; forward-only above is fine
    assert attention_kernel("cuda", torch.float16, 256, capability=(8, 6), **kw) == KEEP
    assert attention_kernel("cuda", torch.float16, 256, capability=(8, 6), needs_grad=False, **kw) == FLASH


@pytest.mark.parametrize(("mode", "present"), [("native", True), ("emulate", False)])
def test_the_pipeline_selects_after_the_native_lowering(mode, present):
    passes = default_passes(DLSConfig(fp16_type="bfloat16", loss_scale=None, mixed_precision=True,
                                      precision_mode=mode))
    names = [type(p) for p in passes]
    assert (SelectAttentionKernelPass in names) is present
    if present:
        assert names.index(SelectAttentionKernelPass) == names.index(LowerPrecisionPass) + 1
