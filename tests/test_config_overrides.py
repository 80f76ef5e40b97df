"""One merge rule: every entry point resolves ``config=`` plus keyword overrides the same way.

The four entry points (``capture_step``, ``dlspass.compile``, ``make_backend`` and
``backend="dlspass"`` options, the CLI's ``--config`` plus flags) get the same base config
(a flat dlspass YAML for the CLI) and the same overrides; each must end with the config written
out field by field here, and refuse the same bad value with the same message. A live scaler is
the one place an override that moves the scale range is refused, in both entry points that
take one.
"""

from __future__ import annotations

import math

import cli_factories as cf
import pytest
import torch

import dlspass
from dlspass.capture import dynamo_backend
from dlspass.capture.functional import CaptureError
from dlspass.config import ConfigError, DLSConfig
from dlspass.models import MLP, mse_loss, mse_train_step

BASE = {"policy": "torch", "steps_per_increase": 7, "max_gradient_norm": 2.0}
# the backend reads only the lowering keys (its loss scaling is the scaler's)
LOWERING = {"fp16_type": "cbfloat16", "mixed_precision": False, "precision_mode": "native"}
OVERRIDES = {**LOWERING, "max_gradient_norm": 0.5}
BAD = {"precision_mode": "fast"}
BAD_MESSAGE = "precision_mode: unknown mode 'fast'; choose one of emulate, native"


def _opt() -> tuple[MLP, torch.optim.SGD]:
    model = MLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8), torch.randn(4, 4)


def _capture(config: DLSConfig, **overrides: object) -> DLSConfig:
    model, opt = _opt()
    return dlspass.capture_step(model, mse_loss, opt, _batch(), config=config, **overrides).config


def _compile(config: DLSConfig, **overrides: object) -> DLSConfig:
    model, opt = _opt()
    return dlspass.compile(mse_train_step(model, opt), optimizer=opt, config=config,
                           backend_compiler="eager", **overrides).config


def _make_backend(config: DLSConfig, **overrides: object) -> DLSConfig:
    return dlspass.make_backend(config=config, backend_compiler="eager", **overrides).config


def _options(config: DLSConfig, **overrides: object) -> DLSConfig:
    # what backend="dlspass" does with torch.compile's options
    return dynamo_backend.DLSBackend({"config": config, **overrides}).config


def _cli(tmp_path, flags: list[str]) -> tuple[int, str]:
    yaml = tmp_path / "dls.yaml"
    yaml.write_text("".join(f"{k}: {v}\n" for k, v in BASE.items()))
    out = tmp_path / "step.pt2"
    return cf.cli("transform", cf.joint_file("mlp"), "-o", out, "--config", yaml, *flags), str(out)


def _cli_flags(overrides: dict[str, object]) -> list[str]:
    flags: list[str] = []
    for key, value in overrides.items():
        if key == "mixed_precision":
            flags.append("--mixed-precision" if value else "--no-mixed-precision")
        else:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def test_all_entry_points_resolve_the_same_overrides_to_the_same_config(tmp_path) -> None:
    base = DLSConfig(**BASE)
    # written out, not derived: the base's fields with the overrides' values
    want = DLSConfig(policy="torch", steps_per_increase=7, max_gradient_norm=0.5,
                     fp16_type="cbfloat16", mixed_precision=False, precision_mode="native")
    got = {"capture_step": _capture(base, **OVERRIDES), "compile": _compile(base, **OVERRIDES)}
    rc, out = _cli(tmp_path, _cli_flags(OVERRIDES))
    assert rc == 0
    from dlspass.capture.pt2_io import load_program

    _, meta = load_program(out)
    got["cli"] = DLSConfig(**meta["config"])
    assert got == dict.fromkeys(got, want)
    assert meta["precision_mode"] == "native"
    # the backend takes the lowering keys, merged into the same base the same way
    want_lowering = DLSConfig(**BASE, **LOWERING)
    assert _make_backend(base, **LOWERING) == _options(base, **LOWERING) == want_lowering
    # no live scaler: an fp16_type that moves the scale range is accepted, the preset follows it
    assert want.init_scale == 2.0**16 and DLSConfig(policy="cerebras").with_overrides(
        fp16_type="cbfloat16").init_scale == 2.0**31


def test_all_entry_points_refuse_a_bad_override_with_the_same_message(tmp_path, capsys) -> None:
    base = DLSConfig(**BASE)
    for resolve in (_capture, _compile, _make_backend, _options):
        with pytest.raises(ConfigError) as info:
            resolve(base, **BAD)
        assert str(info.value) == BAD_MESSAGE, resolve.__name__
    # through torch.compile, the same error inside torch's documented wrapper
    torch._dynamo.reset()
    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as wrapped:
        torch.compile(model, backend="dlspass", options={"config": base, **BAD})(x)
    assert str(wrapped.value.inner_exception) == BAD_MESSAGE
    capsys.readouterr()
    rc, out = _cli(tmp_path, _cli_flags(BAD))
    err = capsys.readouterr().err
    assert rc == 2 and BAD_MESSAGE in err and "--precision-mode" in err, err


def test_a_live_scaler_refuses_a_new_scale_range_in_both_entry_points() -> None:
    want = ("fp16_type='cbfloat16' conflicts with the scaler's fp16_type='float16' (it changes "
            "the loss scaling the scaler's state was built for); construct "
            "dlspass.GradScaler(fp16_type='cbfloat16') instead")
    model, opt = _opt()
    with pytest.raises(ConfigError) as compiled:
        dlspass.compile(mse_train_step(model, opt), optimizer=opt, scaler=dlspass.GradScaler(),
                        fp16_type="cbfloat16")
    with pytest.raises(ConfigError) as backend:
        dlspass.make_backend(scaler=dlspass.GradScaler(), fp16_type="cbfloat16")
    assert str(compiled.value) == str(backend.value) == want
    # keys that leave the scaler's state alone merge, the same in both
    scaler = dlspass.GradScaler()
    keep = {"mixed_precision": False, "precision_mode": "native"}
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt, scaler=scaler, **keep)
    assert step.config == dlspass.make_backend(scaler=scaler, **keep).config == DLSConfig(**keep)
    # a config that is not the scaler's, and something that is not a scaler
    for entry in (lambda **kw: dlspass.compile(mse_train_step(model, opt), optimizer=opt, **kw),
                  dlspass.make_backend):
        with pytest.raises(ConfigError, match="differs from the scaler's config"):
            entry(scaler=scaler, config=DLSConfig(fp16_type="cbfloat16"))
        with pytest.raises(ConfigError, match="scaler: expected a dlspass.GradScaler"):
            entry(scaler=object())


def test_compile_with_a_config_makes_its_scaler_from_the_resolved_config() -> None:
    model, opt = _opt()
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt,
                           config=DLSConfig(policy="torch"), fp16_type="cbfloat16",
                           backend_compiler="eager")
    assert step.scaler.config == step.config == DLSConfig(policy="torch", fp16_type="cbfloat16")
    assert float(step.scaler.get_scale()) == 2.0**16  # torch's preset, not cbfloat16's 2**31
    x, y = _batch()
    loss = step(x, y)
    assert math.isfinite(float(loss)) and int(step.scaler.state.num_skipped_steps) == 0


def test_without_a_config_naming_a_format_asks_for_lowering_everywhere() -> None:
    want = DLSConfig(loss_scale=None, fp16_type="bfloat16", mixed_precision=True)
    model, opt = _opt()
    captured = dlspass.capture_step(model, mse_loss, opt, _batch(), fp16_type="bfloat16")
    compiled = dlspass.compile(mse_train_step(model, opt), optimizer=opt, fp16_type="bfloat16")
    assert captured.config == compiled.config == want
    # nothing given: capture_step only captures; compile runs float32 without scaling
    assert dlspass.capture_step(model, mse_loss, opt, _batch()).config is None
    assert dlspass.compile(mse_train_step(model, opt), optimizer=opt).config == DLSConfig(
        loss_scale=None, mixed_precision=False)


def test_with_overrides_names_an_unknown_key_and_keeps_preset_defaults() -> None:
    with pytest.raises(ConfigError, match=r"'precison_mode' \(did you mean 'precision_mode'\?\)"):
        DLSConfig().with_overrides(precison_mode="native")
    cfg = DLSConfig().with_overrides(policy="deepspeed")
    assert cfg.steps_per_increase is None and cfg.growth_interval == 1000  # the new preset's
    assert DLSConfig.from_dict(cfg.with_overrides(precision_mode="native").to_dict()) == DLSConfig(
        policy="deepspeed", precision_mode="native")


def test_capture_errors_are_one_class() -> None:
    from dlspass.capture.compiled_step import CompileError

    assert CaptureError is CompileError is dlspass.StepCaptureError
    assert dlspass.CaptureError is dlspass.CompileError is dlspass.StepCaptureError
    assert issubclass(dlspass.StepCaptureError, dlspass.DLSInputError)
    assert issubclass(dlspass.StepCaptureError, RuntimeError)


def test_a_step_file_records_the_mode_that_ran_and_an_older_emulated_file_stays_emulated(tmp_path) -> None:
    from dlspass.capture.joint_step import transform_program
    from dlspass.capture.optim import OptimizerSpec
    from dlspass.capture.pt2_io import load_program
    from dlspass.errors import InputValueError

    modes = {}
    for fmt, flags in {"float16": [], "cbfloat16": [], "float16-emulate": ["--precision-mode", "emulate"]}.items():
        out = tmp_path / f"{fmt}.pt2"
        assert cf.cli("transform", cf.joint_file("mlp"), "-o", out, "--fp16-type",
                      fmt.removesuffix("-emulate"), *flags) == 0
        _, meta = load_program(out)
        modes[fmt] = (meta["precision_mode"], meta["config"]["precision_mode"])
    assert modes == {"float16": ("native", "native"), "cbfloat16": ("emulate", "emulate"),
                     "float16-emulate": ("emulate", "emulate")}
    # a step written before the config had the field: its recorded mode says what ran
    ep, meta = load_program(tmp_path / "float16-emulate.pt2")
    old = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "precision_mode"}}
    opt = OptimizerSpec(**{k: tuple(v) if k == "betas" else v for k, v in meta["optimizer"].items()})
    assert transform_program(ep, old, DLSConfig(precision_mode="emulate"), opt)[1] is old
    with pytest.raises(InputValueError, match='already a dlspass training step built with .*"emulate"'):
        transform_program(ep, old, DLSConfig(), opt)  # float16's default is native now


def test_a_step_file_with_the_old_mode_key_reads_as_one_written_now(tmp_path) -> None:
    """A step file written before the recorded config carried the mode (the graph's config
    record with ``precision_mode`` null and the mode under ``roles.MODE_KEY``; the file's config
    without the field) reads back with the mode it ran with, as the file written now does."""
    import json

    from dlspass.capture.joint_step import step_graph, transform_program
    from dlspass.capture.optim import OptimizerSpec
    from dlspass.capture.pt2_io import load_program, save_program
    from dlspass.graph import roles
    from dlspass.graph.invariants import verify

    new_file = tmp_path / "new.pt2"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", new_file, "--precision-mode", "emulate") == 0
    ep, meta = load_program(new_file)
    seeds = roles.nodes_with_role(ep.graph_module.graph, roles.SEED)
    assert seeds and all(roles.MODE_KEY not in n.meta["custom"] for n in seeds)  # no longer written
    for node in seeds:  # the record the old way
        custom = node.meta["custom"]
        custom[roles.CONFIG_KEY] = json.dumps({**json.loads(custom[roles.CONFIG_KEY]),
                                               "precision_mode": None}, sort_keys=True)
        custom[roles.MODE_KEY] = "emulate"
    old = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "precision_mode"}}
    save_program(ep, tmp_path / "old.pt2", old)

    old_ep, old_meta = load_program(tmp_path / "old.pt2")
    new_ep, new_meta = load_program(new_file)
    assert [n.meta["custom"].get(roles.MODE_KEY) for n in roles.nodes_with_role(
        old_ep.graph_module.graph, roles.SEED)] == ["emulate"] * len(seeds)
    old_gm, new_gm = step_graph(old_ep, old_meta), step_graph(new_ep, new_meta)
    assert roles.recorded_config(old_gm) == roles.recorded_config(new_gm)
    assert roles.recorded_config(old_gm).lowering_mode == "emulate"
    # without the file's config the graph's own old record says what ran
    del old_gm.graph.output_node().meta["custom"][roles.CONFIG_KEY]
    assert roles.recorded_config(old_gm) == roles.recorded_config(new_gm)
    assert verify(step_graph(old_ep, old_meta)) is True
    opt = OptimizerSpec(**{k: tuple(v) if k == "betas" else v for k, v in old_meta["optimizer"].items()})
    assert transform_program(old_ep, old_meta, DLSConfig(precision_mode="emulate"), opt)[1] is old_meta


def test_transform_program_precision_mode_keyword_is_deprecated(tmp_path) -> None:
    from dlspass.capture.joint_step import transform_program
    from dlspass.capture.optim import OptimizerSpec
    from dlspass.capture.pt2_io import load_program

    ep, meta = load_program(cf.joint_file("mlp"))
    opt = OptimizerSpec(kind="sgd", lr=0.1)
    with pytest.warns(DeprecationWarning, match=r"transform_program\(precision_mode=\.\.\.\) is "
                      r"deprecated: pass config=DLSConfig\(precision_mode='emulate'\)"):
        _, old = transform_program(ep, meta, DLSConfig(), opt, precision_mode="emulate")
    _, new = transform_program(ep, meta, DLSConfig(precision_mode="emulate"), opt)
    assert old["precision_mode"] == new["precision_mode"] == "emulate"
    assert old["config"] == new["config"]


def test_onnx_output_is_emulated(tmp_path) -> None:
    from dlspass.onnx.files import load_onnx, onnx_meta

    out = tmp_path / "step.onnx"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", out) == 0
    assert onnx_meta(load_onnx(out))["precision_mode"] == "emulate"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", tmp_path / "n.onnx",
                  "--precision-mode", "native") == 2
