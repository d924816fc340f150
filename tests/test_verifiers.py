"""Every built-in verifier, checked by exact enumeration on tiny vocabularies (docs/verifiers.md §1-7)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specdec_cli.base.errors import UsageError
from specdec_cli.kit.testing import (
    adversarial_distribution_pairs,
    candidate_acceptance,
    enumerate_output_law,
    optimal_acceptance,
    random_distributions,
)
from specdec_cli.plugins.registry import load_verifier
from specdec_cli.plugins.verifiers import BlockVerifier, Verifier, device_path
from specdec_plugins._importance_parts import Problems

LOSSLESS = ["speculative", "specinfer", "spectr", "is-lp", "is-truncated", "match"]
MULTI_DRAFT = ["specinfer", "spectr", "is-lp", "is-truncated"]


def _drafts_for(name: str, target: torch.Tensor, draft: torch.Tensor, num_drafts: int, generator) -> list:
    """Identical drafts always; for schemes that allow it, also drafts with different laws."""
    cases = [draft.expand(num_drafts, -1)]
    if name != "spectr" and num_drafts > 1:
        others = random_distributions(generator, (num_drafts - 1, len(draft)))
        cases.append(torch.cat([draft.unsqueeze(0), others]))
    return cases


def _cases(vocab: int, count: int = 6):
    generator = torch.Generator().manual_seed(vocab)
    random = [tuple(random_distributions(generator, (2, vocab))) for _ in range(count)]
    return random + adversarial_distribution_pairs(vocab), generator


@pytest.mark.parametrize("name", LOSSLESS + ["mentored-kl0", "is-truncated-tiny-alphabet", "is-truncated-by-mass"])
@pytest.mark.parametrize("vocab", [2, 3, 4, 6])
def test_lossless_output_law_is_the_target(name, vocab):
    verifier = _verifier(name)
    cases, generator = _cases(vocab)
    max_drafts = verifier.max_drafts or 3
    for num_drafts in range(1, max_drafts + 1):
        if vocab == 6 and num_drafts == 3 and name.startswith("is-"):
            continue  # 216 tuples × an LP each round: covered at smaller vocabularies
        for target, draft in cases:
            for drafts in _drafts_for(verifier.name, target, draft, num_drafts, generator):
                law = enumerate_output_law(verifier, target, drafts)
                torch.testing.assert_close(law, target, rtol=0, atol=1e-9)


def _verifier(name: str):
    if name == "mentored-kl0":
        return load_verifier("mentored", {"kl": 0.0})
    if name == "is-truncated-tiny-alphabet":
        return load_verifier("is-truncated", {"s": 1, "alphabet": 2})
    if name == "is-truncated-by-mass":
        return load_verifier("is-truncated", {"s": 2, "alphabet_mass": 0.6})
    return load_verifier(name)


@pytest.mark.parametrize("name", ["speculative", "specinfer", "spectr", "mentored"])
@pytest.mark.parametrize("num_drafts", [1, 2, 3])
def test_closed_form_acceptance_is_exact(name, num_drafts):
    verifier = load_verifier(name, {"kl": 0.1} if name == "mentored" else {})
    if verifier.max_drafts is not None and num_drafts > verifier.max_drafts:
        pytest.skip("single-draft verifier")
    cases, generator = _cases(4)
    for target, draft in cases:
        for drafts in _drafts_for(name, target, draft, num_drafts, generator):
            enumerated = candidate_acceptance(verifier, target, drafts)
            assert float(verifier.acceptance_probability(target, drafts)) == pytest.approx(enumerated, abs=1e-9)


@pytest.mark.parametrize("name", ["is-lp", "is-truncated"])
def test_importance_sampling_acceptance_is_a_lower_bound(name):
    verifier = load_verifier(name)
    cases, generator = _cases(4)
    for target, draft in cases:
        for drafts in _drafts_for(name, target, draft, 2, generator):
            reported = float(verifier.acceptance_probability(target, drafts))
            assert 0 <= reported <= candidate_acceptance(verifier, target, drafts) + 1e-9


@pytest.mark.parametrize("name", MULTI_DRAFT + ["mentored-kl0", "is-truncated-tiny-alphabet"])
def test_one_draft_reduces_to_speculative_sampling(name):
    verifier, speculative = _verifier(name), load_verifier("speculative")
    cases, _ = _cases(5)
    for target, draft in cases:
        drafts = draft.unsqueeze(0)
        for x in torch.nonzero(draft).flatten():
            torch.testing.assert_close(
                verifier.conditional(target, drafts, x.view(1)), speculative.conditional(target, drafts, x.view(1))
            )
        torch.testing.assert_close(
            verifier.acceptance_probability(target, drafts), speculative.acceptance_probability(target, drafts)
        )


# --------------------------------------------------------------------------- optimality (Khisti et al.)


def _brute_force_optimum(target: torch.Tensor, draft: torch.Tensor, exponent: int = 2) -> float:
    """Theorem 3 by enumeration of subsets: 1 + min_S [q(S) - p(S)^K]."""
    vocab = len(target)
    best = 0.0
    for mask in itertools.product([0, 1], repeat=vocab):
        chosen = torch.tensor(mask, dtype=torch.bool)
        best = min(best, float(target[chosen].sum() - draft[chosen].sum() ** exponent))
    return 1 + best


@pytest.mark.parametrize("vocab", [2, 3, 5, 6])
def test_optimum_prefix_formula_matches_subset_enumeration(vocab):
    cases, _ = _cases(vocab, count=20)
    for target, draft in cases:
        for exponent in (2, 3):
            assert float(optimal_acceptance(target, draft, exponent)) == pytest.approx(
                _brute_force_optimum(target, draft, exponent), abs=1e-12
            )


@pytest.mark.parametrize("vocab", [3, 4, 5])
def test_is_lp_reaches_theorem_3_and_no_scheme_exceeds_it(vocab):
    cases, _ = _cases(vocab, count=10)
    verifiers = {name: load_verifier(name) for name in MULTI_DRAFT}
    for target, draft in cases:
        drafts = draft.expand(2, -1)
        optimum = float(optimal_acceptance(target, draft, 2))
        reached = {name: candidate_acceptance(v, target, drafts) for name, v in verifiers.items()}
        assert float(verifiers["is-lp"].acceptance_probability(target, drafts)) == pytest.approx(optimum, abs=1e-7)
        for name, value in reached.items():
            assert value <= optimum + 1e-7, name


@pytest.mark.parametrize("q2", [1 / 9, 0.2, 1 / 3, 0.45, 5 / 9])
def test_example_1_of_the_multi_draft_paper(q2):
    """p uniform on 3 tokens, q = (1/3, q2, 2/3 - q2): acceptance 1 for q2 in [1/9, 5/9] (Figure 2)."""
    draft = torch.full((3,), 1 / 3, dtype=torch.float64)
    target = torch.tensor([1 / 3, q2, 2 / 3 - q2], dtype=torch.float64)
    drafts = draft.expand(2, -1)
    assert float(optimal_acceptance(target, draft, 2)) == pytest.approx(1.0, abs=1e-12)
    assert candidate_acceptance(load_verifier("is-lp"), target, drafts) == pytest.approx(1.0, abs=1e-7)
    for name in ("spectr", "specinfer"):
        reached = candidate_acceptance(load_verifier(name), target, drafts)
        assert (reached == pytest.approx(1.0, abs=1e-9)) == (abs(q2 - 1 / 3) < 1e-12), name


def test_example_1_outside_the_interval_is_below_one():
    draft = torch.full((3,), 1 / 3, dtype=torch.float64)
    target = torch.tensor([1 / 3, 0.05, 2 / 3 - 0.05], dtype=torch.float64)
    assert float(optimal_acceptance(target, draft, 2)) < 1 - 1e-3


@pytest.mark.parametrize("s", [1, 2, 3])
def test_is_truncated_meets_its_bound(s):
    """P_trunc ≥ P* − Σ_{ranked below s} (q_i − p_i²)+  (Khisti et al. §4), identical drafts."""
    cases, _ = _cases(6, count=15)
    verifier = load_verifier("is-truncated", {"s": s, "alphabet": 6, "alphabet_mass": 1.0})
    for target, draft in cases:
        score = target - draft**2
        below = score.sort(descending=True).values[s:]
        bound = float(optimal_acceptance(target, draft, 2)) - float(below.clamp_min(0).sum())
        assert float(verifier.acceptance_probability(target, draft.expand(2, -1))) >= bound - 1e-7


def test_is_truncated_alphabet_is_the_smallest_top_set_reaching_its_mass():
    target = torch.tensor([[0.15, 0.0, 0.5, 0.05, 0.3]], dtype=torch.float64)  # [1, V], not in order

    def alphabet(**params) -> list[int]:
        inside = load_verifier("is-truncated", params).alphabet_mask(target)
        return torch.nonzero(target[0] > 0 if inside is None else inside[0]).flatten().tolist()

    by_mass = {mass: len(alphabet(alphabet_mass=mass)) for mass in (0.4, 0.5, 0.8, 0.9, 0.99, 1.0)}
    assert by_mass == {0.4: 1, 0.5: 1, 0.8: 2, 0.9: 3, 0.99: 4, 1.0: 4}  # never a zero-mass token
    assert alphabet(alphabet_mass=0.8) == [2, 4]  # the most likely tokens
    assert alphabet(alphabet_mass=1.0, alphabet=2) == [2, 4]
    with pytest.raises(ValueError, match="alphabet_mass must be in"):
        load_verifier("is-truncated", {"alphabet_mass": 0})


@pytest.mark.parametrize("vocab", [6, 60])
def test_is_truncated_never_accepts_less_than_one_draft(vocab):
    """With identical drafts the tail mixture keeps p_I = p (λ = 0), so two drafts accept at least what one
    does, also for drafts close to the target, where §4's ranked tail alone often falls far below (the
    negative control: tests/test_importance_device.py, λ forced to 1)."""
    generator = torch.Generator().manual_seed(vocab)
    verifier = load_verifier("is-truncated")
    for closeness in [0.3] * 8 + [1.0, 3.0]:
        logits = torch.randn(vocab, generator=generator, dtype=torch.float64) * 2.5
        target = logits.softmax(-1)
        draft = (logits + closeness * torch.randn(vocab, generator=generator, dtype=torch.float64)).softmax(-1)
        one = float(torch.minimum(target, draft).sum())
        assert float(verifier.acceptance_probability(target, draft.expand(2, -1))) >= one - 1e-9
        assert float(verifier.acceptance_probability(target, draft.expand(4, -1))) >= one - 1e-9


def test_is_truncated_with_a_full_alphabet_accepts_at_least_the_fixed_one():
    """The fixed 40-token alphabet caps the scheme's acceptance at q(O) (there the position falls back to
    SpecInfer); the adaptive one loses at most 1 - alphabet_mass."""
    generator = torch.Generator().manual_seed(7)
    target, draft = random_distributions(generator, (2, 400), sparsity=0.0)
    target = (target.log() * 0.5).softmax(-1)  # flat: the top 40 tokens hold well under all of q
    drafts = draft.expand(2, -1)
    fixed = float(
        load_verifier("is-truncated", {"alphabet": 40, "alphabet_mass": 1.0}).acceptance_probability(target, drafts)
    )
    adaptive = float(load_verifier("is-truncated").acceptance_probability(target, drafts))
    optimum = float(optimal_acceptance(target, draft, 2))
    top40 = float(target.sort(descending=True).values[:40].sum())
    plan = load_verifier("is-truncated", {"alphabet": 40, "alphabet_mass": 1.0}).plan(
        Problems.independent(target[None], drafts[None], torch.zeros(1, 2, dtype=torch.long))
    )
    assert float(plan.inside_mass.squeeze() * plan.scheme.acceptance) <= top40 + 1e-9 < adaptive
    assert fixed <= adaptive + 1e-9
    assert adaptive <= optimum + 1e-9


# --------------------------------------------------------------------------- mentored decoding


def _kl(target: torch.Tensor, law: torch.Tensor) -> float:
    support = target > 0
    return float((target[support] * (target[support] / law[support]).log()).sum())


def _mentored_optimum(target, draft, bound) -> float:
    """max Σ p_i r_i s.t. KL(q ‖ p∘r + σ) ≤ D, 0 ≤ r ≤ 1, σ ≥ 0, Σσ = 1 − Σ p r: scipy SLSQP."""
    import numpy as np
    from scipy.optimize import minimize

    q, p = target.numpy(), draft.numpy()
    vocab = len(q)

    def output(z):
        return p * z[:vocab] + z[vocab:]

    constraints = [
        {"type": "eq", "fun": lambda z: z[vocab:].sum() - (1 - (p * z[:vocab]).sum())},
        {"type": "ineq", "fun": lambda z: bound - float((q * np.log(q / np.maximum(output(z), 1e-300))).sum())},
    ]
    start = np.concatenate([np.minimum(1, q / p), np.maximum(q - p, 0)])
    result = minimize(
        lambda z: -(p * z[:vocab]).sum(),
        start,
        method="SLSQP",
        constraints=constraints,
        bounds=[(0, 1)] * vocab + [(0, 1)] * vocab,
        options={"ftol": 1e-12, "maxiter": 500},
    )
    return -result.fun


@pytest.mark.parametrize("bound", [0.01, 0.05, 0.2])
def test_mentored_meets_its_kl_bound_exactly_with_optimal_acceptance(bound):
    """KL(q ‖ output) = D exactly (enumerated output law) and no rule within D accepts more (SLSQP)."""
    generator = torch.Generator().manual_seed(11)
    verifier = load_verifier("mentored", {"kl": bound})
    for _ in range(6):
        target, draft = random_distributions(generator, (2, 5), sparsity=0.0)
        law = enumerate_output_law(verifier, target, draft.unsqueeze(0))
        divergence = _kl(target, law)
        assert float(verifier.output_kl(target, draft.unsqueeze(0))) == pytest.approx(divergence, abs=1e-12)
        acceptance = float(verifier.acceptance_probability(target, draft.unsqueeze(0)))
        if _kl(target, draft) <= bound:
            assert acceptance == pytest.approx(1.0)
            continue
        assert divergence == pytest.approx(bound, rel=1e-9)
        assert acceptance == pytest.approx(_mentored_optimum(target, draft, bound), abs=1e-6)


@pytest.mark.parametrize("vocab", [2, 50, 4000])
def test_mentored_solves_kl_equals_d_to_rounding_at_any_vocabulary(vocab):
    """The one-sort solve hits D to 1e-9 relative across bounds spanning 1e-6..2 nats, peaked or flat laws.

    KL is recomputed here from α and β by the proof's output law, independently of the solver's sums.
    """
    generator = torch.Generator().manual_seed(vocab)
    verifier = load_verifier("mentored", {"kl": 0.0})
    checked = 0
    for sharpness in (1.0, 3.0):
        target, draft = random_distributions(generator, (2, vocab), sparsity=0.0)
        target = (target.log() * sharpness).softmax(-1)
        for bound in (1e-6, 1e-3, 0.05, 0.5, 2.0):
            if bound >= _kl(target, draft):
                continue
            verifier.kl = bound
            solution = verifier.solve(target, draft.unsqueeze(0))
            ratio = target / draft
            output = torch.where(
                ratio <= solution.alpha,
                target / solution.alpha,
                torch.where(ratio >= solution.beta, target / solution.beta, draft),
            )
            assert float(output.sum()) == pytest.approx(1.0, abs=1e-12)
            assert _kl(target, output) == pytest.approx(bound, rel=1e-9)
            # Negative control: the old bisection's band (D ± 0.1 %) would fail this check.
            assert _kl(target, output) != pytest.approx(bound * (1 + 1e-3), rel=1e-9)
            checked += 1
    assert checked >= 4


def test_mentored_accepts_draft_tokens_the_target_rules_out_when_the_bound_allows():
    """p on a token q rules out (top-k or top-p on the target): below α = 0+ those tokens share the
    rejection, so the bound is still met exactly. q = (½, ½, 0), p = (0.3, 0.3, 0.4): both live
    tokens sit above β, KL = -ln(0.6 + ρ), and D = 0.1 gives 1 - R = e^-0.1 - 0.6. Rejecting all
    of token 3 (the threshold form with α > 0) would stop at R = 0.6 with KL = 0.
    """
    verifier = load_verifier("mentored", {"kl": 0.1})
    target = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    drafts = torch.tensor([[0.3, 0.3, 0.4]], dtype=torch.float64)
    assert float(verifier.acceptance_probability(target, drafts)) == pytest.approx(1.6 - math.exp(-0.1), rel=1e-12)
    law = enumerate_output_law(verifier, target, drafts)
    assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
    assert _kl(target, law) == pytest.approx(0.1, rel=1e-9)


@pytest.mark.parametrize("max_set_steps", [1, None])
def test_mentored_is_exact_on_sparse_laws_and_from_the_sorted_table(monkeypatch, max_set_steps):
    """Zero-q tokens, p = 0 < q tokens and bounds from 1e-6 to 1 nat: KL(q ‖ output) = D wherever
    D < KL(q ‖ p) and the root is representable. With one set step no row settles, so the same
    answers must come from the sorted-table fallback."""
    from specdec_plugins import _mentored_sets as mentored_sets

    if max_set_steps:
        monkeypatch.setattr(mentored_sets, "_MAX_SET_STEPS", max_set_steps)
        monkeypatch.setattr(mentored_sets._Groups, "same_groups", lambda *_: False)
    generator = torch.Generator().manual_seed(21)
    checked = 0
    for vocab in (3, 40, 3000):
        target = random_distributions(generator, (8, vocab), sparsity=0.3)
        draft = random_distributions(generator, (8, vocab), sparsity=0.1)
        for bound in (1e-6, 1e-3, 0.1, 1.0):
            verifier = load_verifier("mentored", {"kl": bound})
            solution = verifier.solve(target, draft.unsqueeze(-2))
            full = torch.tensor(
                [_kl(t, d) if (d[t > 0] > 0).all() else math.inf for t, d in zip(target, draft)], dtype=torch.float64
            )
            exact = (full > bound) & (solution.rejected_mass.squeeze(-1) > 1e-290)  # [8]
            assert torch.allclose(
                solution.kl.squeeze(-1)[exact], torch.full_like(full[exact], bound), rtol=1e-9, atol=0
            )
            assert (solution.rejected_mass.squeeze(-1)[full <= bound] == 0).all()
            checked += int(exact.sum())
    assert checked >= 40


def test_mentored_acceptance_grows_with_the_bound_and_zero_is_speculative():
    generator = torch.Generator().manual_seed(5)
    target, draft = random_distributions(generator, (2, 6))
    drafts = draft.unsqueeze(0)
    values = [
        float(load_verifier("mentored", {"kl": d}).acceptance_probability(target, drafts))
        for d in (0.0, 0.01, 0.05, 0.1, 0.5, 5.0)
    ]
    assert values == sorted(values)
    assert values[0] == pytest.approx(float(torch.minimum(target, draft).sum()), abs=1e-12)
    assert values[-1] == pytest.approx(1.0) or math.isinf(_kl(target, draft))


@pytest.mark.parametrize("kl", [-1, math.inf, math.nan])
def test_mentored_rejects_bad_parameters(kl):
    with pytest.raises(ValueError, match="kl must be a finite number >= 0"):
        load_verifier("mentored", {"kl": kl})
    with pytest.raises(UsageError, match=r"valid parameters: kl, divergence \(given"):
        load_verifier("mentored", {"kll": 0.1})


# --------------------------------------------------------------------------- capability flags


class _ConditionalOnly(Verifier):
    """A token-level plugin that writes only the law: every draw is the base class's own."""

    name, lossless, max_drafts = "conditional-only", True, 1

    def conditional(self, target_probs, draft_probs, draft_tokens):
        return target_probs

    def acceptance_probability(self, target_probs, draft_probs):
        return target_probs.sum(-1)


def test_the_weaker_flags_follow_from_the_stronger_and_from_what_a_plugin_overrides():
    class Selects(_ConditionalOnly):
        def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
            raise NotImplementedError

    class Maps(BlockVerifier):
        name, lossless, max_drafts, batches_by_vmap = "maps", True, 1, True

    class Unkeyed(Maps):
        keyed_randomness = False

    assert _ConditionalOnly.keyed_randomness and not _ConditionalOnly.capturable
    assert not Selects.keyed_randomness  # it may draw in its own select: handed a generator
    assert Maps.capturable and Maps.keyed_randomness
    assert Unkeyed.capturable and not Unkeyed.keyed_randomness  # a flag a class sets is kept
    assert not (BlockVerifier.keyed_randomness or BlockVerifier.capturable or BlockVerifier.batches_by_vmap)


# --------------------------------------------------------------------------- sampling and batching


@pytest.mark.parametrize("name", LOSSLESS + ["mentored"])
def test_select_samples_the_conditional_law(name):
    from scipy.stats import chisquare

    verifier = load_verifier(name, {"kl": 0.2} if name == "mentored" else {})
    num_drafts = 1 if verifier.max_drafts == 1 else 2
    target = torch.tensor([0.1, 0.5, 0.25, 0.15, 0.0], dtype=torch.float64)
    draft = torch.tensor([0.4, 0.1, 0.1, 0.2, 0.2], dtype=torch.float64)
    candidates = torch.tensor([0, 3][:num_drafts])  # both likely to be rejected
    law = verifier.conditional(target, draft.expand(num_drafts, -1), candidates)
    # The IS rules plan each of the n (identical) problems with a [2, n, 32768] rank histogram: 2000 of them, not more.
    n = 2000 if name.startswith("is-") else 20000
    generator = torch.Generator().manual_seed(3)
    tokens, accepted = verifier.select(
        target.expand(n, -1), draft.expand(n, num_drafts, -1), candidates.expand(n, -1), generator
    )
    observed = torch.bincount(tokens, minlength=5)
    support = law > 1e-12
    assert observed[~support].sum() == 0
    assert chisquare(observed[support].numpy(), (law[support] / law[support].sum() * n).numpy()).pvalue > 1e-3
    assert torch.equal(accepted, (tokens.unsqueeze(-1) == candidates).any(-1))


def test_spectr_refuses_different_drafts():
    target, first, second = random_distributions(torch.Generator().manual_seed(1), (3, 4))
    with pytest.raises(UsageError, match="spectr needs identical drafts"):
        load_verifier("spectr").conditional(target, torch.stack([first, second]), torch.tensor([0, 1]))


def test_is_lp_refuses_supports_beyond_its_bound():
    target, draft = random_distributions(torch.Generator().manual_seed(1), (2, 10), sparsity=0.0)
    with pytest.raises(UsageError, match="more than max_support=4"):
        load_verifier("is-lp", {"max_support": 4}).acceptance_probability(target, draft.expand(2, -1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", LOSSLESS + ["mentored"])
def test_cpu_and_cuda_agree(name):
    verifier = load_verifier(name, {"kl": 0.1} if name == "mentored" else {})
    num_drafts = 1 if verifier.max_drafts == 1 else 2
    generator = torch.Generator().manual_seed(2)
    target = random_distributions(generator, (4, 6))
    draft = random_distributions(generator, (4, 1, 6)).expand(-1, num_drafts, -1)
    tokens = torch.multinomial(draft.reshape(-1, 6), 1, generator=generator).reshape(4, num_drafts)
    on_cpu = verifier.conditional(target, draft, tokens)
    on_gpu = verifier.conditional(target.cuda(), draft.cuda(), tokens.cuda()).cpu()
    torch.testing.assert_close(on_cpu, on_gpu)


@pytest.mark.parametrize("name", ["is-lp", "is-truncated"])
def test_importance_sampling_keeps_the_laws_on_the_device(name, monkeypatch):
    """A block reads only the free LPs' few numbers, once per block, from the device, never a law over V."""
    vocab, num_drafts, draft_length = 5000, 3, 3
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(num_drafts, draft_length + 1, vocab, generator=generator) * 3  # [K, L+1, V]
    if name == "is-lp":  # a bounded support, as top-k sampling gives
        logits = logits.masked_fill(logits < logits.topk(20, -1).values[..., -1:], float("-inf"))
    target = logits.softmax(-1)  # [K, L+1, V]
    drafts = (logits[:, :draft_length] + torch.randn(num_drafts, draft_length, vocab, generator=generator)).softmax(-1)
    tokens = torch.zeros(
        num_drafts, draft_length, dtype=torch.long
    )  # every row alive together: every problem has K candidates
    read_sizes = []
    original = torch.Tensor.numpy
    monkeypatch.setattr(
        torch.Tensor, "numpy", lambda self, *a, **k: read_sizes.append(self.numel()) or original(self, *a, **k)
    )
    with device_path():  # the GPU's path: the CPU path reads as it walks (free there)
        decision = load_verifier(name).verify_block(target, drafts, tokens, torch.Generator().manual_seed(0))
    assert len(read_sizes) == 1  # one read per block: every position's free LPs
    assert max(read_sizes) < vocab
    assert 0 <= int(decision.num_accepted) <= draft_length
