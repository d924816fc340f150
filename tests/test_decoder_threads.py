"""One decoder called from several threads: each generation waits for the one under way (its drafters hold their
sequences' state), so every thread gets what it would get alone."""

from __future__ import annotations

import threading

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import build_recipe
from tests.conftest import tiny_recipe

PROMPTS = ["a b c d", "e e a", "b", "d c b a e d c b a"]


def test_threads_sharing_a_decoder_get_their_own_results(tiny_models):
    decoder = SpeculativeDecoder.from_recipe(
        build_recipe(tiny_recipe(tiny_models, generation={"max_new_tokens": 24, "temperature": 1.0}))
    )
    expected = {prompt: decoder.generate(prompt, num_samples=2) for prompt in PROMPTS}
    got: dict[str, list] = {}
    errors: list[BaseException] = []

    def generate(prompt: str, batch_size: int) -> None:
        try:
            got[prompt] = decoder.generate(prompt, num_samples=2, batch_size=batch_size)
        except BaseException as error:  # a thread's failure must fail the test, not vanish with the thread
            errors.append(error)

    threads = [threading.Thread(target=generate, args=(p, 1 + i % 2)) for i, p in enumerate(PROMPTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    for prompt in PROMPTS:
        assert [r.token_ids for r in got[prompt]] == [r.token_ids for r in expected[prompt]]


def test_a_run_holds_the_decoder_until_it_ends(tiny_models):
    """The negative control: while one generation is under way (a generator stopped between samples), another
    thread's call waits; it goes on once the first run is closed."""
    decoder = SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models)))
    first = decoder.samples(PROMPTS, num_samples=1)
    next(first)
    other = threading.Thread(target=decoder.generate, args=("a b",))
    other.start()
    other.join(timeout=2)
    assert other.is_alive(), "a second run started while the first held the decoder's drafters"
    first.close()
    other.join(timeout=60)
    assert not other.is_alive()


def test_decoders_from_with_config_decode_side_by_side(tiny_models):
    """Threads that each take their own decoder over the same loaded models do not wait for each other and still
    get what they would get alone."""
    base = SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models, generation={"max_new_tokens": 24})))
    expected = [base.generate(prompt)[0].token_ids for prompt in PROMPTS]
    got: list = [None] * len(PROMPTS)

    def generate(index: int) -> None:
        got[index] = base.with_config().generate(PROMPTS[index])[0].token_ids

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert got == expected
