"""The law helpers the built-in verifiers are made of, public for plugin authors.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.plugins.laws`
"""

from .plugins.laws import *  # noqa: F403 (the names of that module's __all__)
from .plugins.laws import __all__  # noqa: F401
