"""Every model a process decodes with, each loaded once.

``generate``, ``acceptance``, ``bench`` and the library build decoders through
:meth:`~specdec_cli.engine.decoder.SpeculativeDecoder.from_recipe`, which takes its models from a
:class:`ModelPool`: a bench grid of twenty configurations, or an acceptance run that scores
with every draft, loads each model once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..base.recipe import ModelConfig
from .loading import LoadedModel, check_same_tokenizer, derive_early_exit_draft, load_model


class ModelPool:
    """Loaded models, keyed by where they come from and how they run (source, dtype, device, ...).

    Two draft configs that differ only in sampling settings share one model; a draft with the
    target's own settings is the target's model object.
    """

    def __init__(self, loader: Callable[[ModelConfig, str], LoadedModel] = load_model):
        self._loader = loader
        self._models: dict[Any, LoadedModel] = {}

    def target(self, spec: ModelConfig) -> LoadedModel:
        return self._get(_model_key(spec), lambda: self._loader(spec, "target"))

    def draft(self, spec: ModelConfig, target: LoadedModel) -> LoadedModel:
        """A draft model, loaded and checked to share the target's tokenizer."""
        loaded = self.draft_with_own_tokenizer(spec)
        check_same_tokenizer(target, loaded)
        return loaded

    def draft_with_own_tokenizer(self, spec: ModelConfig) -> LoadedModel:
        """A draft model whose tokenizer may differ from the target's (the retokenize drafter maps text between
        the two), so it is not checked against the target's."""
        return self._get(_model_key(spec), lambda: self._loader(spec, "draft"))

    def early_exit(self, target: LoadedModel, layers: int) -> LoadedModel:
        """A draft derived from ``target``'s first ``layers`` decoder layers (its weights shared)."""
        return self._get(("early_exit", id(target.model), layers), lambda: derive_early_exit_draft(target, layers))

    def models(self) -> list[LoadedModel]:
        """Every model loaded so far, in loading order."""
        return list(self._models.values())

    def _get(self, key: Any, load: Callable[[], LoadedModel]) -> LoadedModel:
        if key not in self._models:
            self._models[key] = load()
        return self._models[key]


def _model_key(spec: ModelConfig) -> ModelConfig:
    """The part of a model or draft config that decides which weights are loaded, and how."""
    return ModelConfig(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelConfig)})
