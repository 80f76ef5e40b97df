"""Outputs written under attack or interruption: mode kept, no stray temp file, stable contents.

* rewriting a 0600 output keeps 0600 (the atomic replace used to leave it 0644);
* SIGTERM during a write leaves neither a hidden temporary file nor a changed target;
* every ``.pt2`` records the root folder ``archive`` (it used to be the temporary file's name).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from hostile_files import TESTS, save_tiny

from dlspass.cli import run
from dlspass.files.atomic_write import write_atomic

pytestmark = pytest.mark.timeout(180)


def test_rewriting_a_private_output_keeps_its_mode(tmp_path, capsys):
    src = save_tiny(tmp_path / "tiny.pt2")
    out = tmp_path / "report.json"
    out.write_text("old")
    out.chmod(0o600)
    assert run(["inspect", str(src), "--format", "json", "-o", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert out.read_text().startswith("{")
    fresh = tmp_path / "fresh.json"
    assert run(["inspect", str(src), "--format", "json", "-o", str(fresh)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


def test_write_atomic_keeps_mode_and_content_on_failure(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"old")
    target.chmod(0o640)

    def fail(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomic(target, fail)
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["t.bin"]
    write_atomic(target, lambda tmp: Path(tmp).write_bytes(b"new"))
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o640


_SLOW_WRITER = """
import sys, time
from pathlib import Path
from dlspass.files.atomic_write import write_atomic

def slow(tmp):
    Path(tmp).write_bytes(b"partial")
    Path(sys.argv[2]).write_text(tmp)  # tell the parent we are mid-write
    time.sleep(60)

write_atomic(Path(sys.argv[1]), slow)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_during_a_write_leaves_no_temporary_file(tmp_path, sig):
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / "step.pt2"
    target.write_bytes(b"previous")
    ready = tmp_path / "ready"
    # the signal's default action in the writer, whatever the suite inherited (under nohup,
    # SIGHUP is ignored, and a writer that ignores it rightly keeps writing)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(target), str(ready)],
                            env={**os.environ, "PYTHONPATH": str(TESTS)},
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    t = time.monotonic()
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() - t < 60, "writer did not start"
        time.sleep(0.05)
    tmp = Path(ready.read_text())
    assert tmp.exists() and tmp.parent == folder  # the hidden temporary file, mid-write
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == -sig  # died of the signal, as without the handler
    assert sorted(os.listdir(folder)) == ["step.pt2"], "a temporary file was left behind"
    assert target.read_bytes() == b"previous"


def test_pt2_records_a_stable_root_folder(tmp_path):
    import torch

    from dlspass.capture.pt2_io import load_program, save_program

    ep = torch.export.load(str(save_tiny(tmp_path / "tiny.pt2")))
    out = tmp_path / "joint.pt2"
    save_program(ep, out, {"format": "dlspass-joint", "kind": "joint"})
    with zipfile.ZipFile(out) as z:
        roots = {n.split("/", 1)[0] for n in z.namelist()}
    assert roots == {"archive"}
    _, meta = load_program(out)
    assert meta == {"format": "dlspass-joint", "kind": "joint"}
