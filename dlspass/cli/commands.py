"""The ``dlspass`` command line: a thin typer app; each command's body lives in its own module.

Exit codes by exception class: 0 success, 1 verification failure (``VerificationError`` from
``dlspass verify``), 2 bad input or usage (a ``DLSInputError``, a file system refusal of a path
the user named, or a usage error), 3 anything else: an internal error (a bug: the traceback is
printed). Results go to stdout, progress and logs to stderr. Input errors are
one line on stderr (``dlspass: error: ...``), never a traceback; ``DLSPASS_DEBUG=1`` re-raises.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer

from dlspass.config import FP16_TYPES
from dlspass.errors import DLSInputError, InputValueError
from dlspass.files.bounded_text import excerpt, one_line, printable

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
# Exceptions that mean "the input is wrong": one line on stderr and exit 2. Everything else,
# a ValueError or TypeError included, is a bug in dlspass (exit 3): user input that dlspass
# refuses raises a DLSInputError at its source. OSError stays here because the CLI's file
# system work is on the user's paths (the input, the output, its folder): a name too long, a
# loop of links, no permission or a full disk is about the file the user named.
_BAD_INPUT = (DLSInputError, OSError)
MAX_ERROR_CHARS = 600
"""Longest error line: messages quote input (names, values, paths), which may be huge."""

_HELP = """Dynamic loss scaling for mixed-precision training, as compiler passes on PyTorch graphs.

[bold]Examples[/bold]

  [cyan]dlspass demo[/cyan]                          TinyGPT in float16: no scaling vs DLS vs float32

  [cyan]dlspass demo --steps 20 --json[/cyan]        the same, results as JSON on stdout

  [cyan]dlspass demo --out-dir runs/demo[/cyan]      also write runs/demo/demo_metrics.json

  [cyan]dlspass demo --spike 30 --spike 31[/cyan]    watch DLS skip two overflowing steps

  [cyan]dlspass export mypkg.models:make -o joint.pt2[/cyan]       export a loss model's joint graph

  [cyan]dlspass transform joint.pt2 -o step.pt2[/cyan]             add SGD and dynamic loss scaling

  [cyan]dlspass transform joint.pt2 -o step.onnx --to onnx[/cyan]  the same step for onnxruntime

  [cyan]dlspass export mypkg.models:make -o joint.onnx[/cyan]      the joint graph as ONNX (seed input)

  [cyan]dlspass transform joint.onnx -o dls.onnx[/cyan]            DLS inserted into the ONNX graph

  [cyan]dlspass inspect step.pt2 --format html -o step.html[/cyan] a report with the graph drawn

  [cyan]dlspass verify step.pt2[/cyan]                             prove the DLS invariants

Exit codes: 0 success, 1 verification failure, 2 bad input or usage, 3 internal error.
"""

app = typer.Typer(
    name="dlspass",
    help=_HELP,
    rich_markup_mode="rich",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    # A callback keeps `dlspass` a command group even while it has one command.
    pass


@app.command()
def demo(
    steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the model and the data.")] = 0,
    out_dir: Annotated[Path, typer.Option(
        "--out-dir", file_okay=False,
        help="Where demo_metrics.json and report.html (inspect report of the graph) go.")] = Path("dlspass-demo"),
    eager_kernels: Annotated[bool, typer.Option(
        "--eager-kernels", help="Run the compiled graphs on eager kernels instead of inductor's "
        "C++ kernels (chosen automatically when no C++ compiler is found).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    spike: Annotated[list[int] | None, typer.Option(
        "--spike", help="Make this step's loss spike so its gradients overflow (repeatable; "
        "default: one spike a quarter into the run).")] = None,
    no_spike: Annotated[bool, typer.Option("--no-spike", help="No loss spike.")] = False,
) -> None:
    """Show what dynamic loss scaling is for: TinyGPT in float16 with and without DLS, against float32.

    The loss is weighted by 2^-20, so float16 gradients fall below float16's smallest subnormal. The same model learns a copy task in float32 (eager torch), in float16 without loss scaling (it stalls: its gradients underflow to zero) and in float16 with DLS (it tracks float32). Each float16 step (forward, backward, DLS, Adam) is one graph made by dlspass.compile and compiled by inductor to fused C++ kernels; the report counts them, with and without DLS. A loss spike overflows float16: DLS skips that step and the scale grows back. Writes report.html (an inspect report of the DLS graph) and demo_metrics.json to --out-dir.
    """
    from dlspass.cli.demo import cpp_compiler_available, default_spikes, format_summary, run_demo

    if not eager_kernels and not cpp_compiler_available():
        typer.echo("dlspass demo: no C++ compiler found (inductor looks for $CXX, else g++); "
                   "running the compiled graphs on eager kernels", err=True)
        eager_kernels = True
    spikes = () if no_spike else (spike or default_spikes(steps))
    result = run_demo(steps=steps, seed=seed, out_dir=out_dir, quiet=quiet, spikes=spikes,
                      backend_compiler="eager" if eager_kernels else "inductor")
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(format_summary(result))


def _parse_loss_scale(value: str | None) -> str | float | None:
    if value is None:
        return None
    if value in ("dynamic", "none"):
        return None if value == "none" else value
    try:
        scale = float(value)
    except ValueError:
        raise typer.BadParameter(f"expected 'dynamic', 'none' or a number, got {excerpt(value)}",
                                 param_hint="--loss-scale") from None
    _check_number("--loss-scale", scale, positive=True)
    return scale


def _parse_betas(value: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(v) for v in value.split(","))
    except ValueError:
        raise typer.BadParameter(f"expected two numbers like 0.9,0.999, got {excerpt(value)}",
                                 param_hint="--betas") from None
    return b1, b2


def _check_optimizer_flags(**values: object) -> None:
    """``--optimizer``, ``--lr``, ... by the rule ``OptimizerSpec`` checks its fields with,
    worded as the flag (``kind`` is ``--optimizer``)."""
    from dlspass.capture.optim import optimizer_value_problem

    for name, value in values.items():
        problem = optimizer_value_problem(name, value)
        if problem is not None:
            flag = "--optimizer" if name == "kind" else "--" + name.replace("_", "-")
            raise typer.BadParameter(problem, param_hint=flag)


def _check_number(flag: str, value: float | None, *, positive: bool = False) -> None:
    """A DLS number flag (``--loss-scale``, ``--max-gradient-norm``) must be finite and >= 0
    (> 0 with ``positive``): inf or nan would turn the first step's weights to NaN."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise typer.BadParameter(f"expected {want}, got {value!r}", param_hint=flag)


def _read_config_file(config: Path, modelzoo_model: str | None) -> tuple[Any, list[str]]:
    """``DLSConfig.from_yaml`` and what the reader warned about (a Model Zoo default it had to
    guess, a dropped scale), as ``warning: ...`` lines: the command silences Python's warnings
    (`_quiet_command`), and these are about the user's file. The caller prints them once the
    command succeeded, so that a failing command's stderr stays its one error line."""
    import warnings

    from dlspass.config import DLSConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = DLSConfig.from_yaml(str(config), modelzoo_model=modelzoo_model)
    notes = [f"warning: {one_line(str(w.message), 2000)}" for w in caught
             if issubclass(w.category, UserWarning)]
    return cfg, notes


def _quiet_command(fn: Any) -> Any:
    """Register ``fn`` as a command that runs with torch's logging and warnings silenced: stderr
    stays one line."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get("DLSPASS_DEBUG"):
            return fn(*args, **kwargs)
        from dlspass.files.quiet import quiet_torch

        with quiet_torch():
            return fn(*args, **kwargs)

    return app.command()(wrapper)


# the file export and transform write
_OutputFile = Annotated[Path, typer.Option("--output", "-o", help="The .pt2 or .onnx file to write.")]

@_quiet_command
def export(
    factory: Annotated[str, typer.Argument(
        metavar="MODULE:FACTORY|JOINT.pt2", help="FACTORY() returns (model, example_inputs); model(*inputs) is the loss. Or a joint program from `dlspass export`, run once on its example inputs.")],
    output: _OutputFile,
) -> None:
    """Export a loss model as a joint forward-backward program (loss and parameter gradients).

    To .onnx: outputs loss and grad.<param>, the backward seed is the input loss_seed (feed 1.0) and the parameters are inputs; `dlspass transform joint.onnx -o dls.onnx` then inserts DLS.

    Tied parameters (one tensor under two names, e.g. an embedding shared with the output layer) become one parameter under its first name, trained with the sum of both gradients as torch.optim does; the file's metadata records the merge as "tied": {dropped name: kept name} (shown by `dlspass inspect`, carried into the step by `dlspass transform`). A model torch cannot export (torch.export.export or the trace of its backward fails) exits 2 with one line naming torch's error; exit 3 is kept for failures inside dlspass.

    MODULE is imported from sys.path with the current folder searched last: a module beside you resolves, a file there named like an installed module (filelock.py) is never imported in its place.

    Example: dlspass export tests.cli_factories:mlp -o mlp.pt2
    """
    from dlspass.capture.export import export_factory
    from dlspass.capture.pt2_io import save_program
    from dlspass.files.paths import check_output_path

    out = check_output_path(output, (".pt2", ".onnx"))
    ep, tied = export_factory(factory)
    # the merged names are gone from the program: the metadata is where a user finds them
    if out.suffix == ".onnx":
        from dlspass.onnx.convert import save_joint_onnx

        save_joint_onnx(ep, out, tied=tied)
    else:
        save_program(ep, out, {"format": "dlspass-joint", "kind": "joint", "source": factory,
                               "tied": tied})
    print(f"wrote {printable(str(out))}", file=sys.stderr)


@_quiet_command
def transform(
    input: Annotated[Path, typer.Argument(
        metavar="IN", help="A joint training program (.pt2) or a dlspass step.")],
    output: _OutputFile,
    fp16_type: Annotated[str | None, typer.Option(
        "--fp16-type", help="16-bit format: float16 (default), bfloat16 or cbfloat16.")] = None,
    loss_scale: Annotated[str | None, typer.Option(
        help="'dynamic' (default), 'none' or a static scale.")] = None,
    mixed_precision: Annotated[bool | None, typer.Option(
        "--mixed-precision/--no-mixed-precision",
        help="Run matmuls in the 16-bit format (default) or keep fp32 (DLS only).")] = None,
    precision_mode: Annotated[str | None, typer.Option(
        help="native (default for float16 and bfloat16): real 16-bit kernels, as autocast; "
             "emulate (default for cbfloat16 and for ONNX output): round to the format in fp32 "
             "containers.")] = None,
    float8: Annotated[str | None, typer.Option(
        "--float8", help="Run the step's matmuls in float8 with current scaling: tensorwise "
                         "or rowwise (torchao's recipes; .pt2 output only).")] = None,
    float8_filter: Annotated[str | None, typer.Option(
        "--float8-filter", help="Which matmuls --float8 converts: all (default, as torchao's "
                                "convert_to_float8_training), auto (skip those torchao's auto filter "
                                "finds too small to gain), plus skip:MODULE_PATH entries, "
                                "comma-separated.")] = None,
    optimizer: Annotated[str, typer.Option(help="sgd, adam or adamw.")] = "sgd",
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 0.01,
    momentum: Annotated[float, typer.Option(help="SGD momentum.")] = 0.0,
    weight_decay: Annotated[float, typer.Option(help="Weight decay.")] = 0.0,
    betas: Annotated[str, typer.Option(help="Adam betas, e.g. 0.9,0.999.")] = "0.9,0.999",
    eps: Annotated[float, typer.Option(help="Adam epsilon.")] = 1e-8,
    max_gradient_norm: Annotated[float | None, typer.Option(
        help="Clip the unscaled gradients to this global norm.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", help="A Model Zoo params.yaml supplying the DLS settings.")] = None,
    modelzoo_model: Annotated[str | None, typer.Option(
        "--modelzoo-model", help="The Model Zoo model directory that runs --config (gpt2, bert, "
        "...): its defaults apply to a legacy file that does not say it.")] = None,
    to: Annotated[str | None, typer.Option(
        "--to", help="Output format: pt2 or onnx (default: from the -o suffix).")] = None,
    rounding: Annotated[str, typer.Option(
        "--rounding",
        help="How a .pt2 writes emulated rounding: aten (default; core aten bit operations, the "
             "file loads and trains with torch alone) or op (the dlspass::round_to_format custom "
             "op, compact and named in the graph; loading needs `import dlspass.formats`). "
             "ONNX output always uses float arithmetic.")] = "aten",
) -> None:
    """Build the whole training step with dynamic loss scaling from a joint program.

    Appends the optimizer update, adds optimizer, lr and scaler state as buffers, rewrites the step with the dlspass passes and writes a .pt2 (load(...).module()(*inputs) under torch.no_grad() trains one step in place) or, with --to onnx, an ONNX model whose state is fed back by the caller.

    Example: dlspass transform mlp.pt2 -o step.pt2 --optimizer adam --lr 1e-3
    """
    from dlspass.capture.joint_step import ROUNDINGS, transform_program
    from dlspass.capture.optim import OptimizerSpec
    from dlspass.capture.pt2_io import load_program, save_program
    from dlspass.config import ConfigError, DLSConfig
    from dlspass.files.paths import check_input_file, check_output_path

    if fp16_type is not None and fp16_type not in FP16_TYPES:
        raise typer.BadParameter(f"expected one of {', '.join(FP16_TYPES)}, got {excerpt(fp16_type)}",
                                 param_hint="--fp16-type")
    if rounding not in ROUNDINGS:
        raise typer.BadParameter(f"expected {' or '.join(ROUNDINGS)}, got {excerpt(rounding)}",
                                 param_hint="--rounding")
    fmt = to or ("onnx" if output.suffix == ".onnx" else "pt2")
    if fmt not in ("pt2", "onnx"):
        raise typer.BadParameter(f"expected pt2 or onnx, got {excerpt(to)}", param_hint="--to")
    opt_values = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                  "betas": _parse_betas(betas), "eps": eps}
    _check_optimizer_flags(kind=optimizer, **opt_values)
    _check_number("--max-gradient-norm", max_gradient_norm, positive=True)
    scale = _parse_loss_scale(loss_scale)
    opt = OptimizerSpec(kind=optimizer, **opt_values)
    src = check_input_file(input)
    out = check_output_path(output, (f".{fmt}",))
    # the flags given, merged into --config (or the defaults) by the one rule of every entry point
    flag_of = {"fp16_type": "--fp16-type", "loss_scale": "--loss-scale",
               "max_gradient_norm": "--max-gradient-norm", "mixed_precision": "--mixed-precision",
               "precision_mode": "--precision-mode", "float8": "--float8", "float8_filter": "--float8-filter"}
    overrides: dict[str, Any] = {k: v for k, v in (
        ("fp16_type", fp16_type), ("max_gradient_norm", max_gradient_norm),
        ("mixed_precision", mixed_precision), ("precision_mode", precision_mode),
        ("float8", float8), ("float8_filter", float8_filter)) if v is not None}
    if loss_scale is not None:  # `--loss-scale none` is given, as None: scaling off
        overrides["loss_scale"] = scale
    if modelzoo_model is not None and config is None:
        raise typer.BadParameter("names the model of a --config file; give --config too",
                                 param_hint="--modelzoo-model")
    base, notes = (_read_config_file(config, modelzoo_model) if config is not None
                   else (DLSConfig(), []))
    try:
        cfg = base.with_overrides(**overrides)
    except ConfigError as e:  # the config's own check, reported against the flag
        key = next((k for k in overrides if str(e).startswith(f"{k}:")), None)
        if key is None:
            raise
        raise typer.BadParameter(str(e), param_hint=flag_of[key]) from None
    if fmt == "onnx" and cfg.float8 is not None:
        raise typer.BadParameter("ONNX output has no float8 matmul lowering; write a .pt2",
                                 param_hint="--float8")
    if fmt == "onnx":
        # dlspass's ONNX lowering rounds in float32 containers (LowerPrecisionOnnxPass)
        if cfg.precision_mode == "native" and cfg.mixed_precision:
            raise typer.BadParameter("ONNX output is emulated; use --precision-mode emulate or "
                                     "write a .pt2", param_hint="--precision-mode")
        cfg = cfg.with_overrides(precision_mode="emulate")
    if src.suffix == ".onnx":
        from dlspass.onnx.convert import transform_onnx

        if fmt != "onnx":
            raise typer.BadParameter("an .onnx input can only be written as .onnx", param_hint="--to")
        transform_onnx(src, out, cfg)
        print(*notes, f"wrote {printable(str(out))}", sep="\n", file=sys.stderr)
        return
    ep, meta = load_program(src)
    # ONNX output keeps the op here: save_step_onnx writes it in its float-arithmetic form
    step, step_meta = transform_program(ep, meta, cfg, opt, source=str(src),
                                        rounding="op" if fmt == "onnx" else rounding)
    if fmt == "onnx":
        from dlspass.onnx.convert import save_step_onnx

        save_step_onnx(step, step_meta, out)
    else:
        save_program(step, out, step_meta)
    print(*notes, f"wrote {printable(str(out))}", sep="\n", file=sys.stderr)


@_quiet_command
def inspect(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="A .pt2 (joint program or dlspass step) or .onnx file.")],
    diff: Annotated[Path | None, typer.Option("--diff", help="Compare with this file (e.g. the original).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="text, json, svg or html.")] = "text",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
) -> None:
    """Summarise a graph: nodes each pass inserted, casts, scaled region, roles, DLS config.

    Example: dlspass inspect step.pt2 --diff joint.pt2 --format html -o report.html
    """
    from dlspass.debug.inspect_report import FORMATS, render, summarize_file
    from dlspass.files.atomic_write import write_text_atomic
    from dlspass.files.paths import check_output_path

    if fmt not in FORMATS:
        raise typer.BadParameter(f"expected one of {', '.join(FORMATS)}, got {excerpt(fmt)}",
                                 param_hint="--format")
    out = check_output_path(output, tuple({".txt", ".json", ".svg", ".html", f".{fmt}"})) if output else None
    report = summarize_file(file)
    other = summarize_file(diff) if diff is not None else None
    text = render(report, fmt, other)
    if out is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        write_text_atomic(out, text)
        print(f"wrote {printable(str(out))}", file=sys.stderr)


@_quiet_command
def analyze(
    factory: Annotated[str, typer.Argument(
        metavar="MODULE:FACTORY|JOINT.pt2", help="FACTORY() returns (model, example_inputs); model(*inputs) is the loss. Or a joint program from `dlspass export`, run once on its example inputs.")],
    fmt: Annotated[str, typer.Option("--format", help="text, json or html.")] = "text",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
    formats: Annotated[str | None, typer.Option("--formats", help="Comma-separated formats (default: all).")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Calibration steps.")] = 1,
    threshold: Annotated[float, typer.Option("--threshold", help="Largest fraction of the model's parameter-gradient values allowed to flush to zero (dlspass.analyze's DEFAULT_THRESHOLD).")] = 0.005,
    fp16_type: Annotated[str | None, typer.Option("--fp16-type", help="float8: per matmul (forward and backward), what the float8 cast loses and whether to leave it in 16 bits (a MODULE:FACTORY; text or json); another format: as --formats with that one.")] = None,
    float8: Annotated[str, typer.Option("--float8", help="The float8 recipe judged with --fp16-type float8: tensorwise or rowwise.")] = "tensorwise",
) -> None:
    """Does the model fit float16, bfloat16, cbfloat16, float8? The window of loss scales and a recommended initial_loss_scale per format, from float32 calibration steps.

    What it runs: MODULE:FACTORY imports and calls your code (MODULE from sys.path, the current folder searched last). JOINT.pt2 runs the file's graph once on its example inputs, after the checks of inspect and verify, and only if every node is plain tensor arithmetic (no print, no loops) and no value exceeds a bound set by the size of its inputs (checked on fake tensors first); otherwise exit 2 and nothing runs.

    Example: dlspass analyze mypkg.models:make --format html -o risk.html (or: dlspass analyze joint.pt2)
    """
    from dlspass.debug.analyze_command import run_analyze

    run_analyze(factory, fmt, output, formats, steps, threshold, fp16_type, float8)


@_quiet_command
def verify(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="A dlspass step (.pt2).")],
) -> None:
    """Prove the DLS invariants of a transformed step; exit 1 naming the failing node.

    Example: dlspass verify step.pt2
    """
    from dlspass.capture.joint_step import step_graph
    from dlspass.capture.pt2_io import load_program
    from dlspass.graph.invariants import verify as run_verify

    ep, meta = load_program(file)
    if meta is None or meta.get("kind") != "step":
        raise InputValueError(f"{file}: not a dlspass training step (run `dlspass transform` first)")
    run_verify(step_graph(ep, meta))
    n = sum(1 for node in ep.graph.nodes if node.op == "call_function")
    print(f"OK {printable(str(file))}: DLS invariants hold ({n} ops, config {json.dumps(meta['config'], sort_keys=True)})")


def _is_verification_error(exc: BaseException) -> bool:
    # Look the class up only if dlspass.graph.invariants was imported: main() must stay light.
    verify = sys.modules.get("dlspass.graph.invariants")
    cls = getattr(verify, "VerificationError", None)
    return isinstance(cls, type) and isinstance(exc, cls)


def _one_line(exc: BaseException | str) -> str:
    """The message on one printable line of at most ``MAX_ERROR_CHARS`` characters."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return one_line(f"{exc.filename}: {exc.strerror}", MAX_ERROR_CHARS)
    text = str(exc).strip() or type(exc).__name__
    return one_line(text, MAX_ERROR_CHARS)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and exit with its status code."""
    sys.exit(run(argv))


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code instead of exiting (for embedding and tests)."""
    from typer._click import exceptions as click_exc  # typer vendors click

    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        # Bare `dlspass` shows the help and succeeds (click would exit 2 for no_args_is_help).
        args = ["--help"]
    from dlspass.files.paths import cwd_searched_last

    try:
        # a command imports more (torch, lazily, and a factory's module): nothing of it may
        # come from a file in the current folder that happens to share its name
        with cwd_searched_last():
            rv: Any = app(args=args, prog_name="dlspass", standalone_mode=False)
    except click_exc.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "dlspass"
        print(f"dlspass: error: {_one_line(exc.format_message())} (see '{where} --help')",
              file=sys.stderr)
        return EXIT_USAGE
    except click_exc.ClickException as exc:
        print(f"dlspass: error: {_one_line(exc.format_message())}", file=sys.stderr)
        return exc.exit_code
    except typer.Abort:
        print("dlspass: aborted", file=sys.stderr)
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        print("dlspass: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("DLSPASS_DEBUG"):
            raise
        if _is_verification_error(exc):
            print(f"dlspass: verification failed: {_one_line(exc)}", file=sys.stderr)
            return EXIT_VERIFY
        if isinstance(exc, _BAD_INPUT):
            print(f"dlspass: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
        # A bug, not bad input: keep the traceback, and an exit code that cannot be
        # mistaken for "verification failed".
        traceback.print_exc()
        print(f"dlspass: internal error: {_one_line(exc)} (set DLSPASS_DEBUG=1 to re-raise)",
              file=sys.stderr)
        return EXIT_INTERNAL
    # With standalone_mode=False typer returns an explicit exit code (typer.Exit, --help: 0)
    # or the command's return value (None for every command here).
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else EXIT_OK


if __name__ == "__main__":
    main()
