"""LowerMatmulsToFloat8Pass: every admitted mm/addmm/bmm of the step, forward and backward, in
float8 with current scaling; checked against torchao 0.18.0's ``Float8Linear`` run from its
installed package (the `test` extra pins it)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
import zoo  # tests/models is on pytest's pythonpath (pyproject.toml)
from stepgraph import gpt_step, node_values, reference_step, run, trace_step
from tolerance import assert_close_reordered
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import dlspass
from dlspass.config import ConfigError, DLSConfig
from dlspass.float8_policy import Float8Filter, MatmulSite
from dlspass.graph import roles
from dlspass.models import MHAGPT, SmallCNN, ce_loss
from dlspass.passes import LowerMatmulsToFloat8Pass, apply_dls
from dlspass.passes.lower_matmuls_to_float8_pass import MATMUL_OPS, float8_casts, float8_decisions

torchao_float8 = pytest.importorskip("torchao.float8")
from torchao.float8.float8_training_tensor import Float8TrainingTensor  # noqa: E402

aten = torch.ops.aten
RECIPES = ("tensorwise", "rowwise")


class LinearStack(nn.Module):
    """nn.Linear layers only (what torchao converts): bias and no bias, a 3-d input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(48, 64)
        self.c = nn.Linear(64, 16, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


class Unreachable(nn.Module):
    """Matmuls torchao's module swap cannot reach: nn.MultiheadAttention (fused in-projection,
    batched attention products, its out_proj called through F.linear), F.linear, ``x @ w``."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.v = nn.Parameter(torch.randn(16, d) / d**0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.attn(x, x, x, need_weights=True)[0]  # need_weights: bmm attention, not the fused kernel
        return F.linear(torch.tanh(h @ self.w), self.v)


def _mse(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def _sqnr(ref: Tensor, x: Tensor) -> float:
    """torchao's ``compute_error``: 20 log10(|ref| / |ref - x|), in dB."""
    return float(20 * torch.log10(ref.norm() / (ref - x).norm()))


def _grads_and_loss(step, gm) -> tuple[dict[str, Tensor], Tensor]:
    grads = roles.nodes_with_role(gm.graph, roles.GRAD)
    (loss,) = roles.nodes_with_role(gm.graph, roles.LOSS)
    vals = node_values(gm, step.inputs(), [*grads, loss])
    return {roles.target_of(g): v for g, v in zip(grads, vals, strict=False)}, vals[-1]


def _model_output(step, gm) -> Tensor:
    """The model's output in ``gm``: what the loss subtracts the target (``batch.1``) from."""
    (target,) = [n for n in gm.graph.find_nodes(op="placeholder") if roles.target_of(n) == "batch.1"]
    (sub,) = [u for u in target.users if u.target is aten.sub.Tensor]
    return node_values(gm, step.inputs(), [sub.args[0]])[0]


def _torchao(model: nn.Module, recipe: str, batch: tuple[Tensor, ...],
             bias_terms: dict[str, float] | None = None) -> tuple[dict[str, Tensor], Tensor, int]:
    """torchao's emulated float8 step of ``model``: gradients, loss, and how many matmuls ran
    on its float8 tensors (forward and backward). ``bias_terms``, when given, receives per bias
    the largest sum of magnitudes of the terms its gradient adds up (|grad_output| summed over
    the tokens), the S of `tolerance.reordered_sum_atol`."""
    base = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    config = torchao_float8.Float8LinearConfig(**{**base.__dict__, "emulate": True})
    ref = torchao_float8.convert_to_float8_training(copy.deepcopy(model), config=config)
    if bias_terms is not None:
        for name, mod in ref.named_modules():
            if getattr(mod, "bias", None) is not None:
                def hook(m: nn.Module, gin: object, gout: tuple[Tensor, ...], name: str = name) -> None:
                    bias_terms[f"{name}.bias"] = float(gout[0].abs().flatten(0, -2).sum(0).max())
                mod.register_full_backward_hook(hook)
    counter = _CountFloat8Matmuls()
    with counter:
        loss = _mse(ref, batch) if batch[1].is_floating_point() else _gpt_loss(ref, batch)
        loss.backward()
    return {k: p.grad for k, p in ref.named_parameters()}, loss.detach(), counter.n


class _CountFloat8Matmuls(TorchDispatchMode):
    """Counts the matmuls that read a torchao ``Float8TrainingTensor``."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMUL_OPS and any(isinstance(a, Float8TrainingTensor) for a in args):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _linear_step(seed: int = 0, tokens: tuple[int, ...] = (10,)):
    torch.manual_seed(seed)
    return trace_step(LinearStack(), _mse, (torch.randn(*tokens, 32), torch.randn(*tokens, 16)))


def _f8(recipe: str, mode: str, **kw: object) -> DLSConfig:
    """A float32 step (no 16-bit lowering, no loss scaling) whose matmuls run in float8."""
    return DLSConfig(loss_scale=None, mixed_precision=False, float8=recipe, precision_mode=mode, **kw)


# ---- torchao oracle: nn.Linear layers -----------------------------------------------------------

@pytest.mark.parametrize("tokens", [(10,), (2, 5)], ids=["2d", "3d"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_step_is_torchao_float8_linear_bit_for_bit(recipe: str, tokens: tuple[int, ...]) -> None:
    step = _linear_step(tokens=tokens)
    gm = apply_dls(step.gm, _f8(recipe, "emulate"))
    grads, loss = _grads_and_loss(step, gm)
    bias_terms: dict[str, float] = {}
    ref_grads, ref_loss, n_torchao = _torchao(step.model, recipe, tuple(step.batch), bias_terms)
    # bit equality: both run the same ATen ops (amax, float64 scale, saturated cast,
    # dequantize, float32 mm, bias added after) in the same order on the same values
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for k, g in ref_grads.items():
        if k.endswith("bias") and len(tokens) > 1:
            # not a matmul: the captured graph sums the bias gradient over the flattened
            # tokens, torchao's autograd over (batch, seq) -- torch's reduction order differs
            # (the plain float32 step differs from eager the same way): the same tokens' terms
            # added in another order, S their magnitudes' sum (the terms can cancel)
            n_tokens = step.batch[0].shape[:-1].numel()
            assert_close_reordered(grads[k], g, n_tokens, magnitude=bias_terms[k])
        else:
            assert torch.equal(grads[k], g), k
    # ... and it is float8: the float32 step differs
    _, plain_loss = _grads_and_loss(step, _linear_step(tokens=tokens).gm)
    assert not torch.equal(plain_loss, loss)
    converted = [d for d in float8_decisions(gm.graph).values() if d["float8"] == recipe]
    # 3 layers x (output, grad input, grad weight) less the input gradient of the first layer,
    # which the captured step never computes; torchao's autograd.Function computes it unread
    assert len(converted) == 8 and n_torchao == 9


@pytest.mark.parametrize("recipe", RECIPES)
def test_native_scaled_mm_agrees_with_emulation_to_float32_rounding(recipe: str) -> None:
    step = _linear_step(1)
    emu, emu_loss = _grads_and_loss(step, apply_dls(_linear_step(1).gm, _f8(recipe, "emulate")))
    gm = apply_dls(step.gm, _f8(recipe, "native"))
    assert sum(n.target is aten._scaled_mm.default for n in gm.graph.nodes) == 8
    nat, nat_loss = _grads_and_loss(step, gm)
    assert _sqnr(emu_loss, nat_loss) >= 100
    for k in emu:
        assert _sqnr(emu[k], nat[k]) >= 100, k


def test_operand_formats_and_scaling_axes_follow_torchao() -> None:
    """tensorwise: e4m3 for activations and weights, e5m2 for the gradient, 0-d scales;
    rowwise: e4m3 throughout, scales along the contraction, powers of two."""
    for recipe in RECIPES:
        gm = apply_dls(_linear_step().gm, _f8(recipe, "native"))
        for mm in (n for n in gm.graph.nodes if n.target is aten._scaled_mm.default):
            a, b = mm.args[0], mm.args[1]
            grad_side = roles.descendants(roles.nodes_with_role(gm.graph, roles.SEED))
            fa, fb = a.meta["val"].dtype, b.meta["val"].dtype
            sa, sb = mm.args[2].meta["val"].shape, mm.args[3].meta["val"].shape
            if recipe == "tensorwise":
                assert sa == sb == torch.Size([])
                assert {fa, fb} <= {torch.float8_e4m3fn, torch.float8_e5m2}
                assert (a in grad_side) == (fa == torch.float8_e5m2)
            else:
                assert fa == fb == torch.float8_e4m3fn
                assert sa == (a.meta["val"].shape[0], 1) and sb == (1, b.meta["val"].shape[1])
        exp2 = [n for n in gm.graph.nodes if n.target is aten.exp2.default]
        assert bool(exp2) == (recipe == "rowwise")


# ---- matmuls torchao cannot reach ---------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("mode", ["native", "emulate"])
def test_unreachable_matmuls_convert_within_torchao_sqnr_bars(recipe: str, mode: str) -> None:
    torch.manual_seed(0)
    batch = (torch.randn(2, 8, 32), torch.randn(2, 8, 16))
    step = trace_step(Unreachable(), _mse, batch)
    ref_out = _model_output(step, step.gm)
    ref_grads, _ = _grads_and_loss(step, step.gm)
    step8 = trace_step(step.model, _mse, batch)
    gm = apply_dls(step8.gm, _f8(recipe, mode))
    decisions = float8_decisions(gm.graph)
    ops = {d["op"] for d in decisions.values() if d["float8"]}
    assert {"mm.default", "addmm.default", "bmm.default"} <= ops
    assert all(d["float8"] for d in decisions.values())
    _, _, n_torchao = _torchao(step.model, recipe, batch)
    assert n_torchao == 0 < len(decisions)
    # torchao's own test bars (test/float8/test_base.py): outputs >= 18 dB, weight grads >= 17 dB
    assert _sqnr(ref_out, _model_output(step8, gm)) >= 18
    grads, _ = _grads_and_loss(step8, gm)
    for k, g in ref_grads.items():
        if g.dim() == 2:
            assert _sqnr(g, grads[k]) >= 17, k


def test_bmm_attention_of_a_gpt_converts_forward_and_backward() -> None:
    step = gpt_step(n_layer=1, d=16)
    n_mm = sum(n.target in MATMUL_OPS for n in step.gm.graph.nodes)
    gm = apply_dls(step.gm, _f8("tensorwise", "native"))
    decisions = float8_decisions(gm.graph)
    assert sum(d["float8"] is not None for d in decisions.values()) == n_mm
    assert sum(d["op"] == "bmm.default" for d in decisions.values()) >= 6  # 2 forward, 4 backward
    assert not any(n.target in MATMUL_OPS for n in gm.graph.nodes if roles.pass_of(n) != LowerMatmulsToFloat8Pass.name)


# ---- counts: torchao vs dlspass on a GPT built on nn.MultiheadAttention -----------------------

def _gpt_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    return F.cross_entropy(model(batch[0]).reshape(-1, 32), batch[1].reshape(-1))


def test_every_matmul_of_an_mha_gpt_converts_where_torchao_reaches_15_of_27() -> None:
    torch.manual_seed(0)
    model = MHAGPT(vocab=32, d=32, n_layer=2, n_head=2, block_size=8)
    ids = torch.randint(0, 32, (2, 9))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    _, _, n_torchao = _torchao(model, "tensorwise", batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the stated filter: "all", the default, as torchao's convert_to_float8_training converts
    # every nn.Linear given no module_filter_fn (the count below is torchao's under that default)
    step = dlspass.capture_step(model, _gpt_loss, opt, batch,
                                config=DLSConfig(fp16_type="bfloat16", float8="tensorwise", float8_filter="all"))
    decisions = float8_decisions(step.graph_module.graph)
    matmuls = {k: d for k, d in decisions.items() if d["op"] in ("mm.default", "addmm.default", "bmm.default")}
    assert n_torchao == 15
    assert len(matmuls) == 27 and all(d["float8"] == "tensorwise" for d in matmuls.values())
    assert {d["module"] for d in matmuls.values()} >= {"blocks.0.attn", "blocks.1.attn.out_proj", "head"}
    # the fused attention kernels stay in bfloat16, each with its reason
    fused = [d for d in decisions.values() if d["op"] not in matmuls and d["float8"] is None]
    assert fused and all("no float8 form" in d["why"] for d in fused)
    losses = [float(step(batch)) for _ in range(4)]
    assert losses[-1] < losses[0]


def _torchao_count(case: zoo.Case) -> int:
    """Matmuls torchao's ``convert_to_float8_training`` (tensorwise, its default: no filter)
    runs in float8 in one forward and backward of the case."""
    config = torchao_float8.Float8LinearConfig(emulate=True)
    converted = torchao_float8.convert_to_float8_training(copy.deepcopy(case.model), config=config)
    counter = _CountFloat8Matmuls()
    with counter:
        case.loss_fn(converted, case.batch).backward()
    return counter.n


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "vit", "resnet", "convnext", "mhagpt"])
def test_the_default_filter_converts_at_least_what_torchao_converts_on_every_matrix_model(name: str) -> None:
    """The counts goal, with the default filter ``"all"`` on both sides: every matmul of the
    step (forward and backward) of each compatibility-matrix model runs in float8, which is at
    least torchao's count of the same model (tools/bench/bench_float8.py --counts: the table)."""
    case = getattr(zoo, name)()
    n_torchao = _torchao_count(case)
    model = copy.deepcopy(case.model)
    step = dlspass.capture_step(model, case.loss_fn, torch.optim.SGD(model.parameters(), lr=0.0), case.batch,
                                config=DLSConfig(fp16_type="bfloat16", float8="tensorwise"))
    matmuls = [d for d in float8_decisions(step.graph_module.graph).values()
               if d["op"] in ("mm.default", "addmm.default", "bmm.default")]
    converted = sum(d["float8"] == "tensorwise" for d in matmuls)
    assert n_torchao > 0 and converted == len(matmuls) >= n_torchao


# ---- filter and decisions -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["emulate", "native"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_converted_matmul_names_its_operands_float8_casts(recipe: str, mode: str) -> None:
    """What the telemetry reads (`float8_casts`): both operands of every converted matmul, each
    the float8 cast of ``clamp(x32 * scale)`` with the amax its scale came from (checked on the
    values: the recorded amax is ``max |x32|``, per row along the recorded axis for rowwise);
    a tensorwise cast is shared by every matmul that reads the same tensor."""
    step = _linear_step()
    gm = apply_dls(step.gm, _f8(recipe, mode))
    casts = float8_casts(gm.graph)
    converted = sorted(k for k, d in float8_decisions(gm.graph).items() if d["float8"] == recipe)
    assert sorted(mm for mm, side, _ in casts if side == "a") == converted
    assert sorted(mm for mm, side, _ in casts if side == "b") == converted
    unique = list(dict.fromkeys(c for _, _, c in casts))
    for c in unique:
        assert c.cast.args[1] in (torch.float8_e4m3fn, torch.float8_e5m2)
        assert c.cast.args[0].target is aten.clamp.default and c.cast.args[0].args[0] is c.scaled
        assert c.scaled.target is aten.mul.Tensor and c.scaled.args[0] is c.x32
        assert (c.axis is None) == (recipe == "tensorwise")
    values = node_values(gm, step.inputs(), [n for c in unique for n in (c.x32, c.amax)])
    for i, c in enumerate(unique):
        x32, amax = values[2 * i], values[2 * i + 1]
        want = x32.abs().amax() if c.axis is None else x32.abs().amax(c.axis, keepdim=True)
        assert torch.equal(amax, want)  # a max is exact: the same values in any order
    if recipe == "tensorwise":
        # 16 operands, 9 tensors: 3 layer inputs (forward and weight gradient), 3 weights
        # (forward and input gradient), 3 output gradients (input and weight gradient)
        assert len(casts) == 16 and len(unique) == 9

def test_filter_skips_by_module_size_and_alignment_and_says_why() -> None:
    gm = _linear_step().gm
    LowerMatmulsToFloat8Pass("tensorwise", "emulate", Float8Filter(skip_modules=("b",), multiple_of=16))(gm)
    d = float8_decisions(gm.graph)
    by: dict[str, list[dict]] = {}
    for v in d.values():
        by.setdefault(v["module"], []).append(v)
    assert set(by) == {"a", "b", "c"}
    assert all(v["float8"] is None and "skip_modules" in v["why"] for v in by["b"])
    for v in by["a"] + by["c"]:
        # the weight gradients contract over the 10 tokens of the batch: not a multiple of 16
        if v["mkn"][1] == 10:
            assert v["float8"] is None and "multiples of 16" in v["why"]
        else:
            assert v["float8"] == "tensorwise" and v["why"] is None
    assert sum(v["float8"] is not None for v in d.values()) == 3  # a, c outputs; c grad input
    # the skipped matmuls are still there, unchanged
    skipped = [n for n in gm.graph.nodes if n.target in MATMUL_OPS and roles.pass_of(n) != "lower_matmuls_to_float8"]
    assert len(skipped) == sum(v["float8"] is None for v in d.values())
    gm = _linear_step().gm
    LowerMatmulsToFloat8Pass("tensorwise", "emulate", Float8Filter(min_size="auto"))(gm)
    assert all(v["float8"] is None and "thresholds" in v["why"] for v in float8_decisions(gm.graph).values())


# the weight shapes (in features K, out features N) around torchao 0.18.0's auto-filter edges:
# multiples of 16 or not, tensorwise's K 4096 / N 1024, rowwise's N 2048 / 4096 and K 1024 / 2048
_EDGE_DIMS = (16, 24, 1008, 1024, 1040, 2048, 2064, 4096, 4112, 8192)


@pytest.mark.parametrize("recipe", RECIPES)
def test_auto_filter_decides_as_torchaos_auto_filter_for_every_linear_shape(recipe: str) -> None:
    """``float8_filter="auto"`` against torchao's own ``_auto_filter_for_recipe``, called on an
    ``nn.Linear`` of every shape of the grid (on the meta device: it reads only the shape)."""
    from torchao.float8 import _auto_filter_for_recipe

    theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
    ours = Float8Filter.from_spec("auto")
    recipe_data = LowerMatmulsToFloat8Pass(recipe).recipe
    decided = []
    for k in _EDGE_DIMS:
        for n in _EDGE_DIMS:
            mod = nn.Linear(k, n, device="meta")
            # the output matmul of the linear, [M, K] @ [K, N], with its weight's N, K
            site = MatmulSite("layer", "mm.default", 8, k, n, (n, k))
            why = ours.reason_to_skip(site, recipe_data)
            assert (why is None) == theirs(mod, "layer"), (recipe, k, n, why)
            decided.append(why is None)
    assert any(decided) and not all(decided)  # the grid crosses the edges both ways


class _Sized(nn.Module):
    """One nn.Linear per shape of ``dims`` ((in, out) pairs), each on its own input times a
    trained gain (so that the step computes each linear's input gradient too)."""

    def __init__(self, dims: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(k, n) for k, n in dims)
        self.gains = nn.Parameter(torch.ones(len(dims)))

    def forward(self, *xs: Tensor) -> Tensor:
        return sum(torch.tanh(layer(x * g)).sum() for layer, x, g in zip(self.layers, xs, self.gains, strict=True))


@pytest.mark.parametrize("recipe", RECIPES)
def test_auto_filter_keeps_each_linears_three_matmuls_together_as_torchao_converts_it(recipe: str) -> None:
    """Through ``capture_step``: the linears torchao's auto filter converts are the ones whose
    matmuls (output, input gradient, weight gradient) all run in float8 here, and the others
    keep all three, each with the filter's reason; the weight gradient contracts over the 2
    tokens, which the size rule does not judge (torchao judges the module by its weight)."""
    from torchao.float8 import _auto_filter_for_recipe

    dims = ((4112, 16), (4096, 16), (16, 1040), (16, 1024), (24, 2048), (1040, 4112), (1040, 4096), (2064, 2064))
    torch.manual_seed(0)
    model = _Sized(dims)
    xs = tuple(torch.randn(2, k) for k, _ in dims)
    theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
    expected = {f"layers.{i}": theirs(m, f"layers.{i}") for i, m in enumerate(model.layers)}
    assert any(expected.values()) and not all(expected.values())
    step = dlspass.capture_step(model, lambda m, b: m(*b), torch.optim.SGD(model.parameters(), lr=0.0), xs,
                                config=_f8(recipe, "emulate", float8_filter="auto"))
    decisions = float8_decisions(step.graph_module.graph)
    by_module: dict[str, list[dict]] = {}
    for d in decisions.values():
        by_module.setdefault(d["module"], []).append(d)
    assert set(by_module) == set(expected)
    for module, converts in expected.items():
        ds = by_module[module]
        assert len(ds) == 3, (module, ds)  # output, input gradient, weight gradient
        if converts:
            assert all(d["float8"] == recipe and d["why"] is None for d in ds), ds
        else:
            assert all(d["float8"] is None and "torchao" in d["why"] and "weight N=" in d["why"] for d in ds), ds
    assert step.config.float8_filter == "auto"


def test_filter_spec_skips_modules_by_path_and_is_checked_once() -> None:
    gm = _linear_step().gm
    apply_dls(gm, _f8("tensorwise", "emulate", float8_filter="all, skip:b"))
    d = float8_decisions(gm.graph)
    assert {v["module"] for v in d.values() if v["float8"] is None} == {"b"}
    assert all("skip_modules entry 'b'" in v["why"] for v in d.values() if v["float8"] is None)
    assert roles.recorded_config(gm).float8_filter == "all, skip:b"  # recorded with the recipe
    assert Float8Filter.from_spec("auto,skip:x,skip:y") == Float8Filter(skip_modules=("x", "y"), min_size="auto")
    assert Float8Filter.from_spec("skip:head") == Float8Filter(skip_modules=("head",))
    for bad, says in (("big", "unknown entry 'big'"), ("auto,all", "more than one size rule"),
                      ("skip:", "unknown entry 'skip:'"), (16, "expected a string")):
        with pytest.raises(ConfigError, match=f"^float8_filter: .*{says}"):
            DLSConfig(float8="tensorwise", float8_filter=bad)


def test_convolutions_stay_with_a_reason() -> None:
    torch.manual_seed(0)
    step = trace_step(SmallCNN(in_ch=1, n_classes=3, width=2), ce_loss,
                      (torch.randn(2, 1, 4, 4), torch.tensor([0, 2])))
    gm = apply_dls(step.gm, _f8("tensorwise", "native"))
    d = float8_decisions(gm.graph)
    conv = [v for v in d.values() if v["op"].startswith("convolution")]
    assert conv and all(v["float8"] is None for v in conv)


def test_bad_recipe_and_filter_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="float8"):
        DLSConfig(float8="blockwise")
    with pytest.raises(ConfigError, match="float8"):
        LowerMatmulsToFloat8Pass("e4m3")
    with pytest.raises(ConfigError, match="min_size"):
        Float8Filter(min_size="big")
    cfg = DLSConfig(float8="rowwise")
    assert roles.config_from_record(json.loads(json.dumps(cfg.to_dict()))) == cfg


# ---- DLS composes: float16 loss scaling with float8 matmuls -----------------------------------

def test_float16_dls_with_float8_matmuls_still_skips_an_overflow() -> None:
    torch.manual_seed(0)
    model = MHAGPT(vocab=32, d=32, n_layer=1, n_head=2, block_size=8)
    ids = torch.randint(0, 32, (2, 9))

    def loss_fn(m: nn.Module, b: tuple[Tensor, ...]) -> Tensor:
        return _gpt_loss(m, b) * b[2]

    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.tensor(1.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dlspass.capture_step(model, loss_fn, opt, batch,
                                config=DLSConfig(fp16_type="float16", float8="tensorwise"))
    assert any(d["float8"] for d in float8_decisions(step.graph_module.graph).values())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale = float(step.scaler.get_scale())
    step((*batch[:2], torch.tensor(float("inf"))))
    assert step.scaler.get_num_skipped_steps() == 1 and float(step.scaler.get_scale()) < scale
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    step(batch)
    assert step.scaler.get_num_skipped_steps() == 1
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("fmt", "mode"), [("float16", "native"), ("cbfloat16", "emulate")])
def test_a_dynamically_scaled_16_bit_step_converts_its_matmuls_too(fmt: str, mode: str) -> None:
    config = DLSConfig(fp16_type=fmt, precision_mode=mode, float8="rowwise")
    step = gpt_step(config, n_layer=1, d=16)
    n_mm = sum(n.target in MATMUL_OPS for n in step.gm.graph.nodes)
    gm = apply_dls(step.gm, config)
    assert sum(d["float8"] == "rowwise" for d in float8_decisions(gm.graph).values()) == n_mm
    # the DLS passes still unscale and check every gradient the float8 matmuls produce
    unscaled = {roles.target_of(n) for n in roles.nodes_with_role(gm.graph, roles.UNSCALE) if roles.target_of(n)}
    assert unscaled == {roles.target_of(n) for n in roles.nodes_with_role(gm.graph, roles.GRAD)}
    assert roles.nodes_with_role(gm.graph, roles.ISFINITE)
    out = run(step, gm)
    ref = reference_step(step, config)
    assert bool(out["state"].loss_scale == ref["state"].loss_scale)  # finite: the scale did not back off
    # float8 operands: 3 mantissa bits (e4m3), relative rounding up to 2**-4 per operand
    assert float(out["loss"]) == pytest.approx(float(ref["loss"]), rel=2**-3)
