"""Progress and long waits on stderr: a bar counted in tokens on a terminal (a line every half minute off it), and
the CLI's listener for the library's waits (:mod:`specdec_cli.base.waits`), which importing this module installs."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.file_proxy import FileProxy
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..base import waits


class TokenProgress:
    """A progress bar counted in tokens, so its ETA moves within a long sample (a prompt's worth of
    tokens at a time would leave it blank for minutes)."""

    def __init__(self, progress: Progress | None, task: int | None):
        self._progress, self._task = progress, task

    def advance(self, tokens: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, tokens)

    def describe(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)


class PlainProgress(TokenProgress):
    """Off a terminal (a log, a pipe) a bar cannot redraw, and a long run said nothing for its whole length: one line
    at most every :data:`PLAIN_PROGRESS_EVERY_S` seconds instead, with the tokens done, the time and an ETA."""

    def __init__(self, label: str, total: int, completed: int, clock: Callable[[], float] = time.monotonic):
        super().__init__(None, None)
        self.label, self.total, self.done, self.clock = label, total, completed, clock
        self.start_done, self.start = completed, clock()
        self.last = self.start

    def advance(self, tokens: int) -> None:
        self.done += tokens
        now = self.clock()
        if now - self.last < PLAIN_PROGRESS_EVERY_S:
            return
        self.last = now
        rate = (self.done - self.start_done) / (now - self.start)
        eta = f"ETA {_minutes(max(self.total - self.done, 0) / rate)}" if rate > 0 else "ETA unknown"
        sys.stderr.write(
            f"{self.label}: {self.done}/{self.total} tokens, {_minutes(now - self.start)} elapsed, {eta}\n"
        )
        sys.stderr.flush()

    def describe(self, text: str) -> None:
        self.label = text


PLAIN_PROGRESS_EVERY_S = 30.0


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


@contextmanager
def token_progress(
    total: int, enabled: bool = True, completed: int = 0, label: str = "generating"
) -> Iterator[TokenProgress]:
    """A :class:`TokenProgress` on stderr (transient on a terminal; off it, a :class:`PlainProgress`); disabled, one
    that does nothing."""
    if not enabled:
        yield TokenProgress(None, None)
        return
    if not sys.stderr.isatty():
        yield PlainProgress(label, total, completed)
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        yield TokenProgress(progress, progress.add_task(label, total=total, completed=completed))


WAIT_SAID_AFTER_S = 2.0
"""A wait is said once it has lasted this long; a shorter one passes in silence (a cached model loads in a second,
and a line for each would bury the waits that matter)."""


@dataclass(eq=False)
class _Wait:
    """One wait said by :class:`LongWaitsOnStderr` (each its own, though two may say the same)."""

    what: str
    ended: bool = False


@dataclass
class LongWaitsOnStderr:
    """The CLI's listener (:mod:`specdec_cli.base.waits`): a wait that lasts past ``after_s`` is said on stderr. On a
    terminal, a transient spinner with the innermost wait's text (none while a status or progress bar of the command
    holds the terminal's last line: it says what is going on); off it, one line, once per text in a run (a compile
    said at each new shape would repeat it)."""

    console: Console = field(default_factory=lambda: Console(stderr=True))
    after_s: float = WAIT_SAID_AFTER_S
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _due: list[_Wait] = field(default_factory=list, init=False)
    """The waits being said, innermost last."""
    _said: set[str] = field(default_factory=set, init=False)
    _status: Any = field(default=None, init=False)
    """The spinner while one shows (a rich Status)."""

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        wait = _Wait(what)
        timer = threading.Timer(self.after_s, self._say, [wait])
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            with self._lock:
                wait.ended = True
                if wait in self._due:
                    self._due.remove(wait)
                    self._show()

    def _say(self, wait: _Wait) -> None:
        with self._lock:
            if wait.ended:  # the timer fired as the wait ended
                return
            self._due.append(wait)
            if self.console.is_terminal:
                self._show()
            elif wait.what not in self._said:
                self._said.add(wait.what)
                self.console.print(f"{wait.what}…", highlight=False, soft_wrap=True)

    def _show(self) -> None:
        """The spinner says the innermost wait due (under the lock); gone when none is."""
        if not self.console.is_terminal:
            return
        if not self._due:
            if self._status is not None:
                self._status.stop()
                self._status = None
        elif self._status is not None:
            self._status.update(f"{self._due[-1].what}…")
        elif not isinstance(sys.stderr, FileProxy):  # else the command's own live display holds the last line
            self._status = self.console.status(f"{self._due[-1].what}…")
            self._status.start()


waits.listen(LongWaitsOnStderr())  # the commands say the library's long waits: this module is the CLI's own
