"""The registry's seam for tests and embedders (a class added in-process, as an entry point would name it), and
looking up one name importing that plugin alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_cli.base.errors import UsageError
from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.registry import PluginEntry, VerifierRegistry
from specdec_plugins.prompt_lookup import PromptLookup
from specdec_plugins.speculative import SpeculativeSampling


class Instrumented(SpeculativeSampling):
    """An embedder's rule: speculative sampling under another name."""

    name = "instrumented"


class CalledOtherwise(SpeculativeSampling):
    name = "something else"


class UnsetTokenLevel(SpeculativeSampling):
    token_level = 1


class UnknownBound(SpeculativeSampling):
    kl_bound_parameter = "budget"


def not_a_class():
    """What an entry point may name by mistake."""


class LookupCopy(PromptLookup):
    """Prompt lookup under another name."""

    name = "lookup-copy"


def added(how: str, name: str, cls: object) -> VerifierRegistry:
    """A registry of the installed verifiers plus ``cls`` as ``name``, by the constructor or by ``add``."""
    if how == "extra":
        return VerifierRegistry(extra={name: cls})
    registry = VerifierRegistry()
    registry.add(name, cls)
    return registry


@pytest.mark.parametrize("how", ["extra", "add"])
def test_an_added_class_is_a_plugin_like_an_installed_one(how):
    registry = added(how, "Instrumented", Instrumented)
    assert "instrumented" in registry.names() and "speculative" in registry.names()
    assert type(registry.create("INSTRUMENTED")) is Instrumented
    assert registry.package("instrumented") == f"module {__name__}"
    described = registry.describe()["instrumented"]
    assert described["summary"] == "An embedder's rule: speculative sampling under another name."
    assert described["max_drafts"] == 1 and described["package"] == f"module {__name__}"
    assert "instrumented" not in VerifierRegistry().names()  # negative control: added to that registry only


def test_a_drafter_is_added_the_same_way():
    registry = DrafterRegistry(extra={"lookup-copy": LookupCopy})
    assert {"lookup-copy", "prompt-lookup"} <= set(registry.names())
    assert type(registry.create("lookup-copy")) is LookupCopy
    assert registry.describe()["lookup-copy"]["deterministic"] is True


def test_an_added_class_called_otherwise_runs_under_the_name_it_was_added_as():
    registry = VerifierRegistry(extra={"mine": CalledOtherwise})
    assert registry.create("mine").name == "mine"
    note = registry.describe()["mine"]["note"]
    assert note == "its class calls itself 'something else'; the entry-point name 'mine' is the one used"


def test_an_added_class_takes_the_name_over_an_installed_one():
    registry = VerifierRegistry(extra={"speculative": Instrumented})
    assert type(registry.create("speculative")).__mro__[1] is Instrumented  # renamed to the name it took
    assert registry.package("speculative") == f"module {__name__}"
    assert VerifierRegistry().package("speculative").startswith("specdec-cli ")


def _refusal(registry: VerifierRegistry) -> tuple[str, str]:
    """(The listed failure of 'broken', the line using it raises)."""
    failure = registry.failures()["broken"]
    with pytest.raises(UsageError) as caught:
        registry.create("broken")
    return failure, str(caught.value)


@pytest.mark.parametrize(
    ("broken", "failure"),
    [
        (UnsetTokenLevel, "its class does not set token_level to True or False"),
        (UnknownBound, "its kl_bound_parameter 'budget' is not one of its parameters"),
        (not_a_class, "it names a function, not a BlockVerifier subclass"),
    ],
    ids=["flag", "kl bound", "function"],
)
def test_a_class_breaking_the_contract_is_refused_as_an_entry_point_naming_it_is(monkeypatch, broken, failure):
    by_seam = _refusal(VerifierRegistry(extra={"broken": broken}))
    listed = VerifierRegistry()
    entry = PluginEntry("broken", f"{__name__}:{broken.__name__}", "broken-plugin", "0.1")
    monkeypatch.setattr(listed, "entry_points", lambda: [*VerifierRegistry().entry_points(), entry])
    assert by_seam == _refusal(listed)
    assert failure in by_seam[0] and by_seam[1] == f"verifier 'broken' is installed but failed to load: {by_seam[0]}"
    assert "broken" not in VerifierRegistry(extra={"broken": broken}).names()


def test_added_classes_are_described_but_not_kept_in_the_installed_plugins_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    described = VerifierRegistry(extra={"instrumented": Instrumented, "broken": UnsetTokenLevel}).describe()
    assert described["broken"] == {"error": "its class does not set token_level to True or False"}
    assert "instrumented" in described and "speculative" in described
    kept = [json.loads(path.read_text()) for path in tmp_path.glob("verifiers-*.json")]
    assert kept and all("speculative" in cache and "instrumented" not in cache for cache in kept)
    assert "instrumented" not in VerifierRegistry().describe()


LOOKUPS = """
import json, sys
from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.registry import VerifierRegistry

modules = {
    entry.value.split(":")[0]
    for registry in (VerifierRegistry(), DrafterRegistry())
    for entry in registry.entry_points()
}
imported = {}

def note(what):
    imported[what] = sorted(module for module in modules if module in sys.modules)

note("a registry made")
VerifierRegistry().create("speculative")
note("create speculative")
VerifierRegistry().load_class("specinfer")
note("load_class specinfer")
VerifierRegistry().verifier_class("Block")
note("verifier_class Block")
DrafterRegistry().create("prompt-lookup")
note("create prompt-lookup")
VerifierRegistry().names()
note("names")
print(json.dumps(imported))
"""


def test_looking_up_one_name_imports_that_plugin_alone():
    """In a fresh interpreter, so that no other test's imports count; listing the names is the negative control."""
    checkout = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", LOOKUPS], cwd=checkout, env=dict(os.environ), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout)
    assert imported["a registry made"] == []
    assert imported["create speculative"] == ["specdec_plugins.speculative"]
    assert imported["load_class specinfer"] == ["specdec_plugins.specinfer", "specdec_plugins.speculative"]
    assert "specdec_plugins.block" in imported["verifier_class Block"]
    assert "specdec_plugins.spectr" not in imported["create prompt-lookup"]
    assert "specdec_plugins.prompt_lookup" in imported["create prompt-lookup"]
    assert len(imported["create prompt-lookup"]) == 4
    assert "specdec_plugins.spectr" in imported["names"]  # the check sees a full load
