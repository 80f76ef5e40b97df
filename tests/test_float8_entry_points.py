"""The float8 recipes through every entry point: ``dlspass.compile``, ``backend="dlspass"``,
``make_backend`` and the CLI (``capture_step`` and the torchao oracle are in
tests/passes/test_lower_matmuls_to_float8_pass.py), and ``dlspass inspect``'s float8 report."""

from __future__ import annotations

import copy
import json

import cli_factories as cf
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dlspass
from dlspass.capture import dynamo_backend
from dlspass.capture.pt2_io import load_program
from dlspass.models import MHAGPT
from dlspass.passes.lower_matmuls_to_float8_pass import float8_decisions

aten = torch.ops.aten
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
STEPS = 4


def _setup() -> tuple[MHAGPT, tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    model = MHAGPT(vocab=32, d=32, n_layer=1, n_head=2, block_size=8)
    ids = torch.randint(0, 32, (2, 9))
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def _loss(model: nn.Module, idx: Tensor, targets: Tensor, mult: Tensor | None = None) -> Tensor:
    loss = F.cross_entropy(model(idx).reshape(-1, 32), targets.reshape(-1))
    return loss if mult is None else loss * mult


def _float8_casts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default
               and n.args[1] in FLOAT8)


def _close_to_float32(losses: list[float], ref: list[float]) -> None:
    # float8 operands carry 3 (e4m3) or 2 (e5m2) mantissa bits, relative rounding up to 2**-3;
    # averaged over a matmul's sums, the loss of a few steps stays well inside it
    assert losses == pytest.approx(ref, rel=2**-3)
    assert losses[-1] < losses[0]


def _compiled(config: dlspass.DLSConfig) -> tuple[list[float], list[torch.fx.GraphModule]]:
    model, (idx, tgt) = _setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(a: Tensor, b: Tensor) -> Tensor:
        loss = _loss(model, a, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = dlspass.compile(train_step, optimizer=opt, config=config, backend_compiler="eager")
    return [float(step(idx, tgt)) for _ in range(STEPS)], step.graphs


@pytest.mark.parametrize("mode", ["native", "emulate"])
def test_compile_converts_every_matmul_of_the_step(mode: str) -> None:
    ref, _ = _compiled(dlspass.DLSConfig(loss_scale=None, mixed_precision=False))
    losses, graphs = _compiled(dlspass.DLSConfig(fp16_type="bfloat16", float8="tensorwise", precision_mode=mode))
    decisions = float8_decisions(graphs[-1].graph)
    matmuls = [d for d in decisions.values() if d["op"] in ("mm.default", "addmm.default", "bmm.default")]
    assert len(matmuls) == 15 and all(d["float8"] == "tensorwise" for d in matmuls)
    scaled = sum(n.target is aten._scaled_mm.default for n in graphs[-1].graph.nodes)
    assert scaled == (15 if mode == "native" else 0)
    _close_to_float32(losses, ref)


class _Loss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *batch: Tensor) -> Tensor:
        return _loss(self.model, *batch)


class _Recording(dynamo_backend.DLSBackend):
    """The backend ``backend="dlspass"`` builds, kept (in ``made``) to read its graphs."""

    made: list[dynamo_backend.DLSBackend] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        _Recording.made.append(self)


@pytest.mark.parametrize("make", [False, True], ids=["backend", "make_backend"])
@pytest.mark.parametrize("mode", ["native", "emulate"])
def test_torch_compile_backends_run_float8_matmuls_and_keep_the_overflow_check(mode: str, make: bool) -> None:
    model0, (idx, tgt) = _setup()
    results = {}
    for float8 in (None, "rowwise"):
        model = copy.deepcopy(model0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = dlspass.DLSConfig(fp16_type="float16", float8=float8, precision_mode=mode)
        scaler = dlspass.GradScaler(config=config)
        torch._dynamo.reset()
        _Recording.made.clear()
        if make:
            backend = dlspass.make_backend(scaler=scaler, backend_compiler="eager")
            _Recording.made.append(backend)
            cmodel = torch.compile(_Loss(model), backend=backend)
        else:
            cmodel = torch.compile(_Loss(model), backend="dlspass",
                                   options={"config": config, "backend_compiler": "eager"})
        losses = []
        with pytest.MonkeyPatch.context() as mp:
            if not make:  # keep what backend="dlspass" builds, to read its graphs
                mp.setattr(dynamo_backend, "DLSBackend", _Recording)
            for i in range(STEPS):
                mult = torch.tensor(float("inf") if i == 1 else 1.0)  # step 1 overflows
                loss = cmodel(idx, tgt, mult)
                (loss if make else scaler.scale(loss)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                losses.append(float(loss))
        results[float8] = losses, int(scaler.get_num_skipped_steps()), _Recording.made[-1].graphs
    (ref, ref_skipped, _), (losses, skipped, graphs) = results[None], results["rowwise"]
    assert skipped == ref_skipped == 1  # the overflow check still sees every gradient
    casts = sum(_float8_casts(g) for g in graphs)
    # 15 matmuls, 2 operands each; a cast is shared where the same tensor is read on the same axis
    assert 15 <= casts <= 30
    scaled = sum(n.target is aten._scaled_mm.default for g in graphs for n in g.graph.nodes)
    assert scaled == (15 if mode == "native" else 0)
    finite = [i for i in range(STEPS) if i != 1]
    _close_to_float32([losses[i] for i in finite], [ref[i] for i in finite])


# ---- CLI: transform --float8 and inspect ---------------------------------------------------------

_FLAGS = ("--optimizer", "sgd", "--lr", "0.05", "--fp16-type", "bfloat16")


def test_cli_transform_float8_step_trains_and_inspect_lists_every_matmul(capsys: pytest.CaptureFixture) -> None:
    plain = cf.step_file("gpt", ".pt2", *_FLAGS)
    f8 = cf.step_file("gpt", ".pt2", *_FLAGS, "--float8", "tensorwise")
    ep, meta = load_program(f8)
    assert meta["config"]["float8"] == "tensorwise"  # recorded like every other config field
    assert sum(n.target is aten._scaled_mm.default for n in ep.graph.nodes) > 0
    data = cf.batches("gpt", 5)
    got, ref = cf.train_pt2(f8, data), cf.train_pt2(plain, data)
    finite = [i for i in range(5) if i != cf.OVERFLOW_STEP]
    assert [got["losses"][i] for i in finite] == pytest.approx([ref["losses"][i] for i in finite], rel=2**-3)
    capsys.readouterr()
    assert cf.cli("inspect", f8, "--format", "json") == 0
    report = json.loads(capsys.readouterr().out)
    f8_report = report["float8"]
    matmuls = [d for d in f8_report.values() if d["op"] in ("mm.default", "addmm.default", "bmm.default")]
    assert matmuls and all(d["float8"] == "tensorwise" for d in matmuls)
    assert cf.cli("inspect", f8) == 0
    text = capsys.readouterr().out
    assert f"float8: {len(matmuls)} of {len(f8_report)} matmuls converted (tensorwise {len(matmuls)})" in text


@pytest.mark.parametrize(("out", "value", "says"), [
    ("x.onnx", "tensorwise", "ONNX output has no float8"),
    ("x.pt2", "blockwise", "unknown float8 recipe"),
])
def test_cli_refuses_float8_it_cannot_write_in_one_line(tmp_path, capsys, out: str, value: str, says: str) -> None:
    capsys.readouterr()
    path = tmp_path / out
    assert cf.cli("transform", cf.joint_file("gpt"), "-o", path, "--float8", value) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "--float8" in err and not path.exists()


def test_cli_float8_filter_is_recorded_and_inspect_says_why_each_matmul_stays(capsys: pytest.CaptureFixture) -> None:
    """``--float8-filter auto``: the tiny GPT's linears are all below torchao's auto-filter
    sizes, so every matmul stays in bfloat16 and inspect says why, per matmul; the spec is
    recorded with the recipe. A bad spec is the one-line exit 2 naming the flag."""
    f8 = cf.step_file("gpt", ".pt2", *_FLAGS, "--float8", "tensorwise", "--float8-filter", "auto")
    _, meta = load_program(f8)
    assert (meta["config"]["float8"], meta["config"]["float8_filter"]) == ("tensorwise", "auto")
    capsys.readouterr()
    assert cf.cli("inspect", f8, "--format", "json") == 0
    matmuls = {k: d for k, d in json.loads(capsys.readouterr().out)["float8"].items()
               if d["op"] in ("mm.default", "addmm.default", "bmm.default")}
    assert matmuls and all(d["float8"] is None and "torchao" in d["why"] for d in matmuls.values())
    assert cf.cli("inspect", f8) == 0
    text = capsys.readouterr().out
    assert "float8: 0 of" in text
    for name, d in matmuls.items():
        assert f"  not float8: {name} ({d['op']}" in text and d["why"] in text
    some = cf.step_file("gpt", ".pt2", *_FLAGS, "--float8", "tensorwise", "--float8-filter", "skip:head")
    capsys.readouterr()
    assert cf.cli("inspect", some) == 0
    text = capsys.readouterr().out
    assert "  float8 tensorwise: " in text and "skip_modules entry 'head'" in text
    assert cf.cli("transform", cf.joint_file("gpt"), "-o", cf.tmp_dir() / "bad.pt2", "--float8", "tensorwise",
                  "--float8-filter", "tiny") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--float8-filter" in err and "unknown entry 'tiny'" in err


@pytest.mark.slow  # inductor compiles of a float8 step (about 25 s); the matrix runs float8 through inductor by default
def test_capture_step_compiled_by_inductor_trains_like_the_eager_graph() -> None:
    """Inductor may lay out a buffer as it likes; the native matmuls pin their operands'
    layouts (``torch._scaled_mm`` wants the second one column-major) and train as eagerly."""
    results = []
    for compile_ in (False, True):
        model, batch = _setup()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = dlspass.capture_step(model, lambda m, b: _loss(m, *b), opt, batch, compile=compile_,
                                    config=dlspass.DLSConfig(fp16_type="bfloat16", float8="tensorwise"))
        results.append([float(step(batch)) for _ in range(3)])
    # the same float8 casts and kernels; inductor only fuses the float32 and bfloat16 elementwise
    # work around them (measured: 1e-7 relative), far inside a bfloat16 ulp (2**-8)
    assert results[1] == pytest.approx(results[0], rel=2**-8)


def test_telemetry_still_counts_every_gradient_of_a_float8_step() -> None:
    """The telemetry (after DLS) watches the gradients the float8 matmuls produce; it changes
    no value the step computes."""
    losses, reads = [], []
    for telemetry in (False, True):
        model, batch = _setup()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = dlspass.capture_step(model, lambda m, b: _loss(m, *b), opt, batch, config=dlspass.DLSConfig(
            fp16_type="float16", float8="tensorwise", telemetry=telemetry))
        losses.append([float(step(batch)) for _ in range(2)])
        if telemetry:
            reads.append(step.telemetry.read())
    assert losses[0] == losses[1]  # bit for bit: the counts only read
    grads = {k for k in reads[0] if k.startswith("grad:")}
    assert grads == {f"grad:{k}" for k, _ in _setup()[0].named_parameters()}
    assert all(reads[0][k]["amax"] > 0 for k in grads)


def test_inspect_reads_only_well_formed_float8_records() -> None:
    """The float8 record comes from the file: a hand-edited one cannot stop the report, and what
    it names is escaped (as inspect's other records, tests/hostile)."""
    from dlspass.debug.inspect_report import _float8, _float8_text
    from dlspass.passes.lower_matmuls_to_float8_pass import FLOAT8_KEY

    g = torch.fx.Graph()
    g.output(g.placeholder("x"))
    good = {"float8": None, "why": "bmm\u202e", "op": "bmm.default", "module": "attn"}
    record = {"mm_1": {"float8": "tensorwise", "why": None, "op": "mm.default", "module": ""},
              "bmm_2": good, "bad_type": {"float8": 7, "why": None, "op": "mm.default", "module": ""},
              "missing": {"float8": None}, "not_a_dict": ["x"]}
    g.output_node().meta["custom"] = {FLOAT8_KEY: json.dumps(record)}
    got = _float8(g)
    assert sorted(got) == ["bmm_2", "mm_1"]
    text = "\n".join(_float8_text(got))
    assert text.startswith("float8: 1 of 2 matmuls converted (tensorwise 1)") and "\u202e" not in text
    g.output_node().meta["custom"] = {FLOAT8_KEY: "{not json"}
    assert _float8(g) == {}


def test_backend_options_take_the_float8_filter_as_every_entry_point_does() -> None:
    config, _ = dynamo_backend.validate_options({"float8": "rowwise", "float8_filter": "auto,skip:head"})
    assert (config.float8, config.float8_filter) == ("rowwise", "auto,skip:head")
    with pytest.raises(dlspass.ConfigError, match="^float8_filter: unknown entry"):
        dynamo_backend.validate_options({"float8": "rowwise", "float8_filter": "small"})


@pytest.mark.parametrize("mode", ["native", "emulate"])
def test_a_dynamic_shape_graph_converts_and_records_its_sizes_at_their_example_values(mode: str) -> None:
    """``dynamic=True`` (or dynamo's automatic dynamic shapes after a recompile, which
    ``dlspass.compile`` met on its second model in one process): the batch size is symbolic;
    the filter reads it at its example value and the decisions record plain ints."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    backend = dlspass.make_backend(config=dlspass.DLSConfig(fp16_type="bfloat16", float8="tensorwise",
                                                            precision_mode=mode), backend_compiler="eager")
    torch._dynamo.reset()
    cmodel = torch.compile(model, backend=backend, dynamic=True)
    for batch in (3, 5):
        x = torch.randn(batch, 16)
        out = cmodel(x)
        out.square().mean().backward()
        # float8 operands carry 3 (e4m3) mantissa bits: relative rounding up to 2**-4 each,
        # 2**-3 for a product, bounded by the largest output (terms of both signs cancel)
        ref = model(x).detach()
        torch.testing.assert_close(out.detach().float(), ref, rtol=0, atol=2**-3 * float(ref.abs().max()))
    if mode == "native":  # the joint graph carries the decisions; its halves the kernels
        assert sum(n.target is aten._scaled_mm.default for g in backend.graphs for n in g.graph.nodes) >= 5
        return
    decisions = [d for g in backend.graphs for d in float8_decisions(g.graph).values()]
    assert decisions and all(d["float8"] == "tensorwise" for d in decisions)
    assert all(isinstance(v, int) for d in decisions for v in d["mkn"])
