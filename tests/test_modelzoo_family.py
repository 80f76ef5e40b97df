"""The model family of a legacy Model Zoo config (issue 34, item 6): named, read from the file,
or warned about once. Minimal configs are written in ``tmp_path``; the defaults were read from
each release's ``set_defaults`` (docs/MODELZOO.md)."""

from __future__ import annotations

import warnings

import pytest

from dlspass.config import DLSConfig
from dlspass.modelzoo_releases import GPT_STYLE, model_from_params

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
