"""Native mixed precision (``precision_mode="native"``) against torch's own autocast.

The step graph of a GPT built on ``nn.MultiheadAttention`` runs its matmuls and attention in
16 bits, keeps what autocast keeps in float32, saves 16-bit activations for the backward, and
trains with the skipped steps and scales of ``torch.autocast`` + ``torch.amp.GradScaler`` on the
same model and data, through ``capture_step``, ``dlspass.compile``, ``backend="dlspass"`` and
``make_backend`` (which lower AOTAutograd's joint graph before it is partitioned).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dlspass
from dlspass.capture.functional import CapturedStep
from dlspass.graph import roles
from dlspass.models import MHAGPT

aten = torch.ops.aten
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# what autocast runs in 16 bits, at the ATen level of a training step (forward and backward)
LOW_OPS = {aten.mm.default, aten.addmm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
# what autocast keeps in float32, named here independently of dlspass.precision_policy
FP32_PACKETS = {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
                "native_layer_norm", "native_layer_norm_backward", "nll_loss_forward",
                "nll_loss_backward", "sum", "mean", "exp", "pow"}
# ...of which CPU autocast runs these in their inputs' dtype (torch 2.13, as torch.autocast("cpu")
# shows: tests/passes/test_lower_precision_pass.py), and so does dlspass's CPU policy: the step
# graphs here are traced on CPU, where they read the 16-bit logits and stay 16-bit
CPU_16_BIT_PACKETS = {"exp", "pow"}
CPU_FP32_PACKETS = FP32_PACKETS - CPU_16_BIT_PACKETS
DLS_ROLES = {roles.SCALED_SEED, roles.UNSCALE, roles.ISFINITE, roles.GRAD_NORM, roles.CLIP,
             roles.GUARD, roles.SCALE_UPDATE}


def _model(seed: int = 0) -> MHAGPT:
    torch.manual_seed(seed)
    return MHAGPT(vocab=32, d=32, n_layer=2, n_head=2, block_size=8)


def _batch(i: int, mult: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    idx = torch.randint(0, 32, (2, 8), generator=g)
    return idx, idx.roll(-1, dims=1), torch.tensor(mult)


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Next-token cross-entropy times the batch's multiplier."""
    idx, targets, mult = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) * mult


def _loss_through_fp32_ops(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """``_loss`` plus small terms that read the 16-bit logits through softmax, exp, pow and mean.

    Not for the comparison with CPU autocast: on CPU autocast runs these in 16 bits (its CPU
    float32 list is shorter than CUDA's), where the seed of a float16 step scaled by 2**16 is
    already infinite."""
    idx = batch[0]
    logits = model(idx)
    ce = _loss(lambda _: logits, batch)
    return ce + 1e-4 * logits.pow(2).mean() + 1e-6 * logits.exp().mean() \
        + 1e-4 * logits.softmax(-1).amax(-1).mean()


def _dtype(n: torch.fx.Node) -> torch.dtype | None:
    v = n.meta.get("val")
    return v.dtype if isinstance(v, Tensor) else None


def _native_step(fmt: str, mode: str = "native") -> CapturedStep:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return dlspass.capture_step(model, _loss_through_fp32_ops, opt, _batch(0), config=dlspass.DLSConfig(fp16_type=fmt),
                                precision_mode=mode)


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    (seed,) = roles.nodes_with_role(graph, roles.SEED)
    bwd: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if n is seed or any(a in bwd for a in n.all_input_nodes):
            bwd.add(n)
    return bwd


def _saved_activations(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Forward values computed from the batch that the backward reads (what autograd saves)."""
    bwd = _backward_nodes(graph)
    from_batch: set[torch.fx.Node] = set(roles.nodes_with_role(graph, roles.INPUT))
    for n in graph.nodes:
        if any(a in from_batch for a in n.all_input_nodes):
            from_batch.add(n)
    return [n for n in graph.nodes if n.op == "call_function" and n in from_batch and n not in bwd
            and any(u in bwd for u in n.users) and isinstance(n.meta.get("val"), Tensor)]


def _nbytes(nodes: list[torch.fx.Node]) -> int:
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_saved_activations_are_16_bit_and_fewer_bytes_than_emulation(fmt: str) -> None:
    native = _saved_activations(_native_step(fmt).graph_module.graph)
    emulated = _saved_activations(_native_step(fmt, "emulate").graph_module.graph)
    assert _nbytes(native) < 0.85 * _nbytes(emulated), (_nbytes(native), _nbytes(emulated))
    low = [n for n in native if _dtype(n) == HALF[fmt]]
    assert low
    # every saved value a backward matmul or attention kernel reads is 16-bit
    graph_bwd = [u for n in native for u in n.users if u.target in LOW_OPS]
    assert graph_bwd
    for op in graph_bwd:
        for a in op.all_input_nodes:
            if a.target is operator.getitem and a.args[0].target in LOW_OPS and a.args[1] == 1:
                continue  # the attention's logsumexp: float32 under autocast too
            if a in native and a.meta["val"].is_floating_point():
                assert _dtype(a) == HALF[fmt], (op.name, a.name)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_autocast_float32_ops_optimizer_and_dls_stay_float32(fmt: str) -> None:
    step = _native_step(fmt)
    graph = step.graph_module.graph
    half = HALF[fmt]
    seen, low_seen = set(), set()
    grads = roles.nodes_with_role(graph, roles.GRAD)
    optimizer: set[torch.fx.Node] = set()
    frontier = list(grads)
    while frontier:  # every node downstream of a gradient: unscale, check, clip, optimizer, guard
        n = frontier.pop()
        if n not in optimizer:
            optimizer.add(n)
            frontier += [u for u in n.users if u.op == "call_function"]
    assert grads and len(optimizer) > 5 * len(grads)
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        packet = getattr(n.target, "_opname", None)
        vals = [x for x in [*n.all_input_nodes, n] if x.meta.get("val") is not None]
        if packet in CPU_FP32_PACKETS or n in optimizer or roles.role_of(n) in DLS_ROLES:
            seen.add(packet if packet in CPU_FP32_PACKETS else "optimizer/dls")
            assert not [x.name for x in vals if _dtype(x) == half], (n.name, n.target)
        elif packet in CPU_16_BIT_PACKETS and any(_dtype(x) == half for x in n.all_input_nodes):
            low_seen.add(packet)  # the forward's exp and pow of the 16-bit logits
            assert _dtype(n) == half, n.name
        if n.target in LOW_OPS:
            low_seen.add(n.target)
            outs = n.meta["val"] if isinstance(n.meta["val"], tuple) else (n.meta["val"],)
            assert outs[0].dtype == half, n.name
    assert seen == CPU_FP32_PACKETS | {"optimizer/dls"}, CPU_FP32_PACKETS - seen
    assert low_seen == LOW_OPS | CPU_16_BIT_PACKETS
    for (role, target), v in zip(roles.output_roles(graph), roles.output_values(graph), strict=True):
        if role in (roles.PARAM_UPDATE, roles.OPT_STATE_UPDATE, roles.LOSS):
            assert _dtype(v) == torch.float32, (role, target)


# ---- training against torch.autocast + torch.amp.GradScaler -----------------------------------

STEPS = 6
LR = 1e-2
OVERFLOW_AT = 3  # a loss multiplier float16 cannot hold in the gradients: the step is skipped


def _mult(i: int, fmt: str) -> float:
    return 1e12 if (i == OVERFLOW_AT and fmt == "float16") else 1.0


def _reference(fmt: str) -> tuple[list[tuple[float, int]], dict[str, Tensor]]:
    """torch's own recipe: autocast forward, GradScaler(growth_interval=2) for float16."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2, enabled=fmt == "float16")
    trace = []
    skipped = 0
    for i in range(STEPS):
        with torch.autocast("cpu", dtype=HALF[fmt]):
            loss = _loss(model, _batch(i, _mult(i, fmt)))
        scaler.scale(loss).backward()
        before = scaler.get_scale() if fmt == "float16" else 1.0
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = scaler.get_scale() if fmt == "float16" else 1.0
        skipped += int(after < before)
        trace.append((after, skipped))
    return trace, {k: v.detach().clone() for k, v in model.named_parameters()}


def _config(fmt: str) -> dlspass.DLSConfig:
    return dlspass.DLSConfig(fp16_type=fmt, policy="torch", steps_per_increase=2)


def _train_captured(fmt: str) -> tuple[list[tuple[float, int]], dict[str, Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = dlspass.capture_step(model, _loss, opt, _batch(0), config=_config(fmt), precision_mode="native")
    trace = []
    for i in range(STEPS):
        step(_batch(i, _mult(i, fmt)))
        trace.append((float(step.scaler.get_scale()), int(step.scaler.get_num_skipped_steps())))
    return trace, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_compiled(fmt: str) -> tuple[list[tuple[float, int]], dict[str, Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = dlspass.GradScaler(config=_config(fmt))

    def train_step(idx: Tensor, targets: Tensor, mult: Tensor) -> Tensor:
        loss = _loss(model, (idx, targets, mult))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = dlspass.compile(train_step, optimizer=opt, scaler=scaler, precision_mode="native",
                           backend_compiler="eager")
    trace = []
    for i in range(STEPS):
        step(*_batch(i, _mult(i, fmt)))
        trace.append((float(scaler.get_scale()), int(scaler.get_num_skipped_steps())))
    _assert_16_bit_matmuls([step.graphs[-1]], fmt)
    return trace, {k: v.detach().clone() for k, v in model.named_parameters()}


def _assert_16_bit_matmuls(graphs: list[torch.fx.GraphModule], fmt: str) -> None:
    for gm in graphs:
        mm = [n for n in gm.graph.nodes if n.target is aten.mm.default]
        assert mm and all(_dtype(n) == HALF[fmt] for n in mm)


class _Loss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *batch: Tensor) -> Tensor:
        return _loss(self.model, batch)


def _train_backend(fmt: str, make: bool) -> tuple[list[tuple[float, int]], dict[str, Tensor]]:
    """``backend="dlspass"`` (the eager scaler scales) or ``make_backend(scaler=)`` (the backward
    graph scales): AOTAutograd's joint graph lowered, then partitioned into forward and backward."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = dlspass.GradScaler(config=_config(fmt))
    torch._dynamo.reset()
    if make:
        backend = dlspass.make_backend(scaler=scaler, precision_mode="native", backend_compiler="eager")
        cmodel = torch.compile(_Loss(model), backend=backend)
    else:
        cmodel = torch.compile(_Loss(model), backend="dlspass", options={
            "config": _config(fmt), "precision_mode": "native", "backend_compiler": "eager"})
    trace = []
    for i in range(STEPS):
        loss = cmodel(*_batch(i, _mult(i, fmt)))
        (loss if make else scaler.scale(loss)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        trace.append((float(scaler.get_scale()), int(scaler.get_num_skipped_steps())))
    if make:
        assert len(backend.graphs) == 2  # one forward, one backward graph
        _assert_16_bit_matmuls(backend.graphs, fmt)
    return trace, {k: v.detach().clone() for k, v in model.named_parameters()}


# ---- backend="dlspass" and make_backend: the joint graph lowered before it is partitioned -------

def _backend_graphs(fmt: str, make: bool, mode: str = "native", backend_compiler: str = "eager",
                    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, dict[str, Tensor]]:
    """The AOT forward and backward graphs of one training step of ``_loss_through_fp32_ops``
    through ``backend="dlspass"`` (the eager scaler scales) or ``make_backend(scaler=)``, and the
    gradients it left."""
    from dlspass.capture import dynamo_backend

    model = _model()
    scaler = dlspass.GradScaler(config=dlspass.DLSConfig(fp16_type=fmt))
    torch._dynamo.reset()
    made: list[dynamo_backend.DLSBackend] = []

    class Recording(dynamo_backend.DLSBackend):  # what backend="dlspass" builds, kept
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    opts = {"fp16_type": fmt, "precision_mode": mode, "backend_compiler": backend_compiler}
    if make:
        backend = dlspass.make_backend(scaler=scaler, **opts)
        cmodel = torch.compile(_LossThroughFP32Ops(model), backend=backend)
    else:
        cmodel = torch.compile(_LossThroughFP32Ops(model), backend="dlspass", options=opts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dynamo_backend, "DLSBackend", Recording)
        loss = cmodel(*_batch(0))
    (loss if make else scaler.scale(loss)).backward()
    if make:
        assert bool(scaler.backend_found_finite)
        made.append(backend)
    (backend,) = made
    fw, bw = backend.graphs  # one forward and one backward graph
    unscale = 1.0 if make else float(scaler.get_scale())  # the eager scaler scaled the loss
    grads = {k: p.grad / unscale for k, p in model.named_parameters()}
    return fw, bw, grads


class _LossThroughFP32Ops(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *batch: Tensor) -> Tensor:
        return _loss_through_fp32_ops(self.model, batch)


# the ops through which a saved value reaches a backward kernel: views, and the lowering's casts
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
          aten.permute.default, aten.transpose.int, aten.expand.default, aten.clone.default,
          aten.detach.default, aten.alias.default, torch.ops.prims.convert_element_type.default}


def _saved_for_backward(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                        ) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Autograd's saved activations: the forward's outputs beyond its user outputs that the
    backward takes as inputs (AOTAutograd hands over the saved tensors in order: the last tensor
    outputs of the forward are the backward's inputs before its tangents), computed from the
    batch (the token ids), each with the backward input it becomes. The parameters and their
    16-bit copies are left out, as ``_saved_activations`` leaves them out of the captured step."""
    taken = [n for n in bw.graph.find_nodes(op="placeholder")
             if isinstance(n.meta.get("val"), Tensor) and "tangents" not in n.name]
    outs = [o for o in fw.graph.output_node().args[0]
            if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), Tensor)]
    pairs = list(zip(outs[len(outs) - len(taken):], taken, strict=True))
    for saved, read in pairs:
        assert _dtype(saved) == _dtype(read), (saved.name, read.name)
    from_batch = {n for n in fw.graph.find_nodes(op="placeholder")
                  if isinstance(n.meta.get("val"), Tensor)
                  and not n.meta["val"].is_floating_point()}
    for n in fw.graph.nodes:
        if any(a in from_batch for a in n.all_input_nodes):
            from_batch.add(n)
    return [(saved, read) for saved, read in pairs
            if saved.op == "call_function" and saved in from_batch]


def _kernels_reading(value: torch.fx.Node) -> list[torch.fx.Node]:
    """The 16-bit kernels (LOW_OPS) that read ``value``, directly or through views and casts."""
    found, frontier = [], [value]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.target in LOW_OPS:
                found.append(u)
            elif u.target in _VIEWS and u.args[0] is n:
                frontier.append(u)
    return found


@pytest.mark.parametrize(("fmt", "make", "backend_compiler"), [
    pytest.param("float16", False, "eager", id="backend-float16"),
    pytest.param("bfloat16", False, "eager", id="backend-bfloat16"),
    pytest.param("float16", True, "eager", id="make_backend-float16"),
    pytest.param("bfloat16", True, "eager", id="make_backend-bfloat16"),
    # inductor, the backends' default compiler: its joint-graph passes and min-cut partitioner
    # (two cold compiles, about 140 s on the shared CPUs)
    pytest.param("float16", True, "inductor", id="make_backend-float16-inductor",
                 marks=pytest.mark.slow)])
def test_backend_saves_16_bit_activations_and_fewer_bytes_than_emulation(
        fmt: str, make: bool, backend_compiler: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The AOT forward saves 16-bit activations for the backward, as autocast does: the joint
    graph is lowered before it is partitioned (lowered apart, the forward's outputs would keep
    their traced float32 and native mode would save as many bytes as emulation)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    fw, bw, grads = _backend_graphs(fmt, make, backend_compiler=backend_compiler)
    native = _saved_for_backward(fw, bw)
    emulated = _saved_for_backward(*_backend_graphs(fmt, make, "emulate", backend_compiler)[:2])
    nbytes = [_nbytes([saved for saved, _ in pairs]) for pairs in (native, emulated)]
    assert nbytes[0] < 0.85 * nbytes[1], nbytes
    assert any(_dtype(saved) == HALF[fmt] for saved, _ in native)
    # every saved value a backward matmul or attention kernel reads is 16-bit
    read = 0
    for saved, bw_input in native:
        if (saved.target is operator.getitem and saved.args[0].target in LOW_OPS
                and saved.args[1] == 1):
            continue  # the attention's logsumexp: float32 under autocast too
        if saved.meta["val"].is_floating_point() and _kernels_reading(bw_input):
            read += 1
            assert _dtype(saved) == HALF[fmt], (saved.name, _dtype(saved))
    assert read >= 8, read  # per layer: q, k, v, the attention's output, the matmuls' inputs
    if backend_compiler != "eager":  # inductor's code computes the gradients eager's graphs do
        _, _, want = _backend_graphs(fmt, make)
        for k, g in grads.items():
            torch.testing.assert_close(g, want[k], rtol=2e-2, atol=1e-4, msg=k)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("make", [False, True], ids=["backend", "make_backend"])
def test_backend_keeps_autocast_float32_ops_and_dls_in_float32(fmt: str, make: bool) -> None:
    """Lowered as one joint graph, the forward and backward still run what autocast keeps in
    float32 (softmax, layer norm, losses, reductions; on CPU exp and pow follow their 16-bit
    inputs, as CPU autocast runs them) and make_backend's DLS math in
    float32, the matmuls and attention in 16 bits, and hand the user and autograd their traced
    float32 (the loss, the gradients)."""
    fw, bw, _ = _backend_graphs(fmt, make)
    half = HALF[fmt]
    seen, low_seen = set(), set()
    for gm in (fw, bw):
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            packet = getattr(n.target, "_opname", None)
            vals = [x for x in [*n.all_input_nodes, n] if x.meta.get("val") is not None]
            if packet in CPU_FP32_PACKETS or roles.role_of(n) in DLS_ROLES:
                seen.add(packet if packet in CPU_FP32_PACKETS else roles.role_of(n))
                assert not [x.name for x in vals if _dtype(x) == half], (n.name, n.target)
            elif packet in CPU_16_BIT_PACKETS and any(_dtype(x) == half for x in n.all_input_nodes):
                low_seen.add(packet)  # the forward's exp and pow of the 16-bit logits
                assert _dtype(n) == half, n.name
            if n.target in LOW_OPS:
                low_seen.add(n.target)
                outs = n.meta["val"] if isinstance(n.meta["val"], tuple) else (n.meta["val"],)
                assert outs[0].dtype == half, n.name
    dls = {roles.SCALED_SEED, roles.UNSCALE, roles.ISFINITE} if make else set()
    assert seen == CPU_FP32_PACKETS | dls, (CPU_FP32_PACKETS | dls) ^ seen
    assert low_seen == LOW_OPS | CPU_16_BIT_PACKETS
    # the loss, and the gradients of the float32 parameters (and make_backend's finite flag)
    assert _dtype(fw.graph.output_node().args[0][0]) == torch.float32
    grads = [g for g in bw.graph.output_node().args[0] if isinstance(g, torch.fx.Node)]
    assert grads and all(_dtype(g) in (torch.float32, torch.bool) for g in grads)


# Relative to the update, two correct implementations differ by the format's rounding (float16
# keeps 10 bits, bfloat16 7; autocast on CPU also runs layer norm in 16 bits where dlspass keeps
# it in float32): 4 units of the format's epsilon.
TOLERANCE = {"float16": 4 * 2.0**-10, "bfloat16": 4 * 2.0**-7}


def _comparable(name: str, p: Tensor) -> Tensor:
    """``p`` without the attention's key bias, whose gradient is exactly zero (softmax ignores
    it): AdamW turns its rounding noise into full steps of the learning rate."""
    if name.endswith("attn.in_proj_bias"):
        d = p.shape[0] // 3
        return torch.cat([p[:d], p[2 * d:]])
    return p


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("train", [
    _train_captured, _train_compiled, functools.partial(_train_backend, make=False),
    functools.partial(_train_backend, make=True)],
    ids=["capture_step", "compile", "backend", "make_backend"])
def test_trains_like_torch_autocast_and_gradscaler(fmt: str, train: Callable) -> None:
    ref_trace, ref_params = _reference(fmt)
    trace, params = train(fmt)
    assert trace == ref_trace  # the same scale and skipped-step count after every step
    if fmt == "float16":
        assert ref_trace[OVERFLOW_AT][1] == 1 and ref_trace[-1][0] > ref_trace[0][0]  # skipped, grew
    init = dict(_model().named_parameters())
    for k, want in ref_params.items():
        got, want, start = (_comparable(k, t.detach()) for t in (params[k], want, init[k]))
        moved = float((want - start).norm())
        assert moved > 0, k
        assert float((got - want).norm()) <= TOLERANCE[fmt] * moved, k


def test_native_casts_each_tensor_once_and_never_back_and_forth() -> None:
    graph = _native_step("bfloat16").graph_module.graph
    cet = torch.ops.prims.convert_element_type.default
    casts = [n for n in graph.nodes if n.target is cet and roles.pass_of(n) == "lower_precision"]
    assert casts
    keys = [(c.args[0], c.args[1]) for c in casts]
    assert len(set(keys)) == len(keys), "a tensor is cast twice to the same dtype"
    for c in casts:
        src = c.args[0]
        if src.target is cet:  # a cast of a cast must not return to the first one's source dtype
            assert _dtype(src.args[0]) != c.args[1], c.name
    # parameters (master weights) are float32 inputs, read by the 16-bit ops through one cast each
    params = roles.nodes_with_role(graph, roles.PARAM)
    assert params and all(_dtype(p) == torch.float32 for p in params)
    for p in params:
        assert len([u for u in p.users if u.target is cet]) <= 1, p.name



def test_verifier_passes_native_steps_and_refuses_16_bit_dls_math() -> None:
    from dlspass.graph.invariants import VerificationError, verify
    from dlspass.graph.splice import insert_op

    gm = _native_step("float16").graph_module
    assert verify(gm)
    # a 16-bit value slipped into the unscale (what a wrong lowering would do) is refused
    unscale = roles.nodes_with_role(gm.graph, roles.UNSCALE)[-1]
    x = next(a for a in unscale.all_input_nodes if a.meta["val"].dim() > 0)
    low = insert_op(gm.graph, torch.ops.prims.convert_element_type.default, (x, torch.float16),
                    before=unscale, role=roles.CAST, by_pass="test")
    unscale.replace_input_with(x, low)
    with pytest.raises(VerificationError, match="unscale node .* in torch.float16"):
        verify(gm)


@pytest.mark.parametrize(("fmt", "mode"), [("float16", "native"), ("bfloat16", "native"),
                                           ("cbfloat16", "emulate")])
def test_the_default_mode_is_native_for_float16_and_bfloat16_and_emulate_for_cbfloat16(
        fmt: str, mode: str) -> None:
    assert dlspass.DLSConfig(fp16_type=fmt).lowering_mode == mode
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def train_step(idx: Tensor, targets: Tensor, mult: Tensor) -> Tensor:
        loss = _loss(model, (idx, targets, mult))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = dlspass.compile(train_step, optimizer=opt, fp16_type=fmt, backend_compiler="eager")
    step(*_batch(0))
    graph = step.graphs[-1].graph
    mm = [n for n in graph.nodes if n.target is aten.mm.default]
    rounded = [n for n in graph.nodes if n.target is torch.ops.dlspass.round_to_format.default]
    assert mm and {_dtype(n) for n in mm} == {HALF.get(fmt, torch.float32)}
    assert bool(rounded) == (mode == "emulate")
