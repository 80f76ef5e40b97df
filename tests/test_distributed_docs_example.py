"""docs/DISTRIBUTED.md's float16 FSDP2 loop: the text shown is the script's, and the script runs.

The script (tools/examples/fsdp2_float16_finetune.py) is started as the docs say, with
``torch.distributed.run`` (what ``torchrun`` runs) on 2 gloo ranks, with an inf written into one
rank's gradient shard at one step: both ranks must skip that step (and only that one), end with
the same parameters, and the loss must have come down.

The launch is made robust against what other tests and other processes on the machine leave
behind: ``--standalone`` lets the launcher's own stores bind port 0 (a port picked beforehand
and freed again can be taken by another socket before torchrun binds it on every address, and
binding 127.0.0.1 to pick it does not see sockets on the other addresses), ``--local-addr``
keeps the workers on 127.0.0.1, the launcher's environment variables (``MASTER_*``, ``RANK``,
``PET_*`` flags, ``TORCHELASTIC_*``) are not inherited from the caller, and on a timeout the
whole process group (torchrun and its workers) is killed, not torchrun alone, so no orphaned
worker keeps running beside the next test.

Each rank's output is read from its own file, never from the launcher's shared stdout (where two
ranks' lines can run together): the final results from the ``rank<N>.json`` files the script
writes with ``--result-dir``, and rank 0's step lines from its own stdout file (torchrun's
``--log-dir`` with ``--redirects 3``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


# what torch.distributed.run and its workers read from the environment: a caller's value (a
# test run under torchrun, an exported MASTER_PORT) must not reach this launch
LAUNCHER_ENV = re.compile(r"(MASTER_ADDR|MASTER_PORT|RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK"
                          r"|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_WORLD_SIZE|ROLE_WORLD_SIZE"
                          r"|ROLE_NAME|PET_.*|TORCHELASTIC_.*|TORCH_DISABLE_SHARE_RDZV_TCP_STORE)")


def _launch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_ENV.fullmatch(k)}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    return env


def _rank_stdout(log_dir: Path, local_rank: int) -> str:
    """The stdout torchrun redirected for ``local_rank``: <log-dir>/<run id>/attempt_0/<rank>/."""
    files = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stdout.log"))
    assert len(files) == 1, files
    return files[0].read_text()


def _logs(log_dir: Path) -> str:
    """Every file torchrun wrote, for a failure message."""
    return "\n".join(f"--- {f}\n{f.read_text()[-2000:]}" for f in sorted(log_dir.rglob("*.log")))


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_example_runs_under_torchrun_on_two_gloo_ranks(tmp_path: Path) -> None:
    results, logs = tmp_path / "results", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--local-addr", "127.0.0.1", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3", str(SCRIPT),
           "--steps", str(STEPS), "--inject-inf-at", str(INJECT_AT), "--result-dir", str(results)]
    proc = subprocess.Popen(cmd, env=_launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s:\n{(stdout + stderr)[-4000:]}"
                    f"\n{_logs(logs)}")
    assert proc.returncode == 0, (stdout + stderr)[-4000:] + _logs(logs)
    done = [json.loads((results / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [d["rank"] for d in done] == [0, 1]
    assert done[0]["skipped"] == done[1]["skipped"]  # both ranks skipped the same steps
    # and hold identical parameters: each rank gathers the same full tensors and sums them with
    # the same ops in the same order, so the checksums are bit-equal
    assert done[0]["checksum"] == done[1]["checksum"]
    steps = re.findall(r"^step (\d+) loss (\S+) scale (\S+) stepped (True|False)$",
                       _rank_stdout(logs, 0), re.M)
    assert [int(s[0]) for s in steps] == list(range(STEPS))
    assert steps[INJECT_AT][3] == "False"  # the inf on rank 1 made rank 0 skip too
    assert done[0]["skipped"] == sum(s[3] == "False" for s in steps) < STEPS // 2
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < 0.5 * losses[0], losses
