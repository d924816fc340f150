"""Token-level acceptance of every verifier on real models and prompts, next to the optimum.

For each prompt the target alone generates a continuation (seeded); at every generated
position the target law q and each draft config's law p are computed for the same prefix,
and each verifier's ``acceptance_probability`` is evaluated there for every number of drafts K.
K drafts are drawn round-robin from the draft configs (one config: K identical drafts).
The optimum row is the best acceptance of any lossless rule (the optimal-transport dual of Hu et
al. 2025; Khisti et al., Theorem 3): exact on the full vocabulary for K identical drafts, and for
K = 2 different drafts when they share at most ``MAX_TWO_DRAFT_SUPPORT`` tokens (see ``theory``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .bench.store import RecordKind
from .engine import SpeculativeDecoder, load_drafts, sample_seed
from .errors import SpecdecError, UsageError
from .recipe import Recipe
from .sampling import probs_from_logits
from .theory import (
    MAX_TWO_DRAFT_SUPPORT,
    optimal_acceptance,
    optimal_acceptance_two_drafts,
    two_draft_support,
)
from .verifiers import VerifierRegistry

OPTIMUM = "optimum"
MENTORED = "mentored"


@dataclass(frozen=True)
class AcceptanceRequest:
    verifiers: tuple[str, ...]
    """Verifier names; 'mentored' expands to one row per KL bound."""
    num_drafts: tuple[int, ...] = (1, 2, 4)
    kl_values: tuple[float, ...] = (0.05, 0.2, 0.5)


@dataclass
class Cell:
    mean: float
    stderr: float
    count: int


@dataclass
class PromptAcceptance:
    """Per-position values for one prompt: ``values[row][K]`` and mentored's ``kl[row]``."""

    prompt: str
    prompt_index: int
    positions: int
    values: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    kl: dict[str, list[float]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    """'row|K' → why that cell has no value here (gathered into the report's ``unavailable``)."""

    def to_record(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "PromptAcceptance":
        """The inverse of :meth:`to_record` (JSON turned the K keys into text)."""
        values = {row: {int(k): v for k, v in by_k.items()} for row, by_k in record["values"].items()}
        return cls(record["prompt"], record["prompt_index"], record["positions"], values, record["kl"],
                   record["unavailable"])  # fmt: skip


PROMPT_RECORDS = RecordKind(lambda record: (record["prompt_index"],),
                            frozenset({"prompt", "prompt_index", "positions", "values", "kl", "unavailable"}))


@dataclass
class AcceptanceReport:
    rows: list[str]
    num_drafts: list[int]
    prompts: list[PromptAcceptance] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    """'row|K' → why that cell has no value (e.g. a single-draft verifier at K = 2)."""
    identical_drafts: bool = True
    interrupted: bool = False

    def cell(self, row: str, num_drafts: int) -> Cell | None:
        values = [v for p in self.prompts for v in p.values.get(row, {}).get(num_drafts, [])]
        return _summary(values)

    def kl(self, row: str) -> Cell | None:
        return _summary([v for p in self.prompts for v in p.kl.get(row, [])])

    def to_dict(self) -> dict:
        table = {}
        for row in self.rows:
            table[row] = {str(k): dataclasses.asdict(c) if (c := self.cell(row, k)) else None for k in self.num_drafts}
            if (divergence := self.kl(row)) is not None:
                table[row]["kl"] = dataclasses.asdict(divergence)
        return {
            "rows": self.rows,
            "num_drafts": self.num_drafts,
            "table": table,
            "unavailable": self.unavailable,
            "identical_drafts": self.identical_drafts,
            "interrupted": self.interrupted,
            "prompts": [dataclasses.asdict(p) for p in self.prompts],
        }


def mentored_row(kl: float) -> str:
    return f"{MENTORED} D={kl:g}"


def _summary(values: list[float]) -> Cell | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return Cell(mean, float("nan"), 1)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return Cell(mean, math.sqrt(variance / len(values)), len(values))


class AcceptanceAnalysis:
    """Generates with the target alone and evaluates every verifier on the positions it visits."""

    def __init__(self, recipe: Recipe, request: AcceptanceRequest, registry: VerifierRegistry | None = None):
        if not recipe.drafts:
            raise UsageError("the recipe has no draft: acceptance compares a target with its draft(s)")
        if any(k < 1 for k in request.num_drafts):
            raise UsageError("--num-drafts values must be >= 1")
        if any(d < 0 for d in request.kl_values):
            raise UsageError("--kl values must be >= 0")
        self.recipe = recipe
        self.request = request
        self.registry = registry or VerifierRegistry()
        params = recipe.verifier.params  # each verifier gets those it takes (is-lp's max_support, ...)
        self.verifiers = {
            name: self.registry.create(name, self.registry.params_for(name, params))
            for name in request.verifiers if name.lower() != MENTORED
        }  # fmt: skip
        single = dataclasses.replace(recipe, speculation=dataclasses.replace(recipe.speculation, num_drafts=1))
        self.decoder = SpeculativeDecoder.from_recipe(single, autoregressive=True)
        self.draft_groups = load_drafts(single, self.decoder.target)
        self.num_configs = sum(len(params) for _, params in self.draft_groups)
        self.mentored = [
            (mentored_row(d), self.registry.create(MENTORED, {**self.registry.params_for(MENTORED, params), "kl": d}))
            for d in (request.kl_values if any(n.lower() == MENTORED for n in request.verifiers) else ())
        ]

    def rows(self) -> list[str]:
        return [OPTIMUM, *self.verifiers, *(row for row, _ in self.mentored)]

    def run(
        self,
        prompts: Sequence[str],
        on_prompt: Callable[[PromptAcceptance], None] | None = None,
        done: Sequence[PromptAcceptance] = (),
    ) -> AcceptanceReport:
        """Evaluate every prompt not in ``done`` (a resumed run's); Ctrl-C stops early and keeps what
        was computed (``interrupted``). A prompt's result depends only on the recipe and its index."""
        report = AcceptanceReport(self.rows(), sorted(set(self.request.num_drafts)), identical_drafts=self.num_configs == 1)
        finished = {result.prompt_index: result for result in done}
        encoded = [self.decoder.encode_prompt(p) for p in prompts]
        try:
            for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
                result = finished.get(index) or self.evaluate_prompt(prompt, index, ids)
                report.prompts.append(result)
                report.unavailable.update(result.unavailable)
                if on_prompt is not None and index not in finished:
                    on_prompt(result)
        except KeyboardInterrupt:
            report.interrupted = True
        return report

    @torch.inference_mode()
    def laws(self, prompt_ids: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, V]`` and every draft config's p ``[T, C, V]`` (float64) at the T generated positions."""
        target_logits = _position_logits(self.decoder.target.model, prompt_ids, tokens, self.decoder)
        target = probs_from_logits(target_logits, self.decoder.target_params, "target")  # [T, V]
        drafts = []
        for loaded, params_list in self.draft_groups:
            logits = _position_logits(loaded.model, prompt_ids, tokens, self.decoder).to(target.device)
            drafts += [probs_from_logits(logits, params, loaded.name) for params in params_list]
        # float64 laws that sum to 1 to double precision (float32 softmax rows miss by ~1e-7), so
        # every verifier and the optimum are evaluated at the precision the theory is checked to.
        target, drafts = target.double(), torch.stack(drafts, dim=1).double()  # [T, V], [T, C, V]
        return target / target.sum(-1, keepdim=True), drafts / drafts.sum(-1, keepdim=True)

    def evaluate_prompt(self, prompt: str, index: int, prompt_ids: list[int]) -> PromptAcceptance:
        seed = sample_seed(self.recipe.seed, index, 0)
        tokens, _, _ = self.decoder.generate_ids(prompt_ids, seed)
        target, configs = self.laws(prompt_ids, tokens)  # [T, V], [T, C, V]
        result = PromptAcceptance(prompt, index, len(tokens))
        unavailable = result.unavailable
        for num_drafts in self.request.num_drafts:
            drafts = configs[:, [k % self.num_configs for k in range(num_drafts)]]  # [T, K, V]
            identical = self.num_configs == 1 or num_drafts == 1
            optimum, reason = _optimum(target, drafts, identical)
            if optimum is None:
                unavailable[f"{OPTIMUM}|{num_drafts}"] = reason
            else:
                result.values.setdefault(OPTIMUM, {})[num_drafts] = optimum
            for name, verifier in self.verifiers.items():
                reason = _why_not(verifier, num_drafts, identical)
                if reason is None:
                    try:
                        values = verifier.acceptance_probability(target, drafts)  # [T]
                        result.values.setdefault(name, {})[num_drafts] = values.double().tolist()
                        continue
                    except SpecdecError as error:
                        reason = str(error)
                unavailable[f"{name}|{num_drafts}"] = reason
            for row, verifier in self.mentored:
                if num_drafts == 1:
                    result.values.setdefault(row, {})[1] = verifier.acceptance_probability(target, drafts).tolist()
                    result.kl[row] = verifier.output_kl(target, drafts).tolist()
                else:
                    unavailable[f"{row}|{num_drafts}"] = "mentored takes one draft"
        return result


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


def _why_not(verifier, num_drafts: int, identical: bool) -> str | None:
    if not verifier.token_level:
        return f"{verifier.name} decides whole blocks: a per-token acceptance is not defined (compare it with bench)"
    if verifier.max_drafts is not None and num_drafts > verifier.max_drafts:
        return f"{verifier.name} takes at most {verifier.max_drafts} draft(s)"
    if verifier.identical_drafts and not identical:
        return f"{verifier.name} needs identical drafts"
    return None


def _position_logits(model, prompt_ids: list[int], tokens: list[int], decoder: SpeculativeDecoder) -> torch.Tensor:
    """Logits ``[T, vocab]`` predicting each of ``tokens`` from its prefix: one forward, no cache."""
    device = model.device
    if decoder.target.is_encoder_decoder:
        start = decoder.decoder_start
        output = model(
            input_ids=torch.tensor([prompt_ids], device=device),
            decoder_input_ids=torch.tensor([start + tokens], device=device),
        )
        first = len(start) - 1
    else:
        output = model(input_ids=torch.tensor([prompt_ids + tokens], device=device))
        first = len(prompt_ids) - 1
    return output.logits[0, first : first + len(tokens), : decoder.vocab_size]
