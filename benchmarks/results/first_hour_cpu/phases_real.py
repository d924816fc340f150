# ruff: noqa: E402  (imports placed where the timing and the patches need them)
"""generate under a simulated busy load reading, with the time each phase starts and ends."""

import sys
import time
from contextlib import contextmanager

t0 = time.monotonic()


def stamp(text):
    print(f"[{time.monotonic() - t0:6.1f}] {text}", file=sys.stderr, flush=True)


from specdec_cli.base import waits


@contextmanager
def said(what):
    stamp("begin " + what[:60])
    yield
    stamp("end   " + what[:60])


from specdec_cli.engine.decoder import SpeculativeDecoder

original = SpeculativeDecoder.warm_up


def warm_up(self, *a, **k):
    with said("warm-up"):
        return original(self, *a, **k)


SpeculativeDecoder.warm_up = warm_up
stamp("imported")
from specdec_cli.cli import main

with waits.listening(said):
    try:
        main(sys.argv[1:])
    finally:
        stamp("done")
