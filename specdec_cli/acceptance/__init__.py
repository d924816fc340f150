"""`specdec acceptance`'s library side: the analysis (:mod:`.analysis`), its typed results
(:mod:`.results`) and their table, files and plot (:mod:`.report`).

Names are imported on first use, so the results and the report can be read without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AcceptanceAnalysis": "analysis",
    **{
        name: "results"
        for name in (
            "OPTIMUM",
            "AcceptanceReport",
            "AcceptanceRequest",
            "AcceptanceRow",
            "DrafterSection",
            "Estimate",
            "PromptAcceptance",
        )
    },
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
