# ruff: noqa: E402  (imports placed where the timing and the patches need them)
"""specdec generate with the calibration's load reading set to a busy CPU (load 3.0 on 2 cores),
as tests/test_threads.py does: the run's own wall time from start to end, printed to stderr."""

import sys
import time

started = time.monotonic()
from specdec_cli.generation import calibration

calibration.cpu_load = lambda: calibration.CpuLoad(3.0, 2)
from specdec_cli.cli import main

try:
    main(sys.argv[1:])
finally:
    print(f"WALL {time.monotonic() - started:.1f}", file=sys.stderr)
