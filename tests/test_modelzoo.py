"""Model Zoo params.yaml loader: both layouts, the flat dict, defaults and every error path."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from dlspass.config import ConfigError, DLSConfig
from dlspass.modelzoo import model_from_path

# the two entry points (dlspass.modelzoo returns DLSConfig arguments below them)
config_from_params = DLSConfig.from_dict
config_from_yaml = DLSConfig.from_yaml
DATA = Path(__file__).parent / "data"


def _current(**precision):
    return {"trainer": {"init": {"precision": precision}}}


def _err(data) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_params(data, source="params.yaml")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("params.yaml: ")
    return msg


# ---- current layout -----------------------------------------------------------------------------
def test_spec_example_cbfloat16_dynamic():
    cfg = config_from_yaml(DATA / "modelzoo_current_spec.yaml")
    assert cfg.loss_scale == "dynamic"
    assert cfg.fp16_type == "cbfloat16"
    assert cfg.mixed_precision is True
    assert cfg.max_gradient_norm == 1.0
    assert cfg.log_loss_scale is True
    # docs/SEMANTICS.md §2: cbfloat16 starts at (and is capped by) 2**31, floor 2**-14, interval 2000.
    assert cfg.init_scale == 2.0**31
    assert cfg.max_scale == 2.0**31
    assert cfg.min_scale == 2.0**-14
    assert cfg.growth_interval == 2000
    assert cfg.tolerance == 0.0
    assert cfg.dynamic and cfg.enabled
    assert cfg.overflow_check == "global_norm"


def test_from_yaml_classmethod_and_str_path():
    path = DATA / "modelzoo_current_spec.yaml"
    assert DLSConfig.from_yaml(str(path)) == config_from_yaml(path)


def test_every_current_key_and_ignored_unrelated_keys():
    cfg = config_from_yaml(DATA / "modelzoo_current_full.yaml")
    assert cfg == DLSConfig(
        loss_scale="dynamic", fp16_type="float16", mixed_precision=True,
        initial_loss_scale=2e9, steps_per_increase=500, min_loss_scale=1e-4,
        max_loss_scale=2.0**32, max_gradient_value=5.0, log_loss_scale=False,
    )
    # PyYAML alone reads `2e9` and `1e-4` as strings (YAML 1.1); the loader reads floats.
    assert isinstance(cfg.initial_loss_scale, float) and isinstance(cfg.min_loss_scale, float)
    assert cfg.extras == {"precision_opt_level": 1}
    assert cfg.init_scale == 2e9


def test_float16_dynamic_defaults():
    cfg = config_from_params(_current(fp16_type="float16", loss_scaling_factor="dynamic"))
    assert (cfg.init_scale, cfg.max_scale, cfg.min_scale) == (2.0**15, 2.0**15, 2.0**-14)


def test_absent_loss_scaling_factor_means_no_scaling():
    # Model Zoo's MixedPrecision default loss_scaling_factor is 1.0.
    cfg = config_from_params(_current(fp16_type="float16"))
    assert cfg.loss_scale == 1.0 and not cfg.enabled and not cfg.dynamic
    assert cfg.init_scale == 1.0


def test_absent_fp16_type_is_float16_in_2_3_and_enabled_defaults_on():
    # MixedPrecision(fp16_type="float16") in trainer/callbacks/precision.py of Release_2.3.0.
    cfg = config_from_params(_current(loss_scaling_factor="dynamic"), modelzoo_release="2.3")
    assert cfg.fp16_type == "float16" and cfg.mixed_precision is True and cfg.dynamic


def test_absent_fp16_type_is_bfloat16_since_2_4_and_dls_is_dropped_with_a_warning():
    # MixedPrecision(fp16_type="bfloat16") from Release_2.4.0 on; setup() drops the scaler.
    for release in ("2.4", "Release_2.10.0", None):
        with pytest.warns(UserWarning, match="'dynamic' is dropped: the half format is bfloat16"):
            cfg = config_from_params(_current(loss_scaling_factor="dynamic"), modelzoo_release=release)
        assert cfg.fp16_type == "bfloat16" and cfg.mixed_precision is True
        assert not cfg.dynamic and not cfg.enabled and cfg.init_scale == 1.0


def test_static_scale():
    cfg = config_from_params(_current(loss_scaling_factor=128), modelzoo_release="2.3")
    assert cfg.loss_scale == 128.0 and cfg.enabled and not cfg.dynamic and cfg.init_scale == 128.0


def test_bfloat16_needs_no_scaling_and_is_accepted():
    with pytest.warns(UserWarning, match=r"'dynamic' is dropped: the half format is bfloat16, which"):
        cfg = config_from_params(_current(fp16_type="bfloat16", loss_scaling_factor="dynamic"))
    assert cfg.fp16_type == "bfloat16" and not cfg.enabled and not cfg.dynamic
    cfg = config_from_params(_current(fp16_type="bfloat16"))
    assert not cfg.enabled


def test_cbfloat16_disabled_mixed_precision_needs_no_dynamic():
    cfg = config_from_params(_current(enabled=False, fp16_type="cbfloat16", loss_scaling_factor=1.0))
    assert cfg.mixed_precision is False


def test_log_loss_scale_null_follows_dynamic():
    # MixedPrecision of Release_2.5.0 and later: None means "log when dynamic".
    assert config_from_params(_current(fp16_type="float16", loss_scaling_factor="dynamic",
                                       log_loss_scale=None)).log_loss_scale
    assert not config_from_params(_current(fp16_type="float16", loss_scaling_factor=8.0,
                                           log_loss_scale=None)).log_loss_scale
    # Releases 2.3 and 2.4 keep log_loss_scale=False unless the file says true.
    assert not config_from_params(_current(fp16_type="float16", loss_scaling_factor="dynamic"),
                                  modelzoo_release="2.4").log_loss_scale


def test_null_loss_scaling_factor():
    cfg = config_from_params(_current(loss_scaling_factor=None))
    assert cfg.loss_scale is None and not cfg.enabled


def test_no_precision_section_is_fp32_without_scaling():
    for data in ({"trainer": {"init": {"model": {"name": "gpt2"}}}}, {"trainer": {"fit": {}}}):
        cfg = config_from_params(data)
        assert cfg.mixed_precision is False and cfg.loss_scale is None and not cfg.enabled
    # `precision: null` is no Precision callback at all (trainer/validate.py: Optional, None).
    cfg = config_from_params({"trainer": {"init": {"precision": None}}})
    assert cfg.mixed_precision is False and cfg.loss_scale is None and not cfg.enabled
    # An empty `precision: {}` section is MixedPrecision() with its defaults (on, factor 1.0).
    cfg = config_from_params({"trainer": {"init": {"precision": {}}}})
    assert cfg.mixed_precision is True and cfg.loss_scale == 1.0 and cfg.fp16_type == "bfloat16"


# ---- legacy layout ------------------------------------------------------------------------------
def test_legacy_layout():
    cfg = config_from_yaml(DATA / "modelzoo_legacy.yaml")
    assert cfg == DLSConfig(
        loss_scale="dynamic", fp16_type="cbfloat16", mixed_precision=True,
        initial_loss_scale=2.0**20, steps_per_increase=100, min_loss_scale=1.0,
        max_gradient_norm=1.0, log_loss_scale=True,
    )
    assert cfg.extras == {
        "precision_opt_level": 1,
        "log_summaries": True,
        "load_checkpoint_states": ["model", "optimizer"],
    }
    assert cfg.max_scale == 2.0**31 and cfg.init_scale == 2.0**20


def test_legacy_defaults_and_list_of_states():
    cfg = config_from_params({
        "model": {"fp16_type": "float16", "hidden_size": 8},
        "optimizer": {"learning_rate": 0.1, "loss_scaling_factor": "dynamic"},
        "runconfig": {"load_checkpoint_states": ["model", "grad_scaler"]},
    })
    assert cfg.mixed_precision is True and cfg.dynamic and cfg.init_scale == 2.0**15
    assert cfg.extras == {"load_checkpoint_states": ["model", "grad_scaler"]}


def test_legacy_use_bfloat16():
    with pytest.warns(UserWarning, match="is dropped"):
        cfg = config_from_params({"model": {"use_bfloat16": True}, "optimizer": {"loss_scaling_factor": "dynamic"}})
    assert cfg.fp16_type == "bfloat16" and not cfg.enabled
    msg = _err({"model": {"use_bfloat16": True, "fp16_type": "cbfloat16"},
                "optimizer": {"loss_scaling_factor": "dynamic"}})
    assert "model.use_bfloat16" in msg and "cbfloat16" in msg


def test_legacy_without_precision_keys_is_fp32():
    cfg = config_from_params({"model": {"hidden_size": 8}, "optimizer": {"learning_rate": 0.1}})
    assert cfg.mixed_precision is False and not cfg.enabled


# ---- flat layout (DLSConfig.to_dict) ------------------------------------------------------------
def test_flat_round_trip():
    cfg = DLSConfig(fp16_type="cbfloat16", steps_per_increase=7, min_loss_scale=0.5,
                    policy="cerebras", extras={"precision_opt_level": 2})
    back = DLSConfig.from_dict(cfg.to_dict())
    assert back == cfg and back.extras == cfg.extras
    assert DLSConfig.from_dict({}) == DLSConfig()
    torch_cfg = DLSConfig.from_dict({"policy": "torch"})
    assert torch_cfg.init_scale == 2.0**16


def test_flat_errors():
    assert "params.yaml: loss_scaling_factor: unknown DLSConfig field" in _err({"loss_scaling_factor": "dynamic"})
    assert "mixed_precision: expected true or false, got 'yes'" in _err({"mixed_precision": "yes"})
    assert "steps_per_increase" in _err({"steps_per_increase": 0})
    assert "fp16_type" in _err({"fp16_type": "float8"})
    assert "extras: expected a mapping" in _err({"extras": [1]})


# ---- errors -------------------------------------------------------------------------------------
def test_typo_value_error_names_file_and_key():
    path = DATA / "modelzoo_typo.yaml"
    with pytest.raises(ConfigError) as info:
        config_from_yaml(path)
    assert str(info.value) == (
        f"{path}: trainer.init.precision.loss_scaling_factor: "
        "expected \"dynamic\", a number or null, got 'dynamc'"
    )


@pytest.mark.parametrize(
    ("precision", "fragment"),
    [
        ({"enabled": "yes"}, "trainer.init.precision.enabled: expected true or false, got 'yes'"),
        ({"fp16_type": "fp16"}, "trainer.init.precision.fp16_type: expected one of float16 | bfloat16 | cbfloat16, got 'fp16'"),
        ({"precision_opt_level": 3}, "trainer.init.precision.precision_opt_level: expected 0, 1, 2 or null, got 3"),
        ({"precision_opt_level": True}, "precision_opt_level: expected 0, 1, 2 or null, got True"),
        ({"loss_scaling_factor": True}, "loss_scaling_factor: expected \"dynamic\", a number or null, got True"),
        ({"loss_scaling_factor": -1.0}, "loss_scaling_factor: expected \"dynamic\" or a finite number > 0, got -1.0"),
        ({"loss_scaling_factor": float("inf")}, "loss_scaling_factor: expected \"dynamic\" or a finite number > 0"),
        ({"initial_loss_scale": "big"}, "trainer.init.precision.initial_loss_scale: expected a positive number or null, got 'big'"),
        ({"steps_per_increase": 0}, "trainer.init.precision.steps_per_increase: expected a positive integer or null, got 0"),
        ({"steps_per_increase": 2000.0}, "steps_per_increase: expected a positive integer or null, got 2000.0"),
        ({"min_loss_scale": 0}, "trainer.init.precision.min_loss_scale: expected a finite number > 0, got 0"),
        ({"max_loss_scale": -2}, "max_loss_scale: expected a finite number > 0, got -2"),
        ({"max_gradient_norm": 0.0}, "max_gradient_norm: expected a finite number > 0, got 0.0"),
        ({"max_gradient_value": -1}, "max_gradient_value: expected a finite number > 0, got -1"),
        ({"max_gradient_norm": 1.0, "max_gradient_value": 1.0}, "max_gradient_norm and trainer.init.precision.max_gradient_value: set at most one"),
        ({"log_loss_scale": 1}, "trainer.init.precision.log_loss_scale: expected true or false, got 1"),
        ({"loss_scaling_facter": "dynamic"}, "trainer.init.precision.loss_scaling_facter: unknown precision key (did you mean 'loss_scaling_factor'?)"),
        ({"overflow_tolerance": 0.1}, "trainer.init.precision.overflow_tolerance: unknown precision key"),
        ({"zzz": 1}, "zzz: unknown precision key; known keys: enabled, fp16_type"),
        ({"fp16_type": "cbfloat16", "loss_scaling_factor": 1.0}, "trainer.init.precision.loss_scaling_factor: cbfloat16 requires loss_scaling_factor: dynamic (got 1.0)"),
        ({"fp16_type": "cbfloat16"}, "cbfloat16 requires loss_scaling_factor: dynamic (absent means 1.0)"),
        ({"fp16_type": "float16", "loss_scaling_factor": "dynamic", "initial_loss_scale": 8.0, "min_loss_scale": 16.0},
         "trainer.init.precision.initial_loss_scale: 8.0 is outside [trainer.init.precision.min_loss_scale"),
        ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, "trainer.init.precision.min_loss_scale (4.0) is greater than"),
    ],
)
def test_current_layout_errors(precision, fragment):
    assert fragment in _err(_current(**precision))


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"trainer": [1]}, "params.yaml: trainer: expected a mapping, got list"),
        ({"trainer": {"init": "x"}}, "params.yaml: trainer.init: expected a mapping"),
        ({"trainer": {"init": {"precision": [1]}}}, "trainer.init.precision: expected a mapping"),
        ({"optimizer": "adam"}, "params.yaml: optimizer: expected a mapping"),
        ({"optimizer": {"loss_scaling_factr": "dynamic", "learning_rate": 1}},
         "optimizer.loss_scaling_factr: unknown key (did you mean 'loss_scaling_factor'?)"),
        ({"model": {"mixed_precison": True}}, "model.mixed_precison: unknown key (did you mean 'mixed_precision'?)"),
        ({"model": {"fp16_type": "cbfloat16"}, "optimizer": {"loss_scaling_factor": 2.0}},
         "optimizer.loss_scaling_factor: cbfloat16 requires loss_scaling_factor: dynamic (got 2.0)"),
        ({"model": {"mixed_precision": 1}}, "model.mixed_precision: expected true or false, got 1"),
        ({"optimizer": {"log_summaries": "on"}}, "optimizer.log_summaries: expected true or false"),
        ({"runconfig": {"load_checkpoint_states": 3}}, "runconfig.load_checkpoint_states: expected a comma-separated string"),
        ({"runconfig": {"precision_opt_level": "1"}}, "runconfig.precision_opt_level: expected 0, 1, 2 or null, got '1'"),
        ({"optimizer": {"max_gradient_norm": 1.0, "max_gradient_value": 2.0}}, "optimizer.max_gradient_norm and optimizer.max_gradient_value"),
        ({"trainer": {"init": {"precision": {}}}, "optimizer": {"loss_scaling_factor": "dynamic"}},
         "both under trainer.init.precision"),
    ],
)
def test_layout_errors(data, fragment):
    assert fragment in _err(data)


def test_unrelated_legacy_keys_are_not_mistaken_for_typos():
    cfg = config_from_params({
        "model": {"name": "gpt2", "hidden_size": 768, "dropout_rate": 0.1, "use_bias_in_output": False,
                  "mixed_precision": True, "fp16_type": "float16", "precision": "x"},
        "optimizer": {"optimizer_type": "Adam", "learning_rate": [{"scheduler": "Linear"}],
                      "weight_decay": 0.01, "loss_scaling_factor": 4.0, "max_gradient_norm": 2.0},
        "runconfig": {"max_steps": 5, "checkpoint_steps": 1, "log_steps": 1},
        "train_input": {"batch_size": 4},
    })
    assert cfg.loss_scale == 4.0 and cfg.max_gradient_norm == 2.0


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("modelzoo_broken.yaml", "invalid YAML (line 5, column 14): expected ',' or ']'"),
        ("modelzoo_list.yaml", "the top level must be a mapping of settings, got list"),
        ("modelzoo_empty.yaml", "the top level must be a mapping of settings, got nothing"),
    ],
)
def test_file_errors(name, fragment):
    path = DATA / name
    with pytest.raises(ConfigError) as info:
        config_from_yaml(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and fragment in msg and "\n" not in msg


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such file$"):
        config_from_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        config_from_yaml(tmp_path)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_yaml(bad)


def test_config_error_is_value_error_and_from_dict_source():
    with pytest.raises(ValueError, match="^cfg: "):
        DLSConfig.from_dict(_current(fp16_type="x"), source="cfg")
    with pytest.raises(ConfigError, match="^<dict>: the top level must be a mapping"):
        DLSConfig.from_dict([1])  # type: ignore[arg-type]


# ---- Model Zoo configs, as facts ----------------------------------------------------------------
# tests/data/modelzoo_facts.yaml records, for 42 public Cerebras/modelzoo params.yaml files of
# releases R_1.6.0 .. Release_2.10.0 (repository, path and commit named per fact), the precision keys
# each carries in its layout and what each release's Model Zoo code does with them (`expected`,
# with the code named in `expected_from`). Each test writes the minimal config of a fact into a
# Model Zoo-shaped folder and reads it back through DLSConfig.from_yaml.
FACTS_FILE = DATA / "modelzoo_facts.yaml"
FACTS = yaml.safe_load(FACTS_FILE.read_text(encoding="utf-8"))["facts"]
FACT = {fact["id"]: fact for fact in FACTS}
CASES = [(fact, release) for fact in FACTS for release in fact["releases"]]


def _fact_file(root: Path, fact_id: str) -> Path:
    """Write a fact's minimal config at <root>/<release>/<path in the Model Zoo tree>."""
    fact = FACT[fact_id]
    path = root / fact["release"] / fact["source"]["path"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(fact["config"], sort_keys=False), encoding="utf-8")
    return path


def test_the_facts_cover_both_layouts_and_name_their_sources():
    assert len(FACTS) == 43 and len(CASES) == 110  # one fact per Model Zoo file the suite covers
    assert len(FACT) == len(FACTS)
    assert len({release for fact in FACTS for release in fact["releases"]}) >= 8
    assert {fact["layout"] for fact in FACTS} == {"current", "legacy"}
    paths = [(fact["source"]["commit"], fact["source"]["path"]) for fact in FACTS]
    assert len(set(paths)) == len(paths)
    for fact in FACTS:
        source = fact["source"]
        assert source["repo"] == "Cerebras/modelzoo" and len(source["commit"]) == 40, fact["id"]
        assert source["path"].endswith(".yaml") and len(source["blob"]) == 40, fact["id"]
        assert fact["release"] in fact["releases"], fact["id"]
        assert set(fact["expected_from"]) <= set(fact["expected"]), fact["id"]
        assert set(fact.get("expected_by_release", {})) <= set(fact["releases"]) - {fact["release"]}
        # the layout is decided by the nesting the config keeps: trainer.init, else the sections
        assert ("trainer" in fact["config"]) is (fact["layout"] == "current"), fact["id"]


@pytest.mark.parametrize(("fact", "release"), CASES, ids=[f"{f['id']}@{r}" for f, r in CASES])
def test_model_zoo_config_facts_match_what_each_release_does(fact, release, tmp_path):
    exp = {**fact["expected"], **fact.get("expected_by_release", {}).get(release, {})}
    path = _fact_file(tmp_path, fact["id"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_yaml(path, modelzoo_release=release, modelzoo_model=fact["model"])
    dropped = [w for w in caught if "is dropped: the half format is bfloat16" in str(w.message)]
    assert len(dropped) == (1 if exp.get("dls_dropped_for_bfloat16") else 0)
    assert len(caught) == len(dropped)
    assert cfg.mixed_precision is exp["mixed_precision"]
    if "fp16_type" in exp:
        assert cfg.fp16_type == exp["fp16_type"]
    assert cfg.log_loss_scale is exp.get("log_loss_scale", False)
    assert cfg.max_gradient_norm == exp.get("max_gradient_norm")
    assert cfg.extras.get("precision_opt_level") == exp.get("precision_opt_level")
    if exp["scaler"] == "none":
        assert not cfg.enabled and not cfg.dynamic and cfg.init_scale == 1.0
    elif exp["scaler"] == "static":
        assert cfg.enabled and not cfg.dynamic and cfg.init_scale == exp["init_scale"]
    else:
        assert cfg.dynamic
        assert (cfg.init_scale, cfg.max_scale, cfg.min_scale, cfg.growth_interval) == (
            exp["init_scale"], exp["max_scale"], exp["min_scale"], exp["steps_per_increase"])
    # The checkout-shaped path names the same model where Model Zoo keeps the file directly in
    # <model>/configs/ (a subfolder such as gpt3/configs/muP/ names none), and reads the same.
    inferred = model_from_path(path)
    assert inferred in (fact["model"], None)
    if inferred is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert config_from_yaml(path, modelzoo_release=release) == cfg


def test_model_zoo_configs_without_a_release_read_as_the_newest_or_a_2_0_file(tmp_path):
    # gemma2 (2.10, no fp16_type): bfloat16 without scaling, with a warning, as Model Zoo 2.10 does.
    with pytest.warns(UserWarning, match="is dropped"):
        cfg = DLSConfig.from_yaml(str(_fact_file(tmp_path, "Release_2.10.0/gemma2/params_gemma2_27b_msl8k")))
    assert cfg.fp16_type == "bfloat16" and not cfg.enabled and cfg.log_loss_scale is True
    # A file with model.use_bfloat16 is read with the rules of 2.0, the last release that reads it.
    cfg = DLSConfig.from_yaml(str(_fact_file(tmp_path, "Release_2.0.2/btlm/params_btlm_2p7b_2k")))
    assert cfg.fp16_type == "bfloat16" and cfg.log_loss_scale is False
    assert cfg.extras["precision_opt_level"] == 1


def test_release_specific_keys_are_refused_where_model_zoo_refuses_them(tmp_path):
    path = _fact_file(tmp_path, "Release_2.0.2/btlm/params_btlm_2p7b_2k")
    # half_dtype.py of Release_2.1.0 raises KeyError on model.use_bfloat16.
    with pytest.raises(ConfigError, match=r"model\.use_bfloat16: Model Zoo 2\.1 rejects this key"):
        config_from_yaml(path, modelzoo_release="Release_2.1.0")
    # run_cstorch_flow.py of Release_2.1.0 raises on model.precision_opt_level.
    with pytest.raises(ConfigError, match=r"model\.precision_opt_level: Model Zoo 2\.1 no longer reads it"):
        config_from_yaml(_fact_file(tmp_path, "R_1.7.1/gpt3/params_gpt3_xl"), modelzoo_release="2.1")
    with pytest.raises(ConfigError, match="the trainer layout needs Model Zoo 2.3 or later"):
        config_from_yaml(_fact_file(tmp_path, "Release_2.5.0/bert/bert_base_classifier_mnli"),
                         modelzoo_release="2.2")
    with pytest.raises(ConfigError, match="modelzoo_release: expected a release such as"):
        config_from_yaml(path, modelzoo_release="latest")
    with pytest.raises(ConfigError, match="predates R_1.6.0"):
        config_from_yaml(path, modelzoo_release="1.5")


# ---- release rules, each against the Model Zoo code it reproduces --------------------------------
def _legacy(**optimizer):
    return {"model": {"mixed_precision": True, "fp16_type": "float16"},
            "optimizer": {"loss_scaling_factor": "dynamic", **optimizer}}


@pytest.mark.parametrize(("release", "logged", "logged_off"), [
    # not read by 1.6/1.7; their GPU runner (pytorch_runner.py) logs the scale whenever it has a
    # GradScaler (mixed_precision and loss_scaling_factor != 1.0), with or without log_summaries
    ("R_1.6.0", True, True),
    ("R_1.7.1", True, True),
    ("Release_1.8.0", True, False),  # pytorch_base_runner._log_summaries_loss_scale
    ("1.9", True, False),
    ("Release_2.0.3", False, False),  # run_cstorch_flow returns loss_scale None
    ("2.1", True, False),            # run_cstorch_flow: grad_scaler.get_scale() under log_summaries
    ("2.3", True, False),            # trainer conversion: log_summaries -> precision.log_loss_scale
    ("2.10", True, False),
])
def test_log_summaries_per_release(release, logged, logged_off):
    cfg = config_from_params(_legacy(log_summaries=True), modelzoo_release=release)
    assert cfg.log_loss_scale is logged
    assert cfg.extras["log_summaries"] is True
    off = config_from_params(_legacy(log_summaries=False), modelzoo_release=release)
    assert off.log_loss_scale is logged_off


@pytest.mark.parametrize("release", ["R_1.6.1", "R_1.7.0"])
def test_1_6_and_1_7_log_the_scale_exactly_when_the_gpu_runner_has_a_scaler(release):
    # R_1.7.1 pytorch_runner.py L60-76: GradScaler only for mixed_precision and a factor != 1.0
    static = {"model": {"mixed_precision": True, "fp16_type": "float16"},
              "optimizer": {"loss_scaling_factor": 128.0, "log_summaries": False}}
    assert config_from_params(static, modelzoo_release=release).log_loss_scale is True
    one = {**static, "optimizer": {"loss_scaling_factor": 1.0, "log_summaries": True}}
    assert config_from_params(one, modelzoo_release=release).log_loss_scale is False
    fp32 = {**static, "model": {"mixed_precision": False}}
    assert config_from_params(fp32, modelzoo_release=release).log_loss_scale is False
    explicit = {**static, "optimizer": {"loss_scaling_factor": "dynamic", "log_loss_scale": False}}
    assert config_from_params(explicit, modelzoo_release=release).log_loss_scale is False


def test_absent_log_summaries_follows_dynamic_from_2_5():
    assert config_from_params(_legacy(), modelzoo_release="2.5").log_loss_scale is True
    assert config_from_params(_legacy(), modelzoo_release="2.4").log_loss_scale is False
    assert config_from_params(_legacy(), modelzoo_release="1.9").log_loss_scale is False


def test_model_precision_opt_level_up_to_2_0_and_runconfig_wins():
    data = {"model": {"mixed_precision": True, "precision_opt_level": 0, "fp16_type": "float16"},
            "optimizer": {"loss_scaling_factor": "dynamic"}}
    assert config_from_params(data, modelzoo_release="2.0").extras["precision_opt_level"] == 0
    both = {**data, "runconfig": {"precision_opt_level": 2}}
    assert config_from_params(both, modelzoo_release="1.9").extras["precision_opt_level"] == 2
    with pytest.raises(ConfigError, match="no longer reads it here"):
        config_from_params(data, modelzoo_release="2.2")


def test_csconfig_use_cbfloat16():
    data = {"model": {"mixed_precision": True}, "optimizer": {"loss_scaling_factor": "dynamic"},
            "csconfig": {"use_cbfloat16": True}}
    cfg = config_from_params(data)  # detected as a 1.9 file
    assert cfg.fp16_type == "cbfloat16" and cfg.init_scale == 2.0**31
    assert config_from_params(data, modelzoo_release="R_1.6.0").fp16_type == "cbfloat16"
    with pytest.raises(ConfigError, match="csconfig.use_cbfloat16: Model Zoo 2.4 does not read"):
        config_from_params(data, modelzoo_release="2.4")
    clash = {**data, "model": {"mixed_precision": True, "use_bfloat16": True}}
    assert "csconfig.use_cbfloat16: true contradicts" in _err(clash)
    with pytest.raises(ConfigError, match="cbfloat16 requires loss_scaling_factor: dynamic"):
        config_from_params({**data, "optimizer": {}}, modelzoo_release="1.9")


@pytest.mark.parametrize(("release", "model", "fp16_type"), [
    ("R_1.6.0", "gpt2", "float16"),     # no set_defaults for the format yet
    ("R_1.7.0", "gpt2", "bfloat16"),    # gpt2/utils.py set_defaults: use_bfloat16 True
    ("R_1.7.0", "bert", "float16"),
    ("R_1.7.0", "llama", "float16"),    # llama/run.py uses gpt2 defaults only from 1.9
    ("1.9", "llama", "bfloat16"),
    ("2.2", "jais", "bfloat16"),        # models/nlp/gpt2/utils.py: fp16_type default bfloat16
    ("2.1", "jais", "float16"),
    ("2.3", "gpt2", "float16"),         # trainer flow: MixedPrecision(fp16_type="float16")
    ("2.4", "bert", "bfloat16"),        # MixedPrecision(fp16_type="bfloat16")
])
def test_release_and_model_fp16_defaults(release, model, fp16_type):
    data = {"model": {"mixed_precision": True}, "optimizer": {"loss_scaling_factor": 8.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = config_from_params(data, modelzoo_release=release, modelzoo_model=model)
    assert cfg.fp16_type == fp16_type
    assert cfg.enabled is (fp16_type != "bfloat16")


def test_cstorch_caps_initial_scale_at_max_and_refuses_tiny_min():
    # cerebras.pytorch.amp.GradScaler: loss_scale = min(max_loss_scale, init_scale)
    cfg = config_from_params(_current(fp16_type="float16", loss_scaling_factor="dynamic",
                                      initial_loss_scale=2.0**20, max_loss_scale=2.0**10))
    assert cfg.init_scale == 2.0**10 and cfg.max_scale == 2.0**10
    cfg = config_from_params(_current(fp16_type="float16", loss_scaling_factor="dynamic", initial_loss_scale=2.0**20))
    assert cfg.init_scale == 2.0**15  # the default max of float16
    # ... and raises "min_loss_scale too small" below 2**-14 when dynamic.
    msg = _err(_current(fp16_type="float16", loss_scaling_factor="dynamic", min_loss_scale=2.0**-15))
    assert "trainer.init.precision.min_loss_scale: 3.0517578125e-05 is below 2**-14" in msg
    msg = _err(_current(fp16_type="float16", loss_scaling_factor="dynamic", initial_loss_scale=2.0**20,
                        min_loss_scale=2.0**16))
    assert msg.endswith("trainer.init.precision.min_loss_scale (65536.0) is greater than "
                        "trainer.init.precision.max_loss_scale (32768.0)")
    # A static scale ignores min_loss_scale, as cstorch does.
    assert config_from_params(_current(fp16_type="float16", loss_scaling_factor=4.0, min_loss_scale=2.0**-15)).enabled


def test_duplicate_yaml_keys_are_an_error(tmp_path):
    # Model Zoo 2.5+ loads params with UniqueKeyLoader (common/utils/utils.py), which refuses them.
    path = tmp_path / "dup.yaml"
    path.write_text("trainer:\n  init:\n    precision:\n      fp16_type: cbfloat16\n"
                    "      fp16_type: float16\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"invalid YAML \(line 5, column 7\): duplicate key 'fp16_type'"):
        config_from_yaml(path)


@pytest.mark.parametrize(("path", "model"), [
    # paths of each release's own tree (git ls-tree of the tags named)
    ("modelzoo/transformers/pytorch/gpt2/configs/params_gpt2_small.yaml", "gpt2"),  # R_1.7.1
    ("modelzoo/transformers/pytorch/bert/fine_tuning/qa/configs/bert_base_squad.yaml", "bert"),
    ("modelzoo/transformers/pytorch/gptj/fine_tuning/continuous_pretraining/configs/p.yaml", "gptj"),
    ("modelzoo/fc_mnist/pytorch/configs/params.yaml", "fc_mnist"),
    ("src/cerebras/modelzoo/models/nlp/gpt3/configs/Cerebras_GPT_2p7b.yaml", "gpt3"),  # 2.2.0
    ("params_gpt2_small.yaml", None),
    ("runs/gpt2/params.yaml", None),
])
def test_the_model_is_read_from_a_model_zoo_checkout_path(path, model):
    assert model_from_path(path) == model


def test_a_gpt_config_in_a_checkout_gets_its_family_default_and_elsewhere_a_warning(tmp_path):
    # R_1.7.1 gpt2/utils.py set_defaults: model.use_bfloat16 defaults to True (L35)
    text = "model:\n  mixed_precision: true\noptimizer:\n  loss_scaling_factor: dynamic\n"
    in_tree = tmp_path / "modelzoo/transformers/pytorch/gpt2/configs/params_gpt2_tiny.yaml"
    in_tree.parent.mkdir(parents=True)
    in_tree.write_text(text)
    with pytest.warns(UserWarning, match="is dropped: the half format is bfloat16"):
        assert config_from_yaml(in_tree, modelzoo_release="R_1.7.1").fp16_type == "bfloat16"
    loose = tmp_path / "params.yaml"
    loose.write_text(text)
    with pytest.warns(UserWarning, match=r"family is not named and Model Zoo 1\.7 defaults 2 "
                      r"settings per model: the half format is not named, read as float16 "
                      r"\(bfloat16 for .*gpt2.*loss_scaling_factor: dynamic is kept"):
        assert config_from_yaml(loose, modelzoo_release="R_1.7.1").fp16_type == "float16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = config_from_yaml(loose, modelzoo_release="R_1.7.1", modelzoo_model="bert")
    assert cfg.fp16_type == "float16"  # bert/utils.py of R_1.7.1: use_bfloat16 False (L51)


def test_log_steps_is_read_from_both_layouts_and_checked():
    legacy = {**_legacy(log_summaries=True), "runconfig": {"log_steps": 50}}
    assert config_from_params(legacy, modelzoo_release="1.9").extras["log_steps"] == 50
    current = _current(fp16_type="float16")
    current["trainer"]["init"]["logging"] = {"log_steps": 10}
    assert config_from_params(current).extras["log_steps"] == 10
    assert "log_steps" not in config_from_params(_current(fp16_type="float16")).extras
    # log_steps alone is not a precision setting: fp32 without a scaler, as before
    assert not config_from_params({"runconfig": {"log_steps": 5}}).mixed_precision
    with pytest.raises(ConfigError, match=r"runconfig\.log_steps: expected a positive integer"):
        config_from_params({**legacy, "runconfig": {"log_steps": 0}})
    current["trainer"]["init"]["logging"] = {"log_steps": "often"}
    with pytest.raises(ConfigError, match=r"trainer\.init\.logging\.log_steps: expected a positive integer"):
        config_from_params(current)
