"""What ``specdec generate`` writes: the streamed text, the notes, the tables and the JSON."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import __version__
from ..base.recipe import Recipe
from ..engine.stopping import cut_at_stop
from ..results.stats import INTERVAL_LEVEL, GenerationResult
from . import common

if TYPE_CHECKING:  # torch and transformers load only when a command runs models
    from ..engine.decoder import SpeculativeDecoder
    from ..generation.comparison import ConfigurationResult

ACCEPTED_STYLE = "green"


def print_notes(err: Console, decoder: SpeculativeDecoder, calibration_note: str | None) -> None:
    """The models that keep the dynamic cache, an ``exact_first`` that changes nothing, the calibration's note, and
    under ``--verbose --compile`` what each model's compile cache entry gave this run."""
    exact_first = None if decoder.exact_first_note is None else f"note: {decoder.exact_first_note}"
    for note in [*decoder.cache_notes, exact_first, calibration_note, *_compile_cache_notes(decoder)]:
        if note is not None:
            err.print(note, highlight=False, soft_wrap=True)


def _compile_cache_notes(decoder: SpeculativeDecoder) -> list[str]:
    """Under ``--verbose``, one line per model whose steps ``--compile`` compiled: what its compile cache entry gave
    (an entry's note that its first compile wait already said is not said twice)."""
    if not (common.GLOBAL_FLAGS.verbose and decoder.config.speculation.compile):
        return []
    from ..engine import compile_cache  # torch: only once a model has loaded

    return [use.summary() for use in compile_cache.uses() if not (use.note and use.noted)]


def print_round(out: Console, rows: list[ConfigurationResult], results: list[GenerationResult]) -> None:
    """One (prompt, sample)'s text from every configuration (``results`` in the order of ``rows``), written
    in one go: Ctrl-C in the middle of a rich print leaves its text queued, and the table would repeat it."""
    with out.capture() as captured:
        for row, result in zip(rows, results):
            out.rule(f"prompt {result.prompt_index + 1}.{result.sample_index + 1} · {row.label}", style="dim")
            out.print(result.text, markup=False)
    sys.stdout.write(captured.get())
    sys.stdout.flush()


def json_header(recipe: Recipe, decoder: SpeculativeDecoder, interrupted: bool) -> dict:
    from ..results.provenance import provenance

    return {
        "specdec_version": __version__,
        "recipe": recipe.to_dict(),
        "environment": provenance(decoder.device),
        "interrupted": interrupted,
    }


def write_json(payload: dict) -> None:
    sys.stdout.write(json.dumps(payload, indent=2) + "\n")


def comparison_table(rows: list[ConfigurationResult], samples: int) -> Table:
    has_baseline = any(row.speedup is not None for row in rows)
    caption = (
        f"{samples} sample(s) per configuration, same prompts and seeds, run in turn; one untimed warm-up "
        "each; tokens/s excludes loading, with the tokens it counts"
    )
    caption += (
        f"; speedup: token rate over the target alone [{INTERVAL_LEVEL:.0%} interval over the samples]"
        if has_baseline
        else "; add none to --verifier for speedups"
    )
    table = Table(title="verifiers compared", caption=caption)
    table.add_column("verifier")
    for name in ("tokens/s", "speedup", "block efficiency", "acceptance", "seconds"):
        table.add_column(name, justify="right", overflow="fold")
    for row in rows:
        label = "none (target alone)" if not row.speculative else row.label
        acceptance = "—" if row.acceptance_rate is None else f"{row.acceptance_rate:.1%}"
        table.add_row(
            label,
            row.tokens_per_second_text(),
            row.speedup_text(),
            f"{row.block_efficiency:.2f}",
            acceptance,
            f"{row.summary()['wall_time_s']:.2f}",
        )
    return table


class Stream:
    """Writes each committed block's text as it arrives, styling accepted draft tokens on a terminal. With stop
    texts it shows what the result's text will be: nothing from a stop text on, and the last characters that could
    begin one held back until the text goes on past them or the sample ends."""

    def __init__(self, tokenizer, console: Console, several: bool, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.console = console
        self.several = several
        self.stops = stops
        self.held = max(map(len, stops), default=1) - 1  # characters that may be a stop text's beginning
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
            cut = cut_at_stop(text, self.stops)
            text = cut if cut != text else text[: len(text) - self.held]
            piece.append(text[len(self.shown) :], style=ACCEPTED_STYLE if from_draft else None)
            self.shown = max(text, self.shown, key=len)
        self._write(piece)

    def _write(self, piece: Text) -> None:
        if self.console.is_terminal:
            self.console.print(piece, end="", soft_wrap=True)
        else:
            sys.stdout.write(piece.plain)
            sys.stdout.flush()

    def finish(self) -> None:
        if self.current is not None:
            if self.held:  # what was held back and turned out not to begin a stop text
                text = cut_at_stop(self.tokenizer.decode(self.tokens, skip_special_tokens=True), self.stops)
                self._write(Text(text[len(self.shown) :]))
            if self.console.is_terminal:
                self.console.print()
            else:
                sys.stdout.write("\n")
                sys.stdout.flush()


def stats_table(decoder: SpeculativeDecoder, results: list[GenerationResult], colour_caption: bool) -> Table:
    """One row per metric, one column per sample (at most 6, then only the mean); titled with the configuration."""
    shown = results if len(results) <= 6 else []
    speculative = decoder.verifier is not None
    if speculative:
        title = f"{decoder.verifier.name} · L={decoder.draft_length} · K={decoder.config.speculation.num_drafts}"
    else:
        title = "target alone"
    caption = f"accepted draft tokens in {ACCEPTED_STYLE}" if speculative and colour_caption else None
    table = Table(title=title, title_style="bold", caption=caption)
    table.add_column("metric")
    for r in shown:
        table.add_column(
            f"prompt {r.prompt_index + 1}.{r.sample_index + 1}" if len(results) > 1 else "value", justify="right"
        )
    if len(results) > 1:
        table.add_column(f"mean of {len(results)}", justify="right")
    metrics = [
        ("generated tokens", lambda s: s.new_tokens, "{:.0f}"),
        ("block efficiency", lambda s: s.block_efficiency, "{:.2f}"),
        ("acceptance rate", lambda s: s.acceptance_rate, "{:.1%}"),
        ("tokens/s", lambda s: s.tokens_per_second, "{:.1f}"),
        ("seconds (no loading)", lambda s: s.wall_time_s, "{:.2f}"),
        ("target forwards saved", lambda s: s.target_forwards_saved, "{:.0f}"),
    ]
    if not speculative:
        metrics = [m for m in metrics if m[0] in ("generated tokens", "tokens/s", "seconds (no loading)")]
    for label, value, fmt in metrics:
        values = [value(r.stats) for r in results]
        cells = [fmt.format(v) for v in values[: len(shown)]]
        if len(results) > 1:
            cells.append(fmt.format(sum(values) / len(values)))
        table.add_row(label, *cells)
    return table
