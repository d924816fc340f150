"""The single-draft rule base (specdec_cli.plugins.single_draft.SingleDraftRule): a third-party rule written as its two
hooks only (the acceptance of x and the residual's weights) passes the author's kit, and its block law enumerates to
the output law of its conditional; a residual hook that breaks losslessness is caught (negative control)."""

from __future__ import annotations

import functools

import pytest
import torch

from specdec_cli.kit.conformance import ConformanceError, check_verifier
from specdec_cli.kit.testing import random_distributions
from specdec_cli.plugins.single_draft import SingleDraftRule
from specdec_cli.plugins.verifiers import Verifier


class RatioRule(SingleDraftRule):
    """Speculative sampling written from the two hooks alone, in plain torch (no helper of laws.py)."""

    name = "ratio-rule"
    lossless = True
    batches_by_vmap = True

    def acceptance(self, target_probs, draft_probs, x):
        ratio = target_probs.gather(-1, x) / draft_probs.gather(-1, x).clamp_min(1e-30)  # [..., k]
        return ratio.clamp(max=1.0)  # [..., k]

    def residual_weights(self, target_probs, draft_probs, x):
        excess = (target_probs - draft_probs).clamp_min(0)  # [..., V]
        return torch.where(excess.sum(-1, keepdim=True) > 0, excess, target_probs)  # [..., V]


class LenientRule(SingleDraftRule):
    """A lossy rule: accepts x with min(1, 2 q(x) / p(x)) and otherwise draws from q itself, which may give x back
    (a rejection still ends the block there)."""

    name = "lenient-rule"
    lossless = False
    batches_by_vmap = True

    def acceptance(self, target_probs, draft_probs, x):
        return (2 * target_probs.gather(-1, x) / draft_probs.gather(-1, x).clamp_min(1e-30)).clamp(max=1.0)

    def residual_weights(self, target_probs, draft_probs, x):
        return target_probs  # [..., V]


class ResidualOfTarget(RatioRule):
    """Negative control: after a rejection it draws from q, not from (q − p)+, and still calls itself lossless."""

    name = "residual-of-target"

    def residual_weights(self, target_probs, draft_probs, x):
        return target_probs  # [..., V]


@pytest.mark.parametrize("cls", [RatioRule, LenientRule])
def test_a_rule_written_as_its_two_hooks_passes_the_kit(cls):
    report = check_verifier(cls, samples=1000)
    assert any("block law" in check for check in report.checks), report.checks


def _enumerated(rule, block_law, target, draft) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Over every draft token x ~ p at one position (target ``[2, V]``, draft ``[1, V]``): (the output token's law
    from ``block_law``, the mass that ends there plus the accepted mass on x; Σ_x p(x) conditional(x); the accepted
    mass)."""
    vocab = target.shape[-1]
    from_block, from_conditional, accepted = torch.zeros(vocab, dtype=torch.float64), 0.0, 0.0
    for x in range(vocab):
        law = block_law(target.unsqueeze(0), draft.unsqueeze(0), torch.tensor([[x]]))  # [1, 2, V]
        kept = float(law[0, 1].sum())  # the block went past position 0 with x
        from_block += draft[0, x] * (law[0, 0] + kept * torch.eye(vocab, dtype=torch.float64)[x])
        from_conditional += draft[0, x] * rule.conditional(target[0], draft, torch.tensor([x]))  # [V]
        accepted += float(draft[0, x]) * kept
    return from_block, from_conditional, accepted


@pytest.mark.parametrize("cls", [RatioRule, LenientRule])
def test_the_block_law_enumerates_to_the_conditional(cls):
    """The block law's output token follows the conditional's law, and its accepted mass is acceptance_probability.
    Negative control: the walk over the conditional (Verifier.block_law), which goes on wherever the output equals
    the draft token, accepts more than the lenient rule, whose residual can give x back."""
    rule, generator, extra = cls(), torch.Generator().manual_seed(3), []
    for vocab in (3, 5, 8):
        target, draft = (random_distributions(generator, shape).double() for shape in ((2, vocab), (1, vocab)))
        target, draft = target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)  # exact laws
        from_block, from_conditional, accepted = _enumerated(rule, rule.block_law, target, draft)
        torch.testing.assert_close(from_block, from_conditional, rtol=0, atol=1e-12)
        assert float(rule.acceptance_probability(target[0], draft)) == pytest.approx(accepted, abs=1e-12)
        extra.append(_enumerated(rule, functools.partial(Verifier.block_law, rule), target, draft)[2] - accepted)
    assert (max(extra) > 1e-3) == (cls is LenientRule), extra


def test_a_residual_hook_that_breaks_losslessness_is_caught():
    with pytest.raises(ConformanceError, match="declares lossless, but its block's output law differs"):
        check_verifier(ResidualOfTarget, samples=300)
