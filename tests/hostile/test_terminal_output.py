"""File names with control characters in success lines: ``verify``'s "OK", the "wrote" of
``transform`` (from a ``.pt2`` or an ``.onnx``), ``export`` and ``analyze``, and ``inspect``'s
report must show them escaped, as error lines already do. A raw name could clear the screen,
move the cursor or forge a "DLS invariants hold" line."""

from __future__ import annotations

import contextlib
import io
import re

import onnx
import pytest
from hostile_files import chain_onnx

from dlspass.cli import run

pytestmark = pytest.mark.timeout(300)

# ESC [2J (clear screen), CR + a forged line, a C1 CSI, a bidi override
NASTY = "x\x1b[2J\r\x1b[32mOK forged.pt2: DLS invariants hold\x9b1A\u202e"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _out(capsys) -> str:
    captured = capsys.readouterr()
    return captured.out + captured.err


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, object]:
    """A joint and a step under nasty names, and what ``export`` and ``transform`` printed."""
    d = tmp_path_factory.mktemp("nasty")
    joint = d / f"joint{NASTY}.pt2"
    step = d / f"step{NASTY}.pt2"
    said = {}
    for name, args in (("export", ["export", "tests.cli_factories:mlp", "-o", str(joint)]),
                       ("transform", ["transform", str(joint), "-o", str(step)])):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert run(args) == 0, err.getvalue()
        said[name] = out.getvalue() + err.getvalue()
    return {"joint": joint, "step": step, "dir": d, "said": said}


def _check(text: str, *, named: bool = True) -> None:
    assert not RAW.findall(text), f"raw control characters reach the terminal: {RAW.findall(text)!r}"
    if named:
        assert "\\x1b[2J" in text  # the name is still there, escaped


@pytest.mark.parametrize("command", ["export", "transform"])
def test_wrote_lines_escape_control_characters(files, command):
    _check(files["said"][command])


@pytest.mark.parametrize("command", ["transform_onnx", "transform_onnx_input", "analyze", "verify", "inspect"])
def test_success_lines_escape_control_characters_in_file_names(files, capsys, command):
    d = files["dir"]
    capsys.readouterr()
    if command == "transform_onnx":
        rc = run(["transform", str(files["joint"]), "-o", str(d / f"t{NASTY}.onnx")])
    elif command == "transform_onnx_input":  # an ONNX training graph in: its own "wrote" line
        onnx.save(chain_onnx(3), d / "chain.onnx")
        rc = run(["transform", str(d / "chain.onnx"), "-o", str(d / f"c{NASTY}.onnx"),
                  "--loss-scale", "none"])  # no loss to scale in this graph: rounding only
    elif command == "analyze":
        rc = run(["analyze", "tests.cli_factories:mlp", "--steps", "1", "-o", str(d / f"a{NASTY}.txt")])
    elif command == "verify":
        rc = run(["verify", str(files["step"])])
    else:
        rc = run(["inspect", str(files["step"])])
    text = _out(capsys)
    assert rc == 0, text
    _check(text, named=command != "inspect")
