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
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import torch

from ..draft_rows import DraftRows, round_robin
from ..engine import SpeculativeDecoder
from ..randomness import sample_key
from ..errors import SpecdecError, UsageError
from ..model_pool import ModelPool
from ..model_session import next_token_logits
from ..recipe import Recipe
from ..sampling import probs_from_logits
from ..theory import MAX_TWO_DRAFT_SUPPORT, optimal_acceptance, optimal_acceptance_two_drafts, two_draft_support
from ..registry import error_line
from ..verifiers import BlockVerifier, VerifierRegistry
from .results import OPTIMUM, AcceptanceReport, AcceptanceRequest, AcceptanceRow, PromptAcceptance

KL_FRACTIONS = (0.1, 0.3, 1.0)
"""Default KL bounds, as fractions of the pair's measured mean KL(q ‖ p)."""
FALLBACK_KL_VALUES = (0.05, 0.2, 0.5)
"""Bounds when that mean is zero or not finite (identical models; a draft that rules out target tokens)."""


class AcceptanceAnalysis:
    """Generates with the target alone and evaluates every verifier on the positions it visits."""

    def __init__(self, recipe: Recipe, request: AcceptanceRequest, *, registry: VerifierRegistry | None = None,
                 pool: ModelPool | None = None):  # fmt: skip
        if not recipe.drafts:
            raise UsageError("the recipe has no draft: acceptance compares a target with its draft(s)")
        if any(k < 1 for k in request.num_drafts):
            raise UsageError("--num-drafts values must be >= 1")
        if any(d < 0 for d in request.kl_values or ()):
            raise UsageError("--kl values must be >= 0")
        self.recipe = recipe
        self.request = request
        self.registry = registry or VerifierRegistry()
        self.verifiers = self._verifiers(request.kl_values or ())  # every parameter checked before the models load
        self.kl_reference: float | None = None
        """The pair's mean KL(q ‖ p) on the first prompt, when the KL bounds were derived from it."""
        pool = pool if pool is not None else ModelPool()
        self.decoder = SpeculativeDecoder.from_recipe(recipe, autoregressive=True, pool=pool, registry=self.registry)
        self.drafts = pool.drafts(recipe.drafts, self.decoder.target, self.decoder.drafter_registry)
        _check_memory(recipe.generation.max_new_tokens, max(request.num_drafts), self.decoder.vocab_size,
                      self.decoder.device)  # fmt: skip

    def _verifiers(self, bounds: Sequence[float]) -> dict[AcceptanceRow, BlockVerifier]:
        """One verifier per row; a verifier with a KL bound gets a row per bound (one with its own
        parameters while there are none yet)."""
        params = self.recipe.verifier.params  # each verifier gets those it takes (is-lp's max_support, ...)
        verifiers = {}
        for name in self.request.verifiers:
            name = self.registry.canonical(name)
            own = self.registry.params_for(name, params)
            if self.registry.verifier_class(name).kl_bound_parameter is None or not bounds:
                verifiers[AcceptanceRow(name)] = self.registry.create(name, own)
                continue
            for bound in bounds:
                row = AcceptanceRow(name, kl_bound=bound)
                verifiers[row] = self.registry.create(name, self.registry.with_kl_bound(name, own, bound))
        return verifiers

    def draft_rows(self, num_drafts: int) -> DraftRows:
        """K = ``num_drafts`` rows taken in turn from the draft configs."""
        return round_robin([draft.law(self.decoder.config) for draft in self.drafts], num_drafts)

    def rows(self) -> list[AcceptanceRow]:
        return [AcceptanceRow(OPTIMUM), *self.verifiers]

    def run(
        self,
        prompts: Sequence[str],
        on_prompt: Callable[[PromptAcceptance], None] | None = None,
        done: Sequence[PromptAcceptance] = (),
        on_tokens: Callable[[int], None] | None = None,
    ) -> AcceptanceReport:
        """Evaluate every prompt not in ``done`` (a resumed run's); Ctrl-C stops early and keeps what
        was computed (``interrupted``). A prompt's result depends only on the recipe and its index."""
        if self.request.kl_values is None and self._has_kl_bound():
            self.derive_kl_values(prompts[0])
        identical = all(self.draft_rows(k).identical_laws for k in self.request.num_drafts)
        report = AcceptanceReport(rows=self.rows(), num_drafts=sorted(set(self.request.num_drafts)),
                                  identical_drafts=identical)  # fmt: skip
        finished = {result.prompt_index: result for result in done}
        encoded = [self.decoder.encode_prompt(p) for p in prompts]
        try:
            for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
                result = finished.get(index) or self.evaluate_prompt(prompt, index, ids, on_tokens)
                report.add(result)
                if on_prompt is not None and index not in finished:
                    on_prompt(result)
        except KeyboardInterrupt:
            report.interrupted = True
        return report

    def _has_kl_bound(self) -> bool:
        return any(self.registry.verifier_class(name).kl_bound_parameter for name in self.request.verifiers)

    def derive_kl_values(self, prompt: str) -> tuple[float, ...]:
        """KL bounds at ``KL_FRACTIONS`` of the pair's mean KL(q ‖ p) over the first prompt's positions.

        A bound at or above a position's KL(q ‖ p) accepts every draft there, so a fixed grid is
        flat on a close pair and coarse on a distant one. The first prompt's continuation is the
        one its evaluation generates (same seed), so a resumed run derives the same bounds.
        """
        ids = self.decoder.encode_prompt(prompt)
        tokens, _, _ = self.decoder.generate_ids(ids, sample_key(self.recipe.seed, 0, 0))
        target, drafts = self.laws(ids, tokens)  # [T, V], [T, C, V]
        divergence = (torch.xlogy(target, target) - torch.xlogy(target, drafts[:, 0])).sum(-1)  # [T]
        finite = divergence[torch.isfinite(divergence)]  # [T'] (a draft that rules out a target token gives inf)
        self.kl_reference = float(finite.mean()) if finite.numel() else None
        if not self.kl_reference or self.kl_reference <= 0:
            values = FALLBACK_KL_VALUES
        else:
            values = tuple(float(f"{fraction * self.kl_reference:.2g}") for fraction in KL_FRACTIONS)
        self.request = dataclasses.replace(self.request, kl_values=values)
        self.verifiers = self._verifiers(values)
        return values

    @torch.inference_mode()
    def laws(self, prompt_ids: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, V]`` and every draft config's p ``[T, C, V]`` (float64) at the T generated positions."""
        generated = torch.tensor([tokens], dtype=torch.long)  # [1, T]
        vocab = self.decoder.vocab_size
        target_logits = next_token_logits(self.decoder.target, prompt_ids, generated, vocab)[0, :-1]  # [T, V]
        target = probs_from_logits(target_logits, self.decoder.target_params, "target")  # [T, V]
        drafts = []
        for draft in self.drafts:
            logits = next_token_logits(draft.model, prompt_ids, generated, vocab)[0, :-1].to(target.device)  # [T, V]
            drafts.append(probs_from_logits(logits, draft.sampling(self.decoder.config), draft.model.name))
        # float64 laws that sum to 1 to double precision (float32 softmax rows miss by ~1e-7), so
        # every verifier and the optimum are evaluated at the precision the theory is checked to.
        target, drafts = target.double(), torch.stack(drafts, dim=1).double()  # [T, V], [T, C, V]
        return target / target.sum(-1, keepdim=True), drafts / drafts.sum(-1, keepdim=True)

    def evaluate_prompt(self, prompt: str, index: int, prompt_ids: list[int],
                        on_tokens: Callable[[int], None] | None = None) -> PromptAcceptance:  # fmt: skip
        """Every row's acceptance at each position of the target's own continuation of the prompt;
        ``on_tokens(count)`` follows the generation."""
        progress = None if on_tokens is None else (lambda tokens, _mask: on_tokens(len(tokens)))
        tokens, _, _ = self.decoder.generate_ids(prompt_ids, sample_key(self.recipe.seed, index, 0), progress)
        target, configs = self.laws(prompt_ids, tokens)  # [T, V], [T, C, V]
        result = PromptAcceptance(prompt=prompt, prompt_index=index, positions=len(tokens))
        for num_drafts in self.request.num_drafts:
            drafts = configs[:, [k % len(self.drafts) for k in range(num_drafts)]]  # [T, K, V]
            rows = self.draft_rows(num_drafts)
            optimum, reason = _optimum(target, drafts, rows.identical_laws)
            result.record(AcceptanceRow(OPTIMUM), num_drafts, optimum, reason)
            for row, verifier in self.verifiers.items():
                self._evaluate_row(result, row, verifier, target, drafts, rows)
        return result

    def _evaluate_row(self, result: PromptAcceptance, row: AcceptanceRow, verifier: BlockVerifier,
                      target: torch.Tensor, drafts: torch.Tensor, rows: DraftRows) -> None:  # fmt: skip
        """One row's acceptance (and KL) for target ``[T, V]`` and drafts ``[T, K, V]``; a plugin's own
        exception becomes one line naming it."""
        try:
            values, reason = _acceptance(verifier, target, drafts, self.registry.refusal(row.verifier, rows))
            result.record(row, rows.count, values, reason)
            if values is not None and row.label not in result.kl:
                divergence = verifier.output_kl(target, drafts)  # [T] or None
                if divergence is not None:
                    result.kl[row.label] = divergence.double().tolist()
        except SpecdecError:
            raise
        except Exception as error:
            raise self.registry.fault(row.verifier, f"raised {error_line(error)} in acceptance") from error


def _acceptance(verifier: BlockVerifier, target: torch.Tensor, drafts: torch.Tensor, refusal: str | None):
    """(acceptance at each position, or None and why) for target ``[T, V]`` and drafts ``[T, K, V]``."""
    if not verifier.token_level:
        return None, f"{verifier.name} decides whole blocks: a per-token acceptance is not defined (compare it with bench)"
    if refusal is not None:
        return None, refusal
    try:
        return verifier.acceptance_probability(target, drafts).double().tolist(), ""  # [T]
    except SpecdecError as error:
        return None, str(error)


def _optimum(target: torch.Tensor, drafts: torch.Tensor, identical: bool) -> tuple[list[float] | None, str]:
    """The optimum at each position for target ``[T, V]`` and drafts ``[T, K, V]``, or why it is not given."""
    num_drafts = drafts.shape[1]
    if identical:
        return optimal_acceptance(target, drafts[:, 0], num_drafts).tolist(), ""
    if num_drafts > 2:
        return None, "not computed for K > 2 different drafts (exact here for identical drafts and for K = 2)"
    support = int(two_draft_support(drafts[:, 0], drafts[:, 1]).max())
    if support > MAX_TWO_DRAFT_SUPPORT:
        return None, (
            f"not computed: the two different drafts share up to {support} tokens, and the exact optimum "
            f"for different drafts takes at most {MAX_TWO_DRAFT_SUPPORT} (restrict sampling, e.g. --top-k 50)"
        )
    return [float(optimal_acceptance_two_drafts(q, p[0], p[1])) for q, p in zip(target, drafts)], ""



def _check_memory(positions: int, num_drafts: int, vocab_size: int, device: torch.device) -> None:
    """A prompt's K draft laws, ``[T, K, V]`` in float64, must fit the device's memory: refuse a
    ``--num-drafts`` or ``--max-new-tokens`` too large for it in one line, before allocating."""
    needed = positions * num_drafts * vocab_size * 8
    available = _device_memory(device)
    if available is not None and needed > available:
        raise UsageError(
            f"--num-drafts {num_drafts} with --max-new-tokens {positions} needs {needed / 2**30:.3g} GiB for the draft laws "
            f"alone ({positions} positions × {num_drafts} drafts × {vocab_size} tokens × 8 bytes) and this device has "
            f"{available / 2**30:.3g} GiB; lower --num-drafts or --max-new-tokens"
        )


def _device_memory(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes (None where it cannot be told)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
