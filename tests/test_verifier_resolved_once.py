"""A verifier resolved once (#42): each command builds each verifier it runs (a name, its parameters, a KL bound, a
sweep point, the draft length it is told) once, in
:meth:`~specdec_cli.plugins.registry.VerifierRegistry.resolve`, and hands that value to its checks and decoders.

The count is of the plugin registry's constructions, through the real commands on tiny models: before the change,
``generate --verifier mentored --kl 0.5`` built mentored five times before its first token."""

from __future__ import annotations

import collections
import json

import pytest

from specdec_cli.plugins.plugin_registry import PluginRegistry
from specdec_cli.plugins.registry import VerifierRegistry
from tests.conftest import bench_on_files, tiny_recipe


@pytest.fixture
def built(monkeypatch) -> collections.Counter:
    """Verifier constructions in the test, by (name, parameters)."""
    counts: collections.Counter = collections.Counter()
    create = PluginRegistry.create

    def counted(self, name, params=None, set_by=None):
        if isinstance(self, VerifierRegistry):
            counts[name, json.dumps(params or {}, sort_keys=True)] += 1
        return create(self, name, params, set_by)

    monkeypatch.setattr(PluginRegistry, "create", counted)
    return counts


def _built_once(built: collections.Counter, *expected: tuple[str, dict]) -> None:
    for name, params in expected:  # each was built: the check below can fail
        assert built[name, json.dumps(params, sort_keys=True)] >= 1, built
    assert set(built.values()) == {1}, built


@pytest.mark.parametrize(
    ("verifiers", "expected"),
    [
        ("mentored", [("mentored", {"kl": 0.5})]),
        ("mentored,speculative,none", [("mentored", {"kl": 0.5}), ("speculative", {})]),
    ],
    ids=["one", "compared"],
)
def test_generate_builds_each_verifier_once(run, tiny_models, write_recipe, built, verifiers, expected):
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama")))
    code, _, err = run(
        ["generate", "-r", recipe, "--verifier", verifiers, "--kl", "0.5", "--max-new-tokens", "4", "a b"]
    )
    assert code == 0, err
    _built_once(built, *expected)


def test_bench_builds_each_cells_verifier_once(run, tiny_models, write_recipe, data, built):
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 4})))
    arguments = bench_on_files(recipe, data, None, verifier="mentored,ensemble", kl="0.5,1", limit=2)
    code, _, err = run([*arguments, "--sweep", "ensemble.weight=0.2,0.5"])
    assert code == 0, err
    _built_once(
        built,
        *[("mentored", {"kl": bound}) for bound in (0.5, 1.0)],
        *[("ensemble", {"weight": weight}) for weight in (0.2, 0.5)],
    )


def test_acceptance_builds_each_rows_verifier_once(run, tiny_models, write_recipe, built):
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 4})))
    code, _, err = run(
        ["acceptance", "-r", recipe, "a b", "--verifier", "speculative,mentored", "--kl", "0.5,1", "--num-drafts", "1"]
    )
    assert code == 0, err
    _built_once(built, ("speculative", {}), *[("mentored", {"kl": bound}) for bound in (0.5, 1.0)])


def test_a_registry_resolves_a_name_and_its_parameters_once_per_draft_length():
    registry = VerifierRegistry()
    first = registry.resolve("Mentored", {"kl": 0.5, "max_support": 3}, taken_only=True, draft_length=4)
    again = registry.resolve("mentored", {}, kl_bound=0.5, draft_length=4)
    assert again.verifier is first.verifier and again.kl_bound == 0.5 and first.kl_bound is None
    assert first.name == "mentored" and first.params == {"kl": 0.5} and first.bound == 0.5
    assert registry.resolve("mentored", {"kl": 0.5}, draft_length=8).verifier is not first.verifier
    assert registry.resolve("mentored", {"kl": 1.0}, draft_length=4).verifier is not first.verifier
    assert VerifierRegistry().resolve("mentored", {"kl": 0.5}, draft_length=4).verifier is not first.verifier
    checked = registry.resolve("mentored", {"kl": 2.0})  # a command's check: no draft length yet
    told = registry.resolve("mentored", {"kl": 2.0}, draft_length=4)
    assert told.verifier is checked.verifier and told.draft_length == 4
    assert registry.resolve("mentored", {"kl": 2.0}).verifier is checked.verifier
