"""``inspect`` on big or hostile graphs: linear time, escaped names.

The SVG/HTML layout used to bucket nodes per column by scanning all nodes for every column
(quadratic: 20k nodes took about 27 s) and the scaled region searched once per unscale node.
Names come from the file, so an ESC sequence in one must not reach the terminal.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET

import onnx
import pytest
import torch
import torch.fx as fx
from hostile_files import chain_onnx

from dlspass.cli import run
from dlspass.debug.inspect_report import render, summarize_file, summarize_graph
from dlspass.graph import roles

pytestmark = pytest.mark.timeout(180)
ESC_NAME = "evil\x1b]0;owned\x07\x1b[2J\x9b31m"


def _chain_onnx(n: int, pass_name: str = "p") -> onnx.ModelProto:
    """A Relu chain whose first three nodes carry ESC sequences in their names."""
    return chain_onnx(n, "Relu", names={i: f"{ESC_NAME}{i}" for i in range(3)},
                      passes=dict.fromkeys(range(3), pass_name))


def test_20k_node_graph_renders_in_seconds(tmp_path, capsys):
    src = tmp_path / "big.onnx"
    onnx.save(_chain_onnx(20_000), src)
    out = tmp_path / "big.svg"
    t = time.monotonic()
    rc = run(["inspect", str(src), "--format", "svg", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert time.monotonic() - t < 60  # reading the ONNX file included
    assert out.read_text().count("<circle") == 20_000 + 2  # the input, 20k Relu, the MatMul
    report = summarize_file(src)
    for fmt in ("svg", "html"):
        t = time.monotonic()
        render(report, fmt)
        assert time.monotonic() - t < 10, fmt  # about 1.5 s on one idle core


def test_layout_time_grows_linearly():
    """Doubling the nodes about doubles the time (quadratic would quadruple it)."""
    def timed(n: int) -> float:
        g = fx.Graph()
        v = g.placeholder("x")
        for _ in range(n):
            v = g.call_function(torch.ops.aten.relu.default, (v,))
        g.output(v)
        report = summarize_graph(fx.GraphModule(torch.nn.Module(), g))
        t = time.perf_counter()
        render(report, "svg")
        return time.perf_counter() - t

    timed(1_000)  # warm-up
    small, big = min(timed(2_500) for _ in range(2)), min(timed(10_000) for _ in range(2))
    assert big < 8 * small, (small, big)  # 4x the nodes: 4x the time, not 16x


def test_scaled_region_with_many_unscale_nodes_is_linear():
    """One seed feeding 5,000 gradients each unscaled: one backward search, not 5,000."""
    g = fx.Graph()
    seed = g.placeholder("seed")
    roles.set_role(seed, roles.SCALED_SEED, None)
    outs = []
    for i in range(5_000):
        grad = g.call_function(torch.ops.aten.mul.Tensor, (seed, float(i)))
        un = g.call_function(torch.ops.aten.mul.Tensor, (grad, 0.5))
        roles.set_role(un, roles.UNSCALE, f"w{i}")
        outs.append(un)
    g.output(tuple(outs))
    t = time.monotonic()
    report = summarize_graph(fx.GraphModule(torch.nn.Module(), g))
    assert time.monotonic() - t < 10
    assert report["scaled_region"]["size"] == 1 + 2 * 5_000


def test_text_report_escapes_terminal_sequences(tmp_path, capsys):
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(_chain_onnx(3, pass_name=ESC_NAME), a)
    model = _chain_onnx(3)
    model.graph.node[1].op_type = "Relu"
    onnx.save(model, b)
    capsys.readouterr()
    assert run(["inspect", str(a), "--diff", str(b)]) == 0
    out = capsys.readouterr().out
    assert "\\x1b]0;owned" in out  # shown, escaped
    assert not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) <= 0x9f for c in out), repr(out)
    for fmt in ("svg", "html"):
        dst = tmp_path / f"r.{fmt}"
        assert run(["inspect", str(a), "--format", fmt, "-o", str(dst)]) == 0
        text = dst.read_text()
        assert "\x1b" not in text and "\x9b" not in text
        if fmt == "svg":
            ET.fromstring(text)  # well-formed XML (raw control characters are not)
