"""Helpers for testing specdec and verifier plugins: tiny models, exact laws, statistical checks.

Tiny models are built from configs (no download), with a word-level tokenizer over an
8-token vocabulary, and saved with ``save_pretrained`` so tests load them through the real
recipe path. Their output layer is scaled up so that distributions are peaked and two
differently seeded models disagree often: exactly the regime where a wrong verifier shows.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..base.sampling import SamplingParams, probs_from_logits
from ..base.theory import optimal_acceptance, optimal_acceptance_two_drafts  # noqa: F401  (re-exported for plugin authors)
from ..engine.decoder import DecodingRun, SequenceJob
from ..engine.session import next_token_logits
from ..models.loading import LoadedModel
from ..results.stats import GenerationResult

__all__ = [
    "EOS_ID",
    "keyed_samples",
    "PAD_ID",
    "SequenceLaw",
    "TINY_VOCAB",
    "adversarial_distribution_pairs",
    "candidate_acceptance",
    "chi_square_p_value",
    "committed_block_law",
    "decision_outcomes",
    "enumerate_block_law",
    "enumerate_output_law",
    "exact_sequence_law",
    "expected_committed_tokens",
    "optimal_acceptance",
    "optimal_acceptance_two_drafts",
    "random_distributions",
    "random_sequence_laws",
    "save_tiny_model",
    "target_sequence_law",
    "tiny_model",
    "tiny_tokenizer",
]

TINY_VOCAB = ["<pad>", "</s>", "<unk>", "a", "b", "c", "d", "e"]
PAD_ID, EOS_ID = 0, 1


def tiny_tokenizer(vocab: list[str] = TINY_VOCAB) -> Any:
    """A word-level fast tokenizer: one token per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def tiny_model(kind: str, seed: int, layers: int = 2, vocab_size: int = len(TINY_VOCAB), sharpness: float = 6.0):
    """A randomly initialised tiny model: ``kind`` is 'llama', 'gpt2', 't5' or 'bart'.

    ``vocab_size`` larger than the tokenizer's gives padded embeddings (as T5 and OPT have);
    ``sharpness`` scales the output layer so distributions are far from uniform.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = _tiny_config(kind, layers, vocab_size)
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_config(config)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.copy_(torch.randn_like(head) * sharpness / head.shape[1] ** 0.5)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model.eval()


def _tiny_config(kind: str, layers: int, vocab_size: int) -> Any:
    """The configuration of :func:`tiny_model`: 16 wide, two heads, ``layers`` deep (each stack of an
    encoder-decoder)."""
    import transformers

    shapes: dict[str, tuple[str, dict[str, Any]]] = {
        "llama": (
            "LlamaConfig",
            {
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": layers,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
                "tie_word_embeddings": False,
            },
        ),
        "gpt2": ("GPT2Config", {"n_embd": 16, "n_layer": layers, "n_head": 2, "n_positions": 128}),
        "t5": (
            "T5Config",
            {
                "d_model": 16,
                "d_kv": 8,
                "d_ff": 32,
                "num_layers": layers,
                "num_decoder_layers": layers,
                "num_heads": 2,
                "decoder_start_token_id": PAD_ID,
                "tie_word_embeddings": False,
            },
        ),
        # An encoder-decoder with a position limit (64), unlike T5.
        "bart": (
            "BartConfig",
            {
                "d_model": 16,
                "encoder_layers": layers,
                "decoder_layers": layers,
                "encoder_attention_heads": 2,
                "decoder_attention_heads": 2,
                "encoder_ffn_dim": 32,
                "decoder_ffn_dim": 32,
                "max_position_embeddings": 64,
                "decoder_start_token_id": PAD_ID,
                "forced_eos_token_id": None,
            },
        ),
    }
    if kind not in shapes:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    name, shape = shapes[kind]
    special = {"pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": None}
    return getattr(transformers, name)(vocab_size=vocab_size, **shape, **special)


def save_tiny_model(path: str | Path, kind: str, seed: int, **kwargs: Any) -> Path:
    """Build a tiny model with :func:`tiny_model` and save it with its tokenizer to ``path``."""
    path = Path(path)
    tiny_model(kind, seed, **kwargs).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@torch.inference_mode()
def exact_sequence_law(
    model: Any, prompt_ids: list[int], depth: int, params: SamplingParams, vocab_size: int, eos_ids: set[int]
) -> dict[tuple[int, ...], float]:
    """The exact law of the first ``depth`` generated tokens, enumerated from the model alone.

    A sequence that ends with EOS before ``depth`` tokens is an outcome of its own. Uses full
    recomputation (no cache), one batched forward per depth.
    """
    loaded = LoadedModel(model, None, "model", bool(getattr(model.config, "is_encoder_decoder", False)))
    law: dict[tuple[int, ...], float] = {}
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for step in range(depth):
        prefixes = list(frontier)
        batch = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), step)  # [prefixes, step]
        logits = next_token_logits(loaded, prompt_ids, batch, vocab_size)[:, -1]  # [prefixes, vocab]
        probs = probs_from_logits(logits, params).double()  # [prefixes, vocab]
        next_frontier: dict[tuple[int, ...], float] = {}
        for prefix, row in zip(prefixes, probs):
            for token in torch.nonzero(row).flatten().tolist():
                mass = frontier[prefix] * float(row[token])
                sequence = prefix + (token,)
                done = token in eos_ids or step == depth - 1
                (law if done else next_frontier)[sequence] = mass
        frontier = next_frontier
    return law


def chi_square_p_value(counts: dict[Any, int], law: dict[Any, float], min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of observed ``counts`` against ``law``.

    Outcomes expected fewer than ``min_expected`` times are pooled into one bin, so that the
    chi-square approximation holds; an observed outcome outside the law's support gives 0.
    """
    from scipy.stats import chisquare

    if any(outcome not in law or law[outcome] == 0 for outcome in counts):
        return 0.0
    total = sum(counts.values())
    observed, expected = [], []
    pooled_observed, pooled_expected = 0, 0.0
    for outcome, probability in law.items():
        if probability * total >= min_expected:
            observed.append(counts.get(outcome, 0))
            expected.append(probability * total)
        else:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += probability * total
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    if len(observed) < 2:
        return 1.0
    scale = sum(observed) / sum(expected)  # guards against float drift in the law's total
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def random_distributions(generator: torch.Generator, shape: tuple[int, ...], sparsity: float = 0.3) -> torch.Tensor:
    """Random float64 laws ``[*shape]`` (last dim = vocabulary) with some exact zeros."""
    weights = torch.rand(shape, generator=generator, dtype=torch.float64) ** 3  # [*shape]
    weights = weights * (torch.rand(shape, generator=generator, dtype=torch.float64) > sparsity)
    weights[..., 0] += (weights.sum(-1) == 0).double()  # never an all-zero law
    return weights / weights.sum(-1, keepdim=True)


def adversarial_distribution_pairs(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, draft) float64 pairs that break careless verifiers: one-hot, disjoint, near-zero."""
    uniform = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    one_hot_first = torch.zeros(vocab, dtype=torch.float64)
    one_hot_first[0] = 1
    one_hot_last = torch.zeros(vocab, dtype=torch.float64)
    one_hot_last[-1] = 1
    first_half = torch.zeros(vocab, dtype=torch.float64)
    first_half[: vocab // 2] = 1 / (vocab // 2)
    second_half = torch.zeros(vocab, dtype=torch.float64)
    second_half[vocab // 2 :] = 1 / (vocab - vocab // 2)
    nearly_one_hot = torch.full((vocab,), 1e-12, dtype=torch.float64)
    nearly_one_hot[1] = 1 - 1e-12 * (vocab - 1)
    return [
        (one_hot_first, uniform),  # greedy target
        (uniform, one_hot_first),  # one-hot draft
        (one_hot_first, one_hot_last),  # disjoint one-hots
        (first_half, second_half),  # disjoint supports
        (uniform, first_half),  # draft zero where the target is positive
        (nearly_one_hot, uniform),  # probabilities near 1e-12
        (uniform, nearly_one_hot),
        (uniform, uniform),  # identical laws: residual is empty
    ]


def enumerate_output_law(verifier: Any, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The output law of ``verifier`` at one position, summed over every candidate tuple.

    target_probs ``[V]``, draft_probs ``[K, V]`` (float64) → ``[V]``: Σ_S P(S) conditional(S).
    A lossless verifier returns ``target_probs`` here.
    """
    num_drafts, vocab = draft_probs.shape
    tuples = torch.tensor(list(itertools.product(range(vocab), repeat=num_drafts)))  # [V^K, K]
    weights = draft_probs[torch.arange(num_drafts), tuples].prod(-1)  # [V^K]
    possible = weights > 0
    tuples, weights = tuples[possible], weights[possible]  # [S, K], [S]
    conditional = verifier.conditional(
        target_probs.expand(len(tuples), vocab),  # [S, V]
        draft_probs.expand(len(tuples), num_drafts, vocab),  # [S, K, V]
        tuples,  # [S, K]
    )  # [S, V]
    return (weights.unsqueeze(-1) * conditional).sum(0)


def candidate_acceptance(verifier: Any, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """P(output ∈ candidates) by enumeration of every candidate tuple (float64 laws ``[V]``, ``[K, V]``)."""
    num_drafts, vocab = draft_probs.shape
    total = 0.0
    for candidates in itertools.product(range(vocab), repeat=num_drafts):
        weight = float(draft_probs[torch.arange(num_drafts), torch.tensor(candidates)].prod())
        if weight == 0:
            continue
        law = verifier.conditional(target_probs, draft_probs, torch.tensor(candidates))
        total += weight * float(law[list(set(candidates))].sum())
    return total


def block_acceptance(verifier: Any, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """P(a draft token is accepted) at one position, by enumeration of every candidate tuple, from the verifier's own
    ``block_law`` of one-token blocks (float64 laws ``[V]``, ``[K, V]``; the bonus law q): the mass of the blocks
    that go past the position. It is :func:`candidate_acceptance` for a rule whose output equals a candidate exactly
    when it accepts one, and less for a rule whose correction may repeat the rejected token (FSD's backoff draws it
    from q)."""
    num_drafts, vocab = draft_probs.shape
    target = target_probs.expand(num_drafts, 2, vocab)  # [K, 2, V]: the position and the bonus after it
    total = 0.0
    for candidates in itertools.product(range(vocab), repeat=num_drafts):
        weight = float(draft_probs[torch.arange(num_drafts), torch.tensor(candidates)].prod())
        if weight == 0:
            continue
        law = verifier.block_law(target, draft_probs.unsqueeze(1), torch.tensor(candidates).view(num_drafts, 1))
        total += weight * float(law[:, 1].sum())  # [K, 2, V]: the mass that reached the bonus
    return total


# --------------------------------------------------------------------------- block-level laws

SequenceLaw = Callable[[tuple[int, ...]], torch.Tensor]
"""A model's next-token law after a prefix of generated tokens: ``law(prefix) -> [V]`` (float64)."""


def random_sequence_laws(
    generator: torch.Generator, vocab_size: int, depth: int, sparsity: float = 0.3
) -> dict[tuple[int, ...], torch.Tensor]:
    """A random next-token law ``[V]`` after every prefix shorter than ``depth``; pass ``laws.__getitem__``."""
    prefixes = [p for n in range(depth) for p in itertools.product(range(vocab_size), repeat=n)]
    laws = random_distributions(generator, (len(prefixes), vocab_size), sparsity)  # [prefixes, V]
    return dict(zip(prefixes, laws))


def target_sequence_law(target_law: SequenceLaw, vocab_size: int, length: int) -> dict[tuple[int, ...], float]:
    """The target's own law of its first ``length`` tokens."""
    return _complete({(): 1.0}, target_law, vocab_size, length)


def committed_block_law(
    verifier: Any, target_law: SequenceLaw, draft_laws: Sequence[SequenceLaw], vocab_size: int, draft_length: int
) -> dict[tuple[int, ...], float]:
    """The exact law of the tokens one block commits, summed over every draft block.

    Each of the K = ``len(draft_laws)`` rows drafts ``draft_length`` tokens from its own law;
    ``verifier.block_law`` gives the law of the decision for each draft block. Sequences have
    1 to L+1 tokens: the accepted draft prefix and the token that follows it.
    """
    num_drafts = len(draft_laws)
    outcomes: dict[tuple[int, ...], float] = {}
    for flat in itertools.product(range(vocab_size), repeat=num_drafts * draft_length):
        rows = [flat[k * draft_length : (k + 1) * draft_length] for k in range(num_drafts)]
        pairs = [(law, row) for law, row in zip(draft_laws, rows)]
        weight = math.prod(float(law(row[:t])[row[t]]) for law, row in pairs for t in range(draft_length))
        if weight == 0:
            continue
        target_probs = torch.stack(
            [torch.stack([target_law(row[:t]) for t in range(draft_length + 1)]) for row in rows]
        )
        draft_probs = torch.stack([torch.stack([law(row[:t]) for t in range(draft_length)]) for law, row in pairs])
        decision = verifier.block_law(target_probs, draft_probs, torch.tensor(rows))  # [K, L+1, V]
        for sequence, mass in decision_outcomes(decision, torch.tensor(rows)).items():
            outcomes[sequence] = outcomes.get(sequence, 0.0) + weight * mass
    return outcomes


def decision_outcomes(law: torch.Tensor, draft_tokens: torch.Tensor) -> dict[tuple[int, ...], float]:
    """A ``block_law`` ``[K, L+1, V]`` as the law of the committed token sequences (equal ones pooled).

    draft_tokens ``[K, L]``: entry ``[k, n, y]`` is the sequence ``draft_tokens[k, :n]`` then ``y``.
    """
    outcomes: dict[tuple[int, ...], float] = {}
    for k, n, token in torch.nonzero(law).tolist():
        sequence = tuple(draft_tokens[k, :n].tolist()) + (token,)
        outcomes[sequence] = outcomes.get(sequence, 0.0) + float(law[k, n, token])
    return outcomes


def enumerate_block_law(
    verifier: Any, target_law: SequenceLaw, draft_laws: Sequence[SequenceLaw], vocab_size: int, draft_length: int
) -> dict[tuple[int, ...], float]:
    """The law of the first L+1 tokens when one block is followed by the target alone.

    A lossless verifier gives back :func:`target_sequence_law` with ``length = L + 1`` exactly.
    """
    committed = committed_block_law(verifier, target_law, draft_laws, vocab_size, draft_length)
    return _complete(committed, target_law, vocab_size, draft_length + 1)


def expected_committed_tokens(law: dict[tuple[int, ...], float]) -> float:
    """Mean number of tokens a block commits, from :func:`committed_block_law`."""
    return sum(len(sequence) * mass for sequence, mass in law.items())


def _complete(
    partial: dict[tuple[int, ...], float], target_law: SequenceLaw, vocab_size: int, length: int
) -> dict[tuple[int, ...], float]:
    """Extend every sequence of ``partial`` with the target's own tokens up to ``length`` tokens."""
    complete: dict[tuple[int, ...], float] = {}
    frontier = dict(partial)
    while frontier:
        sequence, mass = frontier.popitem()
        if len(sequence) >= length:
            complete[sequence] = complete.get(sequence, 0.0) + mass
            continue
        law = target_law(sequence)  # [V]
        for token in range(vocab_size):
            if law[token] > 0:
                extended = sequence + (token,)
                frontier[extended] = frontier.get(extended, 0.0) + mass * float(law[token])
    return complete


def keyed_samples(decoder: Any, prompt: str, samples: int, batch_size: int = 64) -> list[GenerationResult]:
    """The samples of keys 0 .. ``samples`` - 1 of ``prompt`` (what ``decoder.generate_ids(ids, key)`` gives each),
    decoded ``batch_size`` at a time: a sample's tokens do not depend on its batch."""
    prompt_ids = decoder.encode_prompt(prompt)
    jobs = [SequenceJob(prompt, key, 0, prompt_ids, key=key) for key in range(samples)]
    return list(DecodingRun(decoder, batch_size).run(jobs))
