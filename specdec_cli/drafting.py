"""The drafter contract, where plugin authors import it.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.plugins.drafting`
"""

from .plugins.drafting import *  # noqa: F403 (the names of that module's __all__)
from .plugins.drafting import __all__  # noqa: F401
