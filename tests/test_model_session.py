"""ModelSession: rows of different lengths in one right-aligned cache give each row the logits it gets alone.

Through sequences joining (prompts of different lengths), fanning out, rows keeping different lengths,
a sequence leaving and another joining mid-way, every row's logits equal those of its sequence scored
alone without a cache (to float rounding), for a decoder-only model with positions (llama, gpt2) and an
encoder-decoder with relative attention (t5), with the KV cache and without it (the ids held and recomputed).
BART numbers its decoder positions from the cache: it decodes one sequence at a time, without padding.
"""

from __future__ import annotations

import pytest
import torch

from specdec_cli.engine.session import ModelSession, batch_problem, next_token_logits
from specdec_cli.kit.testing import tiny_model, tiny_tokenizer
from specdec_cli.models.loading import LoadedModel

VOCAB = 8


def loaded(kind: str) -> LoadedModel:
    return LoadedModel(tiny_model(kind, seed=3), tiny_tokenizer(), kind, kind in ("t5", "bart"))


def start_ids(model: LoadedModel, prompt: list[int]) -> list[int]:
    return model.decoder_start_ids if model.is_encoder_decoder else list(prompt)


def alone(model: LoadedModel, prompt: list[int], context: list[int], new: list[int]) -> torch.Tensor:
    """Logits ``[len(new) + 1, V]`` after context + each prefix of new, scored alone without a cache."""
    generated = context[len(start_ids(model, prompt)) :] + new
    logits = next_token_logits(model, prompt, torch.tensor([generated]), VOCAB)[0]  # [generated + 1, V]
    return logits[-(len(new) + 1) :]


CACHES = {
    "dynamic": (True, None),
    "no cache": (False, None),
    "static": (True, 32),
    "static, widened": (True, 1),  # too little headroom: the buffers grow as the rows do
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5"])
@torch.inference_mode()
def test_each_row_sees_what_its_sequence_sees_alone(kind, cache):
    model = loaded(kind)
    prompts = [[3, 4, 5, 6, 7], [6, 3], [5, 6, 7, 3, 4, 5, 6]]
    contexts = [start_ids(model, p) for p in prompts]
    session = ModelSession(model, VOCAB, *CACHES[cache])
    # A decoder-only model takes the static cache it is asked for; an encoder-decoder keeps the dynamic one.
    assert (session.headroom is not None) == (cache.startswith("static") and not model.is_encoder_decoder)
    session.add(prompts[:2], contexts[:2])
    # Block 1: two rows per sequence, three draft tokens each.
    drafts = torch.tensor([[5, 6, 7], [5, 4, 4], [6, 5, 3], [3, 3, 3]])  # [B K, 3]
    session.fan_out(2)
    logits = session.forward([contexts[0]] * 2 + [contexts[1]] * 2, drafts, 4)  # [B K, 4, V]
    for row in range(4):
        expected = alone(model, prompts[row // 2], contexts[row // 2], drafts[row].tolist())
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
    # Sequence 0 keeps row 1's first draft token and commits a correction; sequence 1 keeps all of row 0.
    contexts[0] = contexts[0] + [5, 2]
    contexts[1] = contexts[1] + [6, 5, 3, 4]
    session.keep([1, 2], [len(contexts[0]) - 2, len(contexts[1]) - 1])  # 2 and 1 ids pending
    # A third sequence joins; then a block of one row each, with different numbers of pending ids.
    session.add(prompts[2:], contexts[2:])
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6]])  # [B, 2]
    logits = session.forward(contexts, drafts, 3)
    for row in range(3):
        expected = alone(model, prompts[row], contexts[row], drafts[row].tolist())
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
    # Sequence 1 leaves; the others keep different lengths and go on.
    contexts[0] = contexts[0] + [1, 7]
    contexts[2] = contexts[2] + [7]
    session.keep([0, 2], [len(contexts[0]) - 1, len(contexts[2]) - 1])
    kept = [prompts[0], prompts[2]]
    logits = session.forward([contexts[0], contexts[2]], torch.tensor([[4], [4]]), 2)
    for row, sequence in enumerate((0, 2)):
        expected = alone(model, kept[row], contexts[sequence], [4])
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
    if session.headroom is None:
        assert session.columns == max(session.lengths)  # padding no wider than the longest row needs


@pytest.mark.parametrize("use_cache", [True, False])
@torch.inference_mode()
def test_a_decoder_that_numbers_positions_from_the_cache_decodes_one_sequence_unpadded(use_cache):
    model = loaded("bart")
    assert "numbers its decoder's positions" in batch_problem(model) and "--batch-size 1" in batch_problem(model)
    prompt, context = [3, 4, 5], start_ids(model, [3, 4, 5])
    session = ModelSession(model, VOCAB, use_cache)
    assert not session.padded
    session.add([prompt], [context])
    session.fan_out(2)
    drafts = torch.tensor([[5, 6, 7], [4, 4, 3]])  # [K, 3]
    logits = session.forward([context] * 2, drafts, 4)
    for row in range(2):
        torch.testing.assert_close(
            logits[row], alone(model, prompt, context, drafts[row].tolist()), atol=1e-4, rtol=1e-4
        )
    context = context + [4, 4]  # row 1's first token and a correction
    session.keep([1], [len(context) - 1])
    logits = session.forward([context], torch.tensor([[6]]), 2)
    torch.testing.assert_close(logits[0], alone(model, prompt, context, [6]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@torch.inference_mode()
def test_the_static_cache_pads_a_short_row_into_its_scratch_slot_and_widens_for_a_longer_joiner(kind):
    """A one-id sequence (holding nothing) beside one with two ids pending: its padding goes to the scratch slot,
    which nothing else attends to. A sequence longer than the buffers joins: every row's buffers widen. All rows
    leave and new ones join a fresh cache."""
    model = loaded(kind)
    session = ModelSession(model, VOCAB, True, headroom=2)
    prompts = [[3, 4, 5, 6], [6]]
    session.add(prompts, [list(p) for p in prompts])
    contexts = [prompts[0] + [7], prompts[1]]  # two ids pending, and one
    logits = session.forward(contexts, torch.tensor([[1], [2]]), 2)
    for row in range(2):
        torch.testing.assert_close(
            logits[row], alone(model, prompts[row], contexts[row], [[1], [2]][row]), atol=1e-4, rtol=1e-4
        )
    capacity = session.cache.capacity
    long_prompt = [5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5, 6]
    session.keep([0, 1], [len(contexts[0]), len(contexts[1])])
    session.add([long_prompt], [long_prompt])
    assert session.cache.capacity > capacity
    contexts = [contexts[0] + [1], contexts[1] + [2], long_prompt]
    logits = session.forward(contexts, torch.tensor([[4], [4], [4]]), 2)
    for row, prompt in enumerate(prompts + [long_prompt]):
        torch.testing.assert_close(logits[row], alone(model, prompt, contexts[row], [4]), atol=1e-4, rtol=1e-4)
    session.select([])
    session.add([[4, 5]], [[4, 5]])
    logits = session.forward([[4, 5]], torch.tensor([[6]]), 2)
    torch.testing.assert_close(logits[0], alone(model, [4, 5], [4, 5], [6]), atol=1e-4, rtol=1e-4)
