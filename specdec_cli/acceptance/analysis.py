"""Token-level acceptance of every verifier on real models and prompts, next to the optimum.

For each prompt the target alone generates a continuation (seeded); at every generated
position the target law q and each draft config's law p are computed for the same prefix,
and each verifier's ``acceptance_probability`` is evaluated there for every number of drafts K.
K drafts are drawn round-robin from the draft configs (one config: K identical drafts).
A verifier with a KL bound (``kl_bound_parameter``) gets one row per bound, and its
``output_kl`` beside the acceptance. The optimum row is the best acceptance of any lossless
rule (the optimal-transport dual of Hu et al. 2025; Khisti et al., Theorem 3): exact on the full
vocabulary for K identical drafts, and for K = 2 different drafts when they share at most
``MAX_TWO_DRAFT_SUPPORT`` tokens (see ``theory``).

Draft configs are evaluated in drafter sections (:class:`~.results.DrafterSection`; ``--drafter``),
each on the same continuation. A draft model's law comes from one batched forward over the
continuation; a drafter without a model is asked, as the engine asks it, what it proposes after
each prefix, and its law is that of its first token (one-hot for prompt lookup). Where a row
proposes nothing it leaves the block, as in the engine: a verifier and the optimum are evaluated
over the rows that proposed there, and accept nothing where none did.

With ``exact_first`` N (:class:`~.results.AcceptanceRequest`) a lossy row is evaluated as a run with
``speculation.exact_first`` N decides: at the first N positions of each continuation its acceptance is the exact
rule's (``speculation.exact_verifier``), and its spent divergence counts the positions from N on only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import torch

from ..base.errors import SpecdecError, UsageError
from ..base.randomness import sample_key
from ..base.recipe import Recipe, VerifierConfig
from ..base.sampling import judged_params, probs_from_logits
from ..base.theory import tv_optimal_acceptance
from ..engine.decoder import SpeculativeDecoder
from ..engine.decoding import exact_verifier_name, load_drafts
from ..engine.session import next_token_logits
from ..models.pool import ModelPool
from ..plugins.divergences import DIVERGENCES, kl_divergence, total_variation
from ..plugins.draft_rows import DraftRows
from ..plugins.drafter_registry import DrafterRegistry
from ..plugins.registry import VerifierRegistry, error_line
from ..plugins.sweeps import swept_params
from ..plugins.verifiers import BlockVerifier, JudgedLaws, judged_argument
from .memory import _check_memory
from .position_values import _acceptance, _exact_first, _optimum
from .proposing import _LoadedSection, _proposed_laws, _ProposingRows
from .results import OPTIMUM, AcceptanceReport, AcceptanceRequest, AcceptanceRow, DrafterSection, PromptAcceptance

KL_FRACTIONS = (0.1, 0.3, 1.0)
"""Default KL bounds, as fractions of the pair's mean KL(q ‖ p)."""
FALLBACK_KL_VALUES = (0.05, 0.2, 0.5)
"""Bounds when that mean is zero or not finite (identical models; a draft that rules out target tokens)."""


def _refuse_rows_that_share_a_prefix(sections: Sequence[DrafterSection], num_drafts: int) -> None:
    """A UsageError where an entry's K rows copy their first row's first tokens (the model drafter's
    ``branch_after``): acceptance evaluates every position with K independent candidates, which those positions
    do not have, so its figures there would be wrong."""
    drafters = DrafterRegistry()
    for section in sections:
        entries = [drafters.entry_drafter(entry) for entry in section.drafts]
        for index, name in drafters.dependent_entries(entries, num_drafts)[:1]:
            raise UsageError(
                f"drafts.{index}: drafter '{name}' shares a block's first tokens across its rows (branch_after), "
                "and acceptance evaluates every position with K independent rows: set branch_after: 0 or "
                "--num-drafts 1, or compare with `specdec bench`"
            )


class AcceptanceAnalysis:
    """Generates with the target alone and evaluates every verifier on the positions it visits, per drafter section."""

    def __init__(
        self,
        recipe: Recipe,
        request: AcceptanceRequest,
        *,
        sections: Sequence[DrafterSection] | None = None,
        registry: VerifierRegistry | None = None,
        pool: ModelPool | None = None,
    ):
        sections = DrafterSection.of_recipe(recipe, []) if sections is None else sections
        if any(not section.drafts for section in sections):
            raise UsageError("the recipe has no draft: acceptance compares a target with its draft(s)")
        if any(k < 1 for k in request.num_drafts):
            raise UsageError("--num-drafts values must be >= 1")
        if any(d < 0 for d in request.kl_values or ()):
            raise UsageError("--kl values must be >= 0")
        _refuse_rows_that_share_a_prefix(sections, max(request.num_drafts))
        self.recipe = recipe
        self.request = request
        self.registry = registry or VerifierRegistry()
        self.verifiers = self._verifiers(request.kl_values or ())  # every parameter checked before the models load
        exact = exact_verifier_name(recipe.speculation.exact_verifier, self.registry)
        self.exact = self.registry.resolve(exact, {}).verifier if request.exact_first else None
        """The lossless rule of a lossy row's first ``exact_first`` positions (at its defaults); None: none."""
        self.kl_optimal = self.registry.optimal_name("kl")
        """The installed KL-optimal rule (mentored), looked up once: every lossy row's "best at that KL" is its."""
        self.kl_reference: float | None = None
        """The pair's mean KL(q ‖ p) on the first prompt, when the KL bounds were derived from it."""
        pool = pool if pool is not None else ModelPool()
        self.decoder = SpeculativeDecoder.from_recipe(recipe, autoregressive=True, pool=pool, registry=self.registry)
        self.sections = [self._load(section, pool) for section in sections]
        _check_memory(
            recipe.generation.max_new_tokens, max(request.num_drafts), self.decoder.vocab_size, self.decoder.device
        )

    def _load(self, section: DrafterSection, pool: ModelPool) -> _LoadedSection:
        """The section's entries loaded; each entry without a model, or of a deterministic drafter, gets a decoder of
        its own, in which the engine sets its drafter up as for blocks of one row (the default single-draft verifier
        takes any one row)."""
        drafts = load_drafts(pool, section.drafts, self.decoder.target, self.decoder.drafter_registry)
        config = self.decoder.config.replace(verifier=VerifierConfig().name, num_drafts=1)
        classes = [self.decoder.drafter_registry.plugin_class(draft.drafter) for draft in drafts]
        proposers = {
            index: SpeculativeDecoder(
                self.decoder.target, [draft], config, self.registry, self.decoder.drafter_registry
            )
            for index, (draft, cls) in enumerate(zip(drafts, classes))
            # A deterministic drafter (prompt-lookup, retokenize) or one with a vocabulary of its own
            # (retokenize-sample) is asked what it proposes: its model's logits score another vocabulary, so they
            # are not its law over the target's ids.
            if draft.model is None or cls.deterministic or cls.own_vocabulary
        }
        return _LoadedSection(section.drafter, drafts, [draft.law(self.decoder.config) for draft in drafts], proposers)

    def _verifiers(self, bounds: Sequence[float]) -> dict[AcceptanceRow, BlockVerifier]:
        """One verifier per row, resolved in the registry (the command's checks built it): a verifier with a KL bound
        gets a row per bound (one with its own parameters while there are none yet), times one per combination of
        the values its sweeps give."""
        params = self.recipe.verifier.params  # each verifier gets those it takes (is-lp's max_support, ...)
        verifiers = {}
        for name in map(self.registry.canonical, self.request.verifiers):
            bounded = bounds if self.registry.verifier_class(name).kl_bound_parameter is not None else ()
            for bound, swept in itertools.product(bounded or (None,), swept_params(name, self.request.sweeps)):
                chosen = self.registry.resolve(name, params, kl_bound=bound, swept=swept, taken_only=True)
                verifiers[AcceptanceRow(name, kl_bound=bound, params=swept)] = chosen.verifier
        return verifiers

    def rows(self) -> list[AcceptanceRow]:
        return [AcceptanceRow(OPTIMUM), *self.verifiers]

    def run(
        self,
        prompts: Sequence[str],
        on_prompt: Callable[[list[PromptAcceptance]], None] | None = None,
        done: Sequence[PromptAcceptance] = (),
        on_tokens: Callable[[int], None] | None = None,
    ) -> AcceptanceReport:
        """:meth:`run_sections` of an analysis of one section (no ``sections``, or one) → its report."""
        (report,) = self.run_sections(prompts, on_prompt, done, on_tokens)
        return report

    def run_sections(
        self,
        prompts: Sequence[str],
        on_prompt: Callable[[list[PromptAcceptance]], None] | None = None,
        done: Sequence[PromptAcceptance] = (),
        on_tokens: Callable[[int], None] | None = None,
    ) -> list[AcceptanceReport]:
        """Evaluate every (section, prompt) not in ``done`` (a resumed run's); ``on_prompt`` gets each prompt's new
        results, all sections at once. Ctrl-C stops early and keeps what was computed (``interrupted``).
        A prompt's result depends only on the recipe, its section and its index."""
        if self.request.kl_values is None and self._has_kl_bound():
            self.derive_kl_values(prompts[0])
        counts = sorted(set(self.request.num_drafts))
        reports = [
            AcceptanceReport(
                rows=self.rows(),
                num_drafts=counts,
                drafter=section.drafter,
                identical_drafts=all(section.rows(k).identical_laws for k in counts),
                optimal={name: self._optimal_rows(name) for name in DIVERGENCES},
                exact_first=self.request.exact_first,
                exact_verifier=None if self.exact is None else self.exact.name,
            )
            for section in self.sections
        ]
        finished = {(result.drafter, result.prompt_index): result for result in done}
        encoded = [self.decoder.encode_prompt(p) for p in prompts]
        try:
            for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
                missing = [section for section in self.sections if (section.drafter, index) not in finished]
                new = self.evaluate_prompt(prompt, index, ids, missing, on_tokens) if missing else []
                results = {**finished, **{(result.drafter, index): result for result in new}}
                for report in reports:
                    report.add(results[(report.drafter, index)])
                if new and on_prompt is not None:
                    on_prompt(new)
        except KeyboardInterrupt:
            for report in reports:
                report.interrupted = True
        return reports

    def _optimal_rows(self, divergence: str) -> list[str]:
        """The labels of the rows whose verifier is the installed optimum under ``divergence``, at the settings its
        ``optimal_under`` names (mentored with divergence kl under "kl")."""
        name = self.registry.optimal_name(divergence)
        if name is None:
            return []
        settings = self.registry.verifier_class(name).optimal_under[divergence]
        return [
            row.label
            for row, verifier in self.verifiers.items()
            if row.verifier == name and all(getattr(verifier, key, None) == value for key, value in settings.items())
        ]

    def _has_kl_bound(self) -> bool:
        return any(self.registry.verifier_class(name).kl_bound_parameter for name in self.request.verifiers)

    def derive_kl_values(self, prompt: str) -> tuple[float, ...]:
        """KL bounds at ``KL_FRACTIONS`` of the mean KL(q ‖ p) of the first entry with a model (in section order)
        over the first prompt's positions; ``FALLBACK_KL_VALUES`` where there is none (a one-hot law's KL says
        nothing about a scale of bounds).

        A bound at or above a position's KL(q ‖ p) accepts every draft there, so a fixed grid is
        flat on a close pair and coarse on a distant one. The first prompt's continuation is the
        one its evaluation generates (same seed), so a resumed run derives the same bounds.
        """
        scored = next(
            (
                (section, index)
                for section in self.sections
                for index, draft in enumerate(section.drafts)
                if draft.model is not None
            ),
            None,
        )
        self.kl_reference = None if scored is None else self._mean_kl(prompt, *scored)
        if not self.kl_reference or self.kl_reference <= 0:
            values = FALLBACK_KL_VALUES
        else:
            values = tuple(float(f"{fraction * self.kl_reference:.2g}") for fraction in KL_FRACTIONS)
        self.request = dataclasses.replace(self.request, kl_values=values)
        self.verifiers = self._verifiers(values)
        return values

    def _mean_kl(self, prompt: str, section: _LoadedSection, entry: int) -> float | None:
        """The mean KL(q ‖ p) of ``section``'s entry ``entry`` along the first prompt's continuation (None if
        it is infinite everywhere)."""
        ids = self.decoder.encode_prompt(prompt)
        key = sample_key(self.recipe.seed, 0, 0)
        tokens, _, _ = self.decoder.generate_ids(ids, key)
        target = self.target_law(ids, tokens)  # [T, V]
        drafts, _ = self.draft_laws(section, ids, tokens, key)  # [T, C, V]
        divergence = (torch.xlogy(target, target) - torch.xlogy(target, drafts[:, entry])).sum(-1)  # [T]
        finite = divergence[torch.isfinite(divergence)]  # [T'] (a draft that rules out a target token gives inf)
        return float(finite.mean()) if finite.numel() else None

    @torch.inference_mode()
    def target_law(self, prompt_ids: list[int], tokens: list[int], view: str | None = None) -> torch.Tensor:
        """q ``[T, V]`` (float64) at the T generated positions; with ``view``, the law a verifier judges drafts by
        (its ``judged_laws``) instead of the sampling law."""
        generated = torch.tensor([tokens], dtype=torch.long)  # [1, T]
        logits = next_token_logits(self.decoder.target, prompt_ids, generated, self.decoder.vocab_size)[
            0, :-1
        ]  # [T, V]
        # float64 laws that sum to 1 to double precision (float32 softmax rows miss by ~1e-7), so
        # every verifier and the optimum are evaluated at the precision the theory is checked to.
        params = self.decoder.target_params if view is None else judged_params(self.decoder.target_params, view)
        target = probs_from_logits(logits, params, "target").double()  # [T, V]
        return target / target.sum(-1, keepdim=True)

    @torch.inference_mode()
    def draft_laws(
        self, section: _LoadedSection, prompt_ids: list[int], tokens: list[int], key: int, view: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every entry's p ``[T, C, V]`` (float64; zero where it proposed nothing) at the T generated positions,
        and where it proposed ``[T, C]`` (an entry with a model always does). ``key``: the sample's randomness.
        ``view``: an entry with a model gives the law a verifier judges drafts by (its ``judged_laws``) instead of
        its sampling law; one without (a deterministic drafter) gives its one-hot laws, which stand for any."""
        generated = torch.tensor([tokens], dtype=torch.long)  # [1, T]
        device, vocab = self.decoder.device, self.decoder.vocab_size
        laws, proposed = [], []
        for index, draft in enumerate(section.drafts):
            if index in section.proposers:
                law, made = _proposed_laws(section.proposers[index], prompt_ids, tokens, key)  # [T, V], [T]
            else:
                logits = next_token_logits(draft.model, prompt_ids, generated, vocab)[0, :-1].to(device)  # [T, V]
                params = draft.sampling(self.decoder.config)
                params = params if view is None else judged_params(params, view)
                law = probs_from_logits(logits, params, draft.model.name)  # [T, V]
                made = torch.ones(len(tokens), dtype=torch.bool, device=device)  # [T]
            laws.append(law.double())
            proposed.append(made)
        drafts = torch.stack(laws, dim=1)  # [T, C, V]
        # A law that is all zeros (nothing proposed) stays zeros rather than 0 / 0.
        sums = drafts.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)  # [T, C, 1]
        return drafts / sums, torch.stack(proposed, dim=1)

    def evaluate_prompt(
        self,
        prompt: str,
        index: int,
        prompt_ids: list[int],
        sections: Sequence[_LoadedSection],
        on_tokens: Callable[[int], None] | None = None,
    ) -> list[PromptAcceptance]:
        """Every row's acceptance at each position of the target's own continuation of the prompt, for each of
        ``sections``; ``on_tokens(count)`` follows the generation."""
        progress = None if on_tokens is None else (lambda tokens, _mask: on_tokens(len(tokens)))
        key = sample_key(self.recipe.seed, index, 0)
        tokens, _, _ = self.decoder.generate_ids(prompt_ids, key, progress)
        target = self.target_law(prompt_ids, tokens)  # [T, V]
        results = []
        for section in sections:
            configs, proposed = self.draft_laws(section, prompt_ids, tokens, key)  # [T, C, V], [T, C]
            judged = {  # view → the laws verifiers of this run judge drafts by: [T, V], [T, C, V]
                view: (
                    self.target_law(prompt_ids, tokens, view),
                    self.draft_laws(section, prompt_ids, tokens, key, view)[0],
                )
                for view in self.judged_views
            }
            covered = int(proposed.any(-1).sum()) if section.proposers else None
            result = PromptAcceptance(
                prompt=prompt, prompt_index=index, positions=len(tokens), drafter=section.drafter, covered=covered
            )
            for num_drafts in self.request.num_drafts:
                self._evaluate_drafts(result, section, (target, configs, judged), proposed, num_drafts)
            results.append(result)
        return results

    @property
    def judged_views(self) -> list[str]:
        """The laws this run's verifiers judge drafts by besides the sampling laws (their ``judged_laws``)."""
        return sorted({verifier.judged_laws for verifier in self.verifiers.values() if verifier.judged_laws})

    def _evaluate_drafts(
        self,
        result: PromptAcceptance,
        section: _LoadedSection,
        laws: tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]],
        proposed: torch.Tensor,
        num_drafts: int,
    ) -> None:
        """Every row's acceptance with K = ``num_drafts`` rows, for ``laws``: target ``[T, V]``, the entries' laws
        ``[T, C, V]`` and each judged view's two; and where each entry proposed ``[T, C]``."""
        target, configs, judged = laws
        choice = section.choice(num_drafts)
        drafts = configs[:, choice]  # [T, K, V]
        judged_k = {
            view: (view_target, view_configs[:, choice]) for view, (view_target, view_configs) in judged.items()
        }
        rows, row_laws = section.rows(num_drafts), [section.laws[entry] for entry in choice]
        groups = _ProposingRows.of(proposed[:, choice])
        # The optimum over the rows that proposed: identical where their laws are.
        optimum, reason = groups.values(
            lambda q, p, kept, _judged: _optimum(q, p, len({row_laws[row] for row in kept}) <= 1), target, drafts
        )
        result.record(AcceptanceRow(OPTIMUM), num_drafts, optimum, reason)
        exact = self._exact_acceptance(target, drafts, (rows, groups))
        for row, verifier in self.verifiers.items():
            position_laws = (target, drafts, judged_k.get(verifier.judged_laws))
            self._evaluate_row(result, row, verifier, position_laws, (rows, groups), exact)

    def _exact_acceptance(
        self, target: torch.Tensor, drafts: torch.Tensor, proposing: tuple[DraftRows, _ProposingRows]
    ) -> tuple[list[float] | None, str] | None:
        """The exact rule's acceptance at each position (or None and why) for target ``[T, V]`` and drafts
        ``[T, K, V]``, which a lossy row has at its first ``exact_first`` positions; None without exact_first."""
        if self.exact is None:
            return None
        rows, groups = proposing
        try:
            return _acceptance(self.exact, (target, drafts, None), self.registry.refusal(self.exact.name, rows), groups)
        except SpecdecError:
            raise
        except Exception as error:
            raise self.registry.fault(self.exact.name, f"raised {error_line(error)} in acceptance") from error

    def _evaluate_row(
        self,
        result: PromptAcceptance,
        row: AcceptanceRow,
        verifier: BlockVerifier,
        laws: tuple[torch.Tensor, torch.Tensor, JudgedLaws],
        proposing: tuple[DraftRows, _ProposingRows],
        exact: tuple[list[float] | None, str] | None = None,
    ) -> None:
        """One row's acceptance (and KL) for ``laws``: target ``[T, V]``, drafts ``[T, K, V]`` and the two the
        verifier judges drafts by (or None): refused as the engine refuses the K rows, evaluated over the rows that
        proposed (``proposing``); a lossy row's first ``exact_first`` positions are the exact rule's (``exact``: its
        values, or None and why). A plugin's own exception becomes one line naming it."""
        rows, groups = proposing
        target, drafts, judged = laws
        try:
            refusal = self.registry.refusal(row.verifier, rows)
            values, reason = _acceptance(verifier, (target, drafts, judged), refusal, groups)
            if values is not None and exact is not None and not verifier.lossless:
                values, reason = _exact_first(values, exact, self.request.exact_first)
            result.record(row, rows.count, values, reason)
            if values is not None and rows.count == 1 and not verifier.lossless:
                self._record_spent(result, row.label, verifier, laws, groups)
        except SpecdecError:
            raise
        except Exception as error:
            raise self.registry.fault(row.verifier, f"raised {error_line(error)} in acceptance") from error

    def _record_spent(
        self,
        result: PromptAcceptance,
        label: str,
        verifier: BlockVerifier,
        position_laws: tuple[torch.Tensor, torch.Tensor, JudgedLaws],
        groups: _ProposingRows,
    ) -> None:
        """A lossy row's spent divergence and the optimum at it (:data:`~.results.SPENT_MEASURES`) at each position,
        for target ``[T, V]``, one draft ``[T, 1, V]`` and the two laws it judges drafts by (or None): from its
        ``output_law``; from its ``output_kl`` (KL only) where it gives no law; nothing where it gives neither. With
        ``exact_first`` N only the positions from N on, the lossy part: the exact rule spends nothing before it."""
        first = self.request.exact_first
        target, drafts, judged = position_laws

        def output_law(q, p, laws):
            return verifier.output_law(q, p, **judged_argument(laws)) if verifier.token_level else None

        laws = groups.laws(output_law, target, drafts, judged)
        if laws is None:
            divergence, _ = groups.values(lambda q, p, _kept, _judged: (verifier.output_kl(q, p), ""), target, drafts)
            if divergence is not None:
                result.kl[label] = divergence[first:]
            return
        spent = {"kl": kl_divergence(target, laws), "tv": total_variation(target, laws)}  # [T] each
        spent["optimum_at_tv"] = tv_optimal_acceptance(target, drafts[:, 0], spent["tv"])  # [T]
        lossy = groups.proposed[groups.proposed >= first]  # [P']: the positions whose optimum is counted
        optimum = self._optimum_at_kl(target, drafts[:, 0], spent["kl"], lossy)  # [T] or None
        result.kl[label] = spent.pop("kl").tolist()[first:]
        result.spent = result.spent or {}
        result.spent[label] = {
            measure: values.tolist()[first:]
            for measure, values in {**spent, "optimum_at_kl": optimum}.items()
            if values is not None
        }

    def _optimum_at_kl(
        self, target: torch.Tensor, draft: torch.Tensor, spent: torch.Tensor, proposed: torch.Tensor
    ) -> torch.Tensor | None:
        """At each position, the acceptance of the installed KL-optimal rule at the KL a row spent there ``[T]``
        (target ``[T, V]``, draft ``[T, V]``; 0 where no row proposed), or None where no rule is KL-optimal."""
        name = self.kl_optimal
        if name is None:
            return None
        values = torch.zeros_like(spent)  # [T]
        for position in proposed.tolist():
            bound = float(spent[position])
            if bound == math.inf:  # an output law that rules out a token q allows: any rule is within that
                values[position] = 1.0
                continue
            rule = self.registry.optimal_rule("kl", max(bound, 0.0), name)  # rounding can leave -1e-17
            rows = slice(position, position + 1)
            values[position] = rule.acceptance_probability(target[rows], draft[rows].unsqueeze(1))[0]
        return values
