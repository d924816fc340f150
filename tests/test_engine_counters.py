"""The engines' counters as the engines define them, and a draft that stops at EOS as transformers' assistant does.

- vLLM (vllm-project/vllm@016a858, ``vllm/v1/spec_decode/metrics.py``): ``SpecDecodingStats.new(num_spec_tokens)``
  starts ``num_accepted_tokens_per_pos`` as ``[0] * num_spec_tokens``, so it has L entries whatever was accepted;
  ``num_drafts`` counts drafts. A comparison's entry keeps K beside them, under ``speculation.num_drafts``.
- transformers 5.24.0 (``src/transformers/generation/candidate_generator.py``): ``AssistedCandidateGenerator`` gives
  its assistant the target's ``eos_token_id``, and the assistant's ``generate`` stops there. specdec's model drafter
  drafts nothing after a row's EOS: no forward once every row has ended (where reads are free), and the row's later
  positions repeat the EOS under a one-hot law, so every verifier keeps the target's law.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams
from specdec_cli.bench.metrics import speed_summary
from specdec_cli.kit.testing import EOS_ID, chi_square_p_value, exact_sequence_law, keyed_samples
from specdec_cli.plugins.verifiers import device_path
from specdec_cli.results.stats import SampleStats
from specdec_plugins.model_drafter import ModelDrafter
from tests.conftest import tiny_recipe
from tests.row_acceptance import ONE_ROW_KEYS, acceptance, one_row_acceptance

PROMPT = "a b c d"
DRAFT_EOS_BIAS = 11.0
"""Added to the draft's EOS logit: the tiny draft then drafts EOS at some position of most blocks (never, without)."""


def _decoder(models, verifier: str = "speculative", num_drafts: int = 1, target_eos_bias: float = 0.0, **generation):
    recipe = tiny_recipe(
        models,
        "llama",
        verifier={"name": verifier},
        speculation={"draft_length": 4, "num_drafts": num_drafts},
        generation={"max_new_tokens": 12, "temperature": 1.0, **generation},
    )
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    _bias_eos(decoder.drafters[0].session.model, DRAFT_EOS_BIAS)
    _bias_eos(decoder.target.model, target_eos_bias)
    return decoder


def _bias_eos(model, bias: float) -> None:
    """A loaded model whose EOS logit is raised by ``bias`` (a bias on its output layer, which has none)."""
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.weight.shape[0]))  # [V]
    head.bias.data[EOS_ID] = bias


@pytest.fixture
def proposals(monkeypatch) -> list:
    """Every proposal the model drafter makes while the fixture is active."""
    made: list = []
    propose = ModelDrafter.propose

    def recorded(self, request):
        made.append(propose(self, request))
        return made[-1]

    monkeypatch.setattr(ModelDrafter, "propose", recorded)
    return made


def _row_ends(tokens: torch.Tensor) -> list[int | None]:
    """Each row's first EOS position in ``tokens`` ``[rows, n]`` (None: the row drafted none)."""
    return [row.index(EOS_ID) if EOS_ID in row else None for row in tokens.tolist()]


def _check_rows_end_at_eos(proposal) -> list[int | None]:
    """Each row of each sequence repeats its first EOS to the end under a one-hot law → every row's first EOS."""
    ends = []
    for tokens, laws in zip(proposal.tokens, proposal.laws):  # [rows, n], [rows, n, V]
        for row, end in enumerate(_row_ends(tokens)):
            if end is not None:
                assert tokens[row, end:].eq(EOS_ID).all(), tokens[row]
                assert laws[row, end + 1 :, EOS_ID].eq(1).all() and laws[row, end + 1 :].sum(-1).eq(1).all()
            ends.append(end)
    return ends


def test_a_drafted_eos_ends_the_rows_drafting(tiny_models, proposals):
    """Alone (B = 1, K = 1) the drafter runs one forward per position through the row's EOS and none after, as the
    assistant's generate stops; the positions after it repeat the EOS under a one-hot law."""
    decoder = _decoder(tiny_models)
    prompt_ids = decoder.encode_prompt(PROMPT)
    outputs = [decoder.generate_ids(prompt_ids, key) for key in range(8)]
    early = 0
    for proposal in proposals:
        (end,) = _check_rows_end_at_eos(proposal)
        width = proposal.tokens.shape[2]
        assert proposal.forwards == (width if end is None else end + 1)
        early += end is not None and end < width - 1
    assert early >= 5, "drafts end before their last position"
    drafted = sum(stats.drafted_tokens for _, _, stats in outputs)
    assert sum(stats.draft_forwards for _, _, stats in outputs) < drafted
    # Control: on the device path (no read) the forwards run on, and the samples are the same.
    proposals.clear()
    with device_path():
        on_device = [decoder.generate_ids(prompt_ids, key) for key in range(8)]
    assert all(proposal.forwards == proposal.tokens.shape[2] for proposal in proposals)
    assert sum(stats.draft_forwards for _, _, stats in on_device) == drafted
    assert [(tokens, mask) for tokens, mask, _ in on_device] == [(tokens, mask) for tokens, mask, _ in outputs]


def test_a_batch_of_rows_that_end_apart_gives_the_samples_alone(tiny_models, proposals):
    """K = 2 rows in batches of 4: the forwards run until the last row of the batch ends, and each row's tokens are
    what it drafts alone (where every row of a block ends early)."""
    decoder = _decoder(tiny_models, "specinfer", num_drafts=2, target_eos_bias=4.0)
    alone = keyed_samples(decoder, PROMPT, 12, batch_size=1)
    batched = sorted(keyed_samples(decoder, PROMPT, 12, batch_size=4), key=lambda r: r.prompt_index)  # as they end
    assert [(r.token_ids, r.accepted_mask) for r in batched] == [(r.token_ids, r.accepted_mask) for r in alone]
    ends = [end for proposal in proposals for end in _check_rows_end_at_eos(proposal)]
    assert None in ends and any(end is not None and end < 3 for end in ends), "some rows end early, some never"


@pytest.mark.parametrize(("verifier", "num_drafts"), [("speculative", 1), ("block", 1), ("specinfer", 2)])
def test_drafts_that_end_at_eos_keep_the_target_law(tiny_models, verifier, num_drafts):
    """The first tokens follow the target's law (EOS an outcome of its own) when the drafts end early and the
    target often ends too; block verification decides on the repeated EOS positions as well. K = 2 rows accept more
    than one row on the same keys (the first 300: 0.133 against 0.087): the second row's EOS is in the decisions
    too."""
    depth, samples = 4, 1500
    decoder = _decoder(tiny_models, verifier, num_drafts, target_eos_bias=6.0, max_new_tokens=depth)
    prompt_ids = decoder.encode_prompt(PROMPT)
    params = SamplingParams(1.0)
    law = exact_sequence_law(decoder.target.model, prompt_ids, depth, params, decoder.vocab_size, {EOS_ID})
    results = keyed_samples(decoder, PROMPT, samples)
    counts = Counter(tuple(result.token_ids) for result in results)
    accepted_eos = sum(r.token_ids[-1] == EOS_ID and r.accepted_mask[-1] for r in results)
    drawn_eos = sum(r.token_ids[-1] == EOS_ID and not r.accepted_mask[-1] for r in results)
    assert accepted_eos > 100 and drawn_eos > 20, "EOS comes from the drafts and from the target"
    assert chi_square_p_value(counts, law) > 1e-3
    if num_drafts > 1:
        assert acceptance(results, ONE_ROW_KEYS) > one_row_acceptance(decoder.with_config(num_drafts=1), PROMPT)
    draft = decoder.drafters[0].session.model
    draft_law = exact_sequence_law(draft, prompt_ids, depth, params, decoder.vocab_size, {EOS_ID})
    assert chi_square_p_value(counts, draft_law) < 1e-6  # the check has power: the draft's law fails it


def test_every_sample_counts_l_positions(tiny_models):
    """``accepted_per_position`` (and so ``num_accepted_tokens_per_pos``) has L entries in every sample, also in one
    whose last positions were never accepted (whose list a count of accepted positions alone would cut short)."""
    decoder = _decoder(tiny_models)
    results = keyed_samples(decoder, PROMPT, 12)
    assert all(len(r.stats.to_dict()["num_accepted_tokens_per_pos"]) == 4 for r in results)
    assert any(r.stats.accepted_per_position[-1] == 0 for r in results), "some sample never accepted position L"
    alone = decoder.with_config(verifier="none").generate_ids(decoder.encode_prompt(PROMPT), 0)[2]
    assert alone.to_dict()["num_accepted_tokens_per_pos"] == []  # the target alone drafts no position


def test_a_comparison_keeps_k_beside_the_pooled_counters(run, tiny_models, write_recipe):
    path = str(write_recipe(tiny_recipe(tiny_models, "llama")))
    args = ["generate", "-r", path, "--verifier", "specinfer,none", "--num-drafts", "2", "--num-samples", "3"]
    code, out, err = run([*args, "--json", "a b"])
    assert code == 0, err
    speculative, alone = json.loads(out)["configurations"]
    assert speculative["speculation"]["num_drafts"] == 2 and speculative["draft_length"] == 3
    samples = [sample["stats"] for sample in speculative["samples"]]
    assert speculative["num_drafts"] == sum(stats["num_drafts"] for stats in samples) > 2  # drafts, not K
    assert all(len(stats["num_accepted_tokens_per_pos"]) == 3 for stats in samples)
    assert any(stats["num_accepted_tokens_per_pos"][-1] == 0 for stats in samples), "a sample that stayed short"
    assert speculative["num_accepted_tokens_per_pos"] == [
        sum(stats["num_accepted_tokens_per_pos"][t] for stats in samples) for t in range(3)
    ]
    assert alone["speculation"] is None and alone["num_drafts"] == 0 and alone["num_accepted_tokens_per_pos"] == []


def test_bench_rates_cover_the_drafted_positions_and_the_counters_run_to_l():
    """A record counts L = 4 accepted positions but drafted only 2 (the end of its budget): its per-position
    acceptance covers the 2, its ``num_accepted_tokens_per_pos`` all 4."""
    stats = SampleStats(
        prompt_tokens=2, new_tokens=3, target_forwards=1, wall_time_s=1.0, accepted_per_position=[0] * 4
    )
    stats.record_block(2, 2, 1)
    pooled = speed_summary([stats.to_dict()])
    assert pooled["acceptance_per_position"] == [1.0, 0.0]
    assert pooled["num_accepted_tokens_per_pos"] == [1, 0, 0, 0]
