"""The model family of a legacy Model Zoo config (issue 34, item 6): named, read from the file,
or warned about once. Minimal configs are written in ``tmp_path``; the defaults were read from
each release's ``set_defaults`` (docs/MODELZOO.md)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import cli_factories as cf
import pytest
import yaml

from dlspass.capture.pt2_io import load_program
from dlspass.config import DLSConfig
from dlspass.modelzoo_releases import (
    BFLOAT16_DEFAULTS,
    GPT_STYLE,
    model_from_params,
    model_from_path,
    modelzoo_rules,
)

# R_1.7.1 gpt2/utils.py set_defaults: model.use_bfloat16 defaults to True (L35)
LEGACY = ("model:\n  mixed_precision: true\noptimizer:\n  loss_scaling_factor: 1.0\n"
          "runconfig:\n  log_steps: 10\n")
GPT_INPUT = 'train_input:\n  data_processor: "GptHDF5DataProcessor"\n  batch_size: 8\n'


@pytest.mark.parametrize("processor", ["GptHDF5DataProcessor", "GptHDF5MapDataProcessor"])
def test_a_gpt_data_processor_says_the_family_outside_a_checkout(tmp_path, processor):
    f = tmp_path / "params_gpt2_small.yaml"  # copied out of the checkout: no model directory
    f.write_text(LEGACY + f'eval_input:\n  data_processor: "{processor}"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not named" warning: the file says it
        cfg = DLSConfig.from_yaml(str(f), modelzoo_release="R_1.7.1")
    assert cfg.fp16_type == "bfloat16"


@pytest.mark.parametrize("release", ["R_1.7.1", "1.9", "2.0", "2.2"])
def test_gpt_family_defaults_bfloat16_in_releases_with_gpt_defaults(release):
    data = {"train_input": {"data_processor": "GptHDF5DataProcessor"},
            "model": {"mixed_precision": True}, "optimizer": {"loss_scaling_factor": 1.0}}
    assert DLSConfig.from_dict(data, modelzoo_release=release).fp16_type == "bfloat16"
    # R_1.6 had no GPT default (docs/MODELZOO.md: it does not read use_bfloat16)
    assert DLSConfig.from_dict(data, modelzoo_release="1.6").fp16_type == "float16"


def test_an_unsaid_family_warns_once_naming_the_setting_and_the_value(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text(LEGACY)
    with pytest.warns(UserWarning) as record:
        cfg = DLSConfig.from_yaml(str(f), modelzoo_release="2.1")
    assert cfg.fp16_type == "float16"
    assert len(record) == 1
    msg = str(record[0].message)
    assert "half format is not named" in msg and "read as float16" in msg
    assert "modelzoo_model" in msg and "--modelzoo-model" in msg
    # naming the family settles it, either way
    named = DLSConfig.from_yaml(str(f), modelzoo_release="2.1", modelzoo_model="gptj")
    assert named.fp16_type == "bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bert = DLSConfig.from_yaml(str(f), modelzoo_release="2.1", modelzoo_model="bert")
    assert bert.fp16_type == "float16"


def test_model_from_params_reads_only_the_gpt_processors():
    assert model_from_params({"train_input": {"data_processor": "GptTfRecordsProcessor"}}) == GPT_STYLE
    assert model_from_params({"train_input": {"data_processor": "BertCSVDataProcessor"}}) is None
    assert model_from_params({"train_input": "GptHDF5DataProcessor"}) is None
    assert model_from_params({}) is None


# ---- real configs whose defaults depend on the family (tests/data/modelzoo_facts.yaml) ----------
# The facts record what each release's runner does with the file in its model's checkout. The
# cases here are the legacy facts of releases 1.7-2.2 that name no half format (model.fp16_type /
# use_bfloat16) and whose model defaults it to bfloat16 (GPT-style models; in 2.2 every model with
# a config class, DPR's among them): their half format, whether Model Zoo keeps the dynamic scale,
# whether it logs the scale and whether mixed precision is on are read with the family.
FACTS = yaml.safe_load((Path(__file__).parent / "data" / "modelzoo_facts.yaml")
                       .read_text(encoding="utf-8"))["facts"]
FAMILY_CASES = [
    (fact, release) for fact in FACTS for release in fact["releases"]
    if fact["layout"] == "legacy" and modelzoo_rules(release).release in BFLOAT16_DEFAULTS
    and fact["model"] in BFLOAT16_DEFAULTS[modelzoo_rules(release).release]
    and not {"fp16_type", "use_bfloat16"} & set(fact["config"].get("model", {}))
]
FAMILY_IDS = [f"{f['id']}@{r}" for f, r in FAMILY_CASES]


def test_the_family_cases_are_the_bfloat16_models_configs_without_a_half_format():
    assert FAMILY_IDS == [
        "R_1.7.0/gpt2/params_gpt2_small_ws@R_1.7.0", "R_1.7.0/gpt2/params_gpt2_small_ws@R_1.7.1",
        "R_1.7.0/gpt2/params_gpt2_small@R_1.7.0", "R_1.7.0/gpt2/params_gpt2_small@R_1.7.1",
        "R_1.7.1/gpt2/params_gpt2_xl@R_1.7.1", "R_1.7.1/gpt3/params_gpt3_xl@R_1.7.1",
        "R_1.7.1/gptj/params_gptj_6B@R_1.7.1", "Release_1.9.1/llama/params_llama_7b@Release_1.9.1",
        "Release_2.2.0/dpr/params_dpr_base_nq@Release_2.2.0",
        "Release_2.2.0/dpr/params_dpr_base_nq@Release_2.2.1"]


def _read(data: dict, release: str, **kw) -> tuple[DLSConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = DLSConfig.from_dict(copy.deepcopy(data), modelzoo_release=release, **kw)
    return cfg, [str(w.message) for w in caught]


def _check_defaults(cfg: DLSConfig, exp: dict) -> None:
    # each default on its own, against the release's runner (the fact's `expected`)
    assert cfg.fp16_type == exp["fp16_type"]
    assert cfg.mixed_precision is exp["mixed_precision"]
    assert cfg.log_loss_scale is exp["log_loss_scale"]
    assert cfg.dynamic is (exp["scaler"] == "dynamic")
    assert cfg.enabled is (exp["scaler"] != "none")


@pytest.mark.parametrize(("fact", "release"), FAMILY_CASES, ids=FAMILY_IDS)
def test_real_family_configs_named_inferred_or_warned(fact, release):
    exp = {**fact["expected"], **fact.get("expected_by_release", {}).get(release, {})}
    # named: the runner's defaults, and no family warning
    named, msgs = _read(fact["config"], release, modelzoo_model=fact["model"])
    _check_defaults(named, exp)
    assert not [m for m in msgs if "model family is not named" in m]
    # inferred from the file (its model's data processor), outside any checkout: the same
    processor = "DPRHDF5DataProcessor" if fact["model"] == "dpr" else "GptHDF5DataProcessor"
    with_processor = {**fact["config"], "train_input": {"data_processor": processor}}
    inferred, msgs = _read(with_processor, release)
    assert inferred == named
    assert not [m for m in msgs if "model family is not named" in m]
    # unknown: one warning naming every setting that depends on the family and the value chosen
    unknown, msgs = _read(fact["config"], release)
    family = [m for m in msgs if "model family is not named" in m]
    assert len(family) == 1 and len(msgs) == 1, msgs
    dynamic = fact["config"].get("optimizer", {}).get("loss_scaling_factor") == "dynamic"
    msg = family[0]
    assert "the half format is not named, read as float16" in msg
    assert ("optimizer.loss_scaling_factor: dynamic is kept" in msg) is dynamic
    assert f"defaults {2 if dynamic else 1} setting" in msg
    assert "modelzoo_model" in msg and "--modelzoo-model" in msg
    assert unknown.fp16_type == "float16" and unknown.dynamic is dynamic
    # what does not depend on the family reads the same either way
    assert (unknown.mixed_precision, unknown.log_loss_scale) == (named.mixed_precision,
                                                                 named.log_loss_scale)


def test_cli_warns_once_for_an_unnamed_family_and_takes_the_flag(tmp_path, capsys):
    # a 2.0 file (model.precision_opt_level is read up to 2.0) with a dynamic scale and no half
    # format: GPT-2 defaults bfloat16 (Release_2.0.3 gpt2/utils.py set_defaults) and then drops
    # the dynamic scale (run_cstorch_flow.py); nothing here names the family
    cfg_file = tmp_path / "params.yaml"
    cfg_file.write_text("model:\n  mixed_precision: true\n  precision_opt_level: 1\n"
                        "optimizer:\n  loss_scaling_factor: dynamic\n")
    out = tmp_path / "unnamed.pt2"
    capsys.readouterr()
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", out, "--config", cfg_file) == 0
    err = capsys.readouterr().err
    family = [line for line in err.splitlines() if "model family is not named" in line]
    assert len(family) == 1 and family[0].startswith("warning: ")
    assert "read as float16" in family[0] and "loss_scaling_factor: dynamic is kept" in family[0]
    assert "--modelzoo-model" in family[0]
    _, meta = load_program(out)
    assert meta["config"]["fp16_type"] == "float16" and DLSConfig.from_dict(meta["config"]).dynamic
    # a command that fails after reading the file keeps stderr to its one error line
    bad = tmp_path / "native.onnx"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", bad, "--config", cfg_file,
                  "--precision-mode", "native") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--precision-mode" in err, err
    assert not bad.exists()
    named = tmp_path / "gpt2.pt2"
    assert cf.cli("transform", cf.joint_file("mlp"), "-o", named, "--config", cfg_file,
                  "--modelzoo-model", "gpt2") == 0
    err = capsys.readouterr().err
    assert "model family is not named" not in err
    # GPT-2's bfloat16 drops the dynamic scale, and the reader says so
    assert "warning: " in err and "is dropped: the half format is bfloat16" in err
    _, meta = load_program(named)
    assert meta["config"]["fp16_type"] == "bfloat16"
    assert not DLSConfig.from_dict(meta["config"]).enabled  # bfloat16: no scaling


# ---- 2.2: the config class's default (issue 34, item 6) -----------------------------------------
# Release_2.2.0/2.2.1 cli_parser.py get_params_from_args replaces the params with asdict() of the
# config class registered for the run.py's directory before set_defaults runs, so an absent
# model.fp16_type is ModelZooConfig's "bfloat16" for every model with a config class, "float16"
# for t5 and transformer (t5/config.py), and half_dtype.py's "float16" for the models without one.
@pytest.mark.parametrize(("model", "fp16_type"), [
    ("bert", "bfloat16"), ("dpr", "bfloat16"), ("esm2", "bfloat16"), ("vision_transformer", "bfloat16"),
    ("token_classifier", "bfloat16"), ("t5", "float16"), ("transformer", "float16"),
    ("fc_mnist", "float16"), ("layers_api_demo", "float16"),
])
def test_2_2_defaults_the_half_format_by_config_class(model, fp16_type):
    data = {"model": {"mixed_precision": True}, "optimizer": {"loss_scaling_factor": "dynamic"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bfloat16 drops the dynamic scale, with a warning
        cfg = DLSConfig.from_dict(copy.deepcopy(data), modelzoo_release="2.2.1", modelzoo_model=model)
    assert (cfg.fp16_type, cfg.dynamic) == (fp16_type, fp16_type == "float16")
    # 2.1 had no config classes: only GPT-style models default bfloat16 there
    if model in ("bert", "esm2", "t5"):
        assert DLSConfig.from_dict(copy.deepcopy(data), modelzoo_release="2.1",
                                   modelzoo_model=model).fp16_type == "float16"


def test_unnamed_2_2_family_warning_lists_the_config_class_models():
    data = {"model": {"mixed_precision": True}, "optimizer": {"loss_scaling_factor": "dynamic"}}
    cfg, msgs = _read(data, "2.2.0")
    assert cfg.fp16_type == "float16" and cfg.dynamic
    assert len(msgs) == 1
    assert "bfloat16 for bert, bloom," in msgs[0] and "dpr" in msgs[0] and "t5" not in msgs[0]


def test_model_from_params_reads_the_dpr_processor_only():
    assert model_from_params({"train_input": {"data_processor": "DPRHDF5DataProcessor"}}) == "dpr"
    # embedding generation (its own run.py, no config class in 2.2.0) is not DPR training
    assert model_from_params({"eval_input": {"data_processor": "DPREmbedGenHDF5DataProcessor"}}) is None


@pytest.mark.parametrize(("path", "model"), [
    ("modelzoo/transformers/pytorch/gpt2/configs/params_gpt2_small.yaml", "gpt2"),
    # configs in a subfolder of configs/ (Release_2.2.0 gpt3/configs/Cerebras_GPT/111m.yaml)
    ("src/cerebras/modelzoo/models/nlp/gpt3/configs/Cerebras_GPT/111m.yaml", "gpt3"),
    ("modelzoo/transformers/pytorch/bert/fine_tuning/qa/configs/bert_base_squad.yaml", "bert"),
    ("src/cerebras/modelzoo/models/nlp/dpr/configs/params_dpr_base_nq.yaml", "dpr"),
    ("params.yaml", None), ("configs/params.yaml", None), ("somewhere/else/params.yaml", None),
])
def test_model_from_path_finds_the_model_above_the_innermost_configs(path, model):
    assert model_from_path(path) == model


def test_a_nested_gpt_config_in_its_checkout_needs_no_family(tmp_path):
    f = tmp_path / "gpt3" / "configs" / "Cerebras_GPT" / "params.yaml"
    f.parent.mkdir(parents=True)
    f.write_text(LEGACY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the path names the model: no "not named" warning
        cfg = DLSConfig.from_yaml(str(f), modelzoo_release="1.9")
    assert cfg.fp16_type == "bfloat16"


# ---- the settings that do not depend on the family -------------------------------------------
# Whether the scale is logged and whether mixed precision is on: no release's runner takes a
# model-specific default for them (docs/MODELZOO.md, "Model family" lists what was checked), so a
# legacy fact reads the same with its model named, inferred from its checkout path, and unknown.
LEGACY_CASES = [(fact, release) for fact in FACTS for release in fact["releases"]
                if fact["layout"] == "legacy"]


@pytest.mark.parametrize(("fact", "release"), LEGACY_CASES,
                         ids=[f"{f['id']}@{r}" for f, r in LEGACY_CASES])
def test_log_and_mixed_precision_do_not_depend_on_the_family(fact, release):
    exp = {**fact["expected"], **fact.get("expected_by_release", {}).get(release, {})}
    named, _ = _read(fact["config"], release, modelzoo_model=fact["model"])
    unknown, _ = _read(fact["config"], release)
    for cfg in (named, unknown):
        assert cfg.log_loss_scale is exp["log_loss_scale"]
        assert cfg.mixed_precision is exp["mixed_precision"]
