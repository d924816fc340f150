"""Long waits, said while they last.

Library code names each wait that can run past a couple of seconds (converting weights, loading a model,
measuring the machine, compiling model steps) with :func:`waiting`; whoever listens says it (the CLI, on stderr:
:func:`specdec_cli.commands.common.say_long_waits`). With no one listening nothing is said: the library itself
prints nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

__all__ = ["Listener", "listen", "listening", "waiting"]

Listener = Callable[[str], AbstractContextManager[None]]
"""listener(what) → a context that says ``what`` while the wait it encloses lasts."""

_listeners: list[Listener] = []


@contextmanager
def waiting(what: str) -> Iterator[None]:
    """The block is a wait that can run past a couple of seconds, doing ``what`` (a phrase: "converting the GGUF
    weights once …"), said by the latest listener."""
    if not _listeners:
        yield
        return
    with _listeners[-1](what):
        yield


def listen(listener: Listener) -> None:
    """``listener`` says every wait from now on, until another listens (the CLI's, for the whole run)."""
    _listeners.append(listener)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """``listener`` says the waits within the block (a test; a program that embeds the library)."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
