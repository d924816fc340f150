"""Third-party plugins that misbehave, the registry that finds them and its description cache, and the
engine's guards on what it is given (issue 19, section 3).

A plugin defined here is added to a registry through its seam (``VerifierRegistry(extra={name: cls})``), or, where
the entry point itself is the subject (a module that exits on import, two packages claiming one name, a command
that builds its own registry), named by an entry point that the registry's ``entry_points`` lists beside the
installed ones.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from stevedore.extension import ExtensionManager

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import SpecdecError, UsageError
from specdec_cli.base.recipe import build_recipe
from specdec_cli.plugins.registry import PluginEntry, VerifierRegistry
from specdec_cli.plugins.verifiers import BlockDecision, BlockVerifier
from tests.conftest import one_error_line, tiny_recipe

# --------------------------------------------------------------------------- a verify_block that misbehaves

Decide = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


class Rogue(BlockVerifier):
    """A third-party verifier whose decision is whatever ``decide(target_probs, draft_probs, draft_tokens)`` makes."""

    name = "rogue"
    lossless = True
    max_drafts = None

    @staticmethod
    def decide(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor) -> object:
        raise NotImplementedError

    def verify_block(self, target_probs, draft_probs, draft_tokens, generator=None):
        return self.decide(target_probs, draft_probs, draft_tokens)


def rogue_deciding(decide: Decide) -> type[Rogue]:
    return type("Rogue", (Rogue,), {"decide": staticmethod(decide), "__module__": __name__})


def _long(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.long)


def _accepting(num_accepted: int | None, row: int = 0, shift: int = 0) -> Decide:
    """A decision claiming row ``row``'s first ``num_accepted`` drafts (all of them: None) with row 0's
    tokens, each shifted by ``shift`` in the vocabulary, then a correction."""

    def decide(target_probs, draft_probs, draft_tokens):
        vocab = target_probs.shape[-1]
        tokens = torch.cat([(draft_tokens[0] + shift) % vocab, draft_tokens[0, :1]])  # [L+1]
        claimed = draft_tokens.shape[1] if num_accepted is None else num_accepted
        return BlockDecision(tokens, _long(claimed), _long(row))

    return decide


def _committing(token: Callable[[int], int]) -> Decide:
    """A decision accepting nothing and committing ``token(V)``, for a vocabulary of V ids."""

    def decide(target_probs, draft_probs, draft_tokens):
        block = torch.full((draft_tokens.shape[1] + 1,), token(target_probs.shape[-1]))  # [L+1]
        return BlockDecision(block, _long(0), _long(0))

    return decide


def _with_tokens(make: Callable[[torch.Tensor], object]) -> Decide:
    """A decision whose tokens are ``make(row 0's drafts followed by its first draft)`` and nothing accepted."""
    return lambda t, p, d: BlockDecision(make(torch.cat([d[0], d[0, :1]])), _long(0), _long(0))


def _raising(error: Exception) -> Decide:
    def decide(target_probs, draft_probs, draft_tokens):
        raise error

    return decide


DRAFT_LENGTH = 3
MISBEHAVIOURS = [  # (what the plugin does, what the one line says it returned)
    ("None", lambda t, p, d: None, "returned None instead of a BlockDecision"),
    ("a tuple", lambda t, p, d: (d[0], 0, 0), "returned a tuple instead of a BlockDecision"),
    ("short tokens", lambda t, p, d: BlockDecision(d[0], _long(0), _long(0)), "tokens of shape [3]"),
    ("tokens [1, L+1]", _with_tokens(lambda x: x.view(1, -1)), "tokens of shape [1, 4]"),
    (
        "num_accepted [1]",
        lambda t, p, d: BlockDecision(torch.cat([d[0], d[0, :1]]), torch.zeros(1, dtype=torch.long), _long(0)),
        "num_accepted of shape [1]",
    ),
    (
        "an int row",
        lambda t, p, d: BlockDecision(torch.cat([d[0], d[0, :1]]), _long(0), 0),
        "row as int, not as a tensor",
    ),
    ("float tokens", _with_tokens(lambda x: x.float()), "tokens of dtype torch.float32"),
    ("NaN tokens", _with_tokens(lambda x: torch.full(x.shape, float("nan"))), "tokens of dtype torch.float32"),
    ("bool tokens", _with_tokens(lambda x: x > 0), "tokens of dtype torch.bool"),
    ("tokens on another device", _with_tokens(lambda x: x.to("meta")), "tokens on meta"),
    ("a token past the vocabulary", _committing(lambda vocab: vocab), "outside the vocabulary of"),
    ("a negative token", _committing(lambda vocab: -1), "returned token -1, outside the vocabulary"),
    ("num_accepted > L", _accepting(DRAFT_LENGTH + 2), "returned num_accepted 5 for a block of 3 draft tokens"),
    ("num_accepted < 0", _accepting(-1), "returned num_accepted -1 for a block of 3 draft tokens"),
    ("row out of range", _accepting(1, row=1), "returned row 1 for a block of 1 draft row"),
    (
        "accepted tokens that are not the drafts",
        _accepting(DRAFT_LENGTH, shift=1),
        "which are not row 0's first 3 draft",
    ),
    ("an exception", _raising(RuntimeError("shape mismatch\nsecond line")), "raised RuntimeError: shape mismatch"),
    ("a KeyError", _raising(KeyError("draft_probs")), "raised KeyError: 'draft_probs'"),
]


def _decoder(tiny_models, registry: VerifierRegistry, verifier: str = "rogue", **recipe) -> SpeculativeDecoder:
    data = tiny_recipe(
        tiny_models, "llama", verifier={"name": verifier}, speculation={"draft_length": DRAFT_LENGTH}, **recipe
    )
    return SpeculativeDecoder.from_recipe(build_recipe(data), registry=registry)


@pytest.mark.parametrize(
    ("decide", "returned"), [row[1:] for row in MISBEHAVIOURS], ids=[row[0] for row in MISBEHAVIOURS]
)
def test_a_misbehaving_verify_block_stops_with_one_line_naming_the_plugin(tiny_models, decide, returned):
    decoder = _decoder(tiny_models, VerifierRegistry(extra={"rogue": rogue_deciding(decide)}))
    with pytest.raises(SpecdecError) as caught:
        decoder.generate(["a b c"])
    message = str(caught.value)
    assert caught.value.exit_code == 1 and "\n" not in message, message
    assert message.startswith("verifier 'rogue' ") and returned in message, message
    assert f"the plugin is at fault (module {__name__}): report it to its author" in message


def test_a_plugins_exception_stays_chained_for_debug(tiny_models):
    error = ZeroDivisionError("division by zero")
    decoder = _decoder(tiny_models, VerifierRegistry(extra={"rogue": rogue_deciding(_raising(error))}))
    with pytest.raises(SpecdecError) as caught:
        decoder.generate(["a b c"])
    assert caught.value.__cause__ is error


def test_a_plugin_that_decides_right_passes_the_checks(tiny_models):
    """Negative control: the checks refuse nothing a correct decision returns (accept none, or all)."""
    for num_accepted in (0, None):
        decoder = _decoder(tiny_models, VerifierRegistry(extra={"rogue": rogue_deciding(_accepting(num_accepted))}))
        stats = decoder.generate(["a b c"], max_new_tokens=13)[0].stats
        # Accepting all keeps every token but each block's bonus (an EOS may cut the last block short).
        accepted_all = stats.new_tokens - stats.blocks <= stats.accepted_tokens <= stats.drafted_tokens
        assert (stats.accepted_tokens == 0 if num_accepted == 0 else accepted_all) and stats.blocks > 1


ClaimsTooMany = rogue_deciding(_accepting(DRAFT_LENGTH + 2))


def test_a_misbehaving_plugin_in_generate_is_one_line_and_exit_1(run, tiny_models, write_recipe, monkeypatch):
    entry = PluginEntry("rogue", f"{__name__}:ClaimsTooMany", "rogue-plugin", "0.1")
    original = VerifierRegistry.entry_points
    monkeypatch.setattr(VerifierRegistry, "entry_points", lambda self: [*original(self), entry])
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", speculation={"draft_length": DRAFT_LENGTH})))
    code, _, err = run(["generate", "-r", recipe, "--verifier", "rogue", "a b c"])
    assert code == 1
    one_error_line(err, "verifier 'rogue' returned num_accepted 5 for a block of 3 draft tokens")
    assert "(rogue-plugin 0.1)" in err


class FailsToStart(Rogue):
    error: Exception = RuntimeError("no GPU found")

    def __init__(self, *, strength: float = 1.0):
        raise self.error


@pytest.mark.parametrize("error", [RuntimeError("no GPU found"), KeyError("weights"), AttributeError("x")])
def test_a_constructor_raising_other_than_a_parameter_error_is_one_line(tiny_models, error):
    registry = VerifierRegistry(
        extra={"rogue": type("FailsToStart", (FailsToStart,), {"error": error, "__module__": __name__})}
    )
    with pytest.raises(SpecdecError) as caught:
        registry.create("rogue", {"strength": 2.0})
    assert not isinstance(caught.value, UsageError) and caught.value.__cause__ is error
    message = str(caught.value)
    assert message.startswith(f"verifier 'rogue' failed to start: {type(error).__name__}: "), message
    assert "the plugin is at fault" in message and "\n" not in message


# --------------------------------------------------------------------------- plugins as entry points


@pytest.fixture
def plugin_modules(tmp_path, monkeypatch):
    """write(name, source): a module (or ``pkg/mod`` path) on sys.path, forgotten by sys.modules afterwards."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # a same-size, same-time edit must not load a stale .pyc
    written: list[str] = []

    def write(name: str, source: str) -> Path:
        path = folder / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        written.append(name.split("/")[0])
        return path

    yield write
    for module in list(sys.modules):
        if module.split(".")[0] in written:
            del sys.modules[module]


class RegistryWithEntries(VerifierRegistry):
    """The installed entry points plus fake ones (as importlib.metadata would list them)."""

    def __init__(self, listed: list[PluginEntry]):
        super().__init__()
        self.listed = listed

    def entry_points(self):
        return [*super().entry_points(), *self.listed]


PLUGIN_CLASS = """
    from specdec_plugins.speculative import SpeculativeSampling

    class Plugin(SpeculativeSampling):
        name = "{name}"
"""

BROKEN_MODULES = [  # (module source, what the failure line says)
    ("import sys\nsys.exit(3)\n", "it called sys.exit(3) on import"),
    ("raise SystemExit('bye')\n", "it called sys.exit('bye') on import"),
    ("class Stop(BaseException):\n    pass\nraise Stop('not an Exception')\n", "Stop: not an Exception"),
    ("assert False, 'checked on import'\n", "AssertionError: checked on import"),
    ("raise ImportError('needs cupy')\n", "ImportError: needs cupy"),
    ("def Plugin():\n    pass\n", "it names a function, not a BlockVerifier subclass"),
    (
        "from specdec_cli.verifiers import BlockVerifier\nclass Plugin(BlockVerifier):\n"
        "    name, lossless = 'x', True\n"
        "    def verify_block(self, *args):\n        pass\n",
        "does not set max_drafts",
    ),
    (
        "from specdec_cli.verifiers import BlockVerifier\nclass Plugin(BlockVerifier):\n    name, max_drafts = 'x', 1\n"
        "    def verify_block(self, *args):\n        pass\n",
        "does not set lossless",
    ),
    (
        "from specdec_plugins.speculative import SpeculativeSampling\nclass Plugin(SpeculativeSampling):\n"
        "    token_level = 1\n",
        "does not set token_level to True or False",
    ),
    (
        "from specdec_cli.verifiers import BlockVerifier\nclass Plugin(BlockVerifier):\n"
        "    name, lossless, max_drafts = "
        "'x', True, 0\n    def verify_block(self, *args):\n        pass\n",
        "max_drafts = 0",
    ),
    (
        "from specdec_cli.verifiers import BlockVerifier\nclass Plugin(BlockVerifier):\n"
        "    name, lossless, max_drafts = "
        "'x', True, 1\n",
        "leaves abstract methods unimplemented: verify_block",
    ),
    (
        "from specdec_plugins.speculative import SpeculativeSampling\nclass Plugin(SpeculativeSampling):\n"
        "    kl_bound_parameter = 'budget'\n",
        "kl_bound_parameter 'budget' is not one of its parameters",
    ),
]


@pytest.mark.parametrize(("source", "failure"), BROKEN_MODULES)
def test_a_plugin_that_cannot_be_used_is_a_load_failure_not_the_end(plugin_modules, source, failure):
    plugin_modules("broken_plugin", source)
    registry = RegistryWithEntries([PluginEntry("broken", "broken_plugin:Plugin", "broken-plugin", "0.1")])
    assert "broken" not in registry.names() and "speculative" in registry.names()
    assert failure in registry.failures()["broken"], registry.failures()
    with pytest.raises(UsageError, match=f"verifier 'broken' is installed but failed to load: .*{failure[:12]}"):
        registry.create("broken")


IMPORT_FAILURES = [("raise ImportError('needs cupy')\n", ImportError), ("import sys\nsys.exit(3)\n", SystemExit)]


@pytest.mark.parametrize(("source", "error_type"), IMPORT_FAILURES)
def test_plugins_are_imported_by_stevedore_which_reports_a_failure_to_the_registry(plugin_modules, source, error_type):
    """An ImportError stevedore catches itself; sys.exit it lets through, and the registry's manager hands it over."""
    plugin_modules("broken_plugin", source)
    reported = []

    class Recording(RegistryWithEntries):
        def load_failed(self, manager, entry_point, error):
            reported.append((manager, entry_point.value, error))
            super().load_failed(manager, entry_point, error)

    registry = Recording([PluginEntry("broken", "broken_plugin:Plugin", "broken-plugin", "0.1")])
    assert "broken" in registry.failures() and "speculative" in registry.names()
    [(manager, value, error)] = reported
    assert isinstance(manager, ExtensionManager) and value == "broken_plugin:Plugin" and type(error) is error_type


def test_a_plugin_exiting_on_import_is_listed_and_other_commands_work(
    run, plugin_modules, tiny_models, write_recipe, monkeypatch, tmp_path
):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    plugin_modules("exits_plugin", "import sys\nsys.exit(3)\n")
    entries = [PluginEntry("exits", "exits_plugin:Plugin", "exits-plugin", "0.1")]
    original = VerifierRegistry.entry_points
    monkeypatch.setattr(VerifierRegistry, "entry_points", lambda self: [*original(self), *entries])
    code, out, _ = run(["verifiers", "--json"])
    assert code == 0
    failed = json.loads(out)["failed"]
    assert failed == [{"name": "exits", "error": "it called sys.exit(3) on import"}]
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 3})))
    assert run(["generate", "-r", recipe, "a b"])[0] == 0
    code, _, err = run(["generate", "-r", recipe, "--verifier", "exits", "a b"])
    assert code == 2
    one_error_line(err, "verifier 'exits' is installed but failed to load: it called sys.exit(3) on import")


def test_the_built_in_wins_a_name_and_the_other_is_listed_as_a_conflict(run, plugin_modules, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    plugin_modules("shadow_plugin", PLUGIN_CLASS.format(name="speculative"))
    entries = [PluginEntry("speculative", "shadow_plugin:Plugin", "otherpkg", "1.0")]
    registry = RegistryWithEntries(entries)
    assert registry.load_class("speculative").__module__ == "specdec_plugins.speculative"
    conflict = (
        "'speculative' from otherpkg 1.0 conflicts with the built-in verifier of specdec-cli; rename its entry point"
    )
    assert registry.failures() == {"speculative (otherpkg 1.0)": conflict}
    assert registry.describe()["speculative"]["package"].startswith("specdec-cli ")
    original = VerifierRegistry.entry_points
    monkeypatch.setattr(VerifierRegistry, "entry_points", lambda self: [*original(self), *entries])
    code, out, _ = run(["verifiers"])
    assert code == 0 and "failed to load speculative (otherpkg 1.0): " in out, out


def test_one_class_declared_twice_is_no_conflict():
    """An environment that kept the project's old distribution declares the same classes again."""
    built_in = next(e for e in VerifierRegistry().entry_points() if e.name == "speculative")
    registry = RegistryWithEntries([PluginEntry("speculative", built_in.value, "specdec", "0.0.9")])
    assert registry.failures() == {} and registry.load_class("speculative").__module__ == "specdec_plugins.speculative"


def test_two_third_party_plugins_with_one_name_are_an_error_naming_both(plugin_modules):
    plugin_modules("twin_a", PLUGIN_CLASS.format(name="twin"))
    plugin_modules("twin_b", PLUGIN_CLASS.format(name="twin"))
    registry = RegistryWithEntries(
        [PluginEntry("twin", "twin_a:Plugin", "twin-a", "1.0"), PluginEntry("Twin", "twin_b:Plugin", "twin-b", "2.0")]
    )
    with pytest.raises(UsageError) as caught:
        registry.create("twin")
    assert "twin-a 1.0 (twin_a:Plugin) and twin-b 2.0 (twin_b:Plugin)" in str(caught.value), str(caught.value)
    assert "uninstall one" in str(caught.value) and "twin" in registry.failures()


def test_a_plugin_named_otherwise_than_its_entry_point_runs_under_the_entry_point_name(
    run, plugin_modules, tiny_models, monkeypatch, tmp_path
):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    plugin_modules("renamed_plugin", PLUGIN_CLASS.format(name="Something Else"))
    entries = [PluginEntry("Renamed", "renamed_plugin:Plugin", "renamed", "0.1")]
    registry = RegistryWithEntries(entries)
    cls = registry.verifier_class("RENAMED")
    assert cls.name == "renamed" and registry.create("renamed").name == "renamed"
    with pytest.raises(UsageError, match="verifier 'renamed': unknown parameter"):  # the base class's message
        registry.create("renamed", {"x": 1})
    assert _decoder(tiny_models, registry, "renamed").generate("a b")[0].stats.blocks >= 1
    original = VerifierRegistry.entry_points
    monkeypatch.setattr(VerifierRegistry, "entry_points", lambda self: [*original(self), *entries])
    code, out, _ = run(["verifiers", "--json"])
    [listed] = [row for row in json.loads(out)["verifiers"] if row["name"] == "renamed"]
    assert listed["note"] == "its class calls itself 'Something Else'; the entry-point name 'renamed' is the one used"


# --------------------------------------------------------------------------- the description cache


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        '{"speculative": "yes"}',
        '{"speculative": {"lossless": true}}',
        '{"speculative": {"error": 3}}',
        '"text"',
        "{",
    ],
)
def test_a_description_cache_of_the_wrong_shape_is_rebuilt(monkeypatch, tmp_path, content):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    VerifierRegistry().describe()
    [cache] = tmp_path.glob("verifiers-*.json")
    cache.write_text(content)
    described = VerifierRegistry().describe()
    assert described["speculative"]["max_drafts"] == 1 and described["speculative"]["parameters"] == {}
    assert json.loads(cache.read_text())["speculative"]["lossless"] is True


EDITABLE = """
    from specdec_plugins.speculative import SpeculativeSampling

    class Plugin(SpeculativeSampling):
        name = "edited"
        max_drafts = {drafts}

        def __init__(self, *, strength: float = {strength}):
            pass
"""


def _set_mtime(path: Path, mtime_ns: int) -> None:
    os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.mark.parametrize("layout", ["package/impl", "module"])
def test_an_edited_plugin_is_described_anew(plugin_modules, monkeypatch, tmp_path, layout):
    """The class in a submodule of the entry point's package, or an edit of the same size within the same second."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    if layout == "package/impl":
        plugin_modules("edited_plugin/__init__", "from .impl import Plugin\n")
        path = plugin_modules("edited_plugin/impl", EDITABLE.format(drafts=1, strength=1.0))
        for file in path.parent.iterdir():
            _set_mtime(file, time.time_ns() - 60 * 10**9)  # written a minute ago: the cache is written
    else:  # written just now, and edited again within the same second
        path = plugin_modules("edited_plugin", EDITABLE.format(drafts=1, strength=1.0))
    entries = [PluginEntry("edited", "edited_plugin:Plugin", "edited", "0.1")]
    first = RegistryWithEntries(entries).describe()["edited"]
    assert (first["parameters"], first["max_drafts"]) == ({"strength": 1.0}, 1)
    # Kept unless a file is so fresh that an edit may not change its time: the key itself is under test.
    assert bool(list((tmp_path / "cache").glob("verifiers-*.json"))) == (layout == "package/impl")
    mtime = path.stat().st_mtime_ns
    path.write_text(textwrap.dedent(EDITABLE.format(drafts=2, strength=2.0)))  # the same size
    if layout == "module":
        _set_mtime(path, mtime)  # a coarse filesystem: the same modification time
    for module in [m for m in sys.modules if m.startswith("edited_plugin")]:
        monkeypatch.delitem(sys.modules, module)
    second = RegistryWithEntries(entries).describe()["edited"]
    assert (second["parameters"], second["max_drafts"]) == ({"strength": 2.0}, 2)


# --------------------------------------------------------------------------- what the library is given


def test_one_string_is_one_prompt(tiny_models):
    decoder = _decoder(tiny_models, VerifierRegistry(), "speculative", generation={"max_new_tokens": 3})
    results = decoder.generate("ab", num_samples=2)
    assert [(r.prompt, r.sample_index) for r in results] == [("ab", 0), ("ab", 1)]


@pytest.mark.parametrize(
    ("prompts", "num_samples", "message"),
    [
        (5, 1, "prompts must be a string or a list of strings, not int"),
        (None, 1, "prompts must be a string or a list of strings, not NoneType"),
        ({"a": 1}, 1, "prompts must be a string or a list of strings, not dict"),
        (b"ab", 1, "prompts must be a string or a list of strings, not bytes"),
        (["a", 3], 1, "prompt 1 is int, not text"),
        ([b"a"], 1, "prompt 0 is bytes, not text"),
        (["a"], 0, "num_samples must be a whole number >= 1, got 0"),
        (["a"], -2, "num_samples must be a whole number >= 1, got -2"),
        (["a"], 1.5, "num_samples must be a whole number >= 1, got 1.5"),
    ],
)
def test_what_generate_cannot_take_is_one_clear_error(tiny_models, prompts, num_samples, message):
    decoder = _decoder(tiny_models, VerifierRegistry(), "speculative")
    with pytest.raises(UsageError, match=message):
        decoder.generate(prompts, num_samples=num_samples)


def test_a_prompt_too_large_to_encode_says_to_shorten_it(tiny_models):
    """A T5 target has no position limit; a prompt whose attention cannot be allocated is one line, not a traceback."""
    data = tiny_recipe(tiny_models, "t5", speculation={"draft_length": 2}, generation={"max_new_tokens": 2})
    decoder = SpeculativeDecoder.from_recipe(build_recipe(data))
    prompt_ids = [3] * 30_000  # attention over 30k positions: several GB per tensor
    with _address_space_limited(extra_bytes=2 << 30), pytest.raises(SpecdecError) as caught:
        decoder.generate_ids(prompt_ids, 0)
    message = str(caught.value)
    assert message.startswith("out of memory") and "shorten the prompt (30000 tokens)" in message, message
    assert "\n" not in message and caught.value.__cause__ is not None


def test_running_out_of_memory_later_names_the_options_to_lower(tiny_models, monkeypatch):
    from specdec_cli.engine.decoder import DecodingRun

    decoder = _decoder(tiny_models, VerifierRegistry(), "speculative", generation={"max_new_tokens": 20})
    score = DecodingRun._score
    calls = iter(range(10**6))

    def fails_on_the_third(*args, **kwargs):
        if next(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total ...")
        return score(*args, **kwargs)

    monkeypatch.setattr(DecodingRun, "_score", fails_on_the_third)
    with pytest.raises(SpecdecError) as caught:
        decoder.generate("a b c")
    message = str(caught.value)
    assert "20.00 GiB" in message and "lower --max-new-tokens (20), --num-drafts (1) or --draft-length (3)" in message


class _address_space_limited:
    """Limit this process's address space to what it uses now plus ``extra_bytes`` (Linux), so an
    allocation the test provokes fails at once whatever the machine's memory."""

    def __init__(self, extra_bytes: int):
        self.extra_bytes = extra_bytes

    def __enter__(self):
        if not Path("/proc/self/statm").exists():
            pytest.skip("needs Linux's /proc to measure the address space")
        used = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        self.previous = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (used + self.extra_bytes, self.previous[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_AS, self.previous)


# --------------------------------------------------------------------------- a plugin's other methods raising


class RefusesBadly(Rogue):
    """A plugin whose draft check itself raises."""

    @classmethod
    def reason_to_refuse(cls, num_drafts, identical_laws):
        raise AttributeError("no attribute 'limit'")


class AcceptsBadly(Rogue):
    """A token-level plugin whose acceptance_probability raises (acceptance calls it on real laws); its verify_block
    is Rogue's, which raises NotImplementedError."""

    name = "accepts-badly"
    max_drafts = 1
    token_level = True

    def acceptance_probability(self, target_probs, draft_probs):
        raise IndexError("index 7 is out of bounds")


def test_a_draft_check_that_raises_is_one_line_in_the_engine_and_the_grid(tiny_models):
    from specdec_cli.bench.grid import Grid

    registry = VerifierRegistry(extra={"rogue": RefusesBadly})
    with pytest.raises(
        SpecdecError, match=r"verifier 'rogue' raised AttributeError: no attribute 'limit' in reason_to_refuse"
    ):
        _decoder(tiny_models, registry)
    recipe = build_recipe(tiny_recipe(tiny_models, "llama"))
    grid = Grid(verifiers=("rogue",), kl=(), num_drafts=(1,), draft_lengths=(2,), temperatures=(1.0,))
    with pytest.raises(SpecdecError, match="in reason_to_refuse"):
        grid.cells(registry, recipe)


def test_an_acceptance_probability_that_raises_is_one_line_naming_the_plugin(tiny_models):
    from specdec_cli.acceptance.analysis import AcceptanceAnalysis
    from specdec_cli.acceptance.results import AcceptanceRequest

    registry = VerifierRegistry(extra={"accepts-badly": AcceptsBadly})
    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 3}))
    analysis = AcceptanceAnalysis(
        recipe, AcceptanceRequest(verifiers=("accepts-badly",), num_drafts=(1,)), registry=registry
    )
    with pytest.raises(SpecdecError, match=r"verifier 'accepts-badly' raised IndexError: index 7 is out of bounds"):
        analysis.run(["a b"])


_LIST_VERIFIERS = (
    "from specdec_cli.plugins.registry import VerifierRegistry\n"
    "print(sorted(entry.name for entry in VerifierRegistry().entry_points()))"
)


def _listed_verifiers(cache: Path) -> subprocess.CompletedProcess:
    """The verifiers a fresh process finds, with stevedore's entry-point cache under ``cache``."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "SPECDEC_CACHE": str(cache / "specdec")}
    checkout = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, "-c", _LIST_VERIFIERS], env=env, cwd=checkout, capture_output=True, text=True
    )


def test_plugins_are_found_through_stevedores_cache_and_a_damaged_one_is_not_trusted(tmp_path):
    """The registry lists what stevedore's cache file says (an entry written there is listed), and a file no
    listing can hold (stevedore trusts any JSON it reads) gives the environment's own listing, not a crash."""
    first = _listed_verifiers(tmp_path)
    assert first.returncode == 0, first.stderr
    assert "'speculative'" in first.stdout, first.stdout
    if sys.executable.startswith("/tmp"):
        # stevedore keeps no cache for an interpreter under /tmp: the listing then comes from the metadata alone
        assert not (tmp_path / "python-entrypoints").exists()
        return
    files = list((tmp_path / "python-entrypoints").iterdir())
    assert files, "stevedore wrote no cache: the test would not test it"
    listing = json.loads(files[0].read_text())
    listing["groups"]["specdec.verifiers"].append(["ghost", "ghost_plugin:Ghost", "specdec.verifiers"])
    files[0].write_text(json.dumps(listing))
    assert "'ghost'" in _listed_verifiers(tmp_path).stdout  # read from stevedore's cache, not the metadata
    for damaged in ("[1, 2]", '{"groups": {"specdec.verifiers": [["x"]]}}', '{"groups": {"specdec.verifiers": 5}}'):
        files[0].write_text(damaged)
        again = _listed_verifiers(tmp_path)
        assert again.returncode == 0 and again.stdout == first.stdout, (damaged, again.stderr)
