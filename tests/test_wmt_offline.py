"""`bench --task wmt` offline: the newstest2014 sample shipped in the package stands in for the whole set,
with a note, in either direction of its two pairs; other pairs still say how to give the data."""

import urllib.error

import pytest

from specdec_cli.base.errors import SpecdecError
from specdec_cli.bench import tasks
from specdec_cli.bench.tasks import DataSource, load_examples
from tests.conftest import read_cells, read_samples


@pytest.fixture
def offline(monkeypatch):
    """sacrebleu's download fails as it does without a network (whatever this machine can reach)."""

    def unreachable(*_):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(tasks, "_sacrebleu_wmt", unreachable)


@pytest.mark.parametrize(
    ("pair", "first_source", "first_reference"),
    [
        ("en-fr", "Spectacular Wingsuit Jump Over Bogota", 'Spectaculaire saut en "wingsuit" au-dessus de Bogota'),
        ("fr-en", 'Spectaculaire saut en "wingsuit" au-dessus de Bogota', "Spectacular Wingsuit Jump Over Bogota"),
        ("en-de", "Gutach: Increased safety for pedestrians", "Gutach: Noch mehr Sicherheit für Fußgänger"),
        ("de-en", "Gutach: Noch mehr Sicherheit für Fußgänger", "Gutach: Increased safety for pedestrians"),
    ],
)
def test_the_shipped_sample_is_aligned_in_either_direction(offline, pair, first_source, first_reference):
    loaded = load_examples(DataSource(task="wmt", lang_pair=pair))
    assert len(loaded.examples) == 300 and len({e.id for e in loaded.examples}) == 300
    assert (loaded.examples[0].source, loaded.examples[0].reference) == (first_source, first_reference)
    assert all(e.source.strip() and e.reference.strip() for e in loaded.examples)
    assert "Name or service not known" in loaded.note and f"newstest2014 {pair} shipped with specdec" in loaded.note


def test_a_pair_without_a_sample_says_how_to_give_the_data(offline):
    with pytest.raises(SpecdecError, match="offline, give the data as --source FILE --reference FILE"):
        load_examples(DataSource(task="wmt", lang_pair="en-cs"))


def test_bench_task_wmt_runs_offline_and_scores_bleu_and_chrf(offline, run, bench_recipe, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = run(["bench", "-r", bench_recipe, "--task", "wmt", "--limit", "2", "--output", str(out)])
    assert code == 0, err
    assert "shipped with specdec" in err and "the whole set: --source FILE --reference FILE" in err
    references = (tasks._SAMPLE_FOLDER / "en-fr.fr").read_text(encoding="utf-8").splitlines()[:2]
    assert {s["reference"] for s in read_samples(out)} == set(references)
    cells = read_cells(out)
    assert cells and all({"bleu", "chrf"} <= set(cell["per_seed"]["0"]) for cell in cells.values()), cells
