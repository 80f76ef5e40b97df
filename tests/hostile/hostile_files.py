"""Crafted but well-formed hostile files for the tests in this folder (valid zips, JSON, pickles,
ONNX protobufs).

Every payload that would run code writes the sentinel file ``PWNED`` into the current folder,
so a test runs the command in a fresh folder and asserts the sentinel never appears.
``run_cli`` runs ``dlspass`` in a subprocess under a time limit and reports its exit code,
stderr, wall time and peak RSS (the child's own ``ru_maxrss``); ``run_cli_batch`` runs several
such calls, each forked from one child that imported dlspass once (the import is most of the
cost of a small call).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import time
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SENTINEL = "PWNED"
PAYLOAD = f"open({SENTINEL!r},'w').write('x')"
TESTS = Path(__file__).resolve().parents[1]


class Exec:
    """Unpickling this runs ``PAYLOAD`` (the pickle names ``builtins.exec``, not this class)."""

    def __reduce__(self) -> tuple:
        return (exec, (PAYLOAD,))


def evil_torch_save() -> bytes:
    """``torch.save`` of an ``Exec`` (what ``torch.load(weights_only=False)`` would run)."""
    buf = io.BytesIO()
    torch.save((Exec(),), buf)
    return buf.getvalue()


def evil_pickle() -> bytes:
    return pickle.dumps(Exec())


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu().sum()


def save_tiny(path: Path, *, dynamic: bool = False) -> Path:
    """A valid ``.pt2`` of a tiny program (static, or with a dynamic batch size)."""
    torch.manual_seed(0)
    shapes = ({0: torch.export.Dim("batch", min=2, max=64)},) if dynamic else None
    ep = torch.export.export(Tiny(), (torch.randn(3, 4),), dynamic_shapes=shapes)
    torch.export.save(ep, str(path))
    return path


_PLAIN_TORCH = """
import json, logging, os, sys, torch
logging.disable(logging.CRITICAL)
out = {}
for name, path in json.loads(sys.argv[1]).items():
    os.chdir(os.path.dirname(path))
    try:
        ep = torch.export.load(path)
        if sys.argv[2] == "run":
            ep.module()(torch.randn(3, 4))
    except Exception:
        pass
    out[name] = os.path.exists("PWNED")
print(json.dumps(out))
"""


def live_under_plain_torch(files: dict[str, Path], *, run_module: bool = False) -> tuple[dict[str, bool], str]:
    """Which of ``files`` (name -> path, each alone in its folder) write the sentinel under
    plain ``torch.export.load`` (and, with ``run_module``, ``.module()`` called on a 3x4
    input), in a fresh process without dlspass; and that process's stderr."""
    proc = subprocess.run([sys.executable, "-c", _PLAIN_TORCH, json.dumps({k: str(v) for k, v in files.items()}),
                           "run" if run_module else "load"],
                          capture_output=True, text=True, timeout=120, cwd=next(iter(files.values())).parent,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS)})
    lines = proc.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if lines else {}), proc.stderr[-2000:]


def members(path: Path) -> tuple[str, dict[str, bytes]]:
    """The archive's root folder and its members by name relative to it, in order."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        root = names[0].split("/", 1)[0]
        return root, {n.split("/", 1)[1]: z.read(n) for n in names}


def rewrite(src: Path, dst: Path, changes: dict[str, bytes | None], *, root: str | None = None,
            extra_raw: list[tuple[str, bytes]] | None = None) -> Path:
    """Copy ``src`` to ``dst`` with members replaced, added (bytes) or dropped (None), all stored
    uncompressed like torch writes them; ``extra_raw`` adds members by full name (duplicates
    and names outside the root folder included)."""
    old_root, files = members(src)
    root = root or old_root
    for rel, data in changes.items():
        if data is None:
            files.pop(rel, None)
        else:
            files[rel] = data
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for rel, data in files.items():
            z.writestr(f"{root}/{rel}", data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Duplicate name": the point of some cases
            for name, data in extra_raw or []:
                z.writestr(name, data)
    return dst


def edit_json(src: Path, dst: Path, rel: str, edit) -> Path:
    _, files = members(src)
    obj = json.loads(files[rel])
    edit(obj)
    return rewrite(src, dst, {rel: json.dumps(obj).encode()})


def deflate_bomb(src: Path, dst: Path, rel: str, inflated: int, *, declared: int | None = None) -> Path:
    """``src`` with member ``rel`` replaced by ``inflated`` spaces, deflated (about 1:1000),
    its CRC correct; ``declared`` (default: the truth) is the size the zip directory states.

    The deflate stream is one fully flushed block of 4 MiB of spaces repeated: each such block
    is byte-aligned and independent of what came before, so the stream is valid without
    compressing 2 GiB."""
    chunk = 4 * 2**20
    assert inflated % chunk == 0
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(b" " * chunk) + c.flush(zlib.Z_FULL_FLUSH)
    end = zlib.compressobj(9, zlib.DEFLATED, -15).flush()
    n = inflated // chunk
    crc = 0
    spaces = b" " * chunk
    for _ in range(n):
        crc = zlib.crc32(spaces, crc)
    size = inflated if declared is None else declared
    tmp = dst.with_suffix(".base.zip")
    rewrite(src, tmp, {rel: None})
    root, files = members(tmp)
    tmp.unlink()
    out = bytearray()
    central = bytearray()

    def add(name: bytes, method: int, crc32: int, csize: int, usize: int, write_data) -> None:
        offset = len(out)
        out.extend(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc32, csize,
                               usize, len(name), 0) + name)
        write_data()
        central.extend(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0,
                                   crc32, csize, usize, len(name), 0, 0, 0, 0, 0, offset) + name)

    for r, data in files.items():
        add(f"{root}/{r}".encode(), 0, zlib.crc32(data), len(data), len(data),
            lambda data=data: out.extend(data))
    csize = len(block) * n + len(end)
    add(f"{root}/{rel}".encode(), 8, crc, csize, size,
        lambda: (out.extend(block * n), out.extend(end)))
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(files) + 1, len(files) + 1,
                       len(central), len(out), 0)
    dst.write_bytes(bytes(out) + bytes(central) + eocd)
    return dst


def chain_onnx(n: int, op: str = "Identity", *, names: dict[int, str] | None = None,
               passes: dict[int, str] | None = None) -> Any:
    """x -> n x ``op`` -> MatMul(., w) -> output ``grad.w`` (a training graph's gradient);
    node ``i`` is named ``names[i]`` (default ``n<i>``) and tagged ``dlspass_pass=passes[i]``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    nodes, prev = [], "x"
    for i in range(n):
        node = helper.make_node(op, [prev], [f"c{i}"], name=(names or {}).get(i, f"n{i}"))
        if passes and i in passes:
            entry = node.metadata_props.add()
            entry.key, entry.value = "dlspass_pass", passes[i]
        nodes.append(node)
        prev = f"c{i}"
    nodes.append(helper.make_node("MatMul", [prev, "w"], ["grad.w"], name="mm"))
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("grad.w", TensorProto.FLOAT, [4, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def chain_onnx_bytes(n: int) -> bytes:
    """``chain_onnx(n).SerializeToString()``'s message, encoded here without building ``n``
    protobuf nodes (300,000 of them grow a process by about 1 GB); the tests compare the two
    for small ``n``."""
    from onnx import ModelProto

    def field(number: int, data: bytes) -> bytes:  # a length-delimited protobuf field
        return _varint(number << 3 | 2) + _varint(len(data)) + data

    model = chain_onnx(0)
    model.graph.node[0].input[0] = f"c{n - 1}" if n else "x"
    tail = model.graph.SerializeToString()  # the MatMul node and the rest of the graph
    nodes = b"".join(
        field(1, field(1, (f"c{i - 1}" if i else "x").encode()) + field(2, f"c{i}".encode())
              + field(3, f"n{i}".encode()) + field(4, b"Identity"))
        for i in range(n))
    head = ModelProto()
    head.CopyFrom(model)
    head.ClearField("graph")
    return head.SerializeToString() + field(7, nodes + tail)  # a repeated field's items join


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


@dataclass
class Result:
    rc: int
    stderr: str
    seconds: float
    peak_rss_mb: float


# Imports dlspass once, then forks one process per call: each call starts from the state a
# fresh `dlspass` would have (nothing else ran in it), with its own cwd and stderr, and its
# peak RSS is that process's own (a forked process counts the resident pages it inherits, as
# a fresh process counts its imports). Its seconds add the child's start-up to the call.
_RUNNER = """
import json, os, sys, time, traceback
from dlspass.cli import run
started = time.monotonic() - float(sys.argv[3])  # CLOCK_MONOTONIC: one clock for all processes
calls, out = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for i, (args, cwd) in enumerate(calls):
    t = time.monotonic()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            fd = os.open(os.path.join(out, f"{i}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            os.chdir(cwd)
            rc = run(args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(rc)
    _, status, usage = os.wait4(pid, 0)
    results[i] = [os.waitstatus_to_exitcode(status), started + time.monotonic() - t, usage.ru_maxrss]
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f)
"""


def run_cli_batch(calls: dict[str, tuple[list[Any], Path]], timeout: float = 60.0) -> dict[str, Result]:
    """``dlspass ARGS`` for each ``name: (ARGS, cwd)``, each call in a process of its own forked
    from one child that imported dlspass (exit code, stderr, seconds, peak RSS per call);
    ``timeout`` is per call."""
    import tempfile

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    env.pop("DLSPASS_DEBUG", None)
    names = list(calls)
    plan = [[list(map(str, args)), str(cwd)] for args, cwd in calls.values()]
    with tempfile.TemporaryDirectory(prefix="dlspass-cli-") as out:
        proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(plan), out, repr(time.monotonic())],
                              cwd=out, env=env, capture_output=True, text=True,
                              timeout=timeout * len(calls))
        done = Path(out) / "results.json"
        assert proc.returncode == 0 and done.exists(), proc.stderr[-2000:]
        results = json.loads(done.read_text())
        return {name: Result(results[str(i)][0], (Path(out) / f"{i}.stderr").read_text(),
                             results[str(i)][1], results[str(i)][2] / 1024)
                for i, name in enumerate(names)}


def run_cli(args: list[Any], cwd: Path, timeout: float = 60.0) -> Result:
    """``dlspass ARGS`` in a subprocess in ``cwd`` (exit code, stderr, seconds, peak RSS)."""
    return run_cli_batch({"cli": (args, cwd)}, timeout)["cli"]
