"""The retokenize drafter: a draft model with a tokenizer of its own writes text, proposed in the target's ids.

Universal assisted generation (transformers' ``AssistantToTargetTranslator``; vLLM drafts across vocabularies
too): the target's committed ids are decoded to text and encoded with the draft's tokenizer; the draft writes
its next tokens greedily; the text they add is encoded with the target's tokenizer, and those target ids are the
block's proposal. Where the draft's text merges with the last committed token (``"hel"`` + ``"lo"``), the last
token's text is encoded again with the new text, and the ids that follow it are proposed when it stays one token.

The draft writes greedily, so its proposal is a function of the committed context: its laws are one-hot in the
target's vocabulary, as prompt lookup's are, and every lossless verifier stays exact whatever the draft model
and its tokenizer are (the draft's own law, over its own vocabulary, never reaches the verifier). It fills one
row. A draft that writes its end-of-sequence token proposes the target's.

Batched: one forward per draft token for every sequence, through one :class:`ModelSession` of the draft model
over its own ids (a dynamic cache). A sequence's draft ids are encoded anew each block, since the text's last
word may be tokenized differently once it grows; the cache keeps the ids they share with the ones it holds.
"""

from __future__ import annotations

from typing import Annotated

import torch

from specdec_cli.base.errors import SpecdecError, UsageError
from specdec_cli.base.timing import RegionTimer
from specdec_cli.engine.session import ModelSession
from specdec_cli.plugins.drafting import Drafter, DraftRequest, DraftSetup, Proposal, one_hot_laws

_INCOMPLETE = "\ufffd"
"""What a tokenizer decodes a cut multi-byte character to: the draft's last token ended inside a character."""


class RetokenizedDrafter(Drafter):
    """A draft model with its own tokenizer (the entry's ``model:``) writes greedily; its text, in the target's ids."""

    name = "retokenize"
    deterministic = True
    uses_model = True
    own_vocabulary = True

    def __init__(
        self,
        *,
        draft_tokens: Annotated[
            int | None, "tokens the draft writes per block, in its own vocabulary (None: the block's draft length)"
        ] = None,
    ):
        if draft_tokens is not None and draft_tokens < 1:  # a whole number: the base class checked the type
            raise ValueError(f"retokenize: draft_tokens must be >= 1, got {draft_tokens!r}")
        self.draft_tokens = draft_tokens

    def entry_problem(self, entry):
        if entry.model is None or entry.early_exit is not None:
            return (
                "the retokenize drafter needs 'model' (hub id, local directory or .gguf file) and no 'early_exit': "
                "a draft model with a tokenizer of its own"
            )
        if (entry.temperature, entry.top_k, entry.top_p) != (None, None, None):
            return "the retokenize drafter writes greedily; remove temperature, top_k and top_p from the entry"
        return None

    def load_model(self, pool, entry, target):
        return pool.draft_with_own_tokenizer(entry)

    def setup(self, setup: DraftSetup) -> None:
        super().setup(setup)
        for loaded in (setup.target, setup.model):
            if loaded.is_encoder_decoder:
                raise UsageError(
                    f"the retokenize drafter drafts for decoder-only models, and the {loaded.name} is an "
                    "encoder-decoder; use a draft that shares the target's tokenizer (drafter: model)"
                )
        draft = setup.model
        self.session = ModelSession(draft, min(draft.logits_size, len(draft.tokenizer)), setup.kv_cache)
        self.held: list[list[int]] = []  # [B]: the draft ids each sequence's session row holds a prefix of
        self.draft_eos = draft.eos_ids
        self.target_eos = setup.target.tokenizer.eos_token_id

    @property
    def label(self) -> str:
        return self.draft_setup.model.name

    def add_sequences(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None) -> None:
        draft_contexts = [self._draft_ids(context) for context in contexts]
        self.session.add(draft_contexts, draft_contexts, timer)
        self.held += draft_contexts

    def remove_sequences(self, kept: list[int]) -> None:
        self.session.select(kept)
        self.held = [self.held[b] for b in kept]

    def keep(self, rows: list[int], lengths: list[int]) -> None:
        """Nothing to do here: committed target ids do not say which draft ids stay, so :meth:`propose` keeps the
        ids the next contexts share with what the session holds."""

    def propose(self, request: DraftRequest) -> Proposal:
        """Each sequence's draft text after its context, as up to ``max_lengths[b]`` target ids."""
        contexts = [self._draft_ids(context) for context in request.contexts]
        steps = self.draft_tokens or max(request.max_lengths)
        self._check_room(contexts, steps)
        self._keep_shared(contexts)
        written = self._write(contexts, steps, request.timer)  # [B][steps]
        self.held = [context + new for context, new in zip(contexts, written)]
        found = [
            self._target_ids(target_context, context, new)[:limit]
            for target_context, context, new, limit in zip(request.contexts, contexts, written, request.max_lengths)
        ]
        device, width = self.draft_setup.device, max(map(len, found))
        tokens = torch.zeros(len(found), 1, width, dtype=torch.long)  # [B, 1, n]: zero filler past each length
        for b, ids in enumerate(found):
            tokens[b, 0, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        tokens = tokens.to(device)
        laws = one_hot_laws(tokens, self.draft_setup.vocab_size)  # [B, 1, n, V]
        finite = torch.ones(
            (), dtype=torch.bool, device=device
        )  # []: one-hot laws are finite, whatever the draft's logits
        return Proposal(tokens, laws, finite, [len(ids) for ids in found], forwards=steps)

    # ----------------------------------------------------------------------- between the two tokenizers

    def _draft_ids(self, target_ids: list[int]) -> list[int]:
        """The committed target ids as the draft reads them: their text, encoded by the draft's tokenizer (with its
        own special tokens: a BOS where it adds one; its EOS where the text is empty, so that it has an id to read)."""
        text = self.draft_setup.target.tokenizer.decode(target_ids, skip_special_tokens=True)
        tokenizer = self.draft_setup.model.tokenizer
        return tokenizer(text).input_ids or [tokenizer.eos_token_id]

    def _target_ids(self, target_context: list[int], draft_context: list[int], written: list[int]) -> list[int]:
        """The target ids of the text the draft ``written`` after ``draft_context``, up to its EOS (then the target's
        EOS)."""
        ended = next((i for i, token in enumerate(written) if token in self.draft_eos), None)
        decode = self.draft_setup.model.tokenizer.decode
        before = decode(draft_context, skip_special_tokens=True)
        after = decode(draft_context + written[:ended], skip_special_tokens=True)
        # The text written is what decoding the whole sequence adds: decoding the new ids alone would lose the space
        # a SentencePiece tokenizer gives a word only after another.
        new_text = after[len(before) :] if after.startswith(before) else decode(written[:ended])
        ids = self._continuation(target_context, new_text.rstrip(_INCOMPLETE))
        return ids + [self.target_eos] if ended is not None and self.target_eos is not None else ids

    def _continuation(self, target_context: list[int], text: str) -> list[int]:
        """Target ids that spell ``text`` after ``target_context``: encoded with the last committed token's text
        first, so that a word the draft completes ("hel" + "lo") is tokenized as the target would, the ids after
        that token where it stays one; ``text`` alone otherwise."""
        if not text:
            return []
        encode = self.draft_setup.target.tokenizer
        last = target_context[-1:]
        joined = encode(encode.decode(last) + text, add_special_tokens=False).input_ids
        if last and joined[:1] == last:
            return joined[1:]
        return encode(text, add_special_tokens=False).input_ids

    # ----------------------------------------------------------------------- the draft model

    def _check_room(self, contexts: list[list[int]], steps: int) -> None:
        """Stop in one line where a draft context and its new tokens would pass the draft model's position limit."""
        limit = self.draft_setup.model.context_length
        longest = max(map(len, contexts)) + steps
        if limit is not None and longest > limit:
            raise SpecdecError(
                f"the retokenize drafter's {self.draft_setup.model.name} reads at most {limit} tokens, and a context "
                f"with its draft takes {longest} of its tokens; lower max_new_tokens or the draft length"
            )

    def _keep_shared(self, contexts: list[list[int]]) -> None:
        """Each session row cropped to the ids its new context shares with what it holds (all but the context's last
        id at most, which the first forward feeds)."""
        shared = [_shared_prefix(held, context) for held, context in zip(self.held, contexts)]
        rows = list(range(len(contexts)))
        self.session.keep(rows, [min(length, len(context) - 1) for length, context in zip(shared, contexts)])

    def _write(self, contexts: list[list[int]], steps: int, timer: RegionTimer | None) -> list[list[int]]:
        """``steps`` greedy draft ids after each context, one forward per id for every sequence."""
        written = torch.empty(len(contexts), steps, dtype=torch.long, device=self.session.device)  # [B, steps]
        for t in range(steps):
            if t == 0:
                logits = self.session.forward(contexts, None, 1, timer)[:, -1]  # [B, V_draft]
            else:
                logits = self.session.forward(None, written[:, t - 1 : t], 1, timer)[:, -1]  # [B, V_draft]
            written[:, t] = logits.argmax(-1)
        return written.tolist()


def _shared_prefix(first: list[int], second: list[int]) -> int:
    """How many leading ids two id lists share."""
    for index, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return index
    return min(len(first), len(second))
