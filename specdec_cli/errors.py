"""The errors specdec raises.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.base.errors`
"""

from __future__ import annotations

from .base.errors import (
    FAILURE_EXIT_CODE,
    USAGE_EXIT_CODE,
    ModelLoadError,
    NonFiniteLogitsError,
    RecipeError,
    SpecdecError,
    UsageError,
    is_allocation_error,
    requested_memory,
)

__all__ = [
    "FAILURE_EXIT_CODE",
    "ModelLoadError",
    "NonFiniteLogitsError",
    "RecipeError",
    "SpecdecError",
    "USAGE_EXIT_CODE",
    "UsageError",
    "is_allocation_error",
    "requested_memory",
]
