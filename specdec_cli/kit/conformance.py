"""Conformance checks a plugin author runs on their own plugin: :func:`check_drafter` and :func:`check_verifier`
(both re-exported from :mod:`specdec_cli.testing`).

:func:`check_verifier` checks a verifier class against the contract and, on small vocabularies where every
draft block can be enumerated, its exact block law (``block_law``): the target's own law for a lossless
verifier, a law within the bound it promises (``promised_bound``: mentored's KL or TV bound) of the target's at
each position for a lossy one; then that ``verify_block``, drawing as the engine makes it draw, samples that law
(a chi-square), with decisions of the right types, shapes and values. A lossy token-level rule is also held to the
frontier: on random law pairs, the acceptance it claims is at most the KL-optimal rule's (mentored's) at the
KL(q ‖ π) its output law spends, and is the acceptance its ``block_law`` gives on one-token blocks; its
``output_law``, where given, is the law its ``conditional`` gives. A lossless rule that declares ``dependent_drafts``
keeps the target's law on rows that share a prefix (:mod:`.dependent_rows`). The built-ins pass it, over the registry; a
verifier that accepts every draft token while calling itself lossless fails it, and so does a lossy one that claims
more than the frontier allows.

Both check a plugin's parameters first: each has a type and a description (``Annotated[float, "..."]``, which the
listing commands show); the given ones make an instance; an unknown parameter, a value of the wrong type, and each
of the author's ``bad_params`` are refused in one line, the author's own refusals naming the parameter.

:func:`check_drafter`:
It builds a tiny target (and, for a drafter whose entry needs a model, a tiny draft) from configs in a temporary
folder, loads them through the real recipe path with the drafter registered under its name, and checks:

1. the class against the contract (what ``specdec drafters`` would report as a load failure), and its
   parameters as below;
2. every proposal of a few hundred generations: shapes, dtypes, devices and length (the engine's own
   checks), laws that sum to 1 and give their tokens positive mass, one-hot laws for a deterministic
   drafter;
3. exactness end to end: with speculative sampling, the first tokens follow the target's law
   (a chi-square against the law enumerated from the target alone), and greedy decoding equals the
   target's greedy output.

A failure raises :class:`ConformanceError` saying what is wrong. The built-in drafters pass it
(``tests/test_drafters.py``); a drafter that misreports its laws fails it.

Both return a :class:`ConformanceReport`: what they checked, a line per check with its figures (the chi-square's p,
the number of law pairs). They print nothing, as library code here does not: in a test the report is not wanted,
and at a prompt (Python's, IPython's, Jupyter's) its representation, the checks line by line, is what shows.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..base.errors import SpecdecError
from ..base.randomness import Draws
from ..base.recipe import DraftConfig, build_recipe
from ..base.sampling import SamplingParams
from ..plugins.divergences import DIVERGENCES, kl_divergence
from ..plugins.drafter_registry import DrafterRegistry
from ..plugins.drafting import Drafter, Proposal
from ..plugins.parameters import PluginParameterError, parameter_specs
from ..plugins.registry import PluginRegistry, VerifierRegistry

__all__ = ["ConformanceError", "ConformanceReport", "check_drafter", "check_verifier"]

PROMPTS = ("a b c d a b c", "e e a", "d c b a e d c b a")
"""Prompts over the tiny vocabulary, with repeats (for drafters that look back at the context)."""


class ConformanceError(AssertionError):
    """A plugin that breaks the contract, with what is wrong."""


@dataclass(frozen=True, repr=False)
class ConformanceReport:
    """What :func:`check_verifier` or :func:`check_drafter` checked of a plugin class, every check of which passed."""

    kind: str  # "verifier" or "drafter"
    name: str  # the class's ``name``
    params: dict[str, Any]
    """The parameters it was checked with."""
    checks: tuple[str, ...] = field(default=())
    """A line per check, in the order run, with its figures."""

    def __repr__(self) -> str:
        """The checks line by line: what a prompt shows of a call's result."""
        settings = ", ".join(f"{key}={value!r}" for key, value in self.params.items()) or "its defaults"
        heading = f"{self.kind} '{self.name}' ({settings}) passed {len(self.checks)} conformance checks:"
        return "\n".join([heading, *(f"  ✓ {check}" for check in self.checks)])


def _registered(registry_type: type[PluginRegistry], cls: type) -> PluginRegistry:
    """A registry of ``registry_type``: the installed plugins plus ``cls``, under its own name."""
    return registry_type(extra={cls.name: cls})


def _check_parameters(
    cls: type, registry: PluginRegistry, params: dict[str, Any], bad_params: Sequence[dict[str, Any]]
) -> tuple[Any, str]:
    """Every parameter has a type and a description; ``params`` make an instance (returned, with the check's line);
    an unknown parameter, a value of the wrong type and each of ``bad_params`` are refused in one line (a ValueError
    or TypeError from the constructor, as the registry reports it), the author's own refusals naming a parameter
    they were given."""
    for name, spec in parameter_specs(cls).items():
        if spec.type_name is None or not spec.description:
            raise ConformanceError(
                f"{cls.name}: parameter '{name}' needs a type and a description, which `specdec "
                f'{registry.kind}s` shows: declare it as {name}: Annotated[TYPE, "what it does"]'
            )
    try:
        instance = registry.create(cls.name, params)
    except SpecdecError as error:
        raise ConformanceError(f"{cls.name}: could not be made with {params}: {error}") from error
    wrong = {
        name: value
        for name, spec in parameter_specs(cls).items()
        if (value := next((v for v in ("not-a-value", 2.5, []) if spec.problem(v)), None)) is not None
    }
    cases = [{**params, "no_such_parameter": 1}, *({**params, name: value} for name, value in wrong.items())]
    for bad in [*cases, *bad_params]:
        message = _refusal(cls, registry, bad)
        if bad in bad_params and not any(name in message for name in bad):
            raise ConformanceError(f"{cls.name}: refused {bad} without naming the parameter: {message!r}")
    refused = ["an unknown parameter", f"{len(wrong)} of the wrong type", f"the {len(bad_params)} of bad_params"]
    count = len(parameter_specs(cls))
    described = f"all {count} typed and described" if count else "none to describe"
    return instance, f"parameters: {described}; an instance made; refused in one line: {', '.join(refused)}"


def _refusal(cls: type, registry: PluginRegistry, params: dict[str, Any]) -> str:
    """What the plugin said refusing ``params`` (a ConformanceError if it did not, or not in one line)."""
    try:
        registry.create(cls.name, params)
    except PluginParameterError as error:
        if "\n" in str(error):
            raise ConformanceError(f"{cls.name}: refused {params} with a message of several lines") from error
        return str(error.__cause__ or error)  # its own words: the registry's line repeats the parameters given
    except SpecdecError as error:
        raise ConformanceError(
            f"{cls.name}: {params} made its constructor fail ({error}); refuse bad parameters "
            "with a ValueError, which reaches the user as one line"
        ) from error
    raise ConformanceError(f"{cls.name}: accepted the bad parameters {params}")


def check_drafter(
    cls: type[Drafter],
    params: dict[str, Any] | None = None,
    samples: int = 1000,
    bad_params: Sequence[dict[str, Any]] = (),
) -> ConformanceReport:
    """Check drafter class ``cls`` with parameters ``params`` (see the module docstring); ``samples``: generations
    in the chi-square test; ``bad_params``: parameters its constructor must refuse. Returns what it checked; raises
    :class:`ConformanceError`; takes about a minute on a CPU."""
    problem = DrafterRegistry().contract_problem(cls)
    if problem is not None or not cls.name:
        raise ConformanceError(f"{cls.__name__}: {problem or 'its class does not set name'}")
    contract = f"contract: a Drafter (deterministic={cls.deterministic}, uses_model={cls.uses_model})"
    drafter, parameters = _check_parameters(cls, _registered(DrafterRegistry, cls), dict(params or {}), bad_params)
    from .testing import save_tiny_model  # transformers: only when a check runs

    with tempfile.TemporaryDirectory() as folder:
        target = save_tiny_model(Path(folder) / "target", "llama", seed=1)
        entry: dict[str, Any] = {"drafter": cls.name, "params": dict(params or {})}
        # A drafter that drafts with a model of its own gets a tiny one; one that drafts with the target's (early
        # exit) takes its entry as it is.
        if cls.uses_model and drafter.entry_problem(DraftConfig(drafter=cls.name, params=entry["params"])):
            entry["model"] = str(save_tiny_model(Path(folder) / "draft", "llama", seed=2, layers=1))
        recipe = {
            "target": {"model": str(target), "device": "cpu"},
            "drafts": [entry],
            "verifier": {"name": "speculative"},
            "speculation": {"draft_length": 3},
            "generation": {"max_new_tokens": 3, "temperature": 1.0},
        }
        checks = (contract, parameters, _check_exactness(cls, recipe, samples), _check_greedy(cls, recipe))
    return ConformanceReport(kind="drafter", name=cls.name, params=dict(params or {}), checks=checks)


def _decoder(cls: type[Drafter], recipe: dict[str, Any], **generation: Any):
    from ..engine.decoder import SpeculativeDecoder

    built = build_recipe({**recipe, "generation": {**recipe["generation"], **generation}})
    try:
        return SpeculativeDecoder.from_recipe(built, drafters=_registered(DrafterRegistry, cls))
    except SpecdecError as error:
        raise ConformanceError(f"{cls.name}: a decoder with it could not be built: {error}") from error


def _watch_proposals(decoder: Any, cls: type[Drafter]) -> None:
    """Check each proposal of the decoder's drafter as the engine receives it."""
    drafter = decoder.drafters[0]
    propose = drafter.propose

    def checked(request):
        proposal = propose(request)
        if isinstance(proposal, Proposal):
            for b, length in enumerate(proposal.lengths):
                if length:
                    _check_laws(cls, proposal.laws[b, :, :length], proposal.tokens[b, :, :length])
        return proposal

    drafter.propose = checked


def _check_laws(cls: type[Drafter], laws: torch.Tensor, tokens: torch.Tensor) -> None:
    """One sequence's proposed laws ``[rows, n, V]`` and tokens ``[rows, n]``."""
    laws = laws.double()
    if not torch.allclose(laws.sum(-1), torch.ones_like(laws[..., 0]), atol=1e-5):
        raise ConformanceError(f"{cls.name}: proposed laws that do not sum to 1")
    if not bool((laws.gather(-1, tokens.unsqueeze(-1)) > 0).all()):
        raise ConformanceError(f"{cls.name}: proposed a token its own law gives no mass (not drawn from that law)")
    if cls.deterministic and not bool((laws.amax(-1) == 1).all()):
        raise ConformanceError(f"{cls.name}: declares deterministic but proposed laws that are not one-hot")


def _run(cls: type[Drafter], decoder: Any, prompt: str, key: int) -> list[int]:
    try:
        tokens, _, _ = decoder.generate_ids(decoder.encode_prompt(prompt), key)
    except SpecdecError as error:  # the engine's checks of a proposal, or the plugin's own exception
        raise ConformanceError(f"{cls.name}: {error}") from error
    return tokens


def _check_exactness(cls: type[Drafter], recipe: dict[str, Any], samples: int) -> str:
    from .testing import EOS_ID, chi_square_p_value, exact_sequence_law, keyed_samples

    decoder = _decoder(cls, recipe)
    _watch_proposals(decoder, cls)
    prompt_ids = decoder.encode_prompt(PROMPTS[0])
    try:
        counts = Counter(tuple(r.token_ids) for r in keyed_samples(decoder, PROMPTS[0], samples))
    except SpecdecError as error:  # the engine's checks of a proposal, or the plugin's own exception
        raise ConformanceError(f"{cls.name}: {error}") from error
    depth = recipe["generation"]["max_new_tokens"]
    law = exact_sequence_law(decoder.target.model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
    p_value = chi_square_p_value(counts, law)
    if p_value < 1e-4:
        raise ConformanceError(
            f"{cls.name}: with speculative sampling the first {depth} tokens do not follow the "
            f"target's law (chi-square p = {p_value:.2g} over {samples} samples): its reported "
            "laws are not the laws its tokens were drawn from"
        )
    return (
        f"exactness: with speculative sampling the first {depth} tokens follow the target's law (chi-square "
        f"p = {p_value:.2g} over {samples} samples), every proposal's laws summing to 1 over its tokens"
    )


def _check_greedy(cls: type[Drafter], recipe: dict[str, Any]) -> str:
    decoder = _decoder(cls, recipe, temperature=0.0, max_new_tokens=24)
    _watch_proposals(decoder, cls)
    alone = decoder.with_config(verifier="none")
    for prompt in PROMPTS:
        if _run(cls, decoder, prompt, 0) != _run(cls, alone, prompt, 0):
            raise ConformanceError(
                f"{cls.name}: greedy decoding with it differs from the target's greedy output on {prompt!r}"
            )
    return f"greedy: decoding with it gives the target's own greedy output on {len(PROMPTS)} prompts"


VOCAB, DRAFT_LENGTH = 3, 2  # every draft block of K ≤ 2 rows is enumerable: 3^(2K) of them


def check_verifier(
    cls: type, params: dict[str, Any] | None = None, samples: int = 3000, bad_params: Sequence[dict[str, Any]] = ()
) -> ConformanceReport:
    """Check verifier class ``cls`` with parameters ``params`` (see the module docstring) with 1 and 2 drafts
    where it takes them; ``samples``: draws of ``verify_block`` in the sampled check; ``bad_params``: parameters
    its constructor must refuse. Returns what it checked; raises :class:`ConformanceError`."""
    problem = VerifierRegistry().contract_problem(cls)
    if problem is not None:
        raise ConformanceError(f"{cls.__name__}: {problem}")
    checks = [
        f"contract: a BlockVerifier (lossless={cls.lossless}, max_drafts={cls.max_drafts}, "
        f"identical_drafts={cls.identical_drafts}, token_level={cls.token_level})"
    ]
    verifier, parameters = _check_parameters(cls, _registered(VerifierRegistry, cls), dict(params or {}), bad_params)
    checks.append(parameters)
    for num_drafts in [k for k in (1, 2) if cls.max_drafts is None or k <= cls.max_drafts]:
        cases = _verifier_cases(num_drafts, cls.identical_drafts)
        held = [_check_block_law(cls, verifier, target_law, draft_laws, num_drafts) for target_law, draft_laws in cases]
        checks.append(
            f"K={num_drafts}: its block law, enumerated on {len(cases)} sets of laws (V={VOCAB}, L={DRAFT_LENGTH}), "
            f"sums to 1{held[-1]}"
        )
        p_value = _check_sampling(cls, verifier, *cases[0], samples)
        checks.append(
            f"K={num_drafts}: verify samples its block law (chi-square p = {p_value:.2g} over {samples} blocks "
            "decided in one call), each decision of the right types, shapes and values"
        )
        checks.append(f"K={num_drafts}: {_check_capabilities(cls, verifier, cases)}")
    if not cls.lossless and cls.token_level and not cls.identical_drafts:
        checks.append(_check_frontier(cls, verifier))
    if cls.dependent_drafts:
        checks.append(_check_dependent_rows(cls, verifier))
    return ConformanceReport(kind="verifier", name=cls.name, params=dict(params or {}), checks=tuple(checks))


def _check_dependent_rows(cls: type, verifier: Any) -> str:
    """A rule that declares ``dependent_drafts`` keeps the target's law on rows that share their first d tokens, each
    copy reported one-hot (:mod:`.dependent_rows`); a lossy one has no law to be held to there."""
    from .dependent_rows import LENGTH, VOCAB, largest_gap

    if not cls.lossless:
        return "dependent_drafts: not checked (a lossy rule promises no law on rows that share a prefix)"
    cases = [(k, d) for k, d in ((2, 1), (2, 2), (3, 1)) if cls.max_drafts is None or k <= cls.max_drafts]
    for num_rows, branch_after in cases:
        gap = largest_gap(verifier, num_rows, branch_after)
        if gap > 1e-9:
            raise ConformanceError(
                f"{cls.name}: declares dependent_drafts, but on K = {num_rows} rows that share their first "
                f"{branch_after} token(s) its output law differs from the target's by {gap:.3g} (V = {VOCAB}, "
                f"L = {LENGTH}); declare dependent_drafts = False if it needs independent rows"
            )
    shown = ", ".join(f"K={k} d={d}" for k, d in cases)
    return f"dependent_drafts: rows sharing their first d tokens ({shown}; V={VOCAB}, L={LENGTH}) keep the target's law"


def _verifier_cases(num_drafts: int, identical: bool) -> list:
    """(target law, K draft laws) over prefixes: random, sparse, and with drafts close to the target."""
    from .testing import random_sequence_laws

    generator = torch.Generator().manual_seed(11 * num_drafts)
    cases = []
    for sparsity in (0.0, 0.0, 0.4):
        target = random_sequence_laws(generator, VOCAB, DRAFT_LENGTH + 1, sparsity)
        drafts = [random_sequence_laws(generator, VOCAB, DRAFT_LENGTH, sparsity) for _ in range(num_drafts)]
        drafts = drafts[:1] * num_drafts if identical else drafts
        cases.append((target.__getitem__, [laws.__getitem__ for laws in drafts]))
    return cases


def _check_block_law(cls: type, verifier: Any, target_law, draft_laws, num_drafts: int) -> str:
    """The block law sums to 1, is the target's for a lossless verifier and within the promised bound at the first
    position for a lossy one that promises one; returns what held beyond the sum ("" where nothing more is claimed)."""
    from .testing import committed_block_law, enumerate_block_law, target_sequence_law

    try:
        law = enumerate_block_law(verifier, target_law, draft_laws, VOCAB, DRAFT_LENGTH)
    except NotImplementedError as error:
        raise ConformanceError(
            f"{cls.name}: implement block_law (the exact law of verify_block's decision), which the kit enumerates"
        ) from error
    if abs(sum(law.values()) - 1) > 1e-9:
        raise ConformanceError(f"{cls.name}: its block law sums to {sum(law.values()):.12g}, not 1 (K = {num_drafts})")
    if cls.lossless:
        gap = max(
            abs(law.get(s, 0.0) - mass) for s, mass in target_sequence_law(target_law, VOCAB, DRAFT_LENGTH + 1).items()
        )
        if gap > 1e-9:
            raise ConformanceError(
                f"{cls.name}: declares lossless, but its block's output law differs from the "
                f"target's by {gap:.3g} (K = {num_drafts}, V = {VOCAB}, L = {DRAFT_LENGTH})"
            )
        return ", and its output law is the target's"
    if verifier.promised_bound() is None or not cls.token_level:
        return ""
    first_token_law = committed_block_law(verifier, target_law, draft_laws, VOCAB, 1)
    return _check_promised_bound(cls, verifier, first_token_law, target_law)


def _check_promised_bound(cls: type, verifier: Any, first_token_law: dict, target_law) -> str:
    """At the block's first position the output law is within the bound the verifier promises (its
    ``promised_bound``: a divergence and a bound) of the target's."""
    divergence, bound = verifier.promised_bound()
    if divergence not in DIVERGENCES:
        raise ConformanceError(
            f"{cls.name}: promised_bound names the divergence {divergence!r}; use one of {', '.join(DIVERGENCES)}"
        )
    output = torch.zeros(VOCAB, dtype=torch.float64)  # [V]
    for sequence, mass in first_token_law.items():
        output[sequence[0]] += mass
    spent = float(DIVERGENCES[divergence](target_law(()), output))
    if spent > bound * (1 + 1e-6) + 1e-9:
        raise ConformanceError(
            f"{cls.name}: its output law is {divergence.upper()} {spent:.6g} from the target's, over the bound "
            f"{bound:g} it promises"
        )
    return f", and its output law at the first position is within the {divergence.upper()} {bound:g} it promises"


def _check_frontier(cls: type, verifier: Any) -> str:
    """A lossy token-level rule with one draft, on random law pairs (V = 3 and 6) and the adversarial ones: the
    acceptance it claims (``acceptance_probability``) is no more than the KL-optimal rule's (the installed one that
    names "kl" in ``optimal_under``) at the KL(q ‖ π) its output law π spends, π enumerated from ``conditional``;
    the claim is the acceptance enumerated from its block law, and ``output_law``, where given, is π."""
    from .testing import adversarial_distribution_pairs, enumerate_output_law, random_distributions

    registry = VerifierRegistry()
    optimal_name = registry.optimal_name("kl")
    generator = torch.Generator().manual_seed(34)
    pairs = [tuple(random_distributions(generator, (2, vocab))) for vocab in (3, 6) for _ in range(10)]
    pairs += adversarial_distribution_pairs(4)
    for target, draft in pairs:
        drafts = draft.unsqueeze(0)  # [1, V]
        law = enumerate_output_law(verifier, target, drafts)  # [V]
        spent = max(float(kl_divergence(target, law)), 0.0)  # rounding leaves -1e-16 where π is q
        claimed = float(verifier.acceptance_probability(target, drafts))
        found = optimal_name is not None and math.isfinite(spent)
        optimal = registry.optimal_rule("kl", spent, optimal_name) if found else None
        best = math.inf if optimal is None else float(optimal.acceptance_probability(target, drafts))
        if claimed > best + 1e-7:
            raise ConformanceError(
                f"{cls.name}: claims acceptance {claimed:.6g} where its output law spends KL {spent:.6g}, above the "
                f"KL-optimal rule's {best:.6g} there (no rule accepts more): its acceptance_probability is wrong"
            )
        _check_against_enumeration(cls, verifier, target, drafts, law, claimed)
    bounded = (
        "" if optimal_name is None else f"is at most the KL-optimal rule's ({optimal_name}) at the KL it spends and "
    )
    return (
        f"frontier: on {len(pairs)} law pairs its claimed acceptance {bounded}is its block law's; output_law, where "
        "given, is its conditional's"
    )


def _check_against_enumeration(cls, verifier, target, drafts, law, claimed: float) -> None:
    """The claimed acceptance is the one enumerated from its ``block_law`` on one-token blocks (the mass that goes
    past the position); ``output_law``, where given, is ``law``."""
    from .testing import block_acceptance

    enumerated = block_acceptance(verifier, target, drafts)
    if abs(claimed - enumerated) > 1e-7:
        raise ConformanceError(
            f"{cls.name}: acceptance_probability gives {claimed:.6g}, but its block law accepts {enumerated:.6g}"
        )
    given = verifier.output_law(target, drafts)  # [V] or None
    gap = 0.0 if given is None else float((given - law).abs().max())
    if gap > 1e-7:
        raise ConformanceError(f"{cls.name}: output_law differs from the law its conditional gives by {gap:.3g}")


def _block_of(target_law, draft_laws) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block whose rows follow each draft law's likeliest tokens: target ``[K, L+1, V]``, draft ``[K, L, V]``
    (float64) and tokens ``[K, L]``."""
    rows = [_likeliest_row(law) for law in draft_laws]
    target_probs = torch.stack([torch.stack([target_law(r[:t]) for t in range(DRAFT_LENGTH + 1)]) for r in rows])
    draft_probs = torch.stack(
        [torch.stack([law(r[:t]) for t in range(DRAFT_LENGTH)]) for law, r in zip(draft_laws, rows)]
    )
    return target_probs, draft_probs, torch.tensor(rows)


def _check_sampling(cls: type, verifier: Any, target_law, draft_laws, samples: int) -> float:
    """``verify``, deciding one block for each of ``samples`` sequences in one call with keyed draws as the engine
    gives them, samples its block_law: the chi-square's p-value."""
    from ..plugins.verifiers import DecisionError, batch_decision_problem, decision_value_problem
    from .testing import chi_square_p_value, decision_outcomes

    target_probs, draft_probs, tokens = _block_of(target_law, draft_laws)
    law = decision_outcomes(verifier.block_law(target_probs, draft_probs, tokens), tokens)
    batch = [tensor.expand(samples, *tensor.shape) for tensor in (target_probs.float(), draft_probs.float(), tokens)]
    try:
        decision = verifier.verify(*batch, Draws.batch(list(range(samples))))
    except DecisionError as error:
        raise ConformanceError(f"{cls.name}: verify_block {error}") from None
    problem = batch_decision_problem(decision, samples, DRAFT_LENGTH + 1, tokens.device)
    if problem is not None:
        raise ConformanceError(f"{cls.name}: verify {problem}")
    rows = tokens.tolist()
    counts: Counter = Counter()
    for committed, accepted, row in zip(
        decision.tokens.tolist(), decision.num_accepted.tolist(), decision.row.tolist()
    ):
        problem = decision_value_problem(committed, accepted, row, False, len(rows), VOCAB)
        if problem is not None:
            raise ConformanceError(f"{cls.name}: verify {problem}")
        if tuple(committed[:accepted]) != tuple(rows[row][:accepted]):
            raise ConformanceError(f"{cls.name}: verify accepted tokens that are not row {row}'s draft tokens")
        counts[tuple(committed[: accepted + 1])] += 1
    p_value = chi_square_p_value(counts, law)
    if p_value < 1e-4:
        raise ConformanceError(
            f"{cls.name}: verify's decisions do not follow its block_law "
            f"(chi-square p = {p_value:.2g} over {samples} blocks)"
        )
    return p_value


def _check_capabilities(cls: type, verifier: Any, cases: list) -> str:
    """The capabilities measured on two of ``cases``' blocks (:mod:`.capabilities`), as the report's line."""
    from .capabilities import CapabilityError, measure_capabilities

    blocks = [
        tuple(tensor.float() if tensor.is_floating_point() else tensor for tensor in _block_of(*case))
        for case in cases[:2]
    ]
    try:
        return measure_capabilities(cls, verifier, blocks).line(cls)
    except CapabilityError as error:
        raise ConformanceError(str(error)) from None


def _likeliest_row(law) -> tuple[int, ...]:
    """A draft row that follows its law's likeliest token at each position (a likely block: long accepted prefixes)."""
    row: tuple[int, ...] = ()
    for _ in range(DRAFT_LENGTH):
        row += (int(law(row).argmax()),)
    return row
