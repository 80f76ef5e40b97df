"""The DLS configuration: `DLSConfig`, checked in float32 terms (the presets it resolves
against are data in `dlspass.presets`).

`DLSConfig` keeps what the user wrote (``None`` means "the preset's default") and resolves the
effective numbers through properties, so that ``dataclasses.replace`` on a config never turns a
defaulted value into an explicit one. Defaults follow the presets table of
docs/SEMANTICS.md §2 (cstorch's and the other tools' defaults, with their sources).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from dlspass import deepspeed_config, modelzoo
from dlspass.errors import InputValueError
from dlspass.presets import (
    FLOAT32_MAX,
    FP16_TYPES,
    POLICIES,
    FP16Type,
    Policy,
    PresetDefaults,
    excerpt,
    preset_defaults,
)

PrecisionMode = Literal["emulate", "native"]
"""How 16-bit ops run: ``emulate`` rounds in float32 containers, ``native`` casts to the dtype."""
PRECISION_MODES: tuple[str, ...] = get_args(PrecisionMode)
NATIVE_FORMATS: tuple[str, ...] = ("float16", "bfloat16")
"""The formats with a hardware dtype: ``precision_mode="native"`` casts to them, and is their default.
The one statement of it: ``dlspass.precision_policy.NATIVE_DTYPES``, ``dlspass.formats`` and the
passes derive theirs from it."""
Float8RecipeName = Literal["tensorwise", "rowwise"]
"""The name of a float8 recipe (torchao's ``Float8LinearRecipeName``): how a float8 step scales
each matmul operand, one scale per tensor or one per row. The recipe itself (formats, axes) is
``dlspass.float8_policy.Float8Recipe``."""
FLOAT8_RECIPES: tuple[str, ...] = get_args(Float8RecipeName)
TelemetryWatch = Literal["default", "all"]
"""What the numerics telemetry watches: ``default`` (what ``telemetry=True`` means) the scaled
gradients and, in a float8 step, each float8 cast of a matmul operand; ``all`` adds every
lowered 16-bit op's output (each read once more: the costly part, tools/bench/RESULTS.md)."""
TELEMETRY_WATCHES: tuple[str, ...] = get_args(TelemetryWatch)
FLOAT8_SIZE_RULES: tuple[str, ...] = ("all", "auto")
"""The size rules of a ``float8_filter``: ``all`` converts a matmul of any size (torchao's
``convert_to_float8_training`` with no ``module_filter_fn``, its default), ``auto`` skips those
torchao's auto filter (``_auto_filter_for_recipe``) skips: too small for float8 to gain."""


class ConfigError(InputValueError):
    """A DLS configuration value is invalid; the message names the key."""


_SKIP_PREFIX = "skip:"


def parse_float8_filter(spec: Any) -> tuple[str, tuple[str, ...]]:
    """``(size rule, module paths to skip)`` of a ``float8_filter`` spec, the one reading of it
    (``DLSConfig`` checks it with this, ``dlspass.float8_policy.Float8Filter.from_spec`` builds
    the filter from it).

    A spec is comma-separated: at most one size rule of `FLOAT8_SIZE_RULES` (default ``all``)
    and any number of ``skip:PATH`` entries, each a substring of the module paths to leave in
    16 bits (torchao's ``filter_fqns``). E.g. ``"auto"``, ``"all,skip:lm_head"``.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"float8_filter: expected a string such as 'all', 'auto' or 'auto,skip:lm_head', "
                          f"got {excerpt(spec)}")
    rules, skips = [], []
    for token in (t.strip() for t in spec.split(",")):
        if token.startswith(_SKIP_PREFIX) and token[len(_SKIP_PREFIX):].strip():
            skips.append(token[len(_SKIP_PREFIX):].strip())
        elif token in FLOAT8_SIZE_RULES:
            rules.append(token)
        else:
            raise ConfigError(f"float8_filter: unknown entry {excerpt(token)} in {excerpt(spec)}; expected "
                              f"{' or '.join(FLOAT8_SIZE_RULES)} and skip:MODULE_PATH entries, comma-separated")
    if len(rules) > 1:
        raise ConfigError(f"float8_filter: more than one size rule in {excerpt(spec)} ({', '.join(rules)})")
    return (rules[0] if rules else "all"), tuple(skips)


# Step counters are int64 tensors: an interval must fit int64 (2**63 - 1 is torch's and Model Zoo's
# "never grow"), so that a hostile value (10**30) cannot overflow the counter arithmetic.
MAX_STEPS = 2**63 - 1


def _number(name: str, value: Any, *, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {excerpt(value)}")
    try:
        as_float = float(value)
    except OverflowError:
        raise ConfigError(f"{name}: must be finite, got {excerpt(value)}") from None
    if not math.isfinite(as_float):
        raise ConfigError(f"{name}: must be finite, got {excerpt(value)}")
    return as_float


def _scale(name: str, value: Any, lowest_exp: int = -126) -> float | None:
    """A loss scale: a number that float32 holds, by default as a normal value with a finite
    reciprocal (the scale is inverted to unscale). ``min_loss_scale`` may go down to float32's
    smallest subnormal (2**-149), as torch's and Keras' scales do: with such a floor the
    gradients are divided by the scale (`dlspass.scale_policy.divides`), never multiplied by an
    infinite reciprocal."""
    v = _number(name, value)
    if v is None:
        return None
    if v <= 0:
        raise ConfigError(f"{name}: must be > 0, got {excerpt(value)}")
    if not 2.0**lowest_exp <= v <= FLOAT32_MAX:
        raise ConfigError(
            f"{name}: {excerpt(value)} is outside float32's range for a loss scale "
            f"[2**{lowest_exp}, {FLOAT32_MAX:.6g}]; the scale is held in float32"
        )
    return v


def _steps(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected a positive integer, got {excerpt(value)}")
    if not 0 < value <= MAX_STEPS:
        raise ConfigError(f"{name}: must be an integer in [1, {MAX_STEPS}], got {excerpt(value)}")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...], what: str) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name}: unknown {what} {excerpt(value)}; choose one of {', '.join(choices)}")


class _GivenOrPreset:
    """A resolved `DLSConfig` value: the field ``key`` as given, or the preset's default where
    the field was left None, as ``cast``."""

    def __init__(self, key: str, cast: type[float] | type[int]) -> None:
        self.key, self.cast = key, cast

    def __get__(self, config: DLSConfig | None, owner: type) -> float | int:
        if config is None:  # read on the class (help(), dataclass introspection)
            return self  # type: ignore[return-value]
        value = getattr(config, self.key)
        return self.cast(value if value is not None else getattr(config.defaults, self.key))


@dataclass(frozen=True)
class DLSConfig:
    """Dynamic loss scaling settings with cstorch's names.

    ``loss_scale``: ``"dynamic"`` turns DLS on; a number is a static scale (no overflow check,
    no skipped steps); ``None`` or ``1.0`` means no scaling. Every other numeric key left at
    ``None`` takes the default of ``policy`` for ``fp16_type`` (docs/SEMANTICS.md §2).
    ``precision_mode``: how the lowered ops run, ``"native"`` (cast to the 16-bit dtype: the
    kernels autocast would run) or ``"emulate"`` (rounded to the format in float32 containers,
    to study the numerics); ``None`` (default) is native for float16 and bfloat16, as a user of
    autocast expects, and emulate for cbfloat16, which has no dtype outside Cerebras hardware
    (`lowering_mode` is the mode in effect). ``telemetry`` (off by default; Model Zoo has no
    key for it): the step front ends (``dlspass.compile``, ``capture_step``) count, in the
    step's own kernels, where each scaled gradient lands in ``fp16_type`` (amax, flushed,
    subnormal, overflow) and, in a float8 step, what each matmul operand's float8 cast
    saturates and flushes, kept on the device until ``step.telemetry.read()``; it changes no
    value the step computes. ``True`` (or ``"default"``) watches those; ``"all"`` adds each
    lowered op's output (`TelemetryWatch`; `telemetry_watch` is the list in effect). ``float8`` (off by
    default): ``"tensorwise"`` or ``"rowwise"`` runs the step's matmuls, forward and backward,
    in float8 with one scale per tensor or per row computed from its amax, torchao's recipes
    (``LowerMatmulsToFloat8Pass``, README "float8"); the rest of the step stays as the other
    fields make it, and ``precision_mode`` picks ``torch._scaled_mm`` (native) or torchao's
    emulation (emulate). ``float8_filter`` says which matmuls that is (`parse_float8_filter`):
    ``"all"`` (default: every matmul, as torchao's ``convert_to_float8_training`` converts every
    ``nn.Linear`` unless given a filter), ``"auto"`` (skip the sizes torchao's auto filter
    skips, measured on H100s), plus ``skip:PATH`` entries by module path; without ``float8``
    it changes nothing. Entry points merge their
    keyword overrides into a config with `with_overrides`.

    Example:
        >>> cfg = DLSConfig(fp16_type="cbfloat16")
        >>> cfg.init_scale, cfg.min_scale
        (2147483648.0, 6.103515625e-05)
    """

    loss_scale: str | float | None = "dynamic"
    initial_loss_scale: float | None = None
    steps_per_increase: int | None = None
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    overflow_tolerance: float | None = None
    max_gradient_norm: float | None = None
    max_gradient_value: float | None = None
    fp16_type: FP16Type = "float16"
    mixed_precision: bool = True
    policy: Policy = "cerebras"
    growth_factor: float | None = None
    backoff_factor: float | None = None
    hysteresis: int | None = None
    consecutive_hysteresis: bool = False
    on_scale_floor: Literal["warn", "raise"] = "warn"
    log_loss_scale: bool = False
    precision_mode: PrecisionMode | None = None
    telemetry: bool | TelemetryWatch = False
    float8: Float8RecipeName | None = None
    float8_filter: str = "all"
    extras: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Every check names the field and shows a bounded excerpt of the value (see `excerpt`);
        # numbers are checked in float32 terms, since that is how the scaler holds them.
        _choice("fp16_type", self.fp16_type, FP16_TYPES, "format")
        _choice("policy", self.policy, POLICIES, "preset")
        if self.precision_mode is not None:
            _choice("precision_mode", self.precision_mode, PRECISION_MODES, "mode")
        if self.float8 is not None:
            _choice("float8", self.float8, FLOAT8_RECIPES, "float8 recipe")
        parse_float8_filter(self.float8_filter)
        ls = self.loss_scale
        if isinstance(ls, str):
            if ls != "dynamic":
                raise ConfigError(f"loss_scale: expected 'dynamic', a number or None, got {excerpt(ls)}")
        elif ls is not None:
            _scale("loss_scale", ls)
        for name in ("initial_loss_scale", "max_loss_scale"):
            _scale(name, getattr(self, name))
        _scale("min_loss_scale", self.min_loss_scale, lowest_exp=-149)
        for name in ("growth_factor", "backoff_factor", "max_gradient_norm", "max_gradient_value"):
            v = _number(name, getattr(self, name))
            if v is not None and not 0 < v <= FLOAT32_MAX:
                raise ConfigError(f"{name}: must be > 0 and at most float32's max, "
                                  f"got {excerpt(getattr(self, name))}")
        for name in ("steps_per_increase", "hysteresis"):
            _steps(name, getattr(self, name))
        tol = _number("overflow_tolerance", self.overflow_tolerance)
        if tol is not None and not 0.0 <= tol < 1.0:
            raise ConfigError(f"overflow_tolerance: must be in [0, 1), got {excerpt(self.overflow_tolerance)}")
        if self.growth_factor is not None and self.growth_factor <= 1.0:
            raise ConfigError(f"growth_factor: must be > 1, got {self.growth_factor!r}")
        if self.backoff_factor is not None and not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError(f"backoff_factor: must be in (0, 1), got {self.backoff_factor!r}")
        if self.max_gradient_norm is not None and self.max_gradient_value is not None:
            raise ConfigError("max_gradient_norm and max_gradient_value: set at most one of them")
        _choice("on_scale_floor", self.on_scale_floor, ("warn", "raise"), "action")
        for name in ("mixed_precision", "consecutive_hysteresis", "log_loss_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected a bool, got {excerpt(getattr(self, name))}")
        if not isinstance(self.telemetry, bool) and self.telemetry not in TELEMETRY_WATCHES:
            raise ConfigError(f"telemetry: expected a bool or one of {', '.join(TELEMETRY_WATCHES)}, "
                              f"got {excerpt(self.telemetry)}")
        if self.precision_mode == "native" and self.mixed_precision and self.fp16_type not in NATIVE_FORMATS:
            raise ConfigError(f"precision_mode: 'native' needs a hardware dtype ({', '.join(NATIVE_FORMATS)}), "
                              f"not fp16_type={self.fp16_type!r}; use 'emulate'")
        if not isinstance(self.extras, dict) or not all(isinstance(k, str) for k in self.extras):
            raise ConfigError(f"extras: expected a dict with string keys, got {excerpt(self.extras)}")
        if self.min_scale > self.max_scale:
            raise ConfigError(
                f"min_loss_scale ({self.min_scale!r}) is greater than max_loss_scale ({self.max_scale!r})"
            )
        if self.initial_loss_scale is not None and not (
            self.min_scale <= self.initial_loss_scale <= self.max_scale
        ):
            raise ConfigError(
                f"initial_loss_scale: {self.initial_loss_scale!r} is outside "
                f"[min_loss_scale, max_loss_scale] = [{self.min_scale!r}, {self.max_scale!r}]"
            )

    # ---- resolved values -------------------------------------------------------------------
    @property
    def defaults(self) -> PresetDefaults:
        return preset_defaults(self.policy, self.fp16_type)

    @property
    def dynamic(self) -> bool:
        """True when the scale changes over time (``loss_scale="dynamic"``) and DLS is useful."""
        return self.loss_scale == "dynamic" and self.fp16_type != "bfloat16"

    @property
    def enabled(self) -> bool:
        """True when any scaling happens (dynamic, or a static scale other than 1)."""
        if self.loss_scale is None or self.fp16_type == "bfloat16":
            return False
        return self.loss_scale == "dynamic" or float(self.loss_scale) != 1.0

    # resolved values: the field as given, or the preset's default where it was left None
    max_scale = _GivenOrPreset("max_loss_scale", float)
    min_scale = _GivenOrPreset("min_loss_scale", float)
    growth_interval = _GivenOrPreset("steps_per_increase", int)
    growth = _GivenOrPreset("growth_factor", float)
    backoff = _GivenOrPreset("backoff_factor", float)
    hysteresis_steps = _GivenOrPreset("hysteresis", int)

    @property
    def init_scale(self) -> float:
        """The scale of the first step: explicit, static, or ``min(max, preset default)``."""
        if not self.enabled:
            return 1.0
        if self.loss_scale != "dynamic":
            return float(self.loss_scale)
        if self.initial_loss_scale is not None:
            return float(self.initial_loss_scale)
        return max(min(self.max_scale, self.defaults.initial_loss_scale), self.min_scale)

    @property
    def telemetry_watch(self) -> TelemetryWatch | None:
        """The telemetry's watch list in effect: None (off), ``"default"`` (``telemetry=True``)
        or ``"all"``."""
        if self.telemetry is False:
            return None
        return "default" if self.telemetry is True else self.telemetry

    @property
    def lowering_mode(self) -> PrecisionMode:
        """The precision mode in effect: ``precision_mode`` as given, else ``"native"`` for
        float16 and bfloat16 and ``"emulate"`` for cbfloat16."""
        if self.precision_mode is not None:
            return self.precision_mode
        return "native" if self.fp16_type in NATIVE_FORMATS else "emulate"

    @property
    def tolerance(self) -> float:
        return float(self.overflow_tolerance) if self.overflow_tolerance is not None else 0.0

    @property
    def overflow_check(self) -> str:
        """``"global_norm"`` (cerebras) or ``"all_finite"`` (the other presets)."""
        return self.defaults.overflow_check

    def with_overrides(self, **overrides: Any) -> DLSConfig:
        """This config with ``overrides`` applied: the one merge rule of every entry point.

        ``capture_step(config=, ...)``, ``dlspass.compile(config=, scaler=, ...)``, the
        ``make_backend`` / ``backend="dlspass"`` options and the CLI's ``--config`` plus flags all
        merge through here, so they resolve the same overrides to the same config:

        - each key must be a field (an unknown key is a ``ConfigError`` naming it); its value
          replaces the field as given, ``None`` included (``loss_scale=None`` turns scaling off),
          so an entry point that reads ``None`` as "not given" leaves such keywords out;
        - the result is checked as a whole (``__post_init__``): a bad value or combination is the
          same ``ConfigError``, with the same message, whichever entry point passed it;
        - the other fields stay as written: one left to its preset stays so and follows a new
          ``policy`` or ``fp16_type``;
        - any key may change, ``fp16_type`` included even where it moves the scale range: a
          config is data until a scaler holds a scale built from it.

        That last case is the one refusal: a live scaler (``compile(scaler=)``,
        ``make_backend(scaler=)``) already holds state built from its config, and overrides of
        it go through `with_overrides_keeping_state`, which refuses a key that changes the rules
        that state follows.

        Example:
            >>> DLSConfig().with_overrides(fp16_type="cbfloat16").init_scale == 2.0**31
            True
        """
        unknown = [k for k in overrides if k not in self.__dataclass_fields__]
        if unknown:
            names = list(self.__dataclass_fields__)
            hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, names, 1))
                     else repr(k) for k in unknown]
            raise ConfigError(f"unknown DLSConfig field(s) {', '.join(hints)}; "
                              f"known: {', '.join(names)}")
        return dataclasses.replace(self, **overrides) if overrides else self

    def with_overrides_keeping_state(self, **overrides: Any) -> DLSConfig:
        """`with_overrides` for the config of a scaler whose state already exists.

        A key that changes the loss scaling that state was built for (whether and how it
        scales, the scale range, the growth, backoff and hysteresis rule, the overflow check),
        or that replaces a clipping limit the config sets, is a ``ConfigError`` naming the key:
        construct the scaler with it instead. The other keys (``mixed_precision``,
        ``precision_mode``, a clipping limit the config leaves open, an ``fp16_type`` that keeps
        the scale range) merge as in `with_overrides`.
        """
        merged = self.with_overrides(**overrides)
        for key, value in overrides.items():
            old = getattr(self, key)
            if key in _CLIPPING and old is not None and value != old:
                why = "the scaler clips with its own"
            elif _scaling_rules(self.with_overrides(**{key: value})) != _scaling_rules(self):
                why = "it changes the loss scaling the scaler's state was built for"
            else:
                continue
            raise ConfigError(f"{key}={excerpt(value)} conflicts with the scaler's {key}={excerpt(old)} "
                              f"({why}); construct dlspass.GradScaler({key}={excerpt(value)}) instead")
        if _scaling_rules(merged) != _scaling_rules(self):
            keys = ", ".join(overrides)
            raise ConfigError(f"{keys}: together they change the loss scaling the scaler's state was "
                              "built for; construct dlspass.GradScaler with them instead")
        return merged

    def to_dict(self) -> dict[str, Any]:
        """The user-given fields, JSON-serializable (used for export metadata)."""
        out = {}
        for name in self.__dataclass_fields__:
            if name == "extras":
                continue
            out[name] = getattr(self, name)
        if self.extras:
            out["extras"] = dict(self.extras)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<dict>",
                  modelzoo_release: str | None = None, modelzoo_model: str | None = None) -> DLSConfig:
        """Read a Model Zoo params dict (current or legacy layout) or a flat dlspass dict.

        ``modelzoo_release`` (e.g. ``"2.4"`` or ``"Release_2.4.0"``) and ``modelzoo_model`` (the
        Model Zoo model directory, e.g. ``"gpt3"``) pick the release-dependent defaults; see
        docs/MODELZOO.md.

        Example:
            >>> cfg = DLSConfig.from_dict({"trainer": {"init": {"precision": {
            ...     "fp16_type": "cbfloat16", "loss_scaling_factor": "dynamic"}}}})
            >>> cfg.init_scale == 2.0**31
            True
        """
        return _from_modelzoo(lambda: modelzoo.settings_from_params(
            data, source=source, modelzoo_release=modelzoo_release, modelzoo_model=modelzoo_model,
            fields=_field_names()))

    @classmethod
    def from_yaml(cls, path: str, *, modelzoo_release: str | None = None,
                  modelzoo_model: str | None = None) -> DLSConfig:
        """Read the precision settings of a Model Zoo ``params.yaml`` (see `from_dict`).

        Example:
            >>> cfg = DLSConfig.from_yaml("params.yaml", modelzoo_release="2.10")  # doctest: +SKIP
            >>> cfg.loss_scale, cfg.fp16_type  # doctest: +SKIP
            ('dynamic', 'cbfloat16')
        """
        return _from_modelzoo(lambda: modelzoo.settings_from_yaml(
            path, modelzoo_release=modelzoo_release, modelzoo_model=modelzoo_model,
            fields=_field_names()))


    @classmethod
    def from_deepspeed(cls, path_or_dict: str | Any, *, release: str | None = None) -> DLSConfig:
        """Read the loss-scaling settings of a DeepSpeed config (a JSON file or its dict):
        the ``fp16`` section with ``release``'s defaults (default: the newest release dlspass
        has read, 0.19.8), ``bf16``, ``zero_optimization.stage`` (which picks ZeRO's scaler or
        the fp16 optimizer's rule) and ``gradient_clipping``. What dlspass cannot map is a
        one-line ``ConfigError`` (`dlspass.deepspeed_config`).

        Example:
            >>> cfg = DLSConfig.from_deepspeed({"fp16": {"enabled": True},
            ...                                 "zero_optimization": {"stage": 2}})
            >>> cfg.policy, cfg.init_scale, cfg.hysteresis_steps
            ('deepspeed', 65536.0, 2)
        """
        return _from_modelzoo(lambda: deepspeed_config.settings_from_deepspeed(path_or_dict, release))


def deprecated_precision_mode(config: DLSConfig | None, precision_mode: PrecisionMode | None,
                              where: str) -> DLSConfig | None:
    """``config`` with a ``precision_mode=`` keyword of ``where`` merged in (``with_overrides``,
    so a bad mode is the config's `ConfigError`), warning that the keyword is deprecated.

    The mode is the config's (`DLSConfig.lowering_mode`): ``apply_dls`` and
    ``transform_program`` take it from there, and keep the keyword for code written against the
    release that had it. Without a config nothing is lowered, so the mode is only checked.
    """
    if precision_mode is None:
        return config
    warnings.warn(f"{where}(precision_mode=...) is deprecated: pass "
                  f"config=DLSConfig(precision_mode={precision_mode!r})", DeprecationWarning, stacklevel=3)
    merged = (config or DLSConfig()).with_overrides(precision_mode=precision_mode)
    return merged if config is not None else None


def _field_names() -> frozenset[str]:
    return frozenset(f.name for f in fields(DLSConfig))


def _from_modelzoo(read: Callable[[], modelzoo.ModelZooSettings]) -> DLSConfig:
    """The `DLSConfig` of what ``read`` takes from a Model Zoo file or dict; every refusal is a
    `ConfigError` naming the file and, for a value DLSConfig refuses, the key the file wrote."""
    try:
        settings = read()
    except InputValueError as exc:  # modelzoo sits below this module: it raises the family class
        raise ConfigError(str(exc)) from None
    try:
        return DLSConfig(**settings.kwargs)
    except ConfigError as exc:
        raise ConfigError(settings.in_file_terms(str(exc))) from None



_CLIPPING = ("max_gradient_norm", "max_gradient_value")


def _scaling_rules(config: DLSConfig) -> tuple:
    """What a scaler's state follows, resolved: two configs with equal rules can share a state."""
    c = config
    # the policy too: presets with equal numbers still differ in rule (deepspeed and
    # deepspeed-0.17.0 read the same counter differently)
    return (c.policy, c.enabled, c.dynamic, c.init_scale, c.min_scale, c.max_scale, c.growth_interval,
            c.growth, c.backoff, c.hysteresis_steps, c.tolerance, c.overflow_check,
            c.consecutive_hysteresis, c.on_scale_floor)


def __getattr__(name: str) -> Any:
    """``Float8Recipe`` was this module's name for the recipe names until
    ``dlspass.float8_policy.Float8Recipe`` (the recipe itself) took it: it still imports from
    here, as `Float8RecipeName`, with a DeprecationWarning."""
    if name == "Float8Recipe":
        warnings.warn("dlspass.config.Float8Recipe is deprecated: use dlspass.config.Float8RecipeName "
                      "(the recipe itself is dlspass.float8_policy.Float8Recipe)", DeprecationWarning, stacklevel=2)
        return Float8RecipeName
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
