"""One decoder factory over a model pool, per-call settings, and verifiers that declare what core needs."""

from __future__ import annotations

import math

import pytest
import torch

from specdec_cli import ModelPool, SpeculativeDecoder
from specdec_cli.acceptance import AcceptanceAnalysis, AcceptanceRequest, AcceptanceRow
from specdec_cli.base.errors import UsageError
from specdec_cli.base.recipe import build_recipe
from specdec_cli.bench.grid import Grid
from specdec_cli.models.loading import load_model
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_cli.plugins.verifiers import Verifier
from tests.conftest import tiny_recipe


class CountingLoader:
    """The real loader, counting the loads."""

    def __init__(self):
        self.loads = []

    def __call__(self, spec, role):
        self.loads.append((spec.model, spec.dtype, role))
        return load_model(spec, role)


def test_a_pool_loads_each_model_once_across_decoders(tiny_models):
    loader = CountingLoader()
    pool = ModelPool(loader)
    recipe = tiny_recipe(tiny_models, "llama")
    draft = recipe.pop("draft")
    recipe["drafts"] = [draft, {**draft, "temperature": 1.5}]  # same model, other sampling
    recipe["verifier"] = {"name": "specinfer"}
    built = build_recipe(recipe)
    first = SpeculativeDecoder.from_recipe(built, pool=pool)
    SpeculativeDecoder.from_recipe(built, pool=pool)
    SpeculativeDecoder.from_recipe(built, pool=pool, autoregressive=True)
    assert len(loader.loads) == 2 and len(pool.models()) == 2
    assert len(first.drafters) == 1 and first.num_draft_rows == 2  # one batched forward for both configs


@pytest.mark.parametrize(
    "changes",
    [
        {"verifier": "block", "draft_length": 2},
        {"verifier": "specinfer", "num_drafts": 3, "temperature": 0.7},
        {"verifier": "mentored", "verifier_params": {"kl": 0.3}, "top_k": 4},
        {"verifier": "none"},
    ],
)
def test_per_call_settings_equal_a_decoder_built_with_them(tiny_models, changes):
    """Changing settings per call reloads nothing and gives exactly what a recipe with them gives."""
    loader = CountingLoader()
    base = build_recipe(tiny_recipe(tiny_models, "llama"))
    decoder = SpeculativeDecoder.from_recipe(base, pool=ModelPool(loader))
    per_call = decoder.generate(["a b c", "d"], num_samples=2, **changes)
    assert len(loader.loads) == 2
    sections = {"verifier": {"name": changes["verifier"], "params": changes.get("verifier_params", {})}}
    for name in ("draft_length", "num_drafts"):
        if name in changes:
            sections.setdefault("speculation", {})[name] = changes[name]
    for name in ("temperature", "top_k"):
        if name in changes:
            sections.setdefault("generation", {})[name] = changes[name]
    fresh = SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models, "llama", **sections)))
    expected = fresh.generate(["a b c", "d"], num_samples=2)
    assert [r.token_ids for r in per_call] == [r.token_ids for r in expected]
    assert [r.accepted_mask for r in per_call] == [r.accepted_mask for r in expected]
    assert decoder.config == base.decoding_config()  # the call did not change the decoder


def test_bad_per_call_settings_are_refused(tiny_models):
    decoder = SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models, "llama")))
    with pytest.raises(UsageError, match="speculation.draft_length: must be >= 1"):
        decoder.generate(["a"], draft_length=0)
    with pytest.raises(UsageError, match="takes at most 1 draft"):
        decoder.generate(["a"], num_drafts=2)
    with pytest.raises(TypeError, match="unknown decoding setting 'lenght'"):
        decoder.generate(["a"], lenght=3)
    alone = SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models, "llama")), autoregressive=True)
    with pytest.raises(UsageError, match="no draft to speculate with"):
        alone.generate(["a"], verifier="speculative")


class BudgetedLenient(Verifier):
    """A third-party lossy scheme with a KL bound: accept with min(1, e^budget q/p) (lossy for budget > 0)."""

    name = "budgeted"
    lossless = False
    max_drafts = 1
    kl_bound_parameter = "budget"

    def __init__(self, *, budget: float = 0.0):
        self.scale = float(torch.tensor(budget).exp())

    def conditional(self, target_probs, draft_probs, draft_tokens):
        p, x = draft_probs[..., 0, :], draft_tokens[..., :1]  # [..., V], [..., 1]
        accept = (self.scale * target_probs.gather(-1, x) / p.gather(-1, x)).clamp(max=1.0)  # [..., 1]
        excess = (target_probs - p).clamp_min(0)  # [..., V]
        total = excess.sum(-1, keepdim=True)  # [..., 1]
        residual = torch.where(total > 0, excess / total.clamp_min(1e-300), target_probs)  # [..., V]
        return ((1 - accept) * residual).scatter_add(-1, x, accept)

    def acceptance_probability(self, target_probs, draft_probs):
        return torch.minimum(draft_probs[..., 0, :], self.scale * target_probs).sum(-1)  # [...]

    def output_kl(self, target_probs, draft_probs):
        return torch.full(target_probs.shape[:-1], self.scale - 1, dtype=torch.float64)  # [...]: a marker


def test_a_third_party_kl_bound_gets_the_sweep_and_the_kl_column(tiny_models):
    registry = VerifierRegistry(extra={BudgetedLenient.name: BudgetedLenient})
    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 4}))
    request = AcceptanceRequest(verifiers=("budgeted", "speculative"), num_drafts=(1, 2), kl_values=(0.0, 0.5))
    report = AcceptanceAnalysis(recipe, request, registry=registry).run(["a b", "c"])
    assert [row.label for row in report.rows] == ["optimum", "budgeted D=0", "budgeted D=0.5", "speculative"]
    assert report.kl(AcceptanceRow("budgeted", kl_bound=0.5)).mean == pytest.approx(math.exp(0.5) - 1)
    assert report.kl("speculative") is None
    assert report.cell(AcceptanceRow("budgeted", kl_bound=0.0), 1).mean == pytest.approx(
        report.cell("speculative", 1).mean
    )
    assert "takes at most 1 draft" in report.unavailable[("budgeted D=0.5", 2)]
    grid = Grid(
        verifiers=("budgeted", "speculative"), kl=(0.1, 0.2), num_drafts=(1,), draft_lengths=(3,), temperatures=(1.0,)
    )
    cells, _ = grid.cells(registry, recipe)
    assert [c.key for c in cells] == [
        "baseline T=1",
        "budgeted D=0.1 K=1 L=3 T=1",
        "budgeted D=0.2 K=1 L=3 T=1",
        "speculative K=1 L=3 T=1",
    ]
    assert cells[1].recipe(recipe, registry).verifier.params == {"budget": 0.1}


def test_the_draft_cost_note_says_when_speculation_cannot_pay():
    from specdec_cli.generation.calibration_figures import DraftCost, draft_cost_note

    slow = DraftCost(
        target_token_s=0.060,
        target_block_s=0.105,
        draft_s=0.074,
        acceptance=0.95,
        machine="AMD EPYC (no native bfloat16), 2 threads",
    )
    assert slow.speedup(1.0, 4) == pytest.approx(5 * 0.060 / (4 * 0.074 + 0.105))
    note = draft_cost_note(slow, 4, bfloat16_draft=True)
    assert "even if every draft token is accepted (at most 0.75×)" in note and "(avx512_bf16 or AMX)" in note
    assert "(avx512_bf16 or AMX)" not in draft_cost_note(slow, 4, bfloat16_draft=False)
    middling = DraftCost(target_token_s=0.06, target_block_s=0.07, draft_s=0.012, acceptance=0.3, machine="x")
    assert middling.speedup(1.0, 4) > 1 > middling.speedup(0.3, 4)
    assert "at the acceptance measured (30%)" in draft_cost_note(middling, 4, bfloat16_draft=False)
    fast = DraftCost(target_token_s=0.06, target_block_s=0.07, draft_s=0.006, acceptance=0.9, machine="x")
    assert draft_cost_note(fast, 4, bfloat16_draft=True) is None


def test_the_draft_cost_is_measured_once_and_cached(tiny_models, tmp_path, monkeypatch):
    from specdec_cli.generation.calibration import draft_cost

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(
        "specdec_cli.generation.calibration._plausible", lambda cost, decoder: True
    )  # a busy CI machine measures slow
    from specdec_cli.generation.calibration import CpuLoad

    # a quiet CPU, whatever the machine's load now: a figure measured on a busy one is never cached
    monkeypatch.setattr("specdec_cli.generation.calibration.cpu_load", lambda: CpuLoad(0.5, 2))
    decoder = SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models, "llama")))
    calls = []
    original = SpeculativeDecoder.generate_ids
    monkeypatch.setattr(
        SpeculativeDecoder, "generate_ids", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    first = draft_cost(decoder, [3, 4, 5])
    assert len(calls) == 8 and first.target_token_s > 0 and first.draft_s > 0 and first.target_block_s > 0
    assert draft_cost(decoder, [3, 4, 5]) == first and len(calls) == 8
    assert len(list((tmp_path / "calibration").iterdir())) == 1


def test_a_verifier_keeps_its_colour_whatever_else_is_installed():
    """A colour comes from the name alone (installing a plugin recolours nothing); the shipped ones differ."""
    from specdec_cli.results.plotting import verifier_colour

    shipped = [
        name
        for name, info in VerifierRegistry().describe().items()
        if info.get("package", "").startswith("specdec-cli ")
    ]
    assert len(shipped) == 15 and len({verifier_colour(name) for name in shipped}) == len(shipped)
    assert verifier_colour("optimum") == "#000000"
