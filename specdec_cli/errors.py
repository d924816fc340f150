"""The one exception type for problems a user can fix.

The CLI turns a :class:`SpecdecError` into a single line on stderr and its exit code;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

USAGE_EXIT_CODE = 2
FAILURE_EXIT_CODE = 1


class SpecdecError(Exception):
    """A problem the user can fix; ``str(error)`` says what is wrong and how to fix it."""

    exit_code = FAILURE_EXIT_CODE


class UsageError(SpecdecError):
    """Bad input on the command line or in a recipe (exit code 2)."""

    exit_code = USAGE_EXIT_CODE


class RecipeError(UsageError):
    """A recipe that cannot be read or does not validate."""


class ModelLoadError(SpecdecError):
    """A model or tokenizer that cannot be found or used."""


class NonFiniteLogitsError(SpecdecError):
    """A model produced NaN or +inf logits; sampling from them would be meaningless."""
