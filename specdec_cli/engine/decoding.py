"""Drafts and verifiers under a :class:`~specdec_cli.recipe.DecodingConfig`.

A :class:`~specdec_cli.engine.decoder.SpeculativeDecoder` holds loaded models and one decoding config;
the verifier, draft length, number of drafts and sampling settings can change from call to
call without loading anything again (:meth:`~specdec_cli.engine.decoder.SpeculativeDecoder.with_config`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..base.errors import UsageError
from ..base.recipe import DecodingConfig, DraftConfig, VerifierConfig
from ..base.sampling import SamplingParams
from ..models.loading import LoadedModel
from ..models.pool import ModelPool
from ..plugins.draft_rows import DraftRows, drafter_key
from ..plugins.drafter_registry import DEFAULT_DRAFTER, DrafterRegistry
from ..plugins.registry import VerifierRegistry
from ..plugins.verifiers import JUDGED_VIEWS, BlockVerifier


@dataclass(frozen=True, eq=False)
class Draft:
    """A loaded draft entry: its model (None for a drafter that takes none), its own sampling settings (None: the
    decoding config's), and the drafter that drafts with them (its entry-point name and parameters)."""

    model: LoadedModel | None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    drafter: str = DEFAULT_DRAFTER
    params: dict[str, Any] = field(default_factory=dict)

    def sampling(self, config: DecodingConfig) -> SamplingParams:
        """This draft's sampling law under ``config``."""
        generation = config.generation
        return SamplingParams(
            temperature=generation.temperature if self.temperature is None else self.temperature,
            top_k=generation.top_k if self.top_k is None else self.top_k,
            top_p=generation.top_p if self.top_p is None else self.top_p,
        )

    def law(self, config: DecodingConfig) -> Hashable:
        """The key of this draft's law for :class:`~specdec_cli.plugins.draft_rows.DraftRows`: its drafter and
        parameters, the loaded model (drafts whose entries name one model share one loaded object) and sampling
        settings."""
        model = None if self.model is None else id(self.model.model)
        return drafter_key(self.drafter, self.params), model, self.sampling(config)


def target_sampling(config: DecodingConfig) -> SamplingParams:
    """The target's sampling law under ``config`` (every draft's too, unless it sets its own)."""
    return SamplingParams(config.generation.temperature, config.generation.top_k, config.generation.top_p)


def create_verifier(config: DecodingConfig, rows: DraftRows, registry: VerifierRegistry) -> BlockVerifier | None:
    """The config's verifier (None for the target alone), once it has said it takes these draft rows.

    Refusals are one line that says what would work instead.
    """
    if not config.speculative:
        return None
    if rows.count == 0:
        raise UsageError("no draft to speculate with: add a 'draft:' section to the recipe, or use --autoregressive")
    verifier = registry.resolve(
        config.verifier.name, config.verifier.params, draft_length=config.speculation.draft_length
    ).verifier
    _check_compilable(config, verifier)
    _check_judged_laws(verifier, rows, registry)
    reason = registry.refusal(config.verifier.name, rows)
    if reason is None:
        return verifier
    if rows.dependent and not verifier.dependent_drafts:  # the reason names the rules that take such rows
        raise UsageError(reason)
    if rows.count > (verifier.max_drafts or rows.count):
        takes_more = registry.names_where(lambda cls: cls.max_drafts is None or cls.max_drafts >= rows.count)
        hint = f"lower --num-drafts (K × draft configs = {rows.count}), or use {', '.join(takes_more)}"
    else:
        different = registry.names_where(lambda cls: not cls.identical_drafts and (cls.max_drafts or 2) > 1)
        hint = f"use one draft config, or a verifier for different drafts ({', '.join(different)})"
    raise UsageError(f"{reason}; {hint}")


def create_exact_verifier(
    config: DecodingConfig, rows: DraftRows, registry: VerifierRegistry, verifier: BlockVerifier | None
) -> BlockVerifier | None:
    """The lossless rule that decides the blocks starting before ``speculation.exact_first`` (its
    ``speculation.exact_verifier``, at its defaults), once it has said it takes these draft rows; None where no block
    needs it: exact_first 0, the target alone (``verifier`` None), or a lossless ``verifier``, exact already.

    The name is checked whenever the run speculates, so a mistyped setting is one line even while it is unused.
    """
    if verifier is None:
        return None
    name = exact_verifier_name(config.speculation.exact_verifier, registry)
    if config.speculation.exact_first == 0 or verifier.lossless:
        return None
    exact = registry.resolve(name, {}, draft_length=config.speculation.draft_length).verifier
    _check_compilable(config, exact)
    reason = registry.refusal(name, rows)
    if reason is None:
        return exact
    takers = [other for other in registry.names_where(lambda cls: cls.lossless) if not registry.refusal(other, rows)]
    raise UsageError(
        f"speculation.exact_verifier: {reason}; name a lossless verifier that takes them ({', '.join(takers)})"
    )


def exact_verifier_name(name: str, registry: VerifierRegistry) -> str:
    """The installed lossless verifier ``name`` (``speculation.exact_verifier``) as the registry spells it; one line
    naming the setting where it is unknown or lossy (its first N tokens would not be exact)."""
    try:
        lossless = registry.verifier_class(name).lossless
    except UsageError as error:
        raise UsageError(f"speculation.exact_verifier: {error}") from None
    canonical = registry.canonical(name)
    if not lossless:
        default = VerifierConfig().name
        named = sorted(registry.names_where(lambda cls: cls.lossless), key=lambda other: other != default)
        lossy = f"speculation.exact_verifier: verifier '{canonical}' is lossy"
        raise UsageError(f"{lossy}; name a lossless verifier ({', '.join(named)})")
    return canonical


def exact_first_note(config: DecodingConfig, verifier: BlockVerifier | None) -> str | None:
    """One line where ``speculation.exact_first`` is set and changes nothing: ``verifier`` is lossless already."""
    if verifier is None or not verifier.lossless or config.speculation.exact_first == 0:
        return None
    return (
        f"exact_first {config.speculation.exact_first} changes nothing for verifier '{verifier.name}': it is "
        "lossless, so every token it verifies is exact already"
    )


def _check_judged_laws(verifier: BlockVerifier, rows: DraftRows, registry: VerifierRegistry) -> None:
    """A verifier that judges drafts by other laws than the sampling ones (its ``judged_laws``) names laws the engine
    computes, and every drafter of its rows reports them (or is deterministic), or one line."""
    view = verifier.judged_laws
    if view is None:
        return
    if view not in JUDGED_VIEWS:
        raise registry.fault(verifier.name, f"sets judged_laws {view!r}; set one of {', '.join(JUDGED_VIEWS)}, or None")
    if rows.unjudged:
        raise UsageError(
            f"verifier '{verifier.name}' judges drafts by their {view} laws, which drafter '{rows.unjudged[0]}' does "
            "not report; give the verifier parameters that judge by the sampling laws, or a drafter that reports "
            "them (the model and early-exit drafters do)"
        )


def _check_compilable(config: DecodingConfig, verifier: BlockVerifier) -> None:
    """Under ``speculation.compile``, a verifier that torch.compile can trace (keyed randomness), or one line."""
    if config.speculation.compile and not verifier.keyed_randomness:
        raise UsageError(
            f"verifier '{verifier.name}' draws from a torch.Generator, which torch.compile cannot "
            "trace; drop speculation.compile (--compile) for it"
        )


def load_drafts(
    pool: ModelPool, specs: Sequence[DraftConfig], target: LoadedModel, drafters: DrafterRegistry
) -> list[Draft]:
    """The drafts of ``specs`` for ``target``: each entry's drafter, its model (loaded by the drafter from ``pool``,
    for a drafter that takes one) and its own sampling settings."""
    drafts = []
    for spec in specs:
        name, params = drafters.entry_drafter(spec)
        drafter = drafters.create(name, params)
        model = drafters.guarded(name, "load_model", drafter.load_model, pool, spec, target)
        drafts.append(Draft(model, spec.temperature, spec.top_k, spec.top_p, drafter=name, params=params))
    return drafts
