"""The GGUF conversion cache: a ``.gguf`` file's weights dequantised to floats by transformers once and saved under
specdec's cache folder (``$SPECDEC_CACHE``, default ``~/.cache/specdec``), keyed by the file's content, so a second
run skips the conversion. A conversion is saved into a staging folder and renamed into place (never half-written);
staging folders that killed runs left behind are removed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ..base.errors import ModelLoadError, SpecdecError
from ..base.inputs import cache_dir, check_writable_folder, write_atomically
from ..base.waits import waiting

__all__ = ["STALE_STAGING_AFTER_S", "cached_gguf_conversion", "content_digest", "remove_stale_staging"]


_STAGING_PREFIX = ".converting-"
STALE_STAGING_AFTER_S = 24 * 3600
"""Age after which any staging folder is stale: a conversion writes files into it within minutes."""


def cached_gguf_conversion(folder: str, gguf_file: str, common: dict[str, Any]) -> str:
    """A directory with the GGUF's weights dequantised to safetensors, converting on first use."""
    gguf_path = Path(folder) / gguf_file
    target = cache_dir() / "gguf" / f"{gguf_path.stem}-{content_digest(gguf_path)[:16]}"
    remove_stale_staging(target.parent)
    if (target / "config.json").is_file():
        return str(target)
    check_writable_folder(target.parent, "the cache folder (SPECDEC_CACHE)")  # before a minute of conversion
    with waiting(f"converting the GGUF weights of {gguf_file} to floats, once: later runs load them from {target}"):
        model, tokenizer = _dequantised(folder, gguf_file, common)
        _save_atomically(model, tokenizer, target)
    return str(target)


_DIGESTS = "gguf-digests"
"""The cache's folder of remembered GGUF digests, one small file per (path, size, modification time); beside
the conversions' folder, which holds conversions only."""
_DIGEST_CHUNK_BYTES = 2**20


def content_digest(path: Path) -> str:
    """The SHA-256 of the file's content, which keys its conversion: the same file installed in several places
    (one per virtual environment) shares one conversion. Read whole once per (path, size, modification time)
    and remembered in the cache: a digest of some parts only could take two files that differ in their middle
    tensors (a fine-tune) for one. A remembered digest that is not 64 hex digits is computed again."""
    stat = path.stat()
    where = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    memo = cache_dir() / _DIGESTS / hashlib.sha256(where.encode()).hexdigest()[:32]
    with suppress(OSError, UnicodeDecodeError):
        remembered = memo.read_text(encoding="ascii").strip()
        if re.fullmatch("[0-9a-f]{64}", remembered):
            return remembered
    try:
        with open(path, "rb") as handle:
            hashed = hashlib.sha256()
            while chunk := handle.read(_DIGEST_CHUNK_BYTES):
                hashed.update(chunk)
    except OSError as error:
        raise ModelLoadError(f"cannot read the GGUF file '{path}' ({error.strerror}); make it readable") from None
    digest = hashed.hexdigest()
    with suppress(OSError):  # a cache that cannot keep it: the next run reads the file again
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(memo, digest + "\n")
    return digest


def _dequantised(folder: str, gguf_file: str, common: dict[str, Any]) -> tuple[Any, Any]:
    """The GGUF's model, with float weights, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with warnings.catch_warnings(), _conversion_bar_as_the_cli_says():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, **common)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, **common)
    except ImportError as error:
        raise ModelLoadError(
            f"loading '{Path(folder) / gguf_file}' needs the gguf package: pip install gguf ({error})"
        ) from None
    # The weights are plain floats once dequantised; transformers only refuses to save them
    # because the model still carries the GGUF quantiser marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


@contextmanager
def _conversion_bar_as_the_cli_says() -> Iterator[None]:
    """transformers' GGUF conversion draws its tqdm bar whatever its progress bar setting (which the CLI
    switches off unless --verbose): drawn here only where that setting lets its own bars through."""
    from transformers import modeling_gguf_pytorch_utils as conversion
    from transformers.utils import logging

    bar = getattr(conversion, "tqdm", None)
    if bar is None or logging.is_progress_bar_enabled():
        yield
        return
    conversion.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        conversion.tqdm = bar


def _save_atomically(model: Any, tokenizer: Any, target: Path) -> None:
    """Save into a staging folder named after this process, then rename it to ``target``: a run never
    sees half a conversion, and a staging folder left by a killed run is recognised as stale later."""
    owner = f"{os.getpid()}-{socket.gethostname()}-"
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=_STAGING_PREFIX + owner))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except BaseException as error:  # Ctrl-C and SIGTERM too: half a gigabyte must not stay behind
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(error, OSError):
            raise
        if not (target / "config.json").is_file():  # else another run renamed its conversion first
            raise SpecdecError(
                f"could not save the converted model in the cache folder '{target.parent}' "
                f"({error.strerror or error}); "
                "free some space or set SPECDEC_CACHE to another folder"
            ) from None


def remove_stale_staging(folder: Path) -> None:
    """Remove the staging folders of conversions that were killed while saving (SIGKILL, a crash)."""
    for staging in folder.glob(f"{_STAGING_PREFIX}*"):
        if staging.is_dir() and _is_stale(staging):
            shutil.rmtree(staging, ignore_errors=True)


def _is_stale(staging: Path) -> bool:
    """Stale: its process (named as pid-host-… by :func:`_save_atomically`) is gone from this host, or it
    has not changed for STALE_STAGING_AFTER_S (another host's, or an older version's without an owner)."""
    pid, _, rest = staging.name.removeprefix(_STAGING_PREFIX).partition("-")
    on_this_host = pid.isdigit() and int(pid) > 0 and rest.rpartition("-")[0] == socket.gethostname()
    if on_this_host and not _process_alive(int(pid)):
        return True
    try:
        return time.time() - staging.stat().st_mtime > STALE_STAGING_AFTER_S
    except OSError:  # removed meanwhile by another run
        return False


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
