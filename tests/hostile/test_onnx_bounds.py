"""ONNX models with an extreme opset, and with more nodes than ``transform`` can build within
the documented 1 GB: refused with one line and exit 2 before torch.onnx or onnx_ir see them."""

from __future__ import annotations

import onnx
import pytest
from hostile_files import chain_onnx, chain_onnx_bytes, run_cli
from onnx import helper

from dlspass.cli import run

pytestmark = pytest.mark.timeout(300)


def _with_opsets(*opsets: tuple[str, int]):
    model = chain_onnx(3)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in opsets)
    return model


OPSETS = {
    "opset_10_to_the_9": [("", 10**9)],
    "negative_opset": [("", -1)],
    "opset_zero": [("", 0)],
    "no_default_domain": [("com.example", 1)],
    "default_domain_twice": [("", 18), ("ai.onnx", 17)],
    "custom_domain_huge": [("", 18), ("com.example", 2**62)],
}


@pytest.mark.parametrize("name", sorted(OPSETS))
@pytest.mark.parametrize("command", ["inspect", "transform"])
def test_extreme_opsets_are_refused_with_one_line(tmp_path, monkeypatch, capsys, name, command):
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(_with_opsets(*OPSETS[name]).SerializeToString())
    monkeypatch.chdir(tmp_path)
    args = [command, str(path)] + (["-o", str(tmp_path / "out.onnx")] if command == "transform" else [])
    capsys.readouterr()
    rc = run(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("dlspass: error:"), err
    assert "opset" in err or "domain" in err, err
    assert not (tmp_path / "out.onnx").exists()


def test_a_14_mb_model_of_trivial_nodes_stays_within_1_gb(tmp_path):
    """300,000 Identity nodes (about 14 MB): onnx_ir would build ~4 kB per node."""
    path = tmp_path / "wide.onnx"
    # encoded without protobuf objects: 300,000 nodes would grow this process by ~1 GB, and
    # the child that runs dlspass would start with that peak RSS
    for n in (0, 1, 7):
        assert onnx.load_model_from_string(chain_onnx_bytes(n)) == chain_onnx(n), n
    path.write_bytes(chain_onnx_bytes(300_000))
    assert path.stat().st_size < 16 * 2**20
    work = tmp_path / "work"
    work.mkdir()
    res = run_cli(["transform", path, "-o", work / "out.onnx"], work)
    assert res.seconds < 60 and res.peak_rss_mb < 1024, (res.seconds, res.peak_rss_mb)
    assert res.rc == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "nodes" in res.stderr, res.stderr
    assert list(work.iterdir()) == []
