"""Hostile inputs: truncated, bit-flipped, re-zipped and random .pt2, .onnx and YAML files.

Contract (dlspass/cli/commands.py): bad input is one line on stderr (``dlspass: error: ...``) and exit
code 2, never a traceback (exit 3 is an internal error, i.e. a bug), never a hang, never a
partial output file. Each format gets >= 300 generated inputs through the in-process CLI
entry ``dlspass.cli.run(argv)`` (or, for YAML, the loader itself); a few subprocess cases check
the real stderr of the ``dlspass`` command.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlspass.cli import run
from dlspass.config import ConfigError, DLSConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("DLSPASS_FUZZ_EXAMPLES", "300"))
# CI replays the same inputs; tools/reliability/fuzz_long.py sets this for fresh ones
DERANDOMIZE = not os.environ.get("DLSPASS_FUZZ_RANDOM")
CALL_LIMIT_S = 60.0  # one CLI call on one input; a hang would blow far past it
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

STATS: dict[str, dict[int, int]] = {}
# Defects found by this fuzzer and not fixed yet (none now: the two it found, non-UTF-8 ONNX
# names and dangling ONNX inputs, are fixed and have regression tests below).
# substrings that all occur in stderr -> short name
KNOWN_DEFECTS: dict[tuple[str, ...], str] = {}
HITS: dict[str, int] = {}


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, bytes]:
    """Valid files to mutate: a joint program, a DLS step (.pt2) and the step as ONNX."""
    d = tmp_path_factory.mktemp("seeds")
    joint, step, onnx = d / "joint.pt2", d / "step.pt2", d / "step.onnx"
    assert call(["export", "tests.cli_factories:mlp", "-o", str(joint)])[0] == 0
    # The custom rounding op keeps the step small (the default core-aten form writes each
    # rounding as a dozen bit ops, which makes every torch.export.load several times slower);
    # the fuzzer aims at the archive, JSON and metadata handling, which both forms share.
    assert call(["transform", str(joint), "-o", str(step), "--rounding", "op"])[0] == 0
    assert call(["transform", str(joint), "-o", str(onnx)])[0] == 0
    return {"joint.pt2": joint.read_bytes(), "step.pt2": step.read_bytes(),
            "step.onnx": onnx.read_bytes()}


def call(argv: list[str]) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(argv)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - t0


# ---- mutations ----------------------------------------------------------------------------------
def truncate(data: bytes, n: int) -> bytes:
    return data[: n % max(len(data), 1)]


def flip(data: bytes, bits: list[int]) -> bytes:
    b = bytearray(data)
    for i in bits:
        if b:
            b[(i // 8) % len(b)] ^= 1 << (i % 8)
    return bytes(b)


def rezip(data: bytes, member: int, how: str, arg: int, junk: bytes) -> bytes:
    """Mutate one member of a zip archive and write a well-formed zip (valid CRCs), so the
    damage reaches the parsers behind the zip layer."""
    src = zipfile.ZipFile(io.BytesIO(data))
    names = src.namelist()
    target = names[member % len(names)]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for name in names:
            body = src.read(name)
            if name == target:
                if how == "truncate":
                    body = truncate(body, arg)
                elif how == "flip":
                    body = flip(body, [arg, arg * 7 + 3, arg * 13 + 5])
                elif how == "junk":
                    body = junk
                elif how == "drop":
                    continue
            dst.writestr(name, body)
    return buf.getvalue()


def mutated(base_names: list[str], zipped: bool) -> st.SearchStrategy:
    base = st.sampled_from(base_names)
    ops = [
        st.tuples(base, st.just("truncate"), st.integers(0, 10**7)),
        st.tuples(base, st.just("flip"), st.lists(st.integers(0, 10**8), min_size=1, max_size=16)),
        st.tuples(base, st.just("random"), st.binary(max_size=4096)),
        st.tuples(base, st.just("random_zip"), st.binary(max_size=512)),
    ]
    if zipped:
        ops.append(st.tuples(base, st.just("rezip"), st.tuples(
            st.integers(0, 100), st.sampled_from(["truncate", "flip", "junk", "drop"]),
            st.integers(0, 10**6), st.one_of(st.binary(max_size=256),
                                              st.sampled_from([b"{}", b"[]", b"null", b"{\"a\": 1}",
                                                               b"\xff\xfe", b"nan"])))))
    return st.one_of(*ops)


def apply(seeds: dict[str, bytes], case: tuple) -> bytes:
    name, op, arg = case
    data = seeds[name]
    if op == "truncate":
        return truncate(data, arg)
    if op == "flip":
        return flip(data, arg)
    if op == "random":
        return arg
    if op == "random_zip":
        return b"PK\x03\x04" + arg
    return rezip(data, *arg)


def check_contract(argv: list[str], out_file: Path | None, kind: str) -> None:
    code, _, err, secs = call(argv)
    STATS.setdefault(kind, {}).setdefault(code, 0)
    STATS[kind][code] += 1
    assert secs < CALL_LIMIT_S, f"{argv[0]} took {secs:.1f} s"
    known = [name for sig, name in KNOWN_DEFECTS.items() if all(x in err for x in sig)]
    if code == 3 and known:
        HITS[known[0]] = HITS.get(known[0], 0) + 1
        return
    assert "Traceback" not in err, err
    assert code in (0, 1, 2), f"exit {code} (internal error) for {argv}: {err}"
    if code != 0:
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        prefix = "dlspass: verification failed:" if code == 1 else "dlspass: error:"
        assert lines[0].startswith(prefix), err
    if out_file is not None:
        if code == 0:
            assert out_file.is_file() and out_file.stat().st_size > 0
        else:
            assert not out_file.exists(), "a failed command left an output file"
        leftovers = [p.name for p in out_file.parent.iterdir() if p.name.endswith(".tmp")
                     or ".tmp" in p.name]
        assert not leftovers, leftovers
        if out_file.exists():
            out_file.unlink()


# ---- .pt2 ---------------------------------------------------------------------------------------
@FUZZ
@given(case=mutated(["joint.pt2", "step.pt2"], zipped=True),
       command=st.sampled_from(["inspect", "inspect", "inspect", "verify", "verify", "transform"]))
def test_fuzz_pt2(seeds, tmp_path_factory, case: tuple, command: str) -> None:
    d = tmp_path_factory.mktemp("pt2")
    src = d / "in.pt2"
    src.write_bytes(apply(seeds, case))
    out = d / "out" / "step.pt2"
    out.parent.mkdir()
    if command == "inspect":
        check_contract(["inspect", str(src), "--format", "json"], None, "pt2")
    elif command == "verify":
        check_contract(["verify", str(src)], None, "pt2")
    else:
        check_contract(["transform", str(src), "-o", str(out)], out, "pt2")


# ---- .onnx --------------------------------------------------------------------------------------
@FUZZ
@given(case=mutated(["step.onnx"], zipped=False),
       command=st.sampled_from(["inspect", "inspect", "transform"]))
def test_fuzz_onnx(seeds, tmp_path_factory, case: tuple, command: str) -> None:
    d = tmp_path_factory.mktemp("onnx")
    src = d / "in.onnx"
    src.write_bytes(apply(seeds, case))
    out = d / "out" / "step.onnx"
    out.parent.mkdir()
    if command == "inspect":
        check_contract(["inspect", str(src), "--format", "json"], None, "onnx")
    else:
        check_contract(["transform", str(src), "-o", str(out)], out, "onnx")


# ---- YAML ---------------------------------------------------------------------------------------
YAML_SEEDS = sorted((ROOT / "tests" / "data").glob("modelzoo_*.yaml"))
KEYS = ["trainer", "init", "precision", "optimizer", "model", "runconfig", "enabled", "fp16_type",
        "precision_opt_level", "loss_scaling_factor", "initial_loss_scale", "steps_per_increase",
        "min_loss_scale", "max_loss_scale", "max_gradient_norm", "max_gradient_value",
        "log_loss_scale", "mixed_precision", "load_checkpoint_states", "policy", "loss_scale",
        "overflow_tolerance", "hysteresis", "growth_factor"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(["dynamic", "float16", "bfloat16", "cbfloat16", "2e15",
                                     "1e-4", "", "~", "yes", "0x10", ".inf"]),
                    st.text(max_size=12))
trees = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.sampled_from(KEYS), kids, max_size=5)),
    max_leaves=20)


def yaml_bytes(case: tuple) -> bytes:
    kind, arg = case
    if kind == "tree":
        return yaml.safe_dump(arg, allow_unicode=True).encode()
    seed_bytes = YAML_SEEDS[arg[0] % len(YAML_SEEDS)].read_bytes()
    if kind == "truncate":
        return truncate(seed_bytes, arg[1])
    if kind == "flip":
        return flip(seed_bytes, arg[1])
    return arg[1]


yaml_cases = st.one_of(
    st.tuples(st.just("tree"), trees),
    st.tuples(st.just("tree"), st.fixed_dictionaries(
        {"trainer": st.fixed_dictionaries({"init": st.fixed_dictionaries(
            {"precision": st.dictionaries(st.sampled_from(KEYS), scalars, max_size=8)})})})),
    st.tuples(st.just("truncate"), st.tuples(st.integers(0, 100), st.integers(0, 10**5))),
    st.tuples(st.just("flip"), st.tuples(st.integers(0, 100),
                                         st.lists(st.integers(0, 10**5), min_size=1, max_size=8))),
    st.tuples(st.just("random"), st.tuples(st.just(0), st.binary(max_size=512))),
)


@FUZZ
@given(case=yaml_cases)
def test_fuzz_yaml_loader(tmp_path_factory, case: tuple) -> None:
    p = tmp_path_factory.mktemp("yaml") / "params.yaml"
    p.write_bytes(yaml_bytes(case))
    t0 = time.monotonic()
    try:
        cfg = DLSConfig.from_yaml(p)
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg and "Traceback" not in msg
        STATS.setdefault("yaml", {}).setdefault(2, 0)
        STATS["yaml"][2] += 1
    else:
        assert isinstance(cfg, DLSConfig)
        STATS.setdefault("yaml", {}).setdefault(0, 0)
        STATS["yaml"][0] += 1
    assert time.monotonic() - t0 < CALL_LIMIT_S


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=yaml_cases)
def test_fuzz_yaml_through_cli(seeds, tmp_path_factory, case: tuple) -> None:
    d = tmp_path_factory.mktemp("yamlcli")
    (d / "joint.pt2").write_bytes(seeds["joint.pt2"])
    cfg = d / "params.yaml"
    cfg.write_bytes(yaml_bytes(case))
    out = d / "out" / "step.pt2"
    out.parent.mkdir()
    check_contract(["transform", str(d / "joint.pt2"), "-o", str(out), "--config", str(cfg)], out,
                   "yaml-cli")


def test_fuzz_counts_reach_300(request) -> None:
    """Runs after the fuzzers in file order: at least EXAMPLES inputs per format went through."""
    if EXAMPLES < 300:
        pytest.skip("reduced by DLSPASS_FUZZ_EXAMPLES")
    for kind in ("pt2", "onnx", "yaml"):
        if kind not in STATS:
            pytest.skip("run the whole file to count")
        assert sum(STATS[kind].values()) >= 300, (kind, STATS[kind])
    print({k: dict(v) for k, v in STATS.items()}, "known defects hit:", HITS)
    stats_file = os.environ.get("DLSPASS_FUZZ_STATS")
    if stats_file:
        import json

        Path(stats_file).write_text(json.dumps({"exit_codes": STATS, "known_defects": HITS},
                                               indent=2))


# ---- regressions of defects the fuzzer found (owned elsewhere; see KNOWN_DEFECTS) ---------------
def test_onnx_non_utf8_node_name_is_bad_input(seeds, tmp_path: Path) -> None:
    import re

    data = seeds["step.onnx"]
    m = re.search(rb"node_[a-z]+_[0-9]", data)
    assert m is not None
    i = m.end() - 2  # the underscore before the digit: 0x5f ^ 0x80 is not valid UTF-8
    p = tmp_path / "bad.onnx"
    p.write_bytes(data[:i] + b"\xdf" + data[i + 1:])
    code, _, err, _ = call(["inspect", str(p), "--format", "json"])
    assert code == 2 and err.startswith("dlspass: error:"), err


def test_onnx_dangling_input_is_bad_input(seeds, tmp_path: Path) -> None:
    import onnx

    model = onnx.load_from_string(seeds["step.onnx"])
    node = next(n for n in model.graph.node if n.input)
    node.input[0] = "no_such_value"
    p = tmp_path / "dangling.onnx"
    p.write_bytes(model.SerializeToString())
    code, _, err, _ = call(["inspect", str(p)])
    assert code == 2 and err.startswith("dlspass: error:"), err


# ---- the real command, a few times ---------------------------------------------------------------
@pytest.mark.parametrize("name, content, argv", [
    ("bad.pt2", b"PK\x03\x04" + b"\x00" * 64, ["inspect"]),
    ("bad.onnx", b"\x08\x07\x12\x04junk" * 10, ["inspect"]),
    ("params.yaml", b"trainer: {init: {precision: {fp16_type: float17}}}", None),
], ids=["pt2", "onnx", "yaml"])
def test_subprocess_one_stderr_line_and_exit_2(tmp_path: Path, seeds, name: str, content: bytes,
                                               argv: list[str] | None) -> None:
    p = tmp_path / name
    p.write_bytes(content)
    out = tmp_path / "o" / "step.pt2"
    out.parent.mkdir()
    if argv is None:
        (tmp_path / "joint.pt2").write_bytes(seeds["joint.pt2"])
        cmd = ["transform", str(tmp_path / "joint.pt2"), "-o", str(out), "--config", str(p)]
    else:
        cmd = [*argv, str(p)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DLSPASS_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "dlspass", *cmd], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlspass: error:"), r.stderr
    assert not out.exists() and not list(out.parent.iterdir())
