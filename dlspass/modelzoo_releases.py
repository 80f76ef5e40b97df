"""What each Cerebras Model Zoo release does with a ``params.yaml`` key it finds absent, read
from that release's code (`ModelZooRules`, `modelzoo_rules`; docs/MODELZOO.md lists the
sources), and which model family a config belongs to (`model_from_path`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dlspass.errors import InputValueError
from dlspass.presets import excerpt, parse_release_name

FIRST_RELEASE = (1, 6)
LATEST_RELEASE = (2, 10)
# Models whose run.py applied gpt2/gptj `set_defaults` (use_bfloat16 / fp16_type defaulting to
# bfloat16), per release: modelzoo/transformers/pytorch/<model>/run.py (R_1.7.0 .. 2.0.3) and
# src/cerebras/modelzoo/models/nlp/<model>/run.py (2.1.0 .. 2.2.1).
GPT_DEFAULTS = {
    (1, 7): {"gpt2", "gpt3", "gptj"},
    (1, 8): {"gpt2", "gpt3", "gptj"},
    (1, 9): {"gpt2", "gpt3", "gptj", "bloom", "falcon", "llama"},
    (2, 0): {"gpt2", "gpt3", "gptj", "bloom", "falcon", "llama", "btlm", "starcoder"},
    (2, 1): {"gpt2", "gpt3", "gptj", "bloom", "falcon", "llama", "btlm", "starcoder", "mistral",
             "mpt", "santacoder"},
    (2, 2): {"gpt2", "gpt3", "gptj", "bloom", "falcon", "llama", "btlm", "starcoder", "mistral",
             "mpt", "santacoder", "jais"},
}

# 2.2.0 / 2.2.1 only: before run.py's set_defaults, common/utils/run/cli_parser.py
# get_params_from_args replaces the params with `asdict` of the config class registered for the
# run.py's directory (config_manager/config_loader.py validate_config_params), which fills every
# absent model key with its default: config_classes/base/model_config.py `ModelConfig.fp16_type =
# "bfloat16"` for these models; t5/config.py overrides it with "float16" (transformer inherits
# T5Config); models without a config class (fc_mnist, layers_api_demo) keep half_dtype.py's float16.
CONFIG_CLASS_BFLOAT16 = frozenset({
    "bert", "bloom", "btlm", "classifier", "dit", "dpo", "dpr", "esm2", "extractive_summarization",
    "falcon", "gpt2", "gpt3", "gpt_inference", "gptj", "jais", "llama", "llava", "mistral", "mpt",
    "santacoder", "starcoder", "token_classifier", "vision_transformer",
})
# The models whose legacy file without a half format runs in bfloat16, per release.
BFLOAT16_DEFAULTS = {
    release: models | (CONFIG_CLASS_BFLOAT16 if release == (2, 2) else frozenset())
    for release, models in GPT_DEFAULTS.items()
}


GPT_STYLE = "gpt-style"
"""The model family a legacy file names through its GPT data processor (`model_from_params`):
one of the GPT-style models of the release, which share the bfloat16 default."""


@dataclass(frozen=True)
class ModelZooRules:
    """What one Model Zoo release does with an absent or legacy precision key.

    ``release`` is ``(major, minor)``; ``model`` the Model Zoo model directory (or None).
    """

    release: tuple[int, int]
    model: str | None = None

    @property
    def has_trainer(self) -> bool:
        """The ``trainer:`` layout exists (2.3+); legacy files are converted to it from 2.3 on."""
        return self.release >= (2, 3)

    def default_fp16_type(self) -> str:
        """The half format used when the file names none (MixedPrecision / half_dtype defaults)."""
        if self.has_trainer:
            # trainer/callbacks/precision.py: MixedPrecision(fp16_type="float16") in 2.3,
            # "bfloat16" from 2.4 on; legacy files go through the same callback.
            return "bfloat16" if self.release >= (2, 4) else "float16"
        if self.release in BFLOAT16_DEFAULTS and (
                self.model == GPT_STYLE or self.model in BFLOAT16_DEFAULTS[self.release]):
            return "bfloat16"
        return "float16"

    @property
    def log_follows_dynamic(self) -> bool:
        """An absent (or null) log_loss_scale means "log when dynamic" (MixedPrecision, 2.5+)."""
        return self.release >= (2, 5)

    @property
    def log_summaries_logs_scale(self) -> bool:
        """optimizer.log_summaries also logs the loss scale in this release.

        1.8-1.9: pytorch_base_runner._log_summaries_loss_scale; 2.0.x: run_cstorch_flow returns
        loss_scale None whatever log_summaries says; 2.1+: run_cstorch_flow logs
        grad_scaler.get_scale() under log_summaries, and the trainer conversion maps
        log_summaries to precision.log_loss_scale. R_1.6/1.7 do not read the key
        (`logs_scale_with_scaler`).
        """
        return (1, 8) <= self.release < (2, 0) or self.release >= (2, 1)

    @property
    def logs_scale_with_scaler(self) -> bool:
        """The scale is logged whenever the run has a scaler, whatever log_summaries says.

        R_1.6.0 / R_1.7.x modelzoo/common/pytorch/pytorch_runner.py, the CPU/GPU runner:
        ``on_train_start`` makes a ``GradScaler`` when ``model.mixed_precision`` and
        ``optimizer.loss_scaling_factor != 1.0`` on CUDA (R_1.7.1 L60-76, R_1.6.0 L55-71), and ``_write_log`` adds
        ``loss_scale`` to the summaries at every log step ``if self._scaler`` (R_1.7.1 L130-133,
        R_1.6.0 L137-140). (Their CS runners print the loss only; dlspass runs where the GPU
        runner runs.)
        """
        return self.release < (1, 8)

    @property
    def reads_model_precision_opt_level(self) -> bool:
        """model.precision_opt_level is read (deprecated) up to 2.0; 2.1 raises on it."""
        return self.release <= (2, 0)

    @property
    def reads_use_bfloat16(self) -> bool:
        """model.use_bfloat16 is read up to 2.0; half_dtype.py of 2.1+ raises KeyError on it."""
        return self.release <= (2, 0)

    @property
    def reads_csconfig(self) -> bool:
        """csconfig.use_cbfloat16 is passed to cbtorch.initialize up to 1.9."""
        return self.release <= (1, 9)


def model_from_path(path: str | Path) -> str | None:
    """The model directory of a config inside a Model Zoo checkout, else None.

    Every release keeps a model's configs in ``<model>/configs/`` or a subfolder of it (R_1.7.1
    ``modelzoo/transformers/pytorch/gpt2/configs/params_gpt2_small.yaml``, 2.2
    ``src/cerebras/modelzoo/models/nlp/gpt2/configs/...``, fine-tuning tasks one level deeper,
    ``bert/fine_tuning/qa/configs``, whose defaults are bert's).
    """
    parts = Path(path).parts[:-1]
    # the innermost configs/ folder: configs of one model may sit in subfolders of it
    # (2.2 gpt3/configs/Cerebras_GPT/111m.yaml, 1.9 gpt3/configs/muP/...)
    inner = [i for i, p in enumerate(parts) if p == "configs"]
    if not inner:
        return None
    up = [p for p in reversed(parts[:inner[-1]]) if p not in _TASK_DIRS]
    return up[0] if up else None


def model_from_params(data: object) -> str | None:
    """The family a legacy file's ``train_input`` or ``eval_input`` data processor names, else
    None: `GPT_STYLE` for a GPT data processor (``GptHDF5DataProcessor``,
    ``GptHDF5MapDataProcessor``, ``GptTfRecordsProcessor``), ``dpr`` for ``DPRHDF5DataProcessor``.

    In every release from R_1.7.1 to 2.2.1 each config naming a GPT processor sits in the
    directory of a model of `GPT_DEFAULTS` (``git grep 'data_processor: "Gpt'`` over those tags:
    gpt2, gpt3, gptj, bloom, falcon, llama, btlm, starcoder, mistral, mpt, santacoder, jais), and
    the configs naming ``DPRHDF5DataProcessor`` (2.2.0 on) are DPR's training configs
    (``dpr/configs/``; DPR's embedding generation reads ``DPREmbedGen*`` processors), so the file
    says its family even when it is read outside a checkout.
    """
    if not isinstance(data, dict):
        return None
    for section in ("train_input", "eval_input"):
        body = data.get(section)
        proc = body.get("data_processor") if isinstance(body, dict) else None
        if isinstance(proc, str) and proc.startswith("Gpt"):
            return GPT_STYLE
        if proc == "DPRHDF5DataProcessor":
            return "dpr"
    return None


# directories between a model and its configs in R_1.6-2.2 (bert/fine_tuning/qa/configs,
# gptj/fine_tuning/continuous_pretraining/configs, fc_mnist/pytorch/configs)
_TASK_DIRS = {"fine_tuning", "qa", "classifier", "extractive_summarization", "token_classifier",
              "abstractive_summarization", "continuous_pretraining", "pytorch"}


def modelzoo_rules(release: str | tuple[int, int] | None = None, model: str | None = None) -> ModelZooRules:
    """Parse a release name (``"2.4"``, ``"2.4.0"``, ``"R_1.7.0"``, ``"Release_2.10.0"``).

    ``None`` means the newest release dlspass knows (2.10).
    """
    if release is None:
        parsed = LATEST_RELEASE
    else:
        parsed = parse_release_name(
            release, r"(?:R_|Release_|rel-|v)?(\d{1,2})\.(\d{1,2})(?:\.\d{1,3})?",
            key="modelzoo_release", example="'2.4' or 'Release_2.4.0'", shape="(major, minor)")
    if parsed < FIRST_RELEASE:
        raise InputValueError(f"modelzoo_release: {parsed[0]}.{parsed[1]} predates R_1.6.0, the first "
                              "release dlspass reads")
    if model is not None and not isinstance(model, str):
        raise InputValueError(f"modelzoo_model: expected a model directory name, got {excerpt(model)}")
    return ModelZooRules(parsed, model)
