"""The presets against the tools they reproduce, run from their installed packages.

References (pinned in pyproject's ``test`` extra): DeepSpeed 0.19.8's ``DynamicLossScaler``
(ZeRO) and its fp16 optimizers' ``_update_scale`` (no ZeRO), megatron-core's
``DynamicGradScaler``, Keras 3's ``LossScaleOptimizer`` on the torch backend and
``torch.amp.GradScaler``. Each is driven with the same overflow patterns as
``dlspass.scale_policy.update_state`` (thousands of seeded random patterns: independent
overflows, bursts, long clean runs), the eager ``dlspass.GradScaler`` (dozens) and a captured step
(a few). Scales are compared bit for bit: every tool and dlspass compute the same float32 (or,
DeepSpeed, exact power-of-two double) values; where a tool leaves float32's range or goes below
dlspass's floor the comparison stops, and the differences dlspass keeps on purpose are asserted
as such (docs/SEMANTICS.md §2, §3).

DeepSpeed 0.17.0's rule (``deepspeed-0.17.0``) and its reading of the ``fp16`` section are run
from 0.17.0's own files: that release does not install beside 0.19.8, so ``tests/deepspeed_sdist.py``
fetches its sdist from PyPI into a cache folder (``$DLSPASS_SDIST_CACHE``, default
``~/.cache/dlspass/sdists``; reused across runs) and runs ``loss_scaler.py``, the ``fp16`` readers of
``config.py`` and the fp16 optimizers' ``_update_scale`` under private module names, beside the
installed 0.19.8. Offline with an empty cache those tests fail with the command that pre-fetches it.
The hand-worked 0.17.0 traces (tests/traces/policies.json) stay as a cross-check of the docs' tables.
"""

from __future__ import annotations

import os
import sys
import types

import deepspeed_sdist
import numpy as np
import pytest
import torch

import dlspass
from dlspass.config import ConfigError, DLSConfig
from dlspass.scale_policy import ScalerState, init_state, update_state

if "keras" not in sys.modules:  # Keras picks its backend once, at its first import
    os.environ["KERAS_BACKEND"] = "torch"

N_STEPS = 40
BIG = 2.0**127  # the presets' cap: the largest power of two float32 holds


# ---- overflow patterns -----------------------------------------------------------------------
def patterns(seed: int, n: int, steps: int = N_STEPS) -> np.ndarray:
    """``n`` overflow patterns (True: that iteration overflows), a third each of independent
    overflows at a random rate, bursts of overflows, and long clean runs with rare overflows."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, steps), dtype=bool)
    for i in range(n):
        kind = i % 3
        if kind == 0:
            out[i] = rng.random(steps) < rng.uniform(0.05, 0.7)
        elif kind == 1:
            t = 0
            while t < steps:
                run = int(rng.integers(1, 8))
                out[i, t:t + run] = rng.random() < 0.4
                t += run
        else:
            out[i] = rng.random(steps) < 0.03
    return out


def dls_batch(cfg: DLSConfig, overflow: np.ndarray) -> list[list[ScalerState]]:
    """`update_state` over every pattern at once: its ops are elementwise, so a state whose
    tensors hold one entry per pattern runs them side by side (the same float32 ops)."""
    n, steps = overflow.shape
    state = ScalerState(*(t.expand(n).clone() for t in init_state(cfg)))
    per_step = []
    for j in range(steps):
        state = update_state(state, torch.from_numpy(~overflow[:, j]), cfg)
        per_step.append(state)
    return [[ScalerState(*(t[i] for t in s)) for s in per_step] for i in range(n)]


# ---- the real tools --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ds_loss_scaler():
    """DeepSpeed's loss_scaler module; its update logs through ``deepspeed.comm.get_rank()``,
    which needs a process group: rank 0 is given without one (the rule is untouched)."""
    from deepspeed.runtime.fp16 import loss_scaler

    saved = loss_scaler.dist
    loss_scaler.dist = types.SimpleNamespace(get_rank=lambda: 0)
    yield loss_scaler
    loss_scaler.dist = saved


@pytest.fixture(scope="module")
def ds_0_17_0() -> deepspeed_sdist.Release:
    """DeepSpeed 0.17.0's loss-scaling code, from its sdist (tests/deepspeed_sdist.py). Without
    the sdist and without PyPI this fails, naming the command that pre-fetches it: skipping would
    leave the 0.17.0 rule unchecked without a sign."""
    try:
        return deepspeed_sdist.release("0.17.0")
    except deepspeed_sdist.SdistUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def deepspeed_zero(ls, seq, init, window, hyst, consecutive, floor):
    """DeepSpeed's ZeRO scaler (``DynamicLossScaler.update_scale``): ``(scale, hysteresis)``;
    ``ls`` is the loss_scaler module of the release followed (installed, or 0.17.0's)."""
    sc = ls.DynamicLossScaler(init_scale=init, scale_window=window, min_scale=floor,
                              delayed_shift=hyst, consecutive_hysteresis=consecutive,
                              raise_error_at_min_scale=False)
    out = []
    for ovf in seq:
        sc.update_scale(bool(ovf))
        out.append((sc.cur_scale, sc.cur_hysteresis))
    return out


def deepspeed_fp16_optimizer(seq, init, window, floor, fused=True, release=None):
    """``FP16_Optimizer._update_scale`` (or the unfused one's), DeepSpeed without ZeRO, run on
    a stand-in for the optimizer: the real method and ``LossScaleConfig`` (the optimizers'
    constructors need a CUDA device). With ``release`` (a `deepspeed_sdist.Release`), that
    release's method and the scale-state branch of its ``__init__``."""
    if release is not None:
        args = {"init_scale": init, "scale_window": window, "min_scale": floor}
        opt, update = release.fp16_optimizer(fused, dynamic_loss_args=args)
        out = []
        for ovf in seq:
            update(bool(ovf))
            out.append(opt.cur_scale)
        return out
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    cls = FP16_Optimizer if fused else FP16_UnfusedOptimizer
    cfg = LossScaleConfig(torch.float16, True, 1.0, {"init_scale": init, "scale_window": window,
                                                     "min_scale": floor})
    opt = types.SimpleNamespace(loss_scale_config=cfg, verbose=False)
    out = []
    for ovf in seq:
        cls._update_scale(opt, bool(ovf))
        out.append(cfg.cur_scale)
    return out


class _CpuTorch:
    """``torch`` for megatron's grad_scaler module with its hard-coded ``device='cuda'`` dropped."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, **kwargs)


@pytest.fixture(scope="module")
def megatron_scaler():
    from megatron.core.optimizer import grad_scaler

    saved = grad_scaler.torch
    grad_scaler.torch = _CpuTorch()
    yield grad_scaler.DynamicGradScaler
    grad_scaler.torch = saved


def megatron(cls, seq, init, window, hyst, floor, growth=2.0, backoff=0.5):
    sc = cls(initial_scale=init, min_scale=floor, growth_factor=growth, backoff_factor=backoff,
             growth_interval=window, hysteresis=hyst)
    out = []
    for ovf in seq:
        sc.update(bool(ovf))
        out.append((float(sc.scale), sc._growth_tracker, sc._hysteresis_tracker))
    return out


@pytest.fixture(scope="module")
def keras():
    import keras

    assert keras.backend.backend() == "torch", "set KERAS_BACKEND=torch before keras is imported"
    return keras


def keras_run(keras, seq, init, window, grad=1.0):
    """Keras 3's LossScaleOptimizer: ``(scale, step_counter, variable)`` after each apply."""
    var = keras.Variable(np.zeros(2, np.float32))
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=init,
                                              dynamic_growth_steps=window)
    opt.build([var])
    out = []
    for ovf in seq:
        g = torch.tensor([float("inf") if ovf else grad, 0.0])
        opt.apply([g], [var])
        out.append((float(opt.dynamic_scale.value), int(opt.step_counter.value),
                    var.value.detach().clone()))
    return out


def torch_amp(seq, init, window, growth=2.0, backoff=0.5):
    """torch.amp.GradScaler's scale and growth tracker after each update."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    sc = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth,
                              backoff_factor=backoff, growth_interval=window)
    sc.scale(torch.ones(()))  # torch builds its scale in the first scale()
    out = []
    for ovf in seq:
        p.grad = torch.tensor([float("inf") if ovf else 1.0, 0.0])
        sc.step(opt)
        sc.update()
        out.append((sc.get_scale(), sc._get_growth_tracker()))
    return out


def f32(x: float) -> float:
    return float(np.float32(x))


# ---- item 1: DeepSpeed as installed --------------------------------------------------------------
def test_deepspeed_grows_one_step_later_than_0_17_0(ds_loss_scaler, ds_0_17_0):
    # The case of the issue: init 1024, window 3, three clean steps: DeepSpeed 0.19.8 holds 1024
    ref = deepspeed_zero(ds_loss_scaler, [False] * 4, 1024.0, 3, 2, False, 1.0)
    assert [s for s, _ in ref] == [1024.0, 1024.0, 1024.0, 2048.0]
    cfg = DLSConfig(policy="deepspeed", initial_loss_scale=1024.0, steps_per_increase=3)
    assert [float(s.loss_scale) for s in dls_batch(cfg, np.zeros((1, 4), bool))[0]] == \
        [1024.0, 1024.0, 1024.0, 2048.0]
    # ... and 0.17.0's own code grows at the third
    old_ref = deepspeed_zero(ds_0_17_0.loss_scaler, [False] * 4, 1024.0, 3, 2, False, 1.0)
    assert [s for s, _ in old_ref] == [1024.0, 1024.0, 2048.0, 2048.0]
    old = DLSConfig(policy="deepspeed-0.17.0", initial_loss_scale=1024.0, steps_per_increase=3)
    assert [float(s.loss_scale) for s in dls_batch(old, np.zeros((1, 4), bool))[0]] == \
        [s for s, _ in old_ref]


@pytest.mark.parametrize("window", [1, 2, 3, 5])
@pytest.mark.parametrize("hyst", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
def test_deepspeed_preset_matches_deepspeed_zero_scaler(ds_loss_scaler, window, hyst, consecutive):
    init = 2.0 ** (4 + window + hyst)  # a few backoffs above the floor: the floor is reached
    cfg = DLSConfig(policy="deepspeed", initial_loss_scale=init, steps_per_increase=window,
                    hysteresis=hyst, consecutive_hysteresis=consecutive, min_loss_scale=1.0)
    seqs = patterns(100 * window + 10 * hyst + consecutive, 60)
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        ref = deepspeed_zero(ds_loss_scaler, seq, init, window, hyst, consecutive, 1.0)
        got = [(float(s.loss_scale), int(s.hysteresis)) for s in ours]
        assert got == ref, seq.astype(int).tolist()


@pytest.mark.parametrize("window", [1, 2, 3, 5])
@pytest.mark.parametrize("hyst", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
def test_deepspeed_0_17_0_preset_matches_0_17_0s_zero_scaler(ds_0_17_0, ds_loss_scaler, window,
                                                             hyst, consecutive):
    # the patterns (seeds) of the 0.19.8 case above, through 0.17.0's DynamicLossScaler
    init = 2.0 ** (4 + window + hyst)
    cfg = DLSConfig(policy="deepspeed-0.17.0", initial_loss_scale=init, steps_per_increase=window,
                    hysteresis=hyst, consecutive_hysteresis=consecutive, min_loss_scale=1.0)
    seqs = patterns(100 * window + 10 * hyst + consecutive, 60)
    differs = 0
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        ref = deepspeed_zero(ds_0_17_0.loss_scaler, seq, init, window, hyst, consecutive, 1.0)
        got = [(float(s.loss_scale), int(s.hysteresis)) for s in ours]
        assert got == ref, seq.astype(int).tolist()
        differs += ref != deepspeed_zero(ds_loss_scaler, seq, init, window, hyst, consecutive, 1.0)
    assert differs > 0  # the patterns tell 0.17.0 from 0.19.8 (the check sees the release)


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("fused", [True, False])
def test_fp16_optimizer_preset_matches_deepspeed_without_zero(window, fused):
    init = 2.0**12
    # hysteresis 3 in the config: FP16_Optimizer never reads it, and neither does the policy
    cfg = DLSConfig(policy="deepspeed-fp16-optimizer", initial_loss_scale=init,
                    steps_per_increase=window, min_loss_scale=1.0, hysteresis=3)
    seqs = patterns(7 * window + fused, 200)
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        ref = deepspeed_fp16_optimizer(seq, init, window, 1.0, fused)
        assert [float(s.loss_scale) for s in ours] == ref, seq.astype(int).tolist()


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("fused", [True, False])
def test_fp16_optimizer_preset_matches_0_17_0_without_zero(ds_0_17_0, window, fused):
    # 0.17.0's optimizers keep the scale state on themselves (no LossScaleConfig yet); the rule
    # is the current one there too, so the one policy serves both releases
    init = 2.0**12
    cfg = DLSConfig(policy="deepspeed-fp16-optimizer", initial_loss_scale=init,
                    steps_per_increase=window, min_loss_scale=1.0)
    seqs = patterns(7 * window + fused, 200)
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        ref = deepspeed_fp16_optimizer(seq, init, window, 1.0, fused, release=ds_0_17_0)
        assert [float(s.loss_scale) for s in ours] == ref, seq.astype(int).tolist()


def _deepspeed_0_17_0_engine(release, ds_config: dict, stage: int):
    """``(scale, update)`` of what DeepSpeed 0.17.0's engine builds from ``ds_config``: its
    config readers' values passed as ``engine.py`` passes them, to ``CreateLossScaler`` (ZeRO,
    stages 1-3, as ``stage_1_and_2.py`` / ``stage3.py`` call it) or to ``FP16_Optimizer``
    (stage 0, FusedAdam: ``_configure_fp16_optimizer``'s dynamic branch)."""
    loss_scale = release.config.get_loss_scale(ds_config)
    args = release.config.get_dynamic_loss_scale_args(ds_config)
    if stage > 0:
        sc = release.loss_scaler.CreateLossScaler(torch.half, loss_scale, loss_scale == 0, args)
        sc.raise_error_at_min_scale = False
        return (lambda: sc.cur_scale), sc.update_scale, sc
    opt, update = release.fp16_optimizer(
        True, dynamic_loss_scale=loss_scale == 0, static_loss_scale=loss_scale,
        initial_dynamic_scale=release.config.get_initial_dynamic_scale(ds_config),
        dynamic_loss_args=args)
    return (lambda: opt.cur_scale), update, opt


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("fp16", [
    {"enabled": True},
    {"enabled": True, "loss_scale_window": 3},
    {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 3},
    {"enabled": True, "initial_scale_power": 8, "hysteresis": 3, "consecutive_hysteresis": True,
     "min_loss_scale": 4, "loss_scale_window": 2},
    {"enabled": True, "min_loss_scale": 0.5, "loss_scale_window": 1},
    {"enabled": True, "loss_scale": 128.0},
])
def test_from_deepspeed_0_17_0_follows_0_17_0s_own_config_reading(ds_0_17_0, fp16, stage):
    ds_config = {"train_batch_size": 8, "fp16": fp16, "zero_optimization": {"stage": stage}}
    assert ds_0_17_0.config.get_fp16_enabled(ds_config)
    if stage == 0 and not any(k in fp16 for k in ("initial_scale_power", "loss_scale_window",
                                                   "min_loss_scale", "hysteresis",
                                                   "consecutive_hysteresis", "loss_scale")):
        # 0.17.0 passes no dynamic arguments: the floor comes from the optimizer class, which
        # the file does not say (FusedAdam 1, the others 0.25), so dlspass refuses the file
        floors = {fused: ds_0_17_0.fp16_optimizer(fused)[0].min_loss_scale for fused in (True, False)}
        assert floors == {True: 1, False: 0.25}
        with pytest.raises(ConfigError, match=r"fp16\.min_loss_scale"):
            DLSConfig.from_deepspeed(ds_config, release="0.17.0")
        return
    cfg = DLSConfig.from_deepspeed(ds_config, release="0.17.0")
    scale, update, ref = _deepspeed_0_17_0_engine(ds_0_17_0, ds_config, stage)
    assert float(init_state(cfg).loss_scale) == scale()
    if not getattr(ref, "dynamic", getattr(ref, "dynamic_loss_scale", True)):
        assert cfg.loss_scale == scale() and not cfg.dynamic
        return
    assert cfg.policy == ("deepspeed-0.17.0" if stage else "deepspeed-fp16-optimizer")
    if stage:
        assert cfg.hysteresis_steps == ref.delayed_shift
    # without a window the default 1000 needs long runs to grow at all
    seqs = patterns(len(fp16) + stage, 12, steps=2500 if "loss_scale_window" not in fp16 else N_STEPS)
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        scale, update, _ = _deepspeed_0_17_0_engine(ds_0_17_0, ds_config, stage)
        for ovf, s in zip(seq, ours, strict=True):
            update(bool(ovf))
            assert float(s.loss_scale) == scale()


def _deepspeed_engine_scaler(ds_loss_scaler, ds_config: dict):
    """The scaler DeepSpeed 0.19.8's ZeRO builds from ``ds_config``: its own config model and
    ``CreateLossScaler`` (what ``DeepSpeedZeroOptimizer.__init__`` calls)."""
    from deepspeed.runtime.precision_config import get_float16_config

    fp16 = get_float16_config(ds_config)
    sc = ds_loss_scaler.CreateLossScaler(torch.half, fp16.loss_scale, fp16.loss_scale == 0,
                                         fp16.dynamic_loss_scale_args())
    sc.raise_error_at_min_scale = False
    return sc


@pytest.mark.parametrize("fp16", [
    {"enabled": True},
    {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3},
    {"enabled": True, "initial_scale_power": 8, "hysteresis": 3, "consecutive_hysteresis": True,
     "min_loss_scale": 4, "loss_scale_window": 2},
    {"enabled": True, "loss_scale": 128.0},
])
def test_from_deepspeed_follows_deepspeeds_own_config_reading(ds_loss_scaler, tmp_path, fp16):
    ds_config = {"train_batch_size": 8, "fp16": fp16, "zero_optimization": {"stage": 2},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    path = tmp_path / "ds_config.json"
    path.write_text(__import__("json").dumps(ds_config))
    cfg = DLSConfig.from_deepspeed(str(path))
    assert cfg == DLSConfig.from_deepspeed(ds_config, release="0.19.8")
    ref = _deepspeed_engine_scaler(ds_loss_scaler, ds_config)
    assert float(init_state(cfg).loss_scale) == ref.cur_scale
    if not ref.dynamic:
        assert cfg.loss_scale == ref.cur_scale and not cfg.dynamic
        return
    assert cfg.policy == "deepspeed" and cfg.hysteresis_steps == ref.delayed_shift
    seqs = patterns(len(fp16), 12, steps=2500 if "loss_scale_window" not in fp16 else N_STEPS)
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        sc = _deepspeed_engine_scaler(ds_loss_scaler, ds_config)
        for ovf, s in zip(seq, ours, strict=True):
            sc.update_scale(bool(ovf))
            assert float(s.loss_scale) == sc.cur_scale


def test_from_deepspeed_release_defaults_and_optimizer_path():
    # 0.17.0 without a dynamic key: ZeRO builds DynamicLossScaler() (2**32, hysteresis 1)
    only_enabled = {"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    old = DLSConfig.from_deepspeed(only_enabled, release="0.17.0")
    assert (old.policy, old.init_scale, old.hysteresis_steps) == ("deepspeed-0.17.0", 2.0**32, 1)
    new = DLSConfig.from_deepspeed(only_enabled, release="0.17.1")
    assert (new.policy, new.init_scale, new.hysteresis_steps) == ("deepspeed", 2.0**16, 2)
    # one dynamic key named: 0.17.0 passes the section's defaults for the others
    named = {"fp16": {"enabled": True, "loss_scale_window": 500}, "zero_optimization": {"stage": 3}}
    cfg = DLSConfig.from_deepspeed(named, release="v0.16.4")
    assert (cfg.init_scale, cfg.hysteresis_steps, cfg.growth_interval) == (2.0**16, 2, 500)
    # no ZeRO: the fp16 optimizer's rule, which ignores hysteresis
    plain = DLSConfig.from_deepspeed({"fp16": {"enabled": True}, "gradient_clipping": 1.0})
    assert plain.policy == "deepspeed-fp16-optimizer" and plain.max_gradient_norm == 1.0
    assert DLSConfig.from_deepspeed({"bf16": {"enabled": True}}).fp16_type == "bfloat16"
    assert not DLSConfig.from_deepspeed({"train_batch_size": 4}).enabled


@pytest.mark.parametrize(("ds_config", "release", "names"), [
    ({"fp16": {"enabled": "auto"}}, None, "fp16.enabled"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, None, "loss_scale_window"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, None,
     "fp16_master_weights_and_grads"),
    ({"fp16": {"enabled": True}}, "0.17.0", "fp16.min_loss_scale"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, None, "bf16.enabled"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0.5}}, "0.19.8", "fp16.min_loss_scale"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, None, "fp16.loss_scale_window"),
    ({"fp16": {"enabled": True, "initial_scale_power": 200}}, None, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 4}}, None, "stage"),
    ({"fp16": {"enabled": True}}, "0.9.0", "release"),
    ({"fp16": {"enabled": True}}, "0.20.0", "release"),
])
def test_from_deepspeed_refuses_what_it_cannot_map(ds_config, release, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")) as info:
        DLSConfig.from_deepspeed(ds_config, release=release)
    assert "\n" not in str(info.value)


# ---- megatron, keras, torch over random patterns ------------------------------------------------
@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("hyst", [1, 2, 4])
@pytest.mark.parametrize(("growth", "backoff"), [(2.0, 0.5), (3.0, 0.3)])
def test_megatron_preset_matches_megatron_core(megatron_scaler, window, hyst, growth, backoff):
    init = 2.0**10
    cfg = DLSConfig(policy="megatron", initial_loss_scale=init, steps_per_increase=window,
                    hysteresis=hyst, min_loss_scale=1.0, growth_factor=growth,
                    backoff_factor=backoff)
    seqs = patterns(window * 31 + hyst, 80)
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        ref = megatron(megatron_scaler, seq, init, window, hyst, 1.0, growth, backoff)
        # megatron's tracker goes below zero; dlspass clamps it at 0 (same backoffs, §3.3)
        want = [(s, t, max(h, 0)) for s, t, h in ref]
        got = [(float(s.loss_scale), int(s.steps_since_rescale), int(s.hysteresis)) for s in ours]
        assert got == want, seq.astype(int).tolist()


@pytest.mark.parametrize("window", [1, 2, 5])
def test_keras_preset_matches_keras(keras, window):
    init = 2.0**8
    cfg = DLSConfig(policy="keras", initial_loss_scale=init, steps_per_increase=window,
                    min_loss_scale=2.0**-149)  # Keras has no floor
    seqs = patterns(window, 90)
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        ref = keras_run(keras, seq, init, window)
        got = [(float(s.loss_scale), int(s.steps_since_rescale)) for s in ours]
        assert got == [(s, c) for s, c, _ in ref], seq.astype(int).tolist()


FACTORS = [(2.0, 0.5), (2.0, 0.3), (1.5, 0.7), (2.5, 0.25), (1.1, 0.9)]


@pytest.mark.parametrize(("growth", "backoff"), FACTORS)
@pytest.mark.parametrize("window", [1, 2, 4])
def test_torch_preset_matches_torch_amp(growth, backoff, window):
    init = 1024.0
    cfg = DLSConfig(policy="torch", initial_loss_scale=init, steps_per_increase=window,
                    growth_factor=growth, backoff_factor=backoff, min_loss_scale=2.0**-149)
    seqs = patterns(int(growth * 10 + backoff * 100) + window, 70)
    for seq, ours in zip(seqs, dls_batch(cfg, seqs), strict=True):
        for (t_scale, tracker), s in zip(torch_amp(seq, init, window, growth, backoff), ours,
                                         strict=True):
            if not 2.0**-149 <= t_scale <= BIG:
                break  # torch left dlspass's [floor, cap] (both intended, docs/SEMANTICS.md §2)
            assert (float(s.loss_scale), int(s.steps_since_rescale)) == (t_scale, tracker), \
                seq.astype(int).tolist()


# ---- item 2: a backoff factor float32 cannot hold ----------------------------------------------
def test_torch_backoff_factor_rounds_once_as_torch():
    ref = torch_amp([True, True, True], 1024.0, 5, backoff=0.3)
    assert ref[-1][0] == f32(27.6480007)
    cfg = DLSConfig(policy="torch", initial_loss_scale=1024.0, backoff_factor=0.3,
                    steps_per_increase=5)
    ours = dls_batch(cfg, np.ones((1, 3), bool))[0]
    assert [float(s.loss_scale) for s in ours] == [s for s, _ in ref]
    # the float32 product (what dlspass computed before) is another number
    assert f32(f32(f32(1024 * f32(0.3)) * f32(0.3)) * f32(0.3)) != ref[-1][0]


# ---- item 3: scales below 2**-126 --------------------------------------------------------------
def test_subnormal_scales_unscale_finite_as_torch_and_keras(keras):
    seq = [True] * 8 + [False]
    t_ref = torch_amp(seq, 2.0**-120, 2)
    k_ref = keras_run(keras, seq, 2.0**-120, 2, grad=2.0**-140)
    assert t_ref[-1] == (2.0**-128, 1) and k_ref[-1][:2] == (2.0**-128, 1)
    # Keras took the clean step with the unscaled gradient 2**-140 / 2**-128 = 2**-12
    assert float(k_ref[-1][2][0]) == -(2.0**-12)
    for policy in ("torch", "keras"):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=1.0)
        sc = dlspass.GradScaler(policy=policy, init_scale=2.0**-120, steps_per_increase=2,
                                min_loss_scale=2.0**-149)
        for ovf in seq:
            opt.zero_grad()
            # at the scale 2**-128 the scaled gradient is 2**-140 (subnormal), as Keras got it
            loss = (p * torch.tensor([2.0**-12, 0.0])).sum()
            sc.scale(loss).backward()
            if ovf:
                p.grad[0] = float("inf")
            sc.step(opt)
            sc.update()
        assert float(sc.get_scale()) == 2.0**-128, policy
        assert int(sc.get_num_skipped_steps()) == 8, policy
        assert p.detach().tolist() == [-(2.0**-12), 0.0], policy


# ---- item 4: the largest scale ------------------------------------------------------------------
def test_largest_scale_is_a_power_of_two(ds_loss_scaler, megatron_scaler, keras):
    seq = np.zeros(4, bool)
    refs = {
        "torch": [s for s, _ in torch_amp(seq, 2.0**125, 1)],
        "keras": [s for s, _, _ in keras_run(keras, seq, 2.0**125, 1)],
        "megatron": [s for s, _, _ in megatron(megatron_scaler, seq, 2.0**125, 1, 2, 1.0)],
        "deepspeed": [s for s, _ in deepspeed_zero(ds_loss_scaler, seq, 2.0**125, 1, 2, False, 1.0)],
    }
    # torch stops at 2**127; Keras and Megatron reach inf; DeepSpeed's Python float goes past
    assert refs["torch"][-1] == BIG and refs["keras"][-1] == refs["megatron"][-1] == float("inf")
    assert refs["deepspeed"][-1] > BIG
    for policy, ref in refs.items():
        cfg = DLSConfig(policy=policy, initial_loss_scale=2.0**125, steps_per_increase=1)
        got = [float(s.loss_scale) for s in dls_batch(cfg, seq[None])[0]]
        assert got == [min(r, BIG) for r in ref], policy
        assert cfg.max_scale == BIG and math_frexp_mantissa(got[-1]) == 0.5, policy


def math_frexp_mantissa(x: float) -> float:
    import math

    return math.frexp(x)[0]


# ---- item 5: GradScaler keywords for every policy parameter -------------------------------------
def test_grad_scaler_keywords_reach_every_policy_parameter(ds_loss_scaler):
    kw = {"policy": "deepspeed", "init_scale": 2.0**10, "steps_per_increase": 2, "hysteresis": 3,
          "consecutive_hysteresis": True, "min_loss_scale": 1.0}
    sc = dlspass.GradScaler(**kw)
    assert sc.config == DLSConfig(policy="deepspeed", initial_loss_scale=2.0**10,
                                  steps_per_increase=2, hysteresis=3,
                                  consecutive_hysteresis=True, min_loss_scale=1.0)
    torch_sc = dlspass.GradScaler(policy="torch", growth_factor=1.5, backoff_factor=0.3)
    assert (torch_sc.get_growth_factor(), torch_sc.get_backoff_factor()) == (1.5, 0.3)
    # merged with config= by the one rule: the keywords given override the config's fields
    base = DLSConfig(policy="megatron", steps_per_increase=7, hysteresis=4)
    merged = dlspass.GradScaler(config=base, hysteresis=2, growth_factor=4.0, policy="cerebras")
    assert merged.config == base.with_overrides(hysteresis=2, growth_factor=4.0, policy="cerebras")
    assert dlspass.GradScaler(config=base).config == base
    with pytest.raises(ConfigError, match="hysteresis"):
        dlspass.GradScaler(config=base, hysteresis=0)
    # a live scaler's state follows its policy: one with the same numbers is still refused
    ds = DLSConfig(policy="deepspeed")
    with pytest.raises(ConfigError, match="policy"):
        ds.with_overrides_keeping_state(policy="deepspeed-0.17.0")


# ---- the eager GradScaler and a captured step against the tools ----------------------------------
def _eager_scales(cfg: DLSConfig, seq) -> list[float]:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.01)
    sc = dlspass.GradScaler(config=cfg)
    out = []
    for ovf in seq:
        opt.zero_grad()
        before = p.detach().clone()
        sc.scale((p * torch.tensor([1.0, 2.0, float("inf") if ovf else 3.0])).sum()).backward()
        sc.step(opt)
        sc.update()
        assert torch.equal(p.detach(), before) == bool(ovf)
        out.append(float(sc.get_scale()))
    return out


def test_eager_grad_scaler_matches_the_tools(ds_loss_scaler, ds_0_17_0, megatron_scaler, keras):
    seqs = patterns(5, 12, steps=30)
    cases = {
        "deepspeed": (dict(hysteresis=2, consecutive_hysteresis=False),
                      lambda s: [x for x, _ in deepspeed_zero(ds_loss_scaler, s, 256.0, 2, 2,
                                                              False, 1.0)]),
        "deepspeed-0.17.0": (dict(hysteresis=2, consecutive_hysteresis=True),
                             lambda s: [x for x, _ in deepspeed_zero(ds_0_17_0.loss_scaler, s,
                                                                     256.0, 2, 2, True, 1.0)]),
        "deepspeed-fp16-optimizer": ({}, lambda s: deepspeed_fp16_optimizer(s, 256.0, 2, 1.0)),
        "megatron": (dict(hysteresis=2), lambda s: [x for x, _, _ in megatron(
            megatron_scaler, s, 256.0, 2, 2, 1.0)]),
        "keras": ({}, lambda s: [x for x, _, _ in keras_run(keras, s, 256.0, 2)]),
        "torch": (dict(backoff_factor=0.3, growth_factor=1.5),
                  lambda s: [x for x, _ in torch_amp(s, 256.0, 2, 1.5, 0.3)]),
    }
    for policy, (kw, ref) in cases.items():
        cfg = DLSConfig(policy=policy, initial_loss_scale=256.0, steps_per_increase=2,
                        min_loss_scale=2.0**-149 if policy in ("torch", "keras") else 1.0,
                        mixed_precision=False, **kw)
        for seq in seqs:
            assert _eager_scales(cfg, seq) == ref(seq), (policy, seq.astype(int).tolist())


def _captured_scales(cfg: DLSConfig, seq, compile: bool = False) -> list[float]:
    from dlspass.models import MLP

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(m, batch):
        x, mult = batch
        return m(x).sum() * mult

    x = torch.randn(4, 8)
    step = dlspass.capture_step(model, loss_fn, opt, (x, torch.tensor(1.0)), config=cfg,
                                compile=compile)
    out = []
    for ovf in seq:
        step((x, torch.tensor(float("inf") if ovf else 1.0)))
        out.append(float(step.scaler.get_scale()))
    return out


def test_captured_step_matches_the_tools(ds_loss_scaler, ds_0_17_0):
    seq = patterns(11, 1, steps=24)[0]
    ds = DLSConfig(policy="deepspeed", initial_loss_scale=256.0, steps_per_increase=2,
                   hysteresis=2, min_loss_scale=1.0, mixed_precision=False)
    assert _captured_scales(ds, seq) == [s for s, _ in deepspeed_zero(
        ds_loss_scaler, seq, 256.0, 2, 2, False, 1.0)]
    old = ds.with_overrides(policy="deepspeed-0.17.0")
    old_ref = [s for s, _ in deepspeed_zero(ds_0_17_0.loss_scaler, seq, 256.0, 2, 2, False, 1.0)]
    assert _captured_scales(old, seq) == old_ref
    assert _captured_scales(ds, seq) != old_ref  # this pattern tells the two releases apart
    fp16_opt = ds.with_overrides(policy="deepspeed-fp16-optimizer")
    assert _captured_scales(fp16_opt, seq) == deepspeed_fp16_optimizer(seq, 256.0, 2, 1.0)
    th = DLSConfig(policy="torch", initial_loss_scale=256.0, steps_per_increase=2,
                   backoff_factor=0.3, growth_factor=1.5, mixed_precision=False)
    # through inductor too: the float64 product of torch's kernel survives compilation
    assert _captured_scales(th, seq, compile=True) == [s for s, _ in torch_amp(seq, 256.0, 2,
                                                                              1.5, 0.3)]
    # a scale below 2**-126 unscales finite in the graph too: the clean step is taken
    sub = DLSConfig(policy="torch", initial_loss_scale=2.0**-120, steps_per_increase=2,
                    min_loss_scale=2.0**-149, mixed_precision=False)
    tiny = [True] * 8 + [False]
    assert _captured_scales(sub, tiny) == [s for s, _ in torch_amp(tiny, 2.0**-120, 2)]


# ---- the 0.17.0 sdist's cache ------------------------------------------------------------------
def test_without_pypi_the_0_17_0_reference_fails_naming_the_prefetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv(deepspeed_sdist.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip offline: no index, no links
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(deepspeed_sdist.SdistUnavailable) as info:
        deepspeed_sdist.sdist("0.17.0")
    msg = str(info.value)
    assert "pip download deepspeed==0.17.0 --no-deps --no-binary :all: --no-build-isolation" in msg
    assert str(tmp_path / "deepspeed-0.17.0") in msg and "\n" not in msg
    # a cached file that is not PyPI's is refused, not run
    (tmp_path / "deepspeed-0.17.0" / "deepspeed-0.17.0.tar.gz").write_bytes(b"not the sdist")
    with pytest.raises(deepspeed_sdist.SdistUnavailable, match="sha256"):
        deepspeed_sdist.sdist("0.17.0")
