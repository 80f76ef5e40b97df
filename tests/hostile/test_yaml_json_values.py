"""YAML values that JSON cannot hold: a config that contains itself, binary blobs, sets,
timestamps, non-string keys. ``from_yaml`` must refuse each with one line (``ConfigError``),
and ``dlspass transform --config`` with exit 2; before, they were accepted and crashed later
(exit 3, a traceback) or reached the run as values no config can mean."""

from __future__ import annotations

import time
from pathlib import Path

import cli_factories as cf
import pytest

from dlspass.cli import run
from dlspass.config import ConfigError, DLSConfig

pytestmark = pytest.mark.timeout(120)

# A current-layout params.yaml whose model section (which dlspass does not read) holds the
# value: the whole document must be data JSON can hold, not only the keys dlspass reads.
PARAMS = """trainer:
  init:
    model:
      name: gpt2
      hidden_size: {value}
    precision:
      enabled: true
      fp16_type: float16
      loss_scaling_factor: dynamic
"""

CASES = {
    "self_referencing_sequence": "&x [1, *x]",
    "self_referencing_mapping": "&m {again: *m}",
    "self_referencing_through_a_list": "&p {inner: [{deeper: *p}]}",
    "binary_blob": "!!binary ZHluYW1pYw==",
    "set_of_values": "!!set {256, 512}",
    "timestamp": "2024-01-01",
    "timestamp_with_time": "2024-01-01 10:00:00",
    "integer_key": "{1: 2}",
    "boolean_key": "{yes: 2}",
    "ordered_pairs": "!!omap [{a: 1}]",
    "pairs": "!!pairs [{a: 1}, {a: 2}]",
    "python_tag": "!!python/name:os.system 256",
}


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(PARAMS.format(value=CASES[name]))
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_from_yaml_refuses_values_json_cannot_hold(tmp_path, name):
    path = _write(tmp_path, name)
    t = time.monotonic()
    with pytest.raises(ConfigError) as info:
        DLSConfig.from_yaml(str(path))
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 500, msg
    assert str(path) in msg
    assert time.monotonic() - t < 5


def test_merge_keys_and_plain_aliases_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &b\n  loss_scaling_factor: dynamic\n  fp16_type: float16\n"
                    "trainer:\n  init:\n    model: {name: gpt2}\n    precision:\n      <<: *b\n"
                    "      enabled: true\nlist: &l [1, 2]\nagain: *l\n")
    assert DLSConfig.from_yaml(str(path)).loss_scale == "dynamic"


@pytest.fixture(scope="module")
def joint() -> Path:
    return cf.joint_file("mlp")  # exported once per test process, shared with other modules


@pytest.mark.parametrize("name", ["self_referencing_sequence", "binary_blob", "timestamp", "integer_key"])
def test_transform_config_is_exit_2_with_one_line(tmp_path, joint, capsys, name):
    path = _write(tmp_path, name)
    out = tmp_path / "o" / "step.pt2"
    out.parent.mkdir()
    capsys.readouterr()
    rc = run(["transform", str(joint), "-o", str(out), "--config", str(path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
    assert list(out.parent.iterdir()) == []
