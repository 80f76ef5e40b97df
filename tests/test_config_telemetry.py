"""``DLSConfig.telemetry``: off by default (Model Zoo has no key for it), a bool or a watch list
(``"default"``, what ``True`` means, or ``"all"``) checked once,
written by ``to_dict`` and read back from a dict or a flat YAML file, mergeable into a live
scaler's config (it changes no scaling rule), and refused in one line by the ``.pt2``
transform, which has no buffer to feed (the step front ends: tests/test_telemetry.py)."""

from __future__ import annotations

from pathlib import Path

import cli_factories as cf
import pytest

import dlspass
from dlspass.config import ConfigError, DLSConfig

DATA = Path(__file__).parent / "data"


def test_telemetry_is_off_by_default_and_in_no_model_zoo_file() -> None:
    assert DLSConfig().telemetry is False
    assert DLSConfig.from_yaml(str(DATA / "modelzoo_current_full.yaml")).telemetry is False
    assert DLSConfig.from_yaml(str(DATA / "modelzoo_legacy.yaml")).telemetry is False


@pytest.mark.parametrize("value", ["yes", 1, None, ["all"]])
def test_a_value_neither_bool_nor_watch_list_is_refused_naming_the_field(value: object) -> None:
    refusal = r"^telemetry: expected a bool or one of default, all, got "
    with pytest.raises(ConfigError, match=refusal):
        DLSConfig(telemetry=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=refusal):
        DLSConfig().with_overrides(telemetry=value)


@pytest.mark.parametrize(("value", "watch"), [(False, None), (True, "default"), ("default", "default"),
                                              ("all", "all")])
def test_the_watch_list_in_effect(value: object, watch: str | None) -> None:
    assert DLSConfig(telemetry=value).telemetry_watch == watch  # type: ignore[arg-type]


def test_the_full_watch_list_round_trips_through_a_flat_yaml_file(tmp_path) -> None:
    path = tmp_path / "dls.yaml"
    path.write_text("telemetry: all\n")
    cfg = DLSConfig.from_yaml(str(path))
    assert cfg.telemetry == "all" and DLSConfig.from_dict(cfg.to_dict()) == cfg


def test_telemetry_round_trips_through_to_dict_and_a_flat_yaml_file(tmp_path) -> None:
    cfg = DLSConfig(fp16_type="bfloat16", telemetry=True)
    assert cfg.to_dict()["telemetry"] is True
    assert DLSConfig.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "dls.yaml"
    path.write_text("fp16_type: bfloat16\ntelemetry: true\n")
    assert DLSConfig.from_yaml(str(path)) == cfg
    assert DLSConfig().with_overrides(telemetry=True).telemetry is True


def test_a_live_scaler_takes_telemetry_as_an_override() -> None:
    scaler = dlspass.GradScaler(fp16_type="float16")
    merged = scaler.config.with_overrides_keeping_state(telemetry=True)
    assert merged.telemetry is True and merged.with_overrides(telemetry=False) == scaler.config


def test_the_pt2_transform_refuses_telemetry_in_one_line(tmp_path, capsys) -> None:
    yaml = tmp_path / "dls.yaml"
    yaml.write_text("telemetry: true\n")
    capsys.readouterr()
    rc = cf.cli("transform", cf.joint_file("mlp"), "-o", tmp_path / "step.pt2", "--config", yaml)
    err = capsys.readouterr().err
    assert rc == 2 and "telemetry=True: this step front end has no telemetry buffer" in err, err
    assert not (tmp_path / "step.pt2").exists()
