"""Counting a verifier's device reads and capturing it in a CUDA graph, public for plugin authors.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.engine.device_path`
"""

from .engine.device_path import *  # noqa: F403 (the names of that module's __all__)
from .engine.device_path import __all__  # noqa: F401
