"""The recipe's sections as frozen dataclasses, and the checks of their values that need no file: what
:mod:`.recipe` builds a YAML recipe into.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AUTOREGRESSIVE",
    "DRAFT_LENGTH_SCHEDULES",
    "DTYPES",
    "DecodingConfig",
    "DraftConfig",
    "GenerationConfig",
    "ModelConfig",
    "Recipe",
    "SpeculationConfig",
    "VerifierConfig",
    "field_names",
    "sampling_problems",
    "target_alone",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")

DRAFT_LENGTH_SCHEDULES = ("constant", "heuristic")
"""How the draft length moves between blocks (``speculation.draft_length_schedule``)."""

AUTOREGRESSIVE = "none"
"""Verifier name meaning "no speculation": the target decodes alone."""


def target_alone(verifier_name: str) -> bool:
    """Whether ``verifier_name`` is :data:`AUTOREGRESSIVE`, in any case and with any surrounding spaces."""
    return verifier_name.strip().lower() == AUTOREGRESSIVE


@dataclass(frozen=True)
class ModelConfig:
    """Where a model comes from and where it runs."""

    model: str | None = None
    """Hub id, local directory, ``.gguf`` file, or ``package:NAME/FILE`` (a file inside an installed Python package)."""
    gguf_file: str | None = None
    """GGUF file name inside ``model`` when ``model`` is a directory or hub id."""
    dtype: str = "auto"
    device: str = "auto"
    device_map: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False

    def problems(self, owner: str) -> list[tuple[str, str]]:
        """(path, what is wrong) for this model's settings out of range, each path under ``owner``."""
        checks = [
            (self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}"),
            (_valid_device(self.device), "device", "must be auto, cpu, cuda or cuda:N"),
        ]
        return [(f"{owner}.{name}", message) for ok, name, message in checks if not ok]


@dataclass(frozen=True)
class DraftConfig(ModelConfig):
    """A draft entry: its drafter, that drafter's parameters, its model (for a drafter that takes one), and its
    own sampling settings (``None`` = the target's). A bare ``model:`` drafts with the model drafter."""

    drafter: str | None = None
    """A drafter plugin's name (``specdec drafters``); None: ``model``, or ``early-exit`` where ``early_exit`` is
    set."""
    params: dict[str, Any] = field(default_factory=dict)
    """The drafter's parameters (its constructor's keyword arguments)."""
    early_exit: int | None = None
    """Derive the draft from the target's first N layers (its final norm and head kept): no second checkpoint."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None


@dataclass(frozen=True)
class VerifierConfig:
    name: str = "speculative"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpeculationConfig:
    draft_length: int = 4
    """L: tokens each draft proposes per block."""
    num_drafts: int = 1
    """K: independent draft sequences sampled from each draft config per block."""
    kv_cache: bool = True
    """False recomputes every forward from the whole sequence (a reference for testing cache rollback)."""
    static_cache: bool = False
    """Preallocate each model's KV cache for prompt + max_new_tokens + L + 1 per sequence and write it in place at
    each row's own positions (a rejected suffix is overwritten by the next block, never cropped): fixed shapes,
    what compiled and captured steps need. A model it does not suit (an encoder-decoder) keeps the dynamic
    cache, and the decoder says so."""
    compile: bool = False
    """Run the model steps, the sampling laws and the verify step through ``torch.compile``. The model steps need
    the static cache, which this turns on; on a GPU they replay from CUDA graphs, and the verify step is captured in
    its own (one launch per block). Worth it where launches dominate; the first blocks of each shape pay the
    compilation."""
    draft_length_schedule: str = "constant"
    """How L moves between blocks: ``constant`` keeps ``draft_length``; ``heuristic`` starts there and follows
    transformers' rule (+2 after a block whose draft was wholly accepted, -1 otherwise), decided from past
    blocks only so that every verifier stays exact."""
    exact_first: int = 0
    """Verify the first N generated tokens of every sample with ``exact_verifier`` (lossless) and the rest with the
    run's verifier; 0: off. A block that starts before N drafts at most up to N, so that every token before N is
    decided by the lossless rule. A lossless verifier is exact already: it changes nothing there."""
    exact_verifier: str = VerifierConfig().name
    """The lossless verifier (at its defaults) that decides the first ``exact_first`` tokens."""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_k: int = 0
    """0 keeps the whole vocabulary."""
    top_p: float = 1.0
    chat: bool = False
    """Apply the tokenizer's chat template to each prompt."""
    stop: tuple[str, ...] = ()
    """Texts that end a sample at their first occurrence in its decoded text (a recipe gives a list; a library
    caller may give one string, which is one text)."""

    def __post_init__(self) -> None:
        # A library caller's list (or one string) becomes the tuple a frozen, hashable config holds.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)


@dataclass(frozen=True)
class Recipe:
    target: ModelConfig
    drafts: tuple[DraftConfig, ...] = ()
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The recipe as plain data; a draft entry leaves out a drafter and parameters it does not set, and the
        speculation and generation sections a schedule, the exact-first settings and stop texts at their defaults,
        so a recipe written before them reads as it did (results folders compare these to resume)."""
        data = dataclasses.asdict(self)
        sections = [*data["drafts"], data["speculation"], data["generation"]]
        for section in sections:
            for key, unset in _LEFT_OUT_AT_DEFAULT.items():
                if key in section and section[key] == unset:
                    del section[key]
        return data

    def decoding_config(self) -> "DecodingConfig":
        """The recipe's settings apart from its models."""
        return DecodingConfig(
            verifier=self.verifier, speculation=self.speculation, generation=self.generation, seed=self.seed
        )


_LEFT_OUT_AT_DEFAULT = {
    "drafter": None,
    "params": {},
    "draft_length_schedule": "constant",
    "exact_first": 0,
    "exact_verifier": VerifierConfig().name,
    "stop": (),
}
"""Keys that :meth:`Recipe.to_dict` leaves out at these values: recipes written before the keys existed read
as they did, so results folders written then still resume. A verifier's ``params`` is not among the sections
walked."""


@dataclass(frozen=True, kw_only=True)
class DecodingConfig:
    """Settings of a decoding call: a recipe without its models.

    :meth:`replace` takes flat names (``draft_length=8``, ``temperature=0.3``, ``verifier="block"``),
    so a library caller need not know which section holds a setting.
    """

    verifier: VerifierConfig = field(default_factory=lambda: VerifierConfig(name=AUTOREGRESSIVE))
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    seed: int = 0

    @property
    def speculative(self) -> bool:
        return not target_alone(self.verifier.name)

    def replace(self, **changes: Any) -> "DecodingConfig":
        """A copy with settings changed by flat name: ``verifier`` (a name; its parameters reset unless
        ``verifier_params`` is given), ``verifier_params``, ``seed``, or any field of the speculation or
        generation section."""
        sections: dict[str, dict[str, Any]] = {"speculation": {}, "generation": {}}
        verifier, top = self.verifier, {}
        if "verifier" in changes:
            verifier = VerifierConfig(name=changes.pop("verifier"))
        if "verifier_params" in changes:
            verifier = dataclasses.replace(verifier, params=dict(changes.pop("verifier_params")))
        for name, value in changes.items():
            owner = next((s for s in sections if name in field_names(getattr(self, s))), None)
            if owner is None and name != "seed":
                valid = [
                    "verifier",
                    "verifier_params",
                    "seed",
                    *field_names(self.speculation),
                    *field_names(self.generation),
                ]
                raise TypeError(f"unknown decoding setting '{name}'; valid: {', '.join(valid)}")
            (sections[owner] if owner else top)[name] = value
        return DecodingConfig(
            verifier=verifier,
            speculation=dataclasses.replace(self.speculation, **sections["speculation"]),
            generation=dataclasses.replace(self.generation, **sections["generation"]),
            seed=top.get("seed", self.seed),
        )

    def problems(self) -> list[tuple[str, str]]:
        """(recipe path, what is wrong) for every value out of range; empty when the config is valid."""
        checks = [
            (self.speculation.draft_length >= 1, "speculation.draft_length", "must be >= 1"),
            (self.speculation.num_drafts >= 1, "speculation.num_drafts", "must be >= 1"),
            (self.speculation.exact_first >= 0, "speculation.exact_first", "must be >= 0"),
            (bool(self.speculation.exact_verifier.strip()), "speculation.exact_verifier", "must not be empty"),
            (self.generation.max_new_tokens >= 1, "generation.max_new_tokens", "must be >= 1"),
            (bool(self.verifier.name.strip()), "verifier.name", "must not be empty"),
            (
                self.speculation.draft_length_schedule in DRAFT_LENGTH_SCHEDULES,
                "speculation.draft_length_schedule",
                f"must be one of {', '.join(DRAFT_LENGTH_SCHEDULES)}",
            ),
            *((bool(text), f"generation.stop.{i}", "must not be empty") for i, text in enumerate(self.generation.stop)),
        ]
        found = [(path, message) for ok, path, message in checks if not ok]
        generation = self.generation
        return found + sampling_problems("generation", generation.temperature, generation.top_k, generation.top_p)


def field_names(section: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(section)]


def sampling_problems(
    owner: str, temperature: float | None, top_k: int | None, top_p: float | None
) -> list[tuple[str, str]]:
    """(path, what is wrong) for ``owner``'s sampling settings out of range (None: not set, fine)."""
    checks = [
        (temperature is None or 0 <= temperature < math.inf, "temperature", "must be >= 0 and finite (0 = greedy)"),
        (top_k is None or top_k >= 0, "top_k", "must be >= 0 (0 = off)"),
        (top_p is None or 0 < top_p <= 1, "top_p", "must be in (0, 1]"),
    ]
    return [(f"{owner}.{name}", message) for ok, name, message in checks if not ok]


def _valid_device(device: str) -> bool:
    if device in ("auto", "cpu", "cuda", "mps"):
        return True
    kind, _, index = device.partition(":")
    return kind == "cuda" and index.isdigit()
