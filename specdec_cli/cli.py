"""The `specdec` command: a thin typer app; each subcommand lives in `commands/`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from typing import Annotated

import typer
from rich.console import Console

from . import __version__
from .base.errors import SpecdecError
from .commands.acceptance import acceptance
from .commands.bench import bench
from .commands.drafters import drafters
from .commands.generate import generate
from .commands.verifiers import verifiers


def _declared_metavar(self: typer.core.TyperOption, ctx: object) -> str | None:
    """Help shows the placeholder each option declares (N, FILE, NATS, …), never typer's own type
    labels (``<bool>``, ``<list[str]>``), which say how Python parses a value, not what to give."""
    return self.metavar or None


# Every option of the CLI declares its metavar; an argument's name already is its placeholder.
typer.core.TyperOption.display_type_rich = _declared_metavar  # type: ignore[method-assign]
typer.core.TyperArgument.display_type_rich = lambda self, ctx: None  # type: ignore[method-assign]

app = typer.Typer(
    name="specdec",
    help="Speculative decoding: generate with exact, pluggable verifiers; measure acceptance and speed.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(generate)
app.command()(acceptance)
app.command()(bench)
app.command()(verifiers)
app.command()(drafters)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"specdec {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", metavar="", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", metavar="", help="Show full tracebacks for errors.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", metavar="", help="Let the libraries' own progress bars and warnings through.")
    ] = False,
) -> None:
    """Speculative decoding: generate with exact, pluggable verifiers; measure acceptance and speed."""


def _quiet_libraries(verbose: bool) -> None:
    """Keep library chatter (loading and download bars, advisory warnings) off the user's terminal,
    unless --verbose. Environment settings only: they act when the libraries are first imported,
    so a command that never loads a model never imports them."""
    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars follow it too
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.simplefilter("ignore")


# click's ClickException, whichever click typer runs on (newer typer releases vendor their own).
_PARSER_ERRORS = tuple(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _terminate_like_ctrl_c(signum: int, frame: object) -> None:
    """SIGTERM (a scheduler's kill, `timeout`) stops a run the way Ctrl-C does: what is done is kept."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user errors become one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    _quiet_libraries("--verbose" in args)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate_like_ctrl_c)
    try:
        code = app(args=args, prog_name="specdec", standalone_mode=False)
    except SpecdecError as error:
        _fail(args, error, str(error), error.exit_code)
    except _PARSER_ERRORS as error:  # the parser's own: an unknown option, a value of the wrong type
        where = error.ctx.command_path if getattr(error, "ctx", None) else "specdec"
        if not error.format_message():  # no arguments at all: the help was printed
            sys.exit(error.exit_code)
        _fail(args, error, f"{error.format_message()} (see `{where} --help`)", error.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        Console(stderr=True).print("interrupted")
        sys.exit(130)
    if isinstance(code, int) and code:
        sys.exit(code)


def _fail(args: list[str], error: Exception, message: str, exit_code: int) -> None:
    """One line on stderr and the exit code; the traceback only with --debug."""
    if "--debug" in args:
        raise error
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    sys.exit(exit_code)
