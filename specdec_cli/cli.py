"""The `specdec` command: a thin typer app; each subcommand lives in `commands/`."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Annotated

# Ctrl-C while the commands are still being imported (the first second of every run) stops the run as it would
# later: exit code 130 and no traceback, not death by the signal.
try:
    import typer
    from rich.console import Console

    from . import __version__
    from .base.errors import SpecdecError
    from .commands.acceptance import acceptance
    from .commands.bench import bench
    from .commands.common import GLOBAL_FLAGS, stdout_to_nowhere
    from .commands.drafters import drafters
    from .commands.generate import generate
    from .commands.verifiers import verifiers
except KeyboardInterrupt:
    sys.exit(130)


def _declared_metavar(self: typer.core.TyperOption, ctx: object) -> str | None:
    """Help shows the placeholder each option declares (N, FILE, NATS, …), never typer's own type
    labels (``<bool>``, ``<list[str]>``), which say how Python parses a value, not what to give."""
    return self.metavar or None


def _leave_a_closed_pipe_to_main(self: Console) -> None:
    """Rich's answer to a reader that closed stdout (`specdec verifiers | head -1`) is exit code 1, the code of a
    failure; raised as BrokenPipeError instead, it reaches :func:`main` (or the command's own handling), which
    ends the run quietly."""
    raise BrokenPipeError


Console.on_broken_pipe = _leave_a_closed_pipe_to_main  # type: ignore[method-assign]

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


def _ends_quietly_when_the_reader_leaves(command: Callable[..., None]) -> Callable[..., None]:
    """``command``, ended with exit code 0 when the reader of its stdout leaves (`specdec verifiers | head -1`): the
    reader took what it wanted. Caught inside click's main, whose own handling of a closed pipe exits with 1."""

    @functools.wraps(command)
    def run(**options: object) -> None:
        try:
            command(**options)
        except BrokenPipeError:
            stdout_to_nowhere()
            raise typer.Exit(0) from None

    return run


for _command in (generate, acceptance, bench, verifiers, drafters):
    app.command()(_ends_quietly_when_the_reader_leaves(_command))


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
        bool,
        typer.Option(
            "--verbose",
            metavar="",
            help="Let the libraries' own progress bars and warnings through, and say what the compile cache reused.",
        ),
    ] = False,
) -> None:
    """Speculative decoding: generate with exact, pluggable verifiers; measure acceptance and speed."""
    GLOBAL_FLAGS.verbose = verbose


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
        _run(args)
    except BrokenPipeError:  # the last flush (see _run), or the help: the reader took what it wanted
        stdout_to_nowhere()
        sys.exit(0)


def _run(args: list[str]) -> None:
    """The command ``args`` names, its errors turned into one line and an exit code."""
    try:
        code = app(args=args, prog_name="specdec", standalone_mode=False)
        sys.stdout.flush()  # a pipe buffers: a reader that left shows here, not at exit where nothing catches it
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
