"""The plugin author's kit: tiny models, exact laws, statistical checks and the conformance checks.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.kit.testing`
- :mod:`specdec_cli.kit.conformance`
"""

from .kit.conformance import *  # noqa: F403 (the names of that module's __all__)
from .kit.conformance import __all__ as _conformance
from .kit.testing import *  # noqa: F403 (the names of that module's __all__)
from .kit.testing import __all__ as _testing

__all__ = [*_testing, *_conformance]
