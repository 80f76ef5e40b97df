"""Long hostile-input fuzzing: tests/test_fuzz_inputs.py with many more, fresh inputs.

Runs the fuzz tests under pytest with ``DLSPASS_FUZZ_EXAMPLES`` inputs per format (default
3000) and random (not replayed) hypothesis seeds, then prints the exit-code counts per format
and the hits of known, already reported defects.

    .venv/bin/python tools/reliability/fuzz_long.py --examples 3000 --out fuzz_stats.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=3000, help="inputs per format")
    ap.add_argument("--out", help="write the JSON statistics here")
    ap.add_argument("--replay", action="store_true", help="CI's fixed inputs instead of fresh ones")
    a = ap.parse_args(argv)
    stats = a.out or os.path.join(tempfile.mkdtemp(), "fuzz_stats.json")
    env = {**os.environ, "DLSPASS_FUZZ_EXAMPLES": str(a.examples), "DLSPASS_FUZZ_STATS": stats,
           "PYTHONPATH": str(ROOT)}
    if not a.replay:
        env["DLSPASS_FUZZ_RANDOM"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
           "-W", "ignore::hypothesis.errors.HypothesisWarning",
           str(ROOT / "tests" / "test_fuzz_inputs.py"), "-k", "fuzz"]
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    if Path(stats).is_file():
        print(Path(stats).read_text())
    return rc


if __name__ == "__main__":
    sys.exit(main())
