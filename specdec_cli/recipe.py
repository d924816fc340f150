"""Recipes and DecodingConfig, for library users who build recipes in code.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.base.recipe`
"""

from .base.recipe import *  # noqa: F403 (the names of that module's __all__)
from .base.recipe import __all__  # noqa: F401
