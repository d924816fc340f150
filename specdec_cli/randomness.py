"""Keyed randomness (Draws, streams), public for plugin authors.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.base.randomness`
"""

from .base.randomness import *  # noqa: F403 (the names of that module's __all__)
from .base.randomness import __all__  # noqa: F401
