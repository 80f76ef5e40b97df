"""docs/DISTRIBUTED.md's float16 FSDP2 loop: the text shown is the script's, and the script runs.

The script (tools/examples/fsdp2_float16_finetune.py) is started exactly as the docs say, with
``torch.distributed.run`` (what ``torchrun`` runs) on 2 gloo ranks on 127.0.0.1, with an inf
written into one rank's gradient shard at one step: both ranks must skip that step (and only
that one), end with the same parameters, and the loss must have come down.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gloo_launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "examples" / "fsdp2_float16_finetune.py"
DOC = ROOT / "docs" / "DISTRIBUTED.md"
STEPS, INJECT_AT = 12, 3
TIMEOUT_S = 300


def _script_loop() -> str:
    text = SCRIPT.read_text()
    body = text.split("# --8<-- [start:loop]\n")[1].split("    # --8<-- [end:loop]")[0]
    return textwrap.dedent(body).strip()


def test_docs_show_the_scripts_loop_and_command() -> None:
    doc = DOC.read_text()
    blocks = [textwrap.dedent(b).strip() for b in re.findall(r"```python\n(.*?)```", doc, re.S)]
    assert _script_loop() in blocks
    assert "torchrun --nproc-per-node 2 tools/examples/fsdp2_float16_finetune.py" in doc


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_example_runs_under_torchrun_on_two_gloo_ranks() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
           "--steps", str(STEPS), "--inject-inf-at", str(INJECT_AT)]
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                             cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    done = re.findall(r"done rank (\d) skipped (\d+) checksum (\S+) final_loss (\S+)", out)
    assert sorted(d[0] for d in done) == ["0", "1"], out[-4000:]
    assert len({d[1] for d in done}) == 1  # both ranks skipped the same number of steps
    assert len({d[2] for d in done}) == 1  # and hold identical parameters
    steps = re.findall(r"step (\d+) loss (\S+) scale (\S+) stepped (True|False)", out)
    assert [int(s[0]) for s in steps] == list(range(STEPS))
    assert steps[INJECT_AT][3] == "False"  # the inf on rank 1 made rank 0 skip too
    assert int(done[0][1]) == sum(s[3] == "False" for s in steps) < STEPS // 2
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < 0.5 * losses[0], losses
