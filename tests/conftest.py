"""Suite-wide collection: the ``numerics`` marker on the test files whose results depend on which
CPU kernels torch picks (tools/run_isa_suite.sh runs them once per ISA setting)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch._inductor import config as inductor_config

from dlspass.cache_facts import CacheFactsPass

# Every inductor compile of the test processes carries the CPU facts in its cache key, torch's
# own baselines (torch.compile(model) beside a dlspass step) included: inductor's key lacks the
# vector ISA, so a cache folder warmed under another ATEN_CPU_CAPABILITY would hand the baseline
# code of the other ISA (seen: vectorised source compiled without the vector headers, a C++
# error). dlspass's own compiles key themselves (tests/test_cache_facts.py checks that in fresh
# processes, where this line does not run).
inductor_config.post_grad_custom_post_pass = CacheFactsPass(None)

_HERE = Path(__file__).parent

# files (or folders) whose tests compare floating-point results computed by torch's CPU kernels:
# the ones ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA can change
NUMERICS = ("passes", "test_formats.py", "test_format_ranges.py", "test_telemetry.py",
            "test_native_precision.py", "test_compile_step.py", "test_scaler.py",
            "test_properties.py", "test_underflow.py", "test_capture.py", "test_optim_functional.py",
            "test_scale_policy.py", "test_dynamo_backend.py", "test_compile_user_grad_code.py",
            "test_splice.py", "test_step_pipeline.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    roots = [_HERE / name for name in NUMERICS]
    for item in items:
        path = Path(item.path)
        if any(path == r or r in path.parents for r in roots):
            item.add_marker(pytest.mark.numerics)
