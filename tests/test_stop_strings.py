"""Stop strings (``generation.stop``): a sequence stops after the token that completes the first occurrence of one,
its text ends before it, its stop reason says so; in a batch each sequence stops on its own."""

from __future__ import annotations

import json

import pytest

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import build_recipe
from specdec_cli.engine.stopping import cut_at_stop, tokens_through_stop
from tests.conftest import tiny_recipe

PROMPTS = ["a b c d", "e e a", "b", "d c b a e d c b a"]
PIECES = {0: "ab", 1: "c", 2: "d", 3: "é", 4: "x"}


def _decode(tokens: list[int]) -> str:
    return "".join(PIECES[token] for token in tokens)


def test_tokens_through_stop_counts_to_the_completing_token():
    assert tokens_through_stop(_decode, [0], [1, 2, 2], ["bc"]) == 1  # begins in an earlier block
    assert tokens_through_stop(_decode, [], [4, 1, 2, 4], ["cd", "xc"]) == 2  # the earliest completion wins
    assert tokens_through_stop(_decode, [], [4, 1, 2], ["d"]) == 3  # the last token completes it
    assert tokens_through_stop(_decode, [4] * 50 + [0], [1], ["abc"]) == 1  # only a tail of the output is decoded
    assert tokens_through_stop(_decode, [0], [1, 2], ["zz"]) is None
    assert tokens_through_stop(_decode, [0], [1, 2], []) is None
    assert tokens_through_stop(_decode, [0], [], ["ab"]) is None


def test_cut_at_stop_ends_before_the_first_stop_string():
    assert cut_at_stop("one two. three. four", [". ", "four"]) == "one two"
    assert cut_at_stop("nothing here", ["zz"]) == "nothing here"
    assert cut_at_stop("abc", []) == "abc"


def _greedy(tiny_models, stop: list[str], family: str = "llama") -> SpeculativeDecoder:
    recipe = tiny_recipe(tiny_models, family, generation={"max_new_tokens": 24, "temperature": 0.0, "stop": stop})
    return SpeculativeDecoder.from_recipe(build_recipe(recipe))


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_output_stops_at_the_stop_string(tiny_models, family, batch_size):
    """Each prompt's greedy output is cut after the token that completes a stop string chosen from its own text (so
    the cut often falls inside a block of several committed tokens); the tokens before it are unchanged."""
    free = _greedy(tiny_models, [], family).generate(PROMPTS, batch_size=batch_size)
    cut_inside_block = 0
    for reference in free:
        words = reference.text.split()
        if len(words) < 4:
            continue
        stop = f"{words[2]} {words[3]}"  # its first occurrence may come earlier than words 2-3
        (result,) = _greedy(tiny_models, [stop], family).generate(reference.prompt)
        start = reference.text.index(stop)
        assert result.text == reference.text[:start]
        through = len(reference.text[: start + len(stop)].split())  # one word per token
        assert result.token_ids == reference.token_ids[:through]
        assert result.accepted_mask == reference.accepted_mask[:through]
        assert result.stats.new_tokens == through
        assert result.stats.stop_reason == "stop_string"
        cut_inside_block += through < len(reference.token_ids)
    assert cut_inside_block >= 2, "the test needs outputs that go on past their stop string"


@pytest.mark.parametrize("batch_size", [1, 4])
def test_each_sequence_of_a_batch_stops_on_its_own(tiny_models, batch_size):
    free = _greedy(tiny_models, []).generate(PROMPTS)
    stops = [result.text.split()[3] for result in free if len(result.text.split()) > 4][:2]
    stopped = _greedy(tiny_models, stops).generate(PROMPTS, batch_size=batch_size)
    for reference, result in zip(free, stopped):
        assert result.text == cut_at_stop(reference.text, stops)
        assert result.token_ids == reference.token_ids[: len(result.token_ids)]
        expected = "stop_string" if result.text != reference.text else reference.stats.stop_reason
        assert result.stats.stop_reason == expected
    assert any(result.stats.stop_reason == "stop_string" for result in stopped)


def test_a_stop_string_that_never_occurs_changes_nothing(tiny_models):
    free = _greedy(tiny_models, []).generate(PROMPTS, batch_size=2)
    never = _greedy(tiny_models, ["zebra"]).generate(PROMPTS, batch_size=2)
    assert [r.token_ids for r in never] == [r.token_ids for r in free]
    assert [r.stats.stop_reason for r in never] == [r.stats.stop_reason for r in free]


def test_the_streamed_text_is_the_result_s_text(run, tiny_models, write_recipe):
    """generate's stream shows what the result keeps: not the stop text, nor what its last token adds after it."""
    recipe = write_recipe(tiny_recipe(tiny_models, generation={"max_new_tokens": 24, "temperature": 0.0}))
    code, out, err = run(["generate", "-r", str(recipe), "--json", "a b c d"])
    assert code == 0, err
    words = json.loads(out)["samples"][0]["text"].split()
    stop = f"{words[2]} {words[3]}"
    code, out, err = run(["generate", "-r", str(recipe), "--json", "--stop", stop, "a b c d"])
    cut = json.loads(out)["samples"][0]["text"]
    assert code == 0 and stop not in cut and len(cut) < len(" ".join(words)), err
    code, streamed, err = run(["generate", "-r", str(recipe), "--stop", stop, "a b c d"])
    assert code == 0, err
    assert streamed == cut + "\n"
    code, streamed, err = run(["generate", "-r", str(recipe), "--stop", "zebra", "a b c d"])
    assert code == 0 and streamed == " ".join(words) + "\n", err  # what was held back comes out at the end
