"""The early-exit drafter: the target's own first N layers (its final norm and head kept) draft.

Self-speculative decoding without a second checkpoint (Zhang et al., "Draft & Verify", ACL 2024,
draft by skipping layers; here the skipped layers are the last ones, as in LayerSkip, Elhoushi et al.,
ACL 2024, without its training). A draft entry ``early_exit: N`` is ``{drafter: early-exit, params:
{layers: N}}``; the layers' weights are the target's, shared, not copied. ``branch_after`` drafts a block's first
tokens once before the rows branch, as the model drafter's does (docs/drafters.md, "Delayed branching").
"""

from __future__ import annotations

from typing import Annotated

from .model_drafter import BranchAfter, ModelDrafter


class EarlyExitDrafter(ModelDrafter):
    """The target's first N layers (the entry's ``early_exit: N``) sample each row's tokens."""

    name = "early-exit"

    def __init__(
        self,
        *,
        layers: Annotated[int, "the target's first decoder layers that draft (early_exit: N)"],
        branch_after: BranchAfter = 0,
    ):
        if layers < 1:  # a whole number: the base class checked the type
            raise ValueError(f"early-exit: layers must be a whole number >= 1 (target layers), got {layers!r}")
        super().__init__(branch_after=branch_after)
        self.layers = layers

    def entry_problem(self, entry):
        if entry.model is not None:
            return "the early-exit drafter drafts with the target's own layers; remove 'model' from the entry"
        return None

    def load_model(self, pool, entry, target):
        return pool.early_exit(target, self.layers)
