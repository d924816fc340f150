"""The one exception type for problems a user can fix.

The CLI turns a :class:`SpecdecError` into a single line on stderr and its exit code;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import re

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


def is_allocation_error(error: BaseException) -> bool:
    """Whether ``error`` is an allocator refusing memory (CUDA, the CPU's, MPS, or Python's own)."""
    import torch  # here: this module is imported before torch is (the CLI's fast paths never load it)

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(s in message for s in ("can't allocate memory", "out of memory"))


def requested_memory(error: BaseException) -> str:
    """`` (N GiB requested)`` from an allocator's message, or nothing when it does not say."""
    found = re.search(r"[Tt]ried to allocate ([\d.]+) ?(bytes|[KMGT]i?B)", str(error))
    if found is None:
        return ""
    amount, unit = found.groups()
    return f" ({int(amount) / 2**30:.2f} GiB requested)" if unit == "bytes" else f" ({amount} {unit} requested)"
