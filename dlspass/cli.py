"""The ``dlspass`` command line: a thin typer app; each command's body lives in its own module.

Exit codes: 0 success, 1 verification failure, 2 bad input or usage, 3 internal error (a bug:
the traceback is printed). Results go to stdout, progress and logs to stderr. Input errors are
one line on stderr (``dlspass: error: ...``), never a traceback; ``DLSPASS_DEBUG=1`` re-raises.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer

from .config import ConfigError

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
# Exceptions that mean "the input is wrong": one line on stderr and exit 2.
_BAD_INPUT = (ConfigError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
              PermissionError)

_HELP = """Dynamic loss scaling for mixed-precision training, as compiler passes on PyTorch graphs.

[bold]Examples[/bold]

  [cyan]dlspass demo[/cyan]                          TinyGPT in emulated cbfloat16 with DLS

  [cyan]dlspass demo --steps 20 --json[/cyan]        the same, results as JSON on stdout

  [cyan]dlspass demo --out-dir runs/demo[/cyan]      also write runs/demo/demo_metrics.json

  [cyan]dlspass demo --spike 30 --spike 31[/cyan]    watch DLS skip two overflowing steps

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
    out_dir: Annotated[Path | None, typer.Option(
        "--out-dir", file_okay=False, help="Also write demo_metrics.json here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    spike: Annotated[list[int] | None, typer.Option(
        "--spike", help="Make this step's loss spike so its gradients overflow (repeatable).")] = None,
) -> None:
    """Train the bundled TinyGPT on a copy task in emulated cbfloat16 with dynamic loss scaling.

    Every nn.Linear rounds its inputs, outputs and their gradients to cbfloat16; the eager dlspass.GradScaler (cerebras policy) scales the loss, skips overflowing steps and adapts the scale. Prints the start and end loss, the final scale and the skipped steps.
    """  # noqa: E501 - typer keeps a docstring's line breaks in --help
    from .demo import format_summary, run_demo

    result = run_demo(steps=steps, seed=seed, out_dir=out_dir, quiet=quiet, spikes=spike or ())
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(format_summary(result))


def _is_verification_error(exc: BaseException) -> bool:
    # Look the class up only if dlspass.verify was imported: main() must stay light.
    verify = sys.modules.get("dlspass.verify")
    cls = getattr(verify, "VerificationError", None)
    return isinstance(cls, type) and isinstance(exc, cls)


def _one_line(exc: BaseException | str) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


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
    try:
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
