"""The dlspass CLI (help, exit codes, one-line errors) and the demo (float16 with and without DLS)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dlspass.cli import commands as cli
from dlspass.cli.demo import emulate_format, run_demo
from dlspass.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("dlspass")


def _cli_cmd() -> list[str]:
    # The console script when it is installed, else the module (same `main`).
    return [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "dlspass.cli"]


@pytest.fixture(autouse=True)
def _cwd_in_tmp(tmp_path, monkeypatch):
    """The demo's default --out-dir is relative (``dlspass-demo``): a test that leaves it out
    writes into its own temporary folder, never into the checkout."""
    monkeypatch.chdir(tmp_path)


def _run(*args: str, timeout: float = 180, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100"}
    env.pop("DLSPASS_DEBUG", None)
    return subprocess.run([*_cli_cmd(), *args], capture_output=True, text=True, cwd=cwd,
                          stdin=subprocess.DEVNULL, timeout=timeout, env=env)


# ---- subprocess: the real entry point -----------------------------------------------------------
def test_help_shows_examples_on_stdout():
    res = _run("--help")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert "Examples" in res.stdout
    assert "dlspass demo --steps 20" in res.stdout
    assert "Exit codes" in res.stdout
    assert re.search(r"demo\s+Show what dynamic loss scaling is for", res.stdout)


def test_module_entry_point_help():
    res = subprocess.run([sys.executable, "-m", "dlspass.cli", "demo", "--help"],
                         capture_output=True, text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--steps" in res.stdout and "--out-dir" in res.stdout


def _row(out: str, label: str) -> tuple[float, float]:
    m = re.search(re.escape(label) + r"\s+([0-9.]+)\s+([0-9.]+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def test_demo_20_steps_shows_underflow_and_dls_no_terminal(tmp_path):
    res = _run("demo", "--steps", "20", "--eager-kernels", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    f32_start, f32_end = _row(out, "float32 (eager torch)")
    u_start, u_end = _row(out, "float16, no scaling")
    d_start, d_end = _row(out, "float16 + DLS")
    # Initial loss of an untrained 16-token model is about ln(16); all runs start alike.
    assert abs(f32_start - math.log(16)) < 0.5
    assert f32_start == u_start == d_start
    assert f32_end < f32_start - 0.05, out
    # float16 without scaling: every gradient flushes to zero, Adam moves nothing.
    assert u_end == u_start, out
    # DLS learns like float32 (the spike at step 5 is skipped, so one update fewer).
    assert d_end < d_start - 0.05 and abs(d_end - f32_end) < 0.5 * (f32_start - f32_end), out
    assert re.search(r"loss spike at step 5: skipped, scale 2\^15 -> 2\^14, back to 2\^15 at step 17", out)
    # Progress goes to stderr, the results to stdout only.
    assert "20/20" in res.stderr and "scale=2^" in res.stderr
    assert "20/20" not in out


def test_demo_loss_weight_really_underflows_float16():
    """Independent of dlspass: the demo's weighted loss has float16-underflowing gradients."""
    from dlspass.cli.demo import LOSS_WEIGHT, _model_and_optimizer
    from dlspass.models import copy_task_batch

    model, _ = _model_and_optimizer(0)
    idx, tgt = copy_task_batch(16, 16, 16, torch.Generator().manual_seed(0))
    logits = model(idx)
    logits.retain_grad()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), tgt.reshape(-1)) * LOSS_WEIGHT
    loss.backward()
    g = logits.grad
    assert g.abs().max() > 0
    assert (g.half() == 0).all()  # below half of float16's smallest subnormal 2**-24
    assert (g * 2.0**15).half().count_nonzero() > 0.9 * g.numel()  # the DLS scale brings it back


def test_bad_option_is_exit_2_with_one_stderr_line():
    res = _run("demo", "--bogus")
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("dlspass: error: ") and "--bogus" in lines[0]


# ---- in-process: cli.run returns the exit code --------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["demo", "--steps", "0"], "'--steps'"),
        (["demo", "--steps", "many"], "'--steps'"),
        (["nope"], "No such command 'nope'"),
        (["demo", "--out-dir", "/proc/no/such/dir", "-q", "--steps", "1"], "/proc/no/such/dir"),
    ],
)
def test_usage_errors_one_line(argv, fragment, capsys):
    assert cli.run(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlspass: error: ") and fragment in lines[0]


def test_bare_dlspass_prints_help_and_succeeds(capsys):
    assert cli.run([]) == 0
    assert "Examples" in capsys.readouterr().out


def test_main_exits_with_run_code(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--bogus"])
    assert info.value.code == 2
    capsys.readouterr()


def test_demo_json_and_out_dir(tmp_path, capsys):
    out_dir = tmp_path / "runs" / "demo"
    assert cli.run(["demo", "--steps", "3", "--json", "-q", "--eager-kernels",
                    "--out-dir", str(out_dir)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert captured.err == ""  # --quiet: no progress bar
    assert result["steps"] == 3 and len(result["losses"]) == 3
    assert result["backend_compiler"] == "eager" and result["kernels"] is None
    on_disk = json.loads((out_dir / "demo_metrics.json").read_text())
    assert on_disk == result
    assert result["graph_breaks"] == 0
    # the float32 and the unscaled float16 runs saw the same batches from the same weights
    assert len(result["unscaled"]["losses"]) == 3 and len(result["fp32"]["losses"]) == 3
    assert result["fp32"]["losses"][0] == pytest.approx(result["losses"][0], rel=1e-2)
    html = (out_dir / "report.html").read_text()
    assert "<svg" in html and "scaled_seed" in html and "guard" in html
    # the summary the demo prints, above the graph: the three runs side by side
    assert html.index("float16, no scaling") < html.index("<svg")
    assert "float16 + DLS" in html and "float32 (eager torch)" in html


def test_no_cpp_compiler_falls_back_to_eager_kernels(monkeypatch, capsys):
    import shutil

    from dlspass.cli import demo as demo_mod

    # inductor's own search (config.cpp.cxx) decides; on this machine it finds $CXX or g++
    assert demo_mod.cpp_compiler_available() == bool(shutil.which(os.environ.get("CXX", "g++")))
    seen: dict = {}

    def fake_run_demo(**kw):
        seen.update(kw)
        return {"backend_compiler": kw["backend_compiler"]}

    monkeypatch.setattr(demo_mod, "run_demo", fake_run_demo)
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        assert not demo_mod.cpp_compiler_available()
        assert cli.run(["demo", "--steps", "8", "--json", "-q"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"backend_compiler": "eager"}
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "no C++ compiler found" in lines[0] and "eager kernels" in lines[0]
    assert seen["spikes"] == (2,)  # the default spike, a quarter into the run
    assert cli.run(["demo", "--steps", "8", "--json", "-q", "--no-spike"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and seen["spikes"] == ()
    assert json.loads(captured.out)["backend_compiler"] == "inductor"


@pytest.mark.slow
def test_demo_on_inductor_counts_kernels(tmp_path):
    r = run_demo(steps=3, quiet=True, spikes=[2])
    assert r["backend_compiler"] == "inductor" and r["graph_breaks"] == 0
    k = r["kernels"]
    assert k["dls"]["launches"] > 0 and k["no_dls"]["launches"] > 0
    assert k["dls_added"] == k["dls"]["launches"] - k["no_dls"]["launches"]
    assert r["skipped"] == [0, 1, 1] and r["scales"] == [2.0**15, 2.0**15, 2.0**14]
    assert r["unscaled"]["end_loss"] == r["unscaled"]["start_loss"]


class _Boom(Exception):
    pass


@pytest.fixture
def temp_command():
    """Register a throwaway command that raises what the test asks for, then remove it."""
    box: dict[str, BaseException] = {}

    def explode() -> None:
        raise box["exc"]

    before = list(cli.app.registered_commands)
    cli.app.command("explode")(explode)
    yield box
    cli.app.registered_commands[:] = before


def test_config_error_is_exit_2_one_line(temp_command, capsys):
    temp_command["exc"] = ConfigError("params.yaml: trainer.init.precision.x: unknown precision key")
    assert cli.run(["explode"]) == 2
    err = capsys.readouterr().err
    assert err == "dlspass: error: params.yaml: trainer.init.precision.x: unknown precision key\n"


def test_missing_file_is_exit_2(temp_command, capsys):
    temp_command["exc"] = FileNotFoundError(2, "No such file or directory", "model.pt2")
    assert cli.run(["explode"]) == 2
    assert capsys.readouterr().err == "dlspass: error: model.pt2: No such file or directory\n"


def test_verification_error_is_exit_1(temp_command, capsys):
    verify = pytest.importorskip("dlspass.graph.invariants")
    temp_command["exc"] = verify.VerificationError("unscale node missing\nfor grad of fc1.weight")
    assert cli.run(["explode"]) == 1
    err = capsys.readouterr().err
    assert err == "dlspass: verification failed: unscale node missing for grad of fc1.weight\n"


def test_internal_error_keeps_traceback_and_exit_3(temp_command, capsys, monkeypatch):
    monkeypatch.delenv("DLSPASS_DEBUG", raising=False)
    temp_command["exc"] = _Boom("a bug")
    assert cli.run(["explode"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "dlspass: internal error: a bug" in err
    monkeypatch.setenv("DLSPASS_DEBUG", "1")
    with pytest.raises(_Boom):
        cli.run(["explode"])


# ---- the demo's cbfloat16 emulation -------------------------------------------------------------
def _cb16_representable(t: torch.Tensor) -> bool:
    """True if every value is a cbfloat16 value (1-6-9, bias 31, subnormals), checked in float64.

    Independent of dlspass.formats: a finite value is representable when value * 2**(9 - e)
    is an integer, with e its binary exponent clamped to the normal minimum -30, and
    |value| <= 2**32 - 2**22.
    """
    v = t.detach().double().flatten()
    v = v[torch.isfinite(v) & (v != 0)]
    if v.numel() == 0:
        return True
    if (v.abs() > 2.0**32 - 2.0**22).any():
        return False
    e = torch.floor(torch.log2(v.abs())).clamp(min=-30)
    scaled = v * torch.exp2(9 - e)
    return bool((scaled == torch.round(scaled)).all())


def test_representability_check_itself():
    assert _cb16_representable(torch.tensor([1.0, 1 + 2**-9, 2.0**-39, 3 * 2.0**-39, -4290772992.0]))
    assert not _cb16_representable(torch.tensor([1 + 2**-10]))
    assert not _cb16_representable(torch.tensor([2.0**-40]))
    assert not _cb16_representable(torch.tensor([65504.0]))


def test_emulate_format_rounds_linear_io_and_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    seen: dict[str, list[torch.Tensor]] = {"in": [], "out": [], "grad_out": [], "grad_in": []}

    def pre(_m, args):
        x = args[0]
        seen["in"].append(x.detach().clone())
        if x.requires_grad:
            x.register_hook(lambda g: seen["grad_in"].append(g.clone()))

    def post(_m, _args, out):
        seen["out"].append(out.detach().clone())
        out.register_hook(lambda g: seen["grad_out"].append(g.clone()))

    x = torch.randn(32, 8, requires_grad=True)
    with emulate_format(model, "cbfloat16") as n_linear:
        assert n_linear == 2
        # registered after the emulation's hooks, so they observe the rounded tensors
        handles = [h for m in model if isinstance(m, nn.Linear)
                   for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
        loss = model(x).pow(2).sum() * 1e3
        loss.backward()
        for h in handles:
            h.remove()
    for key in seen:
        assert seen[key], key
        for t in seen[key]:
            assert _cb16_representable(t), key
    # the hooks are gone after the block: the same forward no longer rounds
    out = model[0](x)
    assert not _cb16_representable(out)


def test_run_demo_is_deterministic_and_uses_float16_defaults():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = run_demo(steps=3, seed=1, quiet=True, compare=False, backend_compiler="eager")
        assert torch.get_num_threads() == 2  # the demo's single-thread setting is undone
    finally:
        torch.set_num_threads(threads)
    b = run_demo(steps=3, seed=1, quiet=True, compare=False, backend_compiler="eager")
    assert a["losses"] == b["losses"] and a["end_loss"] == b["end_loss"]
    assert a["format"] == "float16"
    assert a["initial_scale"] == 2.0**15  # the cerebras preset starts float16 at 2**15
    assert a["scales"][0] == 2.0**15
    assert a["skipped"] == [0, 0, 0] and a["skipped_steps"] == 0
    c = run_demo(steps=3, seed=2, quiet=True, compare=False, backend_compiler="eager")
    assert c["losses"] != a["losses"]


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_run_demo_rejects_bad_steps(steps):
    with pytest.raises(ValueError, match="steps: expected a positive integer"):
        run_demo(steps=steps, quiet=True)


def test_spikes_follow_the_hand_worked_dls_trace():
    # cerebras policy, float16 (starts at its cap 2**15), steps_per_increase=10, spikes at
    # steps 3, 4, 20: 3 overflows -> 2**14; 4 overflows -> 2**13; 5..15 are 11 clean updates,
    # and the 11th (> 10) grows the scale -> 2**14 from step 16; 20 overflows -> 2**13.
    r = run_demo(steps=22, seed=0, quiet=True, spikes=[3, 4, 20], compare=False, backend_compiler="eager")
    expected_scales = [2.0**15] * 3 + [2.0**14] + [2.0**13] * 11 + [2.0**14] * 5 + [2.0**13] * 2
    assert r["scales"] == expected_scales
    assert r["skipped"] == [0, 0, 1] + [2] * 16 + [3] * 3
    assert r["skipped_steps"] == 3 and r["final_scale"] == 2.0**13
    assert r["spikes"] == [3, 4, 20]


def test_cli_spike_option(tmp_path, capsys):
    out_dir = tmp_path / "demo"
    assert cli.run(["demo", "--steps", "4", "--spike", "2", "--json", "-q", "--eager-kernels",
                    "--out-dir", str(out_dir)]) == 0
    assert (out_dir / "report.html").exists()
    result = json.loads(capsys.readouterr().out)
    assert result["skipped_steps"] == 1 and result["final_scale"] == 2.0**14
    assert result["skipped"] == [0, 1, 1, 1]
    assert cli.run(["demo", "--steps", "4", "--spike", "5", "-q", "--eager-kernels"]) == 2
    assert capsys.readouterr().err == "dlspass: error: spikes: expected steps between 1 and 4, got 5\n"
