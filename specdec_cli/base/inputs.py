"""Reading what users hand in (text files, stdin, JSON lines): every problem is a one-line UsageError."""

from __future__ import annotations

import json
import os
import random
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .errors import UsageError

BYTE_ORDER_MARK = "\ufeff"
"""What Windows editors put before UTF-8 text; left in, it would be the first prompt's first character."""


def read_text(path: Path, what: str, stdin: TextIO | None = None) -> str:
    """The UTF-8 text of ``path`` (``-`` = ``stdin``), named ``what`` in errors (e.g. "--prompt-file")."""
    if stdin is not None and str(path) == "-":
        return read_stdin(stdin)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except IsADirectoryError:
        raise UsageError(f"{what} '{path}' is a folder; give a text file") from None
    except OSError as error:
        raise UsageError(f"cannot read {what} '{path}': {error.strerror}; give a readable text file") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what} '{path}' is not UTF-8 text (a binary file?); give a text file") from None
    return _plain_text(text, f"{what} '{path}'")


def read_stdin(stdin: TextIO) -> str:
    try:
        text = stdin.read()
        text.encode("utf-8")  # a C/POSIX locale decodes bytes that are not UTF-8 as lone surrogates
    except (UnicodeDecodeError, UnicodeEncodeError):
        raise UsageError("standard input is not UTF-8 text; pipe text, or give --prompt-file") from None
    return _plain_text(text, "standard input")


def _plain_text(text: str, where: str) -> str:
    """``text`` without a leading byte-order mark; NUL characters mean UTF-16 text or binary data, where
    every other byte of ASCII text would reach the model as NUL."""
    if "\x00" in text:
        raise UsageError(f"{where} holds NUL bytes (UTF-16 text or a binary file?); save it as UTF-8 text")
    return text.removeprefix(BYTE_ORDER_MARK)


@dataclass(frozen=True)
class PromptLines:
    """A plain-text prompt file read as a prompt per non-blank line. A blank line cannot be a prompt (a model given
    nothing to continue), so it is skipped; one between prompts is counted, since it often means paragraphs meant as
    one prompt, and the reader is told (trailing blank lines, an editor's habit, are not counted)."""

    prompts: list[str]
    skipped: tuple[int, ...] = ()
    """The numbers (from 1) of the blank lines before the last prompt."""

    @classmethod
    def of(cls, text: str) -> PromptLines:
        lines = text.splitlines()
        last = max((number for number, line in enumerate(lines, 1) if line.strip()), default=0)
        blank = tuple(number for number, line in enumerate(lines[:last], 1) if not line.strip())
        return cls([line for line in lines if line.strip()], blank)

    def note(self, where: str) -> str | None:
        """One line saying which blank lines of ``where`` ("--prompt-file 'p.txt'") were skipped; None: none was."""
        if not self.skipped:
            return None
        shown = ", ".join(map(str, self.skipped[:SHOWN_LINES])) + (", …" if len(self.skipped) > SHOWN_LINES else "")
        plural = "s" if len(self.skipped) > 1 else ""
        return (
            f"{where}: skipped {len(self.skipped)} blank line{plural} (line{plural} {shown}); each non-blank line is "
            "one prompt, so a prompt of several lines needs a .jsonl file (one JSON object per line)"
        )


SHOWN_LINES = 5
"""Line numbers a note names before it says "…"."""


def has_suffix(path: Path | str, suffix: str) -> bool:
    """Whether ``path`` ends in ``suffix`` (".jsonl"), in any case: some tools write FILE.JSONL."""
    return Path(path).suffix.lower() == suffix


_JSON_KINDS = {
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true or false",
    list: "a list",
    type(None): "null",
}


def json_object_lines(text: str, path: Path, example_field: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line of a JSON-lines file; a line that is not a JSON
    object is one UsageError naming the line (``example_field`` shows what an object looks like)."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(
                f"{path} line {number} is not JSON ({error.msg}); each line must be one JSON object"
            ) from None
        if not isinstance(record, dict):
            raise UsageError(
                f"{path} line {number} is {_JSON_KINDS[type(record)]}, not a JSON object; each line must be one "
                f'object such as {{"{example_field}": "..."}}'
            )
        yield number, record


def text_value(value: Any, where: str, name: str) -> str:
    """A JSON field holding text: a string, or a non-empty list whose first item is one (Spec-Bench's
    ``turns``). Anything else (null, a number, an empty list) is refused rather than turned into "None"."""
    first = value[0] if isinstance(value, list) and value else value
    if not isinstance(first, str):
        raise UsageError(f"{where}: '{name}' must be text or a list of texts, got {value!r}")
    if not first.strip():  # a model given nothing to continue
        raise UsageError(f"{where}: '{name}' is empty; give some text or delete the line")
    return first


def optional_string(record: dict[str, Any], name: str, where: str) -> str | None:
    """``record[name]`` when it is a JSON string, None when absent or null; anything else (a number
    reference, a numeric category) is refused, since text and numbers would be mixed later."""
    value = record.get(name)
    if value is None or isinstance(value, str):
        return value
    fix = f'write it in quotes ("{value}")' if isinstance(value, (int, float)) else "give one string"
    raise UsageError(f"{where}: '{name}' must be a JSON string, got {value!r}; {fix} on every line")


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_writable_folder(path: Path, what: str) -> None:
    """``path`` is (or can be made) a folder this process can write: checked before any slow work."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} '{path}' is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".specdec-write-test-"):
            pass
    except OSError as error:
        raise UsageError(f"cannot write to {what} '{path}' ({error.strerror}); give a writable folder") from None


def check_plot_path(path: Path | None) -> None:
    """A ``--plot`` file name matplotlib can write, in a writable folder (made if missing, as ``--output`` is)."""
    if path is None:
        return
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot '{path}': name a {', '.join(PLOT_SUFFIXES)} file (the suffix picks the format)")
    if path.is_dir():
        raise UsageError(f"--plot '{path}' is a folder; name a file in it, e.g. '{path / 'plot.png'}'")
    check_writable_folder(path.parent, "the --plot folder")


def subset(items: list, limit: int | None, shuffle: bool, seed: int) -> list:
    """``items`` shuffled with ``seed`` if asked, then cut to the first ``limit`` (shuffling comes first)."""
    items = list(items)
    if shuffle:
        random.Random(seed).shuffle(items)
    return items[:limit] if limit else items


def cache_dir() -> Path:
    """Where converted weights and measurements are cached: ``$SPECDEC_CACHE``, default ``~/.cache/specdec``
    (also when it is set but empty)."""
    # An empty value (SPECDEC_CACHE= in a script) means "not set", not the working directory.
    configured = os.environ.get("SPECDEC_CACHE", "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdec"


def require_text(prompt: str) -> None:
    if not prompt.strip():
        raise UsageError("the prompt is empty; give some text to continue")


def write_cache_file(path: Path, text: str) -> None:
    """Write a cache entry; a failure (read-only home, full disk) only costs recomputing it next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)  # whole or not at all: a concurrent reader never sees half an entry
    except OSError:
        pass


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: written to a temporary file beside it, forced to the
    disk, then renamed over it. A failure (a full disk, a kill) leaves the previous file as it was;
    an ``OSError`` is the caller's to report."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "x", encoding="utf-8") as handle:  # "x": never another writer's file
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())  # the data is on the disk before the name points at it
        os.replace(temporary, path)
    except BaseException:
        with suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise
