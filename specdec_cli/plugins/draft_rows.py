"""The one rule for "which draft rows does a block verify, and are their laws identical".

A block verifies ``count`` draft rows at each position. Their laws are identical when every row is
sampled from the same model with the same sampling settings: SpecTr takes only such drafts, and
the optimum for identical drafts has a closed form. The engine (loaded drafts), bench's grid and
acceptance (recipes, before any model loads) all ask :meth:`DraftRows.of`, each giving one law key
per row; :func:`~specdec_cli.plugins.drafter_registry.draft_law` is the key of a recipe's draft,
``Draft.law`` of a loaded one.

Torch-free, so that reading a results folder or listing a grid stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DraftRows:
    """The draft rows of one position of a block."""

    count: int
    """Drafts per position: K rows of each draft config (0 for the target alone)."""
    identical_laws: bool
    """Every row is sampled from one law: one model under one set of sampling settings."""
    unjudged: tuple[str, ...] = ()
    """The drafters of rows that sample without reporting the laws a verifier may judge drafts by (``judged_laws``):
    not deterministic, and no ``reports_judged_laws``."""
    dependent: tuple[str, ...] = ()
    """The drafters whose K rows of one entry are not independent samples (:attr:`Drafter.independent_rows`: the model
    drafter's ``branch_after``, whose rows copy their first row's first tokens): a verifier takes them only where it
    declares ``dependent_drafts``."""

    @classmethod
    def of(cls, row_laws: Sequence[Hashable]) -> "DraftRows":
        """The rows whose laws are keyed by ``row_laws`` (one key per row; equal keys, equal laws)."""
        return cls(count=len(row_laws), identical_laws=len(set(row_laws)) <= 1)


def drafter_key(name: str, params: dict[str, Any]) -> Hashable:
    """A drafter and its parameters as one key: with the model and the sampling settings, what decides a draft's
    law (:func:`~specdec_cli.plugins.drafter_registry.draft_law` for a recipe's entry, ``Draft.law`` for a
    loaded one: the same drafter and parameters give equal keys in both)."""
    return name, json.dumps(params, sort_keys=True, default=repr)


def rows_per_config(deterministic: bool, num_drafts: int) -> int:
    """Rows a draft config fills: ``num_drafts`` samples, or one for a deterministic drafter (whose K
    samples would be one row K times)."""
    return 1 if deterministic else num_drafts


def every_config(
    config_laws: Sequence[Hashable],
    num_drafts: int,
    deterministic: Sequence[bool] = (),
    unjudged: Sequence[str] = (),
    dependent: Sequence[str] = (),
) -> DraftRows:
    """A block's rows: :func:`rows_per_config` of each draft config (how the engine drafts); ``deterministic``:
    one flag per config (none given: no config is); ``unjudged``, ``dependent``: :attr:`DraftRows.unjudged`,
    :attr:`DraftRows.dependent`."""
    flags = list(deterministic) or [False] * len(config_laws)
    rows = DraftRows.of(
        [law for law, single in zip(config_laws, flags) for _ in range(rows_per_config(single, num_drafts))]
    )
    return DraftRows(rows.count, rows.identical_laws, tuple(unjudged), tuple(dependent))


def round_robin(config_laws: Sequence[Hashable], num_drafts: int) -> DraftRows:
    """``num_drafts`` rows taken in turn from the draft configs (how ``acceptance`` counts K)."""
    return DraftRows.of([config_laws[k % len(config_laws)] for k in range(num_drafts)])
