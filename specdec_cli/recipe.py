"""Recipes and DecodingConfig, for library users who build recipes in code.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.base.recipe`
"""

from __future__ import annotations

from .base.recipe import (
    AUTOREGRESSIVE,
    DTYPES,
    MAX_RECIPE_VALUES,
    DecodingConfig,
    DraftConfig,
    GenerationConfig,
    ModelConfig,
    Recipe,
    SpeculationConfig,
    VerifierConfig,
    apply_overrides,
    build_recipe,
    check_expanded_size,
    load_recipe,
    read_recipe_file,
    sampling_problems,
    set_path,
    shipped_recipe_names,
    target_alone,
    validate,
)

__all__ = [
    "AUTOREGRESSIVE",
    "DTYPES",
    "DecodingConfig",
    "DraftConfig",
    "GenerationConfig",
    "MAX_RECIPE_VALUES",
    "ModelConfig",
    "Recipe",
    "SpeculationConfig",
    "VerifierConfig",
    "apply_overrides",
    "build_recipe",
    "check_expanded_size",
    "load_recipe",
    "read_recipe_file",
    "sampling_problems",
    "set_path",
    "shipped_recipe_names",
    "target_alone",
    "validate",
]
