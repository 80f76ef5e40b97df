"""The config a step entry point runs with: its ``config=``, its scaler's, and keyword overrides.

``capture_step``, ``dlspass.compile`` and ``make_backend`` / ``backend="dlspass"`` call
`resolve_config`; the CLI merges its flags into ``--config`` with the same
``DLSConfig.with_overrides``. One rule for all of them (``DLSConfig.with_overrides``): overrides
replace fields and the result is checked as a whole; only a live scaler, whose state already
exists, refuses an override that changes the rules that state follows.
"""

from __future__ import annotations

from typing import Any

from dlspass.config import ConfigError, DLSConfig

NO_SCALING = DLSConfig(loss_scale=None, mixed_precision=False)
"""The step without a config or scaler: float32, no loss scaling."""


def scaler_config(scaler: object) -> DLSConfig:
    """The config of ``scaler``, a ``dlspass.GradScaler`` (anything else is a ``ConfigError``)."""
    config = getattr(scaler, "config", None)
    if not isinstance(config, DLSConfig) or not hasattr(scaler, "state"):
        raise ConfigError(f"scaler: expected a dlspass.GradScaler (with .config and .state), "
                          f"got {type(scaler).__name__}")
    return config


def resolve_config(config: DLSConfig | None = None, scaler: object | None = None, *,
                   default: DLSConfig | None = NO_SCALING, **overrides: Any) -> DLSConfig | None:
    """The entry point's ``DLSConfig``: ``config`` or the scaler's, with ``overrides`` merged.

    An override whose value is None is not given. With ``scaler`` its config is the base and
    `DLSConfig.with_overrides_keeping_state` merges (``config``, if also given, must be the
    scaler's). Without either, ``default`` is the entry point's config when nothing is
    overridden; otherwise the base is ``default`` (or `NO_SCALING`), and naming an
    ``fp16_type`` without ``mixed_precision`` asks for lowering to it.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    if scaler is not None:
        base = scaler_config(scaler)
        if config is not None and config != base:
            raise ConfigError("config: differs from the scaler's config; give the config to "
                              "dlspass.GradScaler(config=...) and pass only the scaler")
        return base.with_overrides_keeping_state(**given)
    if config is not None:
        return config.with_overrides(**given)
    if not given:
        return default
    if "fp16_type" in given:
        given.setdefault("mixed_precision", True)
    return (default or NO_SCALING).with_overrides(**given)
