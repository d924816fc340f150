"""A test run writes nothing under the user's home or in the checkout: every cache the code and its libraries
keep (specdec's, the hub's, matplotlib's, the compiler's, pip's, setuptools' build folders) goes to a session
folder removed at the end, HOME itself to an empty folder there, and :func:`finish` reports what the run left
under that home or in the checkout anyway.

Its own module, imported once: test modules import ``tests.conftest`` a second time under that name, which
must not make a second session folder."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
FOLDER = Path(tempfile.mkdtemp(prefix="specdec-tests-"))
HOME = FOLDER / "home"
# Folder (under FOLDER) of each variable the code and the libraries read for where to write.
CACHE_VARIABLES = {
    "HOME": "home",
    "XDG_CACHE_HOME": "xdg-cache",
    "XDG_CONFIG_HOME": "xdg-config",
    "SPECDEC_CACHE": "specdec",  # specdec_cli.base.inputs.cache_dir: calibration, plugin descriptions, GGUF conversions
    "HF_HOME": "huggingface",
    "HF_HUB_CACHE": "huggingface/hub",
    "HF_DATASETS_CACHE": "huggingface/datasets",
    "MPLCONFIGDIR": "matplotlib",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",  # else /tmp/torchinductor_<user>, kept between runs
    "TRITON_CACHE_DIR": "triton",
    "CUDA_CACHE_PATH": "cuda",  # the NVIDIA driver's compiled kernels, else ~/.nv/ComputeCache
    "PIP_CACHE_DIR": "pip",
}
_USER_ENVIRONMENT = dict(os.environ)
_BYTECODE_OR_PYTEST = re.compile(r"(^|/)(__pycache__|\.pytest_cache)/")  # Python's and pytest's own caches


def redirect_caches() -> None:
    """Point every variable of :data:`CACHE_VARIABLES` at its folder; before torch, transformers and specdec_cli
    are imported, as huggingface_hub reads its variables at import."""
    # Installed toolchains found through HOME stay the user's (a rustup proxy on PATH, which some library probes,
    # wrote a fresh settings file into the session's home): where they live, not a cache.
    for variable, folder in (("RUSTUP_HOME", ".rustup"), ("CARGO_HOME", ".cargo")):
        os.environ.setdefault(variable, str(Path.home() / folder))
    for variable, folder in CACHE_VARIABLES.items():
        (FOLDER / folder).mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(FOLDER / folder)
    # setuptools builds an example plugin that pip installs from its folder in place (build/, *.egg-info)
    # unless told where else: this extra configuration file, read by every setuptools command, tells it.
    build, egg_info = FOLDER / "setuptools-build", FOLDER / "setuptools-egg-info"
    egg_info.mkdir(exist_ok=True)
    (FOLDER / "setuptools.cfg").write_text(f"[build]\nbuild_base = {build}\n[egg_info]\negg_base = {egg_info}\n")
    os.environ["DIST_EXTRA_CONFIG"] = str(FOLDER / "setuptools.cfg")
    os.environ["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # Never wait on the network: a hub id that is not cached must fail at once.
    os.environ["HF_HUB_OFFLINE"] = "1"


def _checkout_extras() -> set[str]:
    """Untracked and ignored files of the checkout, Python's and pytest's caches left out; empty outside a git
    checkout. git runs with the user's own environment: its configuration may be what lets it read the folder."""
    try:
        listed = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
            cwd=CHECKOUT,
            env=_USER_ENVIRONMENT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return set()
    paths = (line[3:] for line in listed if line[:2] in ("??", "!!"))
    return {path for path in paths if not _BYTECODE_OR_PYTEST.search(path)}


_AT_START = _checkout_extras()


def finish() -> str | None:
    """What the run wrote under its home or left in the checkout (None: nothing); the session folder removed."""
    written = sorted(str(path.relative_to(HOME)) for path in HOME.rglob("*"))
    left = sorted(_checkout_extras() - _AT_START)
    shutil.rmtree(FOLDER, ignore_errors=True)
    if not written and not left:
        return None
    return f"the tests wrote under HOME {written[:20]} and left in the checkout {left[:20]}"
