"""Communication that DLS adds per training step under DDP and FSDP2, against torch's scalers.

Two gloo processes on loopback train a small MLP. Collectives are counted by wrapping the
Python entry points every torch.distributed user goes through (``torch.distributed.all_reduce``
and friends, and ``torch.distributed._functional_collectives``, which DTensor uses), and only
inside the scaler's part of the step: ``unscale_`` + clipping + ``step`` + ``update`` (the
forward/backward, and DDP's and FSDP's own gradient communication, are outside). Bytes are the
payload of the tensors handed to the collectives, per rank.

Rows: torch.amp.GradScaler (DDP) and ``torch.distributed.fsdp.sharded_grad_scaler
.ShardedGradScaler`` (FSDP2), with ``torch.nn.utils.clip_grad_norm_`` for clipping, against
``dlspass.GradScaler``; and the captured step of ``dlspass.capture_step_distributed``,
whose collectives are graph nodes. The last column injects an inf into one gradient of rank 1
after the gradient reduction and reports whether rank 0 skipped too (ranks stay identical).

A second run on 4 gloo processes measures the agreement on the same FSDP2 and 2-D mesh runs
against torch's own path: FSDP2 on a 1-D mesh of 4, FSDP + tensor parallel (2x2: ColwiseParallel
/ RowwiseParallel on "tp", ``fully_shard`` on "dp") and HSDP (``fully_shard`` on a 2x2
replicate x shard mesh), each with ``torch.amp.GradScaler``, ``dlspass.TorchGradScaler`` and
``dlspass.GradScaler``; per step the collectives and bytes of the scaler's part and its wall
time, medians over ``--repeats`` repeats that interleave the scalers (their order rotates).

Usage: ``.venv/bin/python tools/bench/bench_distributed.py [--repeats N]``. Writes
``tools/bench/results/distributed.md`` and returns the Markdown from `main()`;
``--smoke`` (2 repeats) only prints it.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results" / "distributed.md"
WORLD = 2
MESH_WORLD = 4
REPEATS = 20
STEPS = 3
MAX_NORM = 0.05
_COUNTED = ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather",
            "reduce_scatter_tensor", "broadcast", "all_gather_single", "reduce_scatter_single")


class CollectiveCounter:
    """Counts calls and payload bytes of torch.distributed collectives while ``active``."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.active = False
        self.names: list[str] = []

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.active = False  # a collective built on another one counts once
                try:
                    t = args[0] if args else next(iter(kwargs.values()))
                    tensors = t if isinstance(t, (list, tuple)) else [t]
                    self.calls += 1
                    self.bytes += sum(x.numel() * x.element_size() for x in tensors
                                      if isinstance(x, torch.Tensor))
                    self.names.append(name)
                    return fn(*args, **kwargs)
                finally:
                    self.active = True
            return fn(*args, **kwargs)

        return wrapper

    @contextmanager
    def patched(self) -> Iterator[CollectiveCounter]:
        """Install the wrappers on torch.distributed and its functional collectives."""
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        saved = []
        for mod in (dist, c10d, funcol):
            for name in _COUNTED:
                if hasattr(mod, name):
                    saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, self._wrap(f"{mod.__name__.split('.')[-1]}.{name}",
                                                  getattr(mod, name)))
        try:
            yield self
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _batch(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    return x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _eager_row(rank: int, wrap: str, scaler_kind: str, clip: bool,
               counter: CollectiveCounter) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dlspass.models import MLP, mse_loss
    from dlspass.scaler import GradScaler

    torch.manual_seed(0)
    net = MLP()
    if wrap == "ddp":
        model: torch.nn.Module = DDP(net)
    else:
        fully_shard(net)
        model = net
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if scaler_kind == "dlspass":
        scaler: Any = GradScaler(init_scale=1024.0, max_gradient_norm=MAX_NORM if clip else None)
    elif wrap == "ddp":
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    else:
        scaler = ShardedGradScaler(device="cpu", init_scale=1024.0)
    calls = []
    byts = []
    skipped_together = None
    for it in range(STEPS + 1):
        scaler.scale(mse_loss(model, _batch(it, rank))).backward()
        inject = it == STEPS
        if inject and rank == 1:
            _local(net.fc2.weight.grad)[0, 0] = float("inf")
        before = torch.cat([_local(p).detach().reshape(-1).clone() for p in net.parameters()])
        c0, b0 = counter.calls, counter.bytes
        with counter.counting():
            if clip:
                if scaler_kind == "dlspass":
                    scaler.unscale_(opt)  # clips inside, after the overflow test
                else:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if not inject:
            calls.append(counter.calls - c0)
            byts.append(counter.bytes - b0)
        else:
            after = torch.cat([_local(p).detach().reshape(-1) for p in net.parameters()])
            skipped_together = bool(torch.equal(before, after))  # rank 0: did it skip too?
    return {"calls": sum(calls) / len(calls), "bytes": sum(byts) / len(byts),
            "rank0_skipped": skipped_together}


def _captured_row(rank: int, agree_flag: bool) -> dict[str, Any]:
    from dlspass.capture.functional import capture_step_distributed
    from dlspass.config import DLSConfig
    from dlspass.distributed import collective_nodes
    from dlspass.graph.roles import FLAG_ALLREDUCE, role_of
    from dlspass.models import MLP, mse_loss

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = DLSConfig(mixed_precision=False, initial_loss_scale=1024.0)
    step = capture_step_distributed(model, mse_loss, opt, _batch(0, rank), cfg,
                                    agree_flag=agree_flag)
    nodes = collective_nodes(step.graph_module)
    dls = [n for n in nodes if role_of(n) == FLAG_ALLREDUCE]
    grad = [n for n in nodes if n not in dls]

    def nbytes(ns: list) -> int:
        return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in ns)

    x, y = _batch(1, rank)
    if rank == 1:
        x = x.clone()
        x[0, 0] = float("inf")
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    step((x, y))
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"calls": len(dls), "bytes": nbytes(dls), "grad_calls": len(grad),
            "grad_bytes": nbytes(grad), "rank0_skipped": bool(torch.equal(before, after))}


def _mesh_model(layout: str) -> torch.nn.Module:
    """The MLP on ``layout``: "fsdp" (1-D, all ranks), "fsdp_tp" (2x2) or "hsdp" (2x2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dlspass.models import MLP

    torch.manual_seed(0)
    net = MLP()
    if layout == "fsdp":
        fully_shard(net)
    elif layout == "hsdp":
        fully_shard(net, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(net, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(net, mesh=mesh["dp"])
    return net


MESH_LAYOUTS = [("FSDP2 1-D (4)", "fsdp"), ("FSDP + TP (2x2)", "fsdp_tp"), ("HSDP (2x2)", "hsdp")]
MESH_SCALERS = ["torch.amp.GradScaler", "dlspass.TorchGradScaler", "dlspass.GradScaler"]


def _mesh_scaler(kind: str) -> Any:
    import dlspass

    if kind == "torch.amp.GradScaler":
        return torch.amp.GradScaler("cpu", init_scale=1024.0)
    if kind == "dlspass.TorchGradScaler":
        return dlspass.TorchGradScaler("cpu", init_scale=1024.0)
    return dlspass.GradScaler(init_scale=1024.0, policy="torch")


def _mesh_rows(rank: int, counter: CollectiveCounter, repeats: int) -> list[dict[str, Any]]:
    """Every (layout, scaler) pair built once, then ``repeats`` rounds of one step each, the
    pairs interleaved (the order rotates per round); the scaler's part is counted and timed."""
    from dlspass.models import mse_loss

    runs = []
    for setup, layout in MESH_LAYOUTS:
        for kind in MESH_SCALERS:
            net = _mesh_model(layout)
            runs.append({"setup": setup, "scaler": kind, "net": net, "scaler_obj": _mesh_scaler(kind),
                         "opt": torch.optim.SGD(net.parameters(), lr=0.01),
                         "calls": [], "bytes": [], "us": []})
    batch_of = {"fsdp": MESH_WORLD, "hsdp": MESH_WORLD, "fsdp_tp": 2}
    for rep in range(repeats + 1):  # round 0 warms up and is not kept
        order = runs[rep % len(runs):] + runs[:rep % len(runs)]
        for run in order:
            layout = dict(MESH_LAYOUTS)[run["setup"]]
            n = batch_of[layout]
            shard = rank if n == MESH_WORLD else rank // 2  # the dp coordinate of a 2x2 mesh
            g = torch.Generator().manual_seed(rep)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            scaler, opt = run["scaler_obj"], run["opt"]
            scaler.scale(mse_loss(run["net"], (x.chunk(n)[shard], y.chunk(n)[shard]))).backward()
            torch.distributed.barrier()  # time the scaler's part only, from a common start
            c0, b0 = counter.calls, counter.bytes
            t0 = time.perf_counter()
            with counter.counting():
                scaler.step(opt)
                scaler.update()
            dt = time.perf_counter() - t0
            opt.zero_grad(set_to_none=True)
            if rep:
                run["calls"].append(counter.calls - c0)
                run["bytes"].append(counter.bytes - b0)
                run["us"].append(dt * 1e6)
    return [{"setup": r["setup"], "scaler": r["scaler"],
             "calls": statistics.median(r["calls"]), "bytes": statistics.median(r["bytes"]),
             "us": statistics.median(r["us"])} for r in runs]


def _mesh_worker(rank: int, port: int, out: str, repeats: int) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=MESH_WORLD, timeout=timedelta(seconds=120))
    counter = CollectiveCounter()
    with counter.patched():
        rows = _mesh_rows(rank, counter, repeats)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


ROWS = [
    ("DDP", "torch.amp.GradScaler", "ddp", "torch", False),
    ("DDP", "torch.amp.GradScaler + clip_grad_norm_", "ddp", "torch", True),
    ("DDP", "dlspass.GradScaler", "ddp", "dlspass", False),
    ("DDP", "dlspass.GradScaler (max_gradient_norm)", "ddp", "dlspass", True),
    ("FSDP2", "ShardedGradScaler", "fsdp", "torch", False),
    ("FSDP2", "ShardedGradScaler + clip_grad_norm_", "fsdp", "torch", True),
    ("FSDP2", "dlspass.GradScaler", "fsdp", "dlspass", False),
    ("FSDP2", "dlspass.GradScaler (max_gradient_norm)", "fsdp", "dlspass", True),
]


def _worker(rank: int, port: int, out: str) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    counter = CollectiveCounter()
    rows = []
    with counter.patched():
        for setup, name, wrap, kind, clip in ROWS:
            r = _eager_row(rank, wrap, kind, clip, counter)
            rows.append({"setup": setup, "scaler": name, **r})
    for agree in (True, False):
        r = _captured_row(rank, agree)
        rows.append({"setup": "captured DP step", "scaler":
                     f"capture_step_distributed(agree_flag={agree})", **r})
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _n_params() -> int:
    from dlspass.models import MLP

    return sum(p.numel() for p in MLP().parameters())


def _fmt(v: float) -> str:
    return f"{v:g}"


def _run_workers(world: int, *extra: str) -> list[dict[str, Any]]:
    """Start ``world`` worker processes of this file; rank 0's rows."""
    out = os.path.join(tempfile.mkdtemp(prefix="dlspass_bench_dist_"), "rows.json")
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, *extra[:1], str(r), str(port), out,
                               *extra[1:]], env=env) for r in range(world)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise RuntimeError(f"bench worker failed (rc {p.returncode})")
    return json.loads(Path(out).read_text())


def main(repeats: int = REPEATS, write: bool = True) -> str:
    """Run the 2- and 4-process measurements, write ``results/distributed.md`` (unless
    ``write`` is False) and return the Markdown."""
    rows = _run_workers(WORLD, "--worker")
    mesh_rows = _run_workers(MESH_WORLD, "--mesh-worker", str(repeats))
    lines = [
        "# Distributed DLS: communication per step",
        "",
        "Command: `.venv/bin/python tools/bench/bench_distributed.py`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}; "
        f"torch {torch.__version__}; {WORLD} gloo processes on loopback; MLP 8-16-16-4 "
        f"({_n_params()} parameters), SGD.",
        "",
        "Collectives and bytes each rank sends per step in the scaler's part of the step "
        "(`unscale_` + clipping + `step` + `update`; the gradient reduction of DDP/FSDP itself "
        "is not counted), mean over 3 clean steps. Last column: an inf is written into one "
        "gradient of rank 1 after the gradient reduction; did rank 0 skip its step too?",
        "",
        "| setup | scaler | collectives / step | bytes / step | rank-local inf skips all ranks |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['scaler']} | {_fmt(r['calls'])} | {_fmt(r['bytes'])} "
                     f"| {'yes' if r['rank0_skipped'] else 'no'} |")
    cap = [r for r in rows if r["setup"] == "captured DP step"]
    lines += [
        "",
        f"Captured step: the graph also holds the gradient averaging itself, "
        f"{cap[0]['grad_calls']} bucketed all-reduce of {cap[0]['grad_bytes']} bytes (what "
        f"DDP would send); the rows above count only what DLS adds on top (the flag "
        f"all-reduce). For the captured step the last column injects the inf into rank 1's "
        f"batch: averaged gradients carry it to every rank, so all ranks skip even without "
        f"the flag all-reduce.",
        "",
        "Notes: dlspass sends one 8-byte vector (sharded squared norm, non-finite flag) per "
        "optimizer and step, which also serves global-norm clipping; ShardedGradScaler reduces "
        "`found_inf` twice under FSDP2 (DTensor's Partial(max) redistribution inside "
        "`_amp_foreach_non_finite_check_and_unscale_`, then its own `all_reduce`) and "
        "`clip_grad_norm_` adds the norm reduction; torch.amp.GradScaler under DDP sends "
        "nothing and so cannot agree when a rank sees an inf its peers do not "
        "(the ranks' parameters then diverge).",
        "",
    ]
    lines += [
        "## The same FSDP2 and 2-D mesh runs against torch.amp.GradScaler",
        "",
        f"{MESH_WORLD} gloo processes, the same MLP; per step, the scaler's part (`step` + "
        f"`update`, which unscales): collectives, bytes and wall time (microseconds, rank 0), "
        f"medians over {repeats} repeats that interleave the rows (the order rotates per "
        f"repeat, a barrier before each timed part).",
        "",
        "| setup | scaler | collectives / step | bytes / step | median time / step (us) |",
        "|---|---|---|---|---|",
    ]
    for r in mesh_rows:
        lines.append(f"| {r['setup']} | {r['scaler']} | {_fmt(r['calls'])} | {_fmt(r['bytes'])} "
                     f"| {r['us']:.0f} |")
    lines += [
        "",
        "dlspass sends one 8-byte all-reduce on every layout (the weighted squared norm and the "
        "flag); torch.amp.GradScaler's count depends on the first gradient's placements "
        "(one Partial(max) redistribution per mesh dimension that gradient is not replicated "
        "on) and it never reduces over a Replicate dimension (docs/DISTRIBUTED.md).",
        "",
    ]
    md = "\n".join(lines)
    if write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(md)
    return md


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "--mesh-worker":
        _mesh_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        import argparse

        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--repeats", type=int, default=REPEATS)
        parser.add_argument("--smoke", action="store_true",
                            help="2 repeats; print the table, do not write results/")
        args = parser.parse_args()
        print(main(2 if args.smoke else args.repeats, write=not args.smoke))
