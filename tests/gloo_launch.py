"""Start a test script as N gloo processes on loopback and collect each rank's saved result.

The script is run as ``python SCRIPT RANK WORLD OUTDIR``, joins the group with `gloo_group`
(or `serve`) and saves its result dict with `save_result`. The ranks meet through a
``FileStore`` in OUTDIR, not a TCP port: a port picked by binding one and releasing it could be
taken by another process (pytest -n 2 runs two launches at once) before rank 0 binds it again,
whereas gloo's own connections bind their ports and keep them. Only loopback is used; every
run is bounded by ``timeout_s``.

Written to hold on a loaded machine (many processes on few cores):

- a worker imports what it tests before the rendezvous, so import time (tens of seconds under
  load) is not spent with the other ranks waiting inside a collective;
- the collective timeout is long (`GROUP_TIMEOUT_S`), the launcher's longer still;
- the group is left in order: a barrier (no rank is still sending to one that has left),
  then ``destroy_process_group``; the process then ends with ``os._exit(0)``, so that the
  interpreter's teardown never destroys gloo's C++ objects (and their threads) in an order of
  its own choosing, which is where a worker died with ``terminate called without an active
  exception``;
- each worker writes its output to a file (no pipe that fills while the launcher waits on
  another rank), and the first worker that fails ends the run with its log.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch

# a collective or the rendezvous waits this long for the slowest rank; a whole run this long
# (a gloo timeout is then reported by the worker); and a test that launches one this long
GROUP_TIMEOUT_S = 240
LAUNCH_TIMEOUT_S = 420
PYTEST_TIMEOUT_S = 480
# imported by every worker before the rendezvous
PRELOAD = ("dlspass", "dlspass.scaler", "dlspass.models", "dlspass.distributed",
           "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.checkpoint")


def launch(script: str, world: int, timeout_s: float = LAUNCH_TIMEOUT_S) -> list[dict]:
    """Run ``script`` on ``world`` ranks; fail the test on a timeout or a failed worker."""
    outdir = tempfile.mkdtemp(prefix=f"dlspass_gloo{world}_")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               # workers import this module (`serve`) from wherever their script lives
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                        os.environ.get("PYTHONPATH")])))
    logs = [Path(outdir) / f"rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, script, str(r), str(world), outdir],
                env=env, stdout=log, stderr=subprocess.STDOUT))

    def tails() -> str:
        return "\n".join(f"--- rank {r} (exit {p.returncode}):\n"
                         + logs[r].read_text(errors="replace")[-3000:]
                         for r, p in enumerate(procs))

    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                pytest.fail("a worker failed:\n" + tails())
            if time.monotonic() > deadline:
                pytest.fail(f"{world}-process run did not finish in {timeout_s} s:\n" + tails())
            time.sleep(0.1)
        if any(p.returncode != 0 for p in procs):
            pytest.fail("a worker failed:\n" + tails())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def save_result(result: dict, outdir: str, rank: int) -> None:
    """Save ``result`` where `launch` reads it (written whole, then renamed into place)."""
    path = os.path.join(outdir, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)


@contextmanager
def gloo_group(argv: list[str]) -> Iterator[tuple[int, int, str]]:
    """The worker side of `launch`: join the gloo group named by ``argv`` (RANK WORLD OUTDIR)
    and yield ``(rank, world, outdir)``. When the body returns, the group is left in
    order and the process ends (exit code 0); an exception propagates (a failed worker)."""
    import torch.distributed as dist

    rank, world, outdir = int(argv[1]), int(argv[2]), argv[3]
    torch.set_num_threads(1)
    for name in PRELOAD:
        importlib.import_module(name)
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.FileStore(os.path.join(outdir, "rdzv"), world)
    store.set_timeout(timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    yield rank, world, outdir
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(argv: list[str], compute: Callable[[int], dict]) -> None:
    """Join the group named by ``argv``, save ``compute(rank)`` where `launch` reads it, and
    leave the group (see `gloo_group`)."""
    with gloo_group(argv) as (rank, _, outdir):
        save_result(compute(rank), outdir, rank)
