"""Start a test script as N gloo processes on loopback and collect each rank's saved result.

The script is run as ``python SCRIPT RANK WORLD PORT OUTDIR`` and must save its result dict to
``OUTDIR/rank<RANK>.pt``. Only 127.0.0.1 is used; every run is bounded by ``timeout_s``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, world: int, timeout_s: float) -> list[dict]:
    """Run ``script`` on ``world`` ranks; fail the test on a timeout or a failed worker."""
    outdir = tempfile.mkdtemp(prefix=f"dlspass_gloo{world}_")
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               # workers import this module (`serve`) from wherever their script lives
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                        os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, script, str(r), str(world), str(port), outdir],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            logs.append(out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{world}-process run did not finish in {timeout_s} s")
    if any(p.returncode != 0 for p in procs):
        pytest.fail("a worker failed:\n" + "\n".join(log[-3000:] for log in logs))
    return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def serve(argv: list[str], compute: Callable[[int], dict]) -> None:
    """The worker side of `launch`: join the gloo group named by ``argv`` (RANK WORLD PORT
    OUTDIR), save ``compute(rank)`` where `launch` reads it, and leave the group."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, world, port, outdir = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    torch.save(compute(rank), os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()
