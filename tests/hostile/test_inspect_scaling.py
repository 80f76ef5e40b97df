"""``inspect`` on big or hostile graphs: linear work, escaped names.

The SVG/HTML layout used to bucket nodes per column by scanning all nodes for every column
(quadratic: 20k nodes took about 27 s) and the scaled region searched once per unscale node.
Growth is asserted on the lines of Python executed (`_python_lines`), which no load on the
machine changes; the wall time is a benchmark, ``tools/bench/bench_inspect_layout.py``.
Names come from the file, so an ESC sequence in one must not reach the terminal.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable

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


def _python_lines(fn: Callable[[], object]) -> int:
    """How many lines of Python ``fn()`` executes, in every frame it runs (the libraries'
    included): a count of its work that, unlike its wall time, no load on the machine changes.
    A quadratic loop, a comprehension's included, counts quadratically many lines."""
    count = 0

    def line(frame, event, arg):
        nonlocal count
        count += event == "line"
        return line

    previous = sys.gettrace()  # a coverage tracer, say: restored after
    sys.settrace(lambda frame, event, arg: line)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def test_20k_node_graph_renders_every_node(tmp_path, capsys):
    src = tmp_path / "big.onnx"
    onnx.save(_chain_onnx(20_000), src)
    out = tmp_path / "big.svg"
    rc = run(["inspect", str(src), "--format", "svg", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert out.read_text().count("<circle") == 20_000 + 2  # the input, 20k Relu, the MatMul
    assert render(summarize_file(src), "html").count("<circle") == 20_000 + 2


@pytest.mark.parametrize("fmt", ["svg", "html"])
def test_inspect_work_grows_linearly(tmp_path, capsys, fmt):
    """The whole command, reading the ONNX file included: 4x the nodes, 4x the work (quadratic
    would be 16x)."""
    def work(n: int) -> int:
        src, out = tmp_path / f"{n}.onnx", tmp_path / f"{n}.{fmt}"
        onnx.save(_chain_onnx(n), src)
        lines = _python_lines(lambda: run(["inspect", str(src), "--format", fmt, "-o", str(out)]))
        assert out.read_text().count("<circle") == n + 2, capsys.readouterr().err
        return lines

    work(10)  # lazy imports and first-call caches, outside the counts compared
    small, big = work(500), work(2_000)
    assert big < 5 * small, (small, big)


def test_layout_work_grows_linearly():
    """4x the nodes, 4x the lines executed by the SVG render (the quadratic bucketing: 13x)."""
    def work(n: int) -> int:
        g = fx.Graph()
        v = g.placeholder("x")
        for _ in range(n):
            v = g.call_function(torch.ops.aten.relu.default, (v,))
        g.output(v)
        report = summarize_graph(fx.GraphModule(torch.nn.Module(), g))
        return _python_lines(lambda: render(report, "svg"))

    work(10)  # lazy imports and first-call caches, outside the counts compared
    small, big = work(500), work(2_000)
    assert big < 5 * small, (small, big)  # 4x the nodes: 4x the work, not 16x


def test_scaled_region_with_many_unscale_nodes_is_linear():
    """A chain of n gradients from one seed (each layer's from the next one's, as backward
    makes them), each unscaled: one backward search, not n, each of which would walk the chain
    back to the seed (4x the gradients: 4x the work, not 16x)."""
    def work(n: int) -> int:
        g = fx.Graph()
        seed = g.placeholder("seed")
        roles.set_role(seed, roles.SCALED_SEED, None)
        outs, grad = [], seed
        for i in range(n):
            grad = g.call_function(torch.ops.aten.mul.Tensor, (grad, float(i)))
            un = g.call_function(torch.ops.aten.mul.Tensor, (grad, 0.5))
            roles.set_role(un, roles.UNSCALE, f"w{i}")
            outs.append(un)
        g.output(tuple(outs))
        gm = fx.GraphModule(torch.nn.Module(), g)
        reports = []
        lines = _python_lines(lambda: reports.append(summarize_graph(gm)))
        assert reports[0]["scaled_region"]["size"] == 1 + 2 * n
        return lines

    work(10)  # lazy imports and first-call caches, outside the counts compared
    small, big = work(1_250), work(5_000)
    assert big < 5 * small, (small, big)


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
