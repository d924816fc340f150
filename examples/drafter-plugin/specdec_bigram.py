"""An example drafter plugin: each row samples its next tokens from the bigram counts of the context so far.

After token t, the law of the next token is how often each token followed t in the prompt and the output,
plus ``smoothing`` on every token of the vocabulary. Each row samples from that law with the keyed uniform
the engine hands it (so its rows are independent samples of one law) and reports the law: speculative
sampling then keeps the target's law exactly, whatever the counts.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch

from specdec_cli.drafting import SequenceDrafter, SequenceProposal, SequenceRequest
from specdec_cli.sampling import sample_with


class ContextBigram(SequenceDrafter):
    """Samples each row's tokens from the context's own bigram counts (no model)."""

    name = "bigram"

    def __init__(self, *, smoothing: Annotated[float, "a count added to every token after every token (> 0)"] = 0.5):
        if not 0 < smoothing < math.inf:  # a number: specdec checked the type; > 0, so that every law is defined
            raise ValueError(f"bigram: smoothing must be a finite number > 0, got {smoothing!r}")
        self.smoothing = float(smoothing)

    def propose_sequence(self, request: SequenceRequest) -> SequenceProposal:
        setup = self.draft_setup
        context = torch.tensor(request.context, dtype=torch.long)  # [n]
        counts = torch.full((setup.vocab_size, setup.vocab_size), self.smoothing, dtype=torch.float64)  # [V, V]
        counts.index_put_(
            (context[:-1], context[1:]), torch.ones(len(context) - 1, dtype=torch.float64), accumulate=True
        )
        bigram_laws = (counts / counts.sum(-1, keepdim=True)).float()  # [V, V]: row t is the law after token t
        tokens = torch.empty(self.rows, request.max_length, dtype=torch.long)  # [rows, L]
        laws = torch.empty(self.rows, request.max_length, setup.vocab_size)  # [rows, L, V]
        last = torch.full((self.rows,), request.context[-1], dtype=torch.long)  # [rows]
        for t in range(request.max_length):
            laws[:, t] = bigram_laws[last]
            tokens[:, t] = sample_with(laws[:, t], request.uniforms[t].cpu())
            last = tokens[:, t]
        finite = torch.ones((), dtype=torch.bool, device=setup.device)  # []
        return SequenceProposal(tokens.to(setup.device), laws.to(setup.device), finite)
