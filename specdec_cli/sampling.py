"""Logits to law and the sampler, public for plugin authors.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.base.sampling`
"""

from .base.sampling import *  # noqa: F403 (the names of that module's __all__)
from .base.sampling import __all__  # noqa: F401
