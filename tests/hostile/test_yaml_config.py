"""Hostile Model Zoo YAML and DLSConfig values: bounded time, bounded memory, one bounded line.

Each case is an input an attacker (or an accident) can hand to ``DLSConfig.from_yaml`` /
``dlspass transform --config``: an alias bomb, a deep flow sequence, a device or a FIFO instead of a
file, scales that float32 cannot hold, values of the wrong type, a 50 MB string. Every case must end
in a `DLSInputError` subclass with one line of bounded length, within the time and memory bounds
below, and never in RecursionError, MemoryError or a hang.
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from dlspass import DLSInputError
from dlspass.config import ConfigError, DLSConfig
from dlspass.files.bounded_yaml import MAX_YAML_BYTES

MAX_LINE = 600          # characters of an error line (the longest lists the known keys)
MAX_SECONDS = 5.0       # wall time of one hostile read (the real files take milliseconds)
MAX_PEAK = 64 << 20     # bytes of Python allocations while handling one hostile input


def _refused(fn: Callable[[], object], *, seconds: float = MAX_SECONDS, peak: int = MAX_PEAK) -> str:
    """Run ``fn`` in a worker thread under the bounds; return its one-line DLSInputError message."""
    box: dict[str, object] = {}

    def work() -> None:
        tracemalloc.start()
        try:
            fn()
        except BaseException as exc:
            box["exc"] = exc
        finally:
            box["peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()

    start = time.perf_counter()
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(seconds)
    elapsed = time.perf_counter() - start
    assert not worker.is_alive(), f"still running after {seconds} s"
    exc = box.get("exc")
    assert isinstance(exc, DLSInputError), f"expected a DLSInputError, got {exc!r:.300}"
    assert isinstance(exc, ConfigError)
    msg = str(exc)
    assert "\n" not in msg and len(msg) <= MAX_LINE, msg[:MAX_LINE]
    assert box["peak"] <= peak, f"peak {box['peak']} bytes"
    assert elapsed <= seconds
    return msg


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The classic "billion laughs": each level is a list of ``width`` aliases of the one before."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        refs = ",".join(f"*a{i - 1}" for _ in range(width))
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---- YAML structure -----------------------------------------------------------------------------
def test_alias_bomb_from_a_wrongly_typed_key_fails_fast(tmp_path):
    bomb = _alias_bomb()
    text = bomb + "trainer:\n  init:\n    precision:\n      fp16_type: *a8\n"
    assert len(text.encode()) < 700  # the ~550-byte bomb plus the key that references it
    path = _write(tmp_path, "bomb.yaml", text)
    msg = _refused(lambda: DLSConfig.from_yaml(path))
    assert msg.startswith(f"{path}: invalid YAML") and "aliases expand the document past" in msg


def test_alias_bomb_under_an_unrelated_key_fails_fast_too(tmp_path):
    path = _write(tmp_path, "bomb2.yaml", _alias_bomb() + "train_input: *a8\noptimizer: {}\n")
    assert "aliases expand the document past" in _refused(lambda: DLSConfig.from_yaml(path))


def test_alias_tree_within_the_bound_is_not_expanded_into_the_message(tmp_path):
    # 9**5 = 59049 leaves: accepted by the loader, but the wrong type must be named, not printed.
    path = _write(tmp_path, "tree.yaml", _alias_bomb(levels=5) + "trainer:\n  init:\n    precision:\n"
                  "      fp16_type: *a4\n")
    msg = _refused(lambda: DLSConfig.from_yaml(path))
    assert msg.endswith("trainer.init.precision.fp16_type: expected one of float16 | bfloat16 | cbfloat16, "
                        "got list of 9 items")


def test_deep_flow_sequence_is_an_input_error_not_recursion(tmp_path):
    path = _write(tmp_path, "deep.yaml", "trainer: " + "[" * 5000 + "]" * 5000 + "\n")
    msg = _refused(lambda: DLSConfig.from_yaml(path))
    assert "invalid YAML" in msg and "nesting deeper than 64 levels" in msg


def test_deep_block_mapping_is_an_input_error(tmp_path):
    text = "".join(f"{' ' * i}k{i}:\n" for i in range(300)) + " " * 300 + "v: 1\n"
    path = _write(tmp_path, "deep_block.yaml", text)
    assert "nesting deeper than 64 levels" in _refused(lambda: DLSConfig.from_yaml(path))


def test_huge_integer_literal_is_an_input_error(tmp_path):
    path = _write(tmp_path, "int.yaml", "trainer:\n  init:\n    precision:\n      steps_per_increase: "
                  + "9" * 20_000 + "\n")
    msg = _refused(lambda: DLSConfig.from_yaml(path))
    assert msg.startswith(f"{path}: ")


# ---- what is read -------------------------------------------------------------------------------
def test_dev_zero_is_refused_without_reading(tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero on this platform")
    msg = _refused(lambda: DLSConfig.from_yaml("/dev/zero"), peak=1 << 20)
    assert msg == "/dev/zero: not a regular file (a device, FIFO or socket); give a YAML file"


def test_fifo_is_refused_without_hanging(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    fifo = tmp_path / "params.yaml"
    os.mkfifo(fifo)
    try:
        msg = _refused(lambda: DLSConfig.from_yaml(fifo), seconds=3.0, peak=1 << 20)
    finally:
        # Should the read have blocked in open(), a writer releases it.
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert msg == f"{fifo}: not a regular file (a device, FIFO or socket); give a YAML file"


def test_oversized_file_is_refused_by_size(tmp_path):
    path = tmp_path / "big.yaml"
    with path.open("wb") as f:
        f.truncate(64 * MAX_YAML_BYTES)  # sparse: costs no disk
    msg = _refused(lambda: DLSConfig.from_yaml(path), peak=4 * MAX_YAML_BYTES)
    assert msg == f"{path}: larger than {MAX_YAML_BYTES} bytes; not a Model Zoo params file"


# ---- DLSConfig values in float32 terms ----------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"initial_loss_scale": 1e39, "max_loss_scale": 1e39}, "initial_loss_scale: 1e+39 is outside float32's range"),
    ({"max_loss_scale": 1e39}, "max_loss_scale: 1e+39 is outside float32's range"),
    ({"loss_scale": 1e39}, "loss_scale: 1e+39 is outside float32's range"),
    ({"loss_scale": 1e-50}, "loss_scale: 1e-50 is outside float32's range"),
    ({"loss_scale": 1e-40}, "loss_scale: 1e-40 is outside float32's range"),  # subnormal: 1/scale is inf
    ({"min_loss_scale": 1e-46}, "min_loss_scale: 1e-46 is outside float32's range"),
    ({"loss_scale": float("nan")}, "loss_scale: must be finite, got nan"),
    ({"initial_loss_scale": 10**400}, "initial_loss_scale: must be finite, got an integer of 1329 bits"),
    ({"max_gradient_norm": 1e39}, "max_gradient_norm: must be > 0 and at most float32's max"),
    ({"growth_factor": float("inf")}, "growth_factor: must be finite"),
    ({"consecutive_hysteresis": "no"}, "consecutive_hysteresis: expected a bool, got 'no'"),
    ({"log_loss_scale": 1}, "log_loss_scale: expected a bool, got 1"),
    ({"extras": [1, 2]}, "extras: expected a dict with string keys, got list of 2 items"),
    ({"extras": {1: "x"}}, "extras: expected a dict with string keys"),
    ({"steps_per_increase": 10**30}, "steps_per_increase: must be an integer in [1, 9223372036854775807], got an integer of 100 bits"),
    ({"hysteresis": 2**63}, "hysteresis: must be an integer in [1, 9223372036854775807], got 9223372036854775808"),
    ({"steps_per_increase": 2.5}, "steps_per_increase: expected a positive integer, got 2.5"),
    ({"fp16_type": ["float16"]}, "fp16_type: unknown format list of 1 items"),
    ({"policy": None}, "policy: unknown preset None"),
    ({"on_scale_floor": "ignore"}, "on_scale_floor: unknown action 'ignore'"),
])
def test_dlsconfig_rejects_values_float32_or_the_scaler_cannot_hold(kwargs, fragment):
    assert fragment in _refused(lambda: DLSConfig(**kwargs))


def test_dlsconfig_accepts_the_float32_extremes():
    top = DLSConfig(initial_loss_scale=3.4e38, max_loss_scale=3.4e38)
    assert top.init_scale == 3.4e38
    low = DLSConfig(loss_scale=2.0**-126)
    assert low.init_scale == 2.0**-126 and low.enabled
    # torch.amp and Model Zoo use growth_interval 2**63 - 1 for "never grow".
    assert DLSConfig(steps_per_increase=2**63 - 1).growth_interval == 2**63 - 1


def test_fifty_megabyte_value_is_not_echoed():
    huge = "x" * 50_000_000
    msg = _refused(lambda: DLSConfig(fp16_type=huge), peak=1 << 20)
    assert msg.startswith("fp16_type: unknown format 'xxxx") and "(50000000 characters)" in msg
    msg = _refused(lambda: DLSConfig.from_dict({"trainer": {"init": {"precision": {"fp16_type": huge}}}},
                                              source="p.yaml"), peak=1 << 20)
    assert "(50000000 characters)" in msg
    msg = _refused(lambda: DLSConfig.from_dict({huge: 1}, source="p.yaml"), peak=1 << 20)
    assert msg.startswith("p.yaml: 'xxxx") and "unknown DLSConfig field" in msg
    msg = _refused(lambda: DLSConfig.from_dict({"trainer": {"init": {"precision": {huge: 1}}}},
                                              source="p.yaml"), peak=1 << 20)
    assert "unknown precision key" in msg
    msg = _refused(lambda: DLSConfig.from_dict({"optimizer": {"loss_scaling_factor": huge}},
                                              source="p.yaml"), peak=1 << 20)
    assert msg.startswith("p.yaml: optimizer.loss_scaling_factor: expected \"dynamic\", a number or null, "
                          "got 'xxxx") and msg.endswith("(50000000 characters)")


def test_yaml_scales_out_of_float32_range_name_the_yaml_key(tmp_path):
    path = _write(tmp_path, "f32.yaml", "trainer:\n  init:\n    precision:\n      fp16_type: float16\n"
                  "      loss_scaling_factor: 1e39\n")
    msg = _refused(lambda: DLSConfig.from_yaml(path))
    assert "trainer.init.precision.loss_scaling_factor: 1e+39 is outside float32's range" in msg
    path = _write(tmp_path, "f32b.yaml", "trainer:\n  init:\n    precision:\n      fp16_type: float16\n"
                  "      loss_scaling_factor: dynamic\n      initial_loss_scale: 1e39\n"
                  "      max_loss_scale: 1e39\n")
    msg = _refused(lambda: DLSConfig.from_yaml(path))
    assert "trainer.init.precision.initial_loss_scale: 1e+39 is outside float32's range" in msg
