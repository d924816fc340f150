"""Reading what users hand in (text files, stdin, JSON lines): every problem is a one-line UsageError."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any, TextIO

from .errors import UsageError


def read_text(path: Path, what: str, stdin: TextIO | None = None) -> str:
    """The UTF-8 text of ``path`` (``-`` = ``stdin``), named ``what`` in errors (e.g. "--prompt-file")."""
    if stdin is not None and str(path) == "-":
        return read_stdin(stdin)
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot read {what} '{path}': {error.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what} '{path}' is not UTF-8 text (a binary file?); give a text file") from None


def read_stdin(stdin: TextIO) -> str:
    try:
        text = stdin.read()
        text.encode("utf-8")  # a C/POSIX locale decodes bytes that are not UTF-8 as lone surrogates
        return text
    except (UnicodeDecodeError, UnicodeEncodeError):
        raise UsageError("standard input is not UTF-8 text; pipe text, or give --prompt-file") from None


def text_value(value: Any, where: str, name: str) -> str:
    """A JSON field holding text: a string, or a non-empty list whose first item is one (Spec-Bench's
    ``turns``). Anything else (null, a number, an empty list) is refused rather than turned into "None"."""
    first = value[0] if isinstance(value, list) and value else value
    if not isinstance(first, str):
        raise UsageError(f"{where}: '{name}' must be text or a list of texts, got {value!r}")
    return first


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
    """A ``--plot`` file name matplotlib can write, in a folder that exists and is writable."""
    if path is None:
        return
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot '{path}': name a {', '.join(PLOT_SUFFIXES)} file (the suffix picks the format)")
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise UsageError(f"--plot '{path}': its folder '{folder}' does not exist or is not writable")


def subset(items: list, limit: int | None, shuffle: bool, seed: int) -> list:
    """``items`` shuffled with ``seed`` if asked, then cut to the first ``limit`` (shuffling comes first)."""
    items = list(items)
    if shuffle:
        random.Random(seed).shuffle(items)
    return items[:limit] if limit else items


def cache_dir() -> Path:
    """Where converted weights and measurements are cached: ``$SPECDEC_CACHE``, default ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def require_text(prompt: str) -> None:
    if not prompt.strip():
        raise UsageError("the prompt is empty; give some text to continue")


def write_cache_file(path: Path, text: str) -> None:
    """Write a cache entry; a failure (read-only home, full disk) only costs recomputing it next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        pass
