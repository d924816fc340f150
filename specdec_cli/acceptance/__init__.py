"""`specdec acceptance`'s library side: the analysis (:mod:`.analysis`), its typed results
(:mod:`.results`) and their table, files and plot (:mod:`.report`)."""

from .analysis import AcceptanceAnalysis
from .results import OPTIMUM, AcceptanceReport, AcceptanceRequest, AcceptanceRow, Estimate, PromptAcceptance

__all__ = [
    "OPTIMUM",
    "AcceptanceAnalysis",
    "AcceptanceReport",
    "AcceptanceRequest",
    "AcceptanceRow",
    "Estimate",
    "PromptAcceptance",
]
