"""Benchmark tasks: where their examples come from and how a prompt is written for each model kind.

Built-in tasks and their prompt templates (``{source}`` is the example's input):

| task | quality | encoder-decoder (T5 task prefix) |
|---|---|---|
| wmt | BLEU, chrF | ``translate English to French: {source}`` |
| xsum | ROUGE-L | ``summarize: {source}`` |
| dolly | ROUGE-L | ``{source}`` |
| spec-bench | speed only, per category | ``{source}`` |

| task | decoder-only (instruction; chat template if the recipe says so) |
|---|---|
| wmt | ``Translate the following English text into French.\\n\\n{source}`` |
| xsum | ``Summarize the following article in one sentence.\\n\\n{source}`` |
| dolly | ``{source}`` |
| spec-bench | ``{source}`` |

Sources, in order: local files (``--source/--reference`` aligned plain text, ``--dataset``
jsonl), then sacrebleu's test-set registry (WMT) or Hugging Face ``datasets`` when online. Offline, WMT
takes the first 300 sentences of newstest2014 en-fr or en-de shipped in ``newstest2014/`` (either
direction), with a note saying so.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..base.errors import SpecdecError, UsageError
from ..base.inputs import json_object_lines, optional_string, read_text, subset, text_value

LANGUAGES = {"en": "English", "fr": "French", "de": "German", "cs": "Czech", "ru": "Russian", "hi": "Hindi"}


@dataclass(frozen=True)
class Example:
    id: str
    source: str
    """The input: the first turn of a multi-turn question."""
    reference: str | None = None
    category: str | None = None
    turns: int = 1
    """Turns of the question the example comes from; only the first is generated (see :func:`turns_note`)."""


def turns_note(examples: list[Example]) -> str | None:
    """A note for data with multi-turn questions: a later turn needs the model's own earlier answer in its
    prompt, so a benchmark of one generation per example runs the first turn only."""
    multi = [e for e in examples if e.turns > 1]
    if not multi:
        return None
    return (
        f"{len(multi)} of {len(examples)} questions have {max(e.turns for e in multi)} turns; only the first "
        "turn of each is generated (a later turn's prompt needs the model's own earlier answer)"
    )


@dataclass(frozen=True)
class Task:
    name: str
    metrics: tuple[str, ...]
    """Quality metrics: 'bleu', 'chrf', 'rougeL'."""
    seq2seq_template: str
    decoder_template: str
    source_field: str
    reference_field: str | None
    hub: tuple[str, ...] = ()
    """datasets.load_dataset arguments (name, config, split) when online."""
    per_category: bool = False

    def template(self, encoder_decoder: bool, lang_pair: tuple[str, str]) -> str:
        source, target = (LANGUAGES.get(code, code) for code in lang_pair)
        text = self.seq2seq_template if encoder_decoder else self.decoder_template
        return text.replace("{src_lang}", source).replace("{tgt_lang}", target)


TASKS = {
    "wmt": Task(
        "wmt",
        ("bleu", "chrf"),
        "translate {src_lang} to {tgt_lang}: {source}",
        "Translate the following {src_lang} text into {tgt_lang}. Reply with the translation only.\n\n{source}",
        "source",
        "reference",
    ),
    "xsum": Task(
        "xsum",
        ("rougeL",),
        "summarize: {source}",
        "Summarize the following article in one sentence.\n\n{source}",
        "document",
        "summary",
        hub=("EdinburghNLP/xsum", None, "test"),
    ),
    "dolly": Task(
        "dolly",
        ("rougeL",),
        "{source}",
        "{source}",
        "instruction",
        "response",
        hub=("databricks/databricks-dolly-15k", None, "train"),
    ),
    "spec-bench": Task("spec-bench", (), "{source}", "{source}", "turns", None, per_category=True),
}


@dataclass(kw_only=True)
class DataSource:
    """Where a run's examples come from (what the user gave on the command line)."""

    task: str = "wmt"
    lang_pair: str = "en-fr"
    source_file: Path | None = None
    reference_file: Path | None = None
    dataset: Path | None = None
    source_field: str | None = None
    reference_field: str | None = None
    limit: int | None = None
    shuffle: bool = False
    seed: int = 0


@dataclass(frozen=True)
class LoadedExamples:
    examples: list[Example]
    note: str | None = None
    """Where the examples came from when that is not what the user asked for (the shipped WMT sample)."""


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UsageError(f"unknown task '{name}'; built-in tasks: {', '.join(TASKS)}")
    return TASKS[name]


def parse_lang_pair(text: str) -> tuple[str, str]:
    source, sep, target = text.partition("-")
    if not sep or not source or not target:
        raise UsageError(f"--lang-pair expects SRC-TGT such as en-fr, got '{text}'")
    return source, target


def load_examples(spec: DataSource) -> LoadedExamples:
    """The examples of a run, limited and shuffled as asked (shuffling before the limit)."""
    task = get_task(spec.task)
    note = None
    if spec.source_file or spec.reference_file:
        examples = _aligned_files(spec)
    elif spec.dataset:
        examples = _jsonl(spec.dataset, task, spec)
    else:
        examples, note = _online(task, spec)
    if not examples:
        raise UsageError("the data has no examples")
    _check_unique_ids(examples)
    return LoadedExamples(subset(examples, spec.limit, spec.shuffle, spec.seed), note)


def _check_unique_ids(examples: list[Example]) -> None:
    """Results are stored and resumed per example id, so two examples with one id would collapse."""
    first_with: dict[str, int] = {}
    for number, example in enumerate(examples, 1):
        if example.id in first_with:
            raise UsageError(
                f"examples {first_with[example.id]} and {number} share the id '{example.id}'; results are kept "
                "per id, so give each example its own 'id' (or drop the field to number them by line)"
            )
        first_with[example.id] = number


def fingerprint(examples: list[Example]) -> str:
    """A hash of the examples, so a results directory can tell that its data changed."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps([example.id, example.source, example.reference]).encode())
    return digest.hexdigest()[:16]


def _read_lines(path: Path, what: str) -> list[str]:
    return read_text(path, what).splitlines()


def _aligned_files(spec: DataSource) -> list[Example]:
    if spec.source_file is None:
        raise UsageError("--reference needs --source (aligned plain-text files, one example per line)")
    sources = _read_lines(spec.source_file, "--source file")
    references = _read_lines(spec.reference_file, "--reference file") if spec.reference_file else None
    if references is not None and len(references) != len(sources):
        raise UsageError(
            f"--source has {len(sources)} lines but --reference has {len(references)}; the files must be aligned"
        )
    return [
        Example(str(i), text, references[i] if references is not None else None)
        for i, text in enumerate(sources)
        if text.strip()
    ]


def _jsonl(path: Path, task: Task, spec: DataSource) -> list[Example]:
    """The examples of a JSON-lines dataset, every field the run uses checked here, before the first sample."""
    source_field = spec.source_field or task.source_field
    reference_field = spec.reference_field or task.reference_field
    text = read_text(path, "--dataset file")
    return [
        _dataset_example(record, number, f"{path} line {number}", task, (source_field, reference_field))
        for number, record in json_object_lines(text, path, source_field)
    ]


def _dataset_example(record: dict, number: int, where: str, task: Task, fields: tuple[str, str | None]) -> Example:
    source_field, reference_field = fields
    if source_field not in record:
        raise UsageError(f"{where} has no '{source_field}' field; name the input field with --source-field")
    source = text_value(record[source_field], where, source_field)
    context = optional_string(record, "context", where) if task.name == "dolly" else None
    if context:
        source = f"{source}\n\n{context}"
    reference = optional_string(record, reference_field, where) if reference_field else None
    turns = len(record[source_field]) if isinstance(record[source_field], list) else 1
    return Example(
        _example_id(record, number, where), source, reference, optional_string(record, "category", where), turns
    )


def _example_id(record: dict, number: int, where: str) -> str:
    """The record's ``question_id`` (Spec-Bench) or ``id``, as text; the line's index when it has neither."""
    name = next((key for key in ("question_id", "id") if record.get(key) is not None), None)
    if name is None:
        return str(number - 1)
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UsageError(f"{where}: '{name}' must be a string or an integer, got {value!r}; results are kept per id")
    return str(value)


def _online(task: Task, spec: DataSource) -> tuple[list[Example], str | None]:
    """The task's published test set, and a note when the shipped WMT sample stands in for it."""
    local = "--source FILE --reference FILE (aligned plain text)" if task.name == "wmt" else "--dataset FILE.jsonl"
    try:
        if task.name == "wmt":
            return _sacrebleu_wmt(spec.lang_pair), None
        if not task.hub:
            raise SpecdecError(f"task '{task.name}' has no download source")
        return _hub(task), None
    except SpecdecError as error:
        reason = str(error)
    except Exception as error:  # network and hub failures come in many types
        reason = f"could not fetch the '{task.name}' data ({_first_line(error)})"
    sample = _shipped_wmt_sample(spec.lang_pair) if task.name == "wmt" else None
    if sample is None:
        raise SpecdecError(f"{reason}; offline, give the data as {local}")
    return sample, (
        f"{reason}: using the {len(sample)} sentences of newstest2014 {spec.lang_pair} shipped with specdec (the "
        f"set's first {len(sample)}; WMT14's terms: research use, cite the shared task); the whole set: {local}"
    )


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


_SAMPLE_FOLDER = Path(__file__).parent / "newstest2014"
_SAMPLE_PAIRS = {("en", "fr"): "en-fr", ("en", "de"): "en-de"}
"""The shipped sample's files (``en-fr.en`` beside ``en-fr.fr``), each read in either direction."""


def _shipped_wmt_sample(lang_pair: str) -> list[Example] | None:
    """newstest2014's first 300 aligned sentences for ``lang_pair`` (en-fr, fr-en, en-de, de-en), else None."""
    source, target = parse_lang_pair(lang_pair)
    pair = _SAMPLE_PAIRS.get((source, target)) or _SAMPLE_PAIRS.get((target, source))
    if pair is None:
        return None
    sources = _read_lines(_SAMPLE_FOLDER / f"{pair}.{source}", "shipped newstest2014 sample")
    references = _read_lines(_SAMPLE_FOLDER / f"{pair}.{target}", "shipped newstest2014 sample")
    return [Example(str(i), s, r) for i, (s, r) in enumerate(zip(sources, references, strict=True))]


def _sacrebleu_wmt(lang_pair: str) -> list[Example]:
    from sacrebleu.utils import get_reference_files, get_source_file

    source_path = get_source_file("wmt14", lang_pair)
    reference_path = get_reference_files("wmt14", lang_pair)[0]
    sources = Path(source_path).read_text(encoding="utf-8").splitlines()
    references = Path(reference_path).read_text(encoding="utf-8").splitlines()
    return [Example(str(i), s, r) for i, (s, r) in enumerate(zip(sources, references))]


def _hub(task: Task) -> list[Example]:
    import os
    import socket

    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise SpecdecError(f"the Hugging Face Hub is switched off (HF_HUB_OFFLINE) and '{task.hub[0]}' is needed")
    try:  # fails at once offline, where the datasets library would retry for half a minute
        socket.getaddrinfo("huggingface.co", 443)
    except OSError:
        raise SpecdecError(f"the Hugging Face Hub cannot be reached for '{task.hub[0]}'") from None
    import datasets

    name, config, split = task.hub
    rows = datasets.load_dataset(name, config, split=split)
    examples = []
    for i, row in enumerate(rows):
        source = row[task.source_field]
        if task.name == "dolly" and row.get("context"):
            source = f"{source}\n\n{row['context']}"
        examples.append(Example(str(row.get("id", i)), source, row.get(task.reference_field)))
    return examples
