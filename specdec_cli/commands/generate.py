"""`specdec generate`: speculative generation, streamed as blocks are committed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import __version__
from ..engine import SpeculativeDecoder, require_text
from ..stats import GenerationResult
from . import common

ACCEPTED_STYLE = "green"


def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Text to continue. Omit to read --prompt-file or stdin.")] = None,
    prompt_file: Annotated[
        Optional[Path], typer.Option(help="File with one prompt per non-empty line ('-' for stdin).")
    ] = None,
    field: common.FieldOption = None,
    recipe: common.RecipeOption = None,
    verifier: common.VerifierOption = None,
    kl: common.KlOption = None,
    num_drafts: common.NumDraftsOption = None,
    draft_length: common.DraftLengthOption = None,
    max_new_tokens: common.MaxNewTokensOption = None,
    temperature: common.TemperatureOption = None,
    top_k: common.TopKOption = None,
    top_p: common.TopPOption = None,
    seed: common.SeedOption = None,
    device: common.DeviceOption = None,
    dtype: common.DtypeOption = None,
    sets: common.SetOption = None,
    num_samples: Annotated[int, typer.Option(min=1, help="Independent samples per prompt.")] = 1,
    chat: Annotated[
        Optional[bool], typer.Option("--chat/--no-chat", help="Apply the model's chat template to each prompt.")
    ] = None,
    autoregressive: Annotated[
        bool, typer.Option("--autoregressive", help="Decode with the target alone (the baseline); same as --verifier none.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (resolved recipe, samples with text, token_ids, stats).")
    ] = False,
) -> None:
    """Generate text with speculative decoding; accepted draft tokens are shown in green on a terminal."""
    options = common.RecipeOptions(
        recipe=recipe, sets=sets or [], verifier=verifier, kl=kl, num_drafts=num_drafts, draft_length=draft_length,
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, device=device,
        dtype=dtype, chat=chat,
    )  # fmt: skip
    resolved = options.resolve()
    prompts = common.read_prompts(prompt, prompt_file, sys.stdin, field)
    for text in prompts:  # checked before the models load, which can take a while
        require_text(text)
    err = Console(stderr=True)
    with err.status("Loading models (the first run converts the GGUF weights once)…"):
        decoder = SpeculativeDecoder.from_recipe(resolved, autoregressive=autoregressive)
    if as_json:
        results = decoder.generate(prompts, num_samples)
        payload = {
            "specdec_version": __version__,
            "recipe": resolved.to_dict(),
            "autoregressive": decoder.verifier is None,
            "samples": [r.to_dict() for r in results],
        }
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return
    stream = _Stream(decoder.target.tokenizer, Console(highlight=False), several=len(prompts) * num_samples > 1)
    results = decoder.generate(prompts, num_samples, on_block=stream.on_block)
    stream.finish()
    err.print(_stats_table(results))


class _Stream:
    """Writes each committed block's text as it arrives, styling accepted draft tokens on a terminal."""

    def __init__(self, tokenizer, console: Console, several: bool):
        self.tokenizer = tokenizer
        self.console = console
        self.several = several
        self.current: tuple[int, int] | None = None
        self.tokens: list[int] = []
        self.shown = ""

    def on_block(self, prompt_index: int, sample_index: int, new_tokens: list[int], accepted: list[bool]) -> None:
        if self.current != (prompt_index, sample_index):
            self.finish()
            self.current, self.tokens, self.shown = (prompt_index, sample_index), [], ""
            if self.several:
                self.console.rule(f"prompt {prompt_index + 1}, sample {sample_index + 1}", style="dim")
        piece = Text()
        for token, from_draft in zip(new_tokens, accepted):
            self.tokens.append(token)
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for its next token
                continue
            piece.append(text[len(self.shown) :], style=ACCEPTED_STYLE if from_draft else None)
            self.shown = text
        if self.console.is_terminal:
            self.console.print(piece, end="", soft_wrap=True)
        else:
            sys.stdout.write(piece.plain)
            sys.stdout.flush()

    def finish(self) -> None:
        if self.current is not None:
            if self.console.is_terminal:
                self.console.print()
            else:
                sys.stdout.write("\n")
                sys.stdout.flush()


def _stats_table(results: list[GenerationResult]) -> Table:
    """One row per metric, one column per sample (at most 6, then only the mean)."""
    shown = results if len(results) <= 6 else []
    table = Table(title="speculative decoding", title_style="bold", caption=f"accepted draft tokens in {ACCEPTED_STYLE}")
    table.add_column("metric")
    for r in shown:
        table.add_column(f"prompt {r.prompt_index + 1}.{r.sample_index + 1}" if len(results) > 1 else "value", justify="right")
    if len(results) > 1:
        table.add_column(f"mean of {len(results)}", justify="right")
    metrics = [
        ("generated tokens", lambda s: s.new_tokens, "{:.0f}"),
        ("block efficiency", lambda s: s.block_efficiency, "{:.2f}"),
        ("acceptance rate", lambda s: s.acceptance_rate, "{:.1%}"),
        ("tokens/s", lambda s: s.tokens_per_second, "{:.1f}"),
        ("target forwards saved", lambda s: s.target_forwards_saved, "{:.0f}"),
    ]
    for label, value, fmt in metrics:
        values = [value(r.stats) for r in results]
        cells = [fmt.format(v) for v in values[: len(shown)]]
        if len(results) > 1:
            cells.append(fmt.format(sum(values) / len(values)))
        table.add_row(label, *cells)
    return table
