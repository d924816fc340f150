"""What every plot shares: a colour per verifier name that does not change when plugins come or go."""

from __future__ import annotations

import hashlib

# Tableau's ten colours, then their lighter halves: distinguishable, and readable in greyscale by shade.
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7")  # fmt: skip
_FIXED = {"optimum": "#000000", "none": "#555555"}
"""Rows that are not verifiers: the theoretical optimum and the target alone."""


def verifier_colour(name: str) -> str:
    """The colour of verifier ``name`` in every plot: from a hash of the name, so installing a plugin
    never recolours the others."""
    if name in _FIXED:
        return _FIXED[name]
    digest = hashlib.md5(name.encode(), usedforsecurity=False).hexdigest()  # a spread, not a secret
    return _PALETTE[int(digest, 16) % len(_PALETTE)]
