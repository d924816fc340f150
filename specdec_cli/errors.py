"""The errors specdec raises.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.base.errors`
"""

from .base.errors import *  # noqa: F403 (the names of that module's __all__)
from .base.errors import __all__  # noqa: F401
