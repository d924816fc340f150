"""The retokenize drafters: a draft model with a tokenizer of its own proposes in the target's ids.

``retokenize`` (greedy; universal assisted generation, transformers' ``AssistedCandidateGeneratorDifferentTokenizers``):
the target's committed ids are decoded to text and encoded with the draft's tokenizer; the draft writes its next
tokens greedily; the text they add is encoded with the target's tokenizer, and those target ids are the block's
proposal. Where the draft's text merges with the last committed token (``"hel"`` + ``"lo"``), the last token's text
is encoded again with the new text, and the ids that follow it are proposed when it stays one token. Its proposal
is a function of the committed context: its laws are one-hot in the target's vocabulary, as prompt lookup's are, and
every lossless verifier stays exact whatever the draft model and its tokenizer are. It fills one row. A draft that
writes its end-of-sequence token proposes the target's. Its draft ids are encoded anew each block, since the text's
last word may be tokenized differently once it grows; the session keeps the ids they share with the ones it holds.

``retokenize-sample`` (Timor et al., ICML 2025, token-level intersection, as transformers'
``UniversalSpeculativeDecodingGenerator`` samples it): the draft samples each token at the entry's sampling settings
(the run's, unless the entry sets its own) from its law restricted to the draft tokens that are one target token
(:mod:`._vocab_intersection`), renormalised; each proposed target token's law is that law, laid over the target's
vocabulary (zero outside the intersection), and it is what the drafter reports, so every lossless verifier stays
exact. It fills K independent rows. Its draft context grows as the target commits: the prompt's text encoded with
the draft's tokenizer, then each committed target token read back, as the draft id that stands for it where it is
in the intersection (every accepted draft token is), its text encoded with the draft's tokenizer where not (the
target's correction). The accepted draft tokens are already in the draft's cache, so a block reads one or two ids
before it drafts.

Both run one forward per draft token for every sequence (and, sampling, every row) at once, through one
:class:`ModelSession` of the draft model over its own ids: the static cache where ``speculation.static_cache`` asks
for it, compiled steps under ``--compile``. Where a draft context with a block's draft tokens would pass the draft
model's position limit, the drafter reads it from a window: its last half of the limit (behind the draft's BOS,
where the context begins with one), read once into the sequence's row alone; the window stays until it fills again.
"""

from __future__ import annotations

from typing import Annotated

import torch

from specdec_cli.base.errors import SpecdecError, UsageError
from specdec_cli.base.sampling import judged_params, sample_with
from specdec_cli.base.timing import RegionTimer
from specdec_cli.engine.session import ModelSession
from specdec_cli.plugins.drafting import Drafter, DraftRequest, DraftSetup, Proposal, one_hot_laws

from ._vocab_intersection import VocabularyIntersection

_INCOMPLETE = "\ufffd"
"""What a tokenizer decodes a cut multi-byte character to: the draft's last token ended inside a character."""


class _Retokenizing(Drafter):
    """What both retokenize drafters share: the draft model's session, each sequence's draft ids, and the window a
    sequence's row reads them from."""

    uses_model = True
    own_vocabulary = True

    def entry_problem(self, entry):
        if entry.model is None or entry.early_exit is not None:
            return (
                f"the {self.name} drafter needs 'model' (hub id, local directory or .gguf file) and no 'early_exit': "
                "a draft model with a tokenizer of its own"
            )
        return None

    def load_model(self, pool, entry, target):
        return pool.draft_with_own_tokenizer(entry)

    def setup(self, setup: DraftSetup) -> None:
        super().setup(setup)
        for loaded in (setup.target, setup.model):
            if loaded.is_encoder_decoder:
                raise UsageError(
                    f"the {self.name} drafter drafts for decoder-only models, and the {loaded.name} is an "
                    "encoder-decoder; use a draft that shares the target's tokenizer (drafter: model)"
                )
        draft = setup.model
        self.draft_vocab = min(draft.logits_size, len(draft.tokenizer))
        self.session = ModelSession(draft, self.draft_vocab, setup.kv_cache, setup.cache_headroom, setup.compile_steps)
        self.contexts: list[list[int]] = []  # [B]: each sequence's draft ids, from the start of its text
        self.starts: list[int] = []  # [B]: where in them the window its session row reads begins

    @property
    def label(self) -> str:
        return self.draft_setup.model.name

    def remove_sequences(self, kept: list[int]) -> None:
        self.session.select(kept)
        self.contexts = [self.contexts[b] for b in kept]
        self.starts = [self.starts[b] for b in kept]

    def _join(self, contexts: list[list[int]], timer: RegionTimer | None) -> list[list[int]]:
        """Sequences of these draft ids join the session (each read from a window that fits the draft model) →
        the windows."""
        first = len(self.contexts)
        self.contexts += contexts
        self.starts += [0] * len(contexts)
        windows = [self._fitted(b, 0) for b in range(first, len(self.contexts))]
        self.session.add(windows, windows, timer)
        return windows

    def _draft_ids(self, target_ids: list[int]) -> list[int]:
        """Target ids as the draft reads them: their text, encoded by the draft's tokenizer (with its own special
        tokens: a BOS where it adds one; its EOS where the text is empty, so that it has an id to read)."""
        text = self.draft_setup.target.tokenizer.decode(target_ids, skip_special_tokens=True)
        tokenizer = self.draft_setup.model.tokenizer
        return tokenizer(text).input_ids or [tokenizer.eos_token_id]

    # ----------------------------------------------------------------------- windows

    def _window(self, b: int) -> list[int]:
        """The draft ids sequence b's session row reads: from its window's start, behind the draft's BOS where its
        context begins with one."""
        context, start = self.contexts[b], self.starts[b]
        return (context[:1] if start > 0 and self._begins_with_bos(b) else []) + context[start:]

    def _begins_with_bos(self, b: int) -> bool:
        bos = self.draft_setup.model.tokenizer.bos_token_id
        return bos is not None and self.contexts[b][:1] == [bos]

    def _fitted(self, b: int, steps: int) -> list[int]:
        """Sequence b's window once ``steps`` draft tokens fit after it in the draft model's positions: moved to the
        last half of the limit where they would not."""
        limit = self.draft_setup.model.context_length
        window = self._window(b)
        if limit is None or len(window) + steps <= limit:
            return window
        kept = limit // 2 - self._begins_with_bos(b)  # the ids after the BOS it keeps
        if kept < 1 or limit // 2 + steps > limit:
            raise SpecdecError(
                f"the {self.name} drafter's {self.draft_setup.model.name} reads at most {limit} tokens, too few for a "
                f"window with {steps} draft tokens after it; lower the draft length to {limit - limit // 2} or less"
            )
        self.starts[b] = len(self.contexts[b]) - kept
        return self._window(b)

    def _windows(self, steps: int, timer: RegionTimer | None) -> list[list[int]]:
        """Every sequence's window with room for ``steps`` draft tokens; a row whose window moved is read again, alone
        (in the batch's forward, every row would recompute as many ids)."""
        windows = []
        for b in range(len(self.contexts)):
            start = self.starts[b]
            windows.append(self._fitted(b, steps))
            if self.starts[b] != start:
                self._read_again(b, windows[b], timer)
        return windows

    def _read_again(self, b: int, window: list[int], timer: RegionTimer | None) -> None:
        """Session row b holds ``window`` (all but its last id) in place of what it held."""
        others = [row for row in range(self.session.rows) if row != b]
        self.session.select(others)
        self.session.add([window], [window], timer)
        self.session.select([row - (row > b) if row != b else len(others) for row in range(len(others) + 1)])


class RetokenizedDrafter(_Retokenizing):
    """A draft model with its own tokenizer (the entry's ``model:``) writes greedily; its text, in the target's ids."""

    name = "retokenize"
    deterministic = True

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
        if (entry.temperature, entry.top_k, entry.top_p) != (None, None, None):
            return (
                "the retokenize drafter writes greedily; remove temperature, top_k and top_p from the entry, or "
                "sample with drafter: retokenize-sample"
            )
        return super().entry_problem(entry)

    def setup(self, setup: DraftSetup) -> None:
        super().setup(setup)
        self.held: list[list[int]] = []  # [B]: the draft ids each sequence's session row holds a prefix of
        self.draft_eos = setup.model.eos_ids
        self.target_eos = setup.target.tokenizer.eos_token_id

    def add_sequences(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None) -> None:
        self.held += self._join([self._draft_ids(context) for context in contexts], timer)

    def remove_sequences(self, kept: list[int]) -> None:
        super().remove_sequences(kept)
        self.held = [self.held[b] for b in kept]

    def _read_again(self, b: int, window: list[int], timer: RegionTimer | None) -> None:
        super()._read_again(b, window, timer)
        self.held[b] = window

    def keep(self, rows: list[int], lengths: list[int]) -> None:
        """Nothing to do here: committed target ids do not say which draft ids stay, so :meth:`propose` keeps the
        ids the next contexts share with what the session holds."""

    def propose(self, request: DraftRequest) -> Proposal:
        """Each sequence's draft text after its context, as up to ``max_lengths[b]`` target ids."""
        self.contexts = [self._draft_ids(context) for context in request.contexts]
        steps = self.draft_tokens or max(request.max_lengths)
        contexts = self._windows(steps, request.timer)
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
        finite = torch.ones((), dtype=torch.bool, device=device)  # []: one-hot laws are finite, whatever the logits
        return Proposal(tokens, laws, finite, [len(ids) for ids in found], forwards=steps)

    # ----------------------------------------------------------------------- between the two tokenizers

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
            step = written[:, t - 1 : t] if t else None  # [B, 1]: each sequence's last draft id
            logits = self.session.forward(contexts if t == 0 else None, step, 1, timer)[:, -1]  # [B, V_draft]
            written[:, t] = logits.argmax(-1)
        return written.tolist()


class SampledRetokenizedDrafter(_Retokenizing):
    """A draft model with its own tokenizer (the entry's ``model:``) samples each row's tokens from its law over the
    tokens the two vocabularies share (token-level intersection), reported as the law of the target ids they are."""

    name = "retokenize-sample"
    reports_judged_laws = True

    def setup(self, setup: DraftSetup) -> None:
        super().setup(setup)
        self.intersection = VocabularyIntersection.build(
            setup.target.tokenizer,
            setup.model.tokenizer,
            setup.vocab_size,
            self.draft_vocab,
            self.session.device,
            setup.device,
        )
        if not len(self.intersection):
            raise UsageError(
                f"no token of the {setup.model.name}'s vocabulary is a token of the target's, so the "
                f"{self.name} drafter has nothing to draw; use drafter: retokenize, which maps text"
            )
        self.read: list[int] = []  # [B]: committed target ids of each sequence read back into its draft ids
        self.drafted_from: list[tuple[int, int]] | None = None  # [B]: (window, target context) lengths of a block

    def add_sequences(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None) -> None:
        self.read += [len(context) for context in contexts]
        self._join([self.draft_context(prompt, context) for prompt, context in zip(prompts, contexts)], timer)

    def remove_sequences(self, kept: list[int]) -> None:
        super().remove_sequences(kept)
        self.read = [self.read[b] for b in kept]

    def draft_context(self, prompt: list[int], context: list[int]) -> list[int]:
        """A sequence's draft ids after its committed ``context`` (which begins with ``prompt``): the prompt's text
        as the draft encodes it, then each later target id read back (:meth:`_read_back`)."""
        return self._draft_ids(prompt) + self._read_back(context, len(prompt))

    def _read_back(self, context: list[int], start: int) -> list[int]:
        """The draft ids of ``context[start:]``: each target id's own where it is in the intersection, else the text it
        adds after the id before it, encoded with the draft's tokenizer."""
        decode = self.draft_setup.target.tokenizer.decode
        ids: list[int] = []
        for index in range(start, len(context)):
            own = self.intersection.draft_of_target.get(context[index])
            if own is not None:
                ids.append(own)
                continue
            before = context[max(index - 1, 0) : index]
            whole = decode(before + context[index : index + 1], skip_special_tokens=True)
            text = whole[len(decode(before, skip_special_tokens=True)) :]
            ids += self.draft_setup.model.tokenizer(text, add_special_tokens=False).input_ids
        return ids

    def keep(self, rows: list[int], lengths: list[int]) -> None:
        """The kept row of each sequence holds its window and the draft ids of the row's committed tokens (each
        committed draft token is the draft id it was drawn as)."""
        if self.drafted_from is None:  # no block drafted since the last keep: each row holds a prefix of its window
            return
        held = [window + length - context for (window, context), length in zip(self.drafted_from, lengths)]
        self.session.keep([b * self.rows + row for b, row in enumerate(rows)], held)
        self.drafted_from = None

    def propose(self, request: DraftRequest) -> Proposal:
        """Every sequence's K rows in one forward per position (``[B K, 1]`` after the first), each row's tokens drawn
        with its own uniforms from the draft's law over the intersection."""
        rows, batch, length = self.rows, len(request.contexts), max(request.max_lengths)
        for b, context in enumerate(request.contexts):
            self.contexts[b] += self._read_back(context, self.read[b])
            self.read[b] = len(context)
        windows = self._windows(length, request.timer)
        self.drafted_from = [(len(window), len(context)) for window, context in zip(windows, request.contexts)]
        self.session.fan_out(rows)
        tokens, laws, judged, finite = self._sample(
            [window for window in windows for _ in range(rows)], length, request
        )
        vocab = self.draft_setup.vocab_size
        return Proposal(
            tokens.view(batch, rows, length),
            laws.view(batch, rows, length, vocab),
            finite,
            list(request.max_lengths),
            forwards=length,
            judged_laws=None if judged is None else judged.view(batch, rows, length, vocab),
        )

    def _sample(
        self, windows: list[list[int]], length: int, request: DraftRequest
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``length`` tokens after each of the session's rows' ``windows`` [B K] → target ids ``[B K, n]``, their laws
        ``[B K, n, V]``, the judged laws (or None) and whether every law came from finite logits ``[]``."""
        device, vocab, params = self.draft_setup.device, self.draft_setup.vocab_size, self.draft_setup.sampling
        count = len(windows)
        tokens = torch.empty(count, length, dtype=torch.long, device=device)  # [B K, n]: target ids
        drawn = torch.empty(count, length, dtype=torch.long, device=self.session.device)  # [B K, n]: their draft ids
        laws = torch.empty(count, length, vocab, device=device)  # [B K, n, V]
        judged = torch.empty_like(laws) if request.judged_view else None  # [B K, n, V]
        finite = torch.ones((), dtype=torch.bool, device=device)  # []
        for t in range(length):
            step = drawn[:, t - 1 : t] if t else None  # [B K, 1]: each row's last draft id
            draft_logits = self.session.forward(windows if t == 0 else None, step, 1, request.timer)[:, -1]
            logits = self.intersection.target_logits(draft_logits).to(device)  # [B K, V]
            law, row_finite = request.sampling_law(logits, params)  # [B K, V], [B K]
            laws[:, t] = law
            finite &= row_finite.all()
            if judged is not None:
                judged[:, t] = request.sampling_law(logits, judged_params(params, request.judged_view))[0]
            tokens[:, t] = sample_with(law, request.uniforms[:, t].reshape(-1))
            drawn[:, t] = self.intersection.draft_by_target[tokens[:, t]].to(self.session.device)
        return tokens, laws, judged, finite


def _shared_prefix(first: list[int], second: list[int]) -> int:
    """How many leading ids two id lists share."""
    for index, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return index
    return min(len(first), len(second))
