"""What a reader takes in at a glance (#41): the acceptance table's numbers and footnotes, the acceptance and bench
plots, the listings at 80 columns, the resume line under a progress bar, 'did you mean' for plugin names, what the
conformance kit checked, and the note for skipped blank prompt lines."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from rich.console import Console

from specdec_cli.acceptance import report as acceptance_report
from specdec_cli.acceptance.results import AcceptanceReport, AcceptanceRow, PromptAcceptance
from specdec_cli.base.inputs import PromptLines
from specdec_cli.generation import calibration
from specdec_cli.kit.conformance import ConformanceReport, check_verifier
from specdec_cli.plugins.registry import VerifierRegistry
from tests.conftest import acceptance_of_one_prompt, bench_on_files

SINGLE_DRAFT = ("cactus", "ensemble", "fuzzy", "speculative", "threshold")


def synthetic_report(kl: dict[str, list[float]], tv: dict[str, list[float]] | None = None, num_drafts=(1, 2)):
    """A report of one prompt of two positions: the optimum, the single-draft verifiers of :data:`SINGLE_DRAFT`
    (each unavailable at K = 2 in the registry's words) and a mentored row per KL bound in ``kl``'s labels; ``kl``
    and ``tv``: label → the two positions' spent divergence."""
    bounded = [AcceptanceRow("mentored", kl_bound=float(label.split("=")[1])) for label in kl if "D=" in label]
    rows = [AcceptanceRow("optimum"), *(AcceptanceRow(name) for name in SINGLE_DRAFT), *bounded]
    prompt = PromptAcceptance(prompt="a b", prompt_index=0, positions=2)
    for number, row in enumerate(rows):
        prompt.values[row.label] = {1: [0.1 + 0.05 * number, 0.2 + 0.05 * number]}
        for k in num_drafts[1:]:
            if row.verifier == "optimum":
                prompt.values[row.label][k] = [0.3, 0.4]
            else:
                prompt.unavailable[(row.label, k)] = f"verifier '{row.verifier}' takes at most 1 draft(s) per position"
    prompt.kl = dict(kl)
    prompt.spent = {label: {"tv": values} for label, values in (tv or {}).items()}
    report = AcceptanceReport(rows=rows, num_drafts=list(num_drafts))
    report.add(prompt)
    return report


def table_text(report: AcceptanceReport) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 (closed by the GC)
    console.print(acceptance_report.table(report))
    return console.export_text()


def table_columns(text: str) -> dict[str, list[str]]:
    """The body's cells by column header (the rows between the header rule and the bottom rule)."""
    lines = text.splitlines()
    header = next(line for line in lines if "verifier" in line and "┃" in line)
    names = [cell.strip() for cell in header.strip("┃").split("┃")]
    body = [line for line in lines if line.startswith("│")]
    cells = [[cell.strip() for cell in line.strip("│").split("│")] for line in body]
    return {name: [row[index] for row in cells] for index, name in enumerate(names)}


# The acceptance table


def test_rounding_noise_is_shown_as_0_and_a_small_value_is_not():
    report = synthetic_report({"threshold": [-2.4e-18, 0.0], "cactus": [2e-4, 2.2e-4], "fuzzy": [0.14, 0.1412]})
    column = dict(
        zip(table_columns(table_text(report))["verifier"], table_columns(table_text(report))["KL(q‖π), mean"])
    )
    assert column["threshold"] == "0"
    assert column["cactus"] == "0.00021"  # a small value keeps two significant figures: never 0 nor noise
    assert "e-" not in table_text(report) and "-0" not in table_text(report)


def test_every_column_has_one_number_format():
    report = synthetic_report(
        {"threshold": [1e-17, -1e-17], "cactus": [0.1406, 0.1406], "mentored D=0.6": [0.6, 0.6], "typical": [1.0, 2.0]},
        tv={"cactus": [0.14, 0.1423], "mentored D=0.6": [0.457, 0.457], "typical": [0.213, 0.213]},
    )
    for header, cells in table_columns(table_text(report)).items():
        if header == "verifier":
            continue
        numbers = [number for cell in cells for number in re.findall(r"-?\d+\.\d+|\b\d+\b", cell) if number != "0"]
        decimals = {len(number.partition(".")[2]) for number in numbers}
        assert len(decimals) == 1, (header, cells)  # the old table mixed 0.141 (3 decimals) with 0.1406 (4 figures)


def test_a_reason_for_missing_cells_is_said_once_naming_its_verifiers():
    report = synthetic_report({"mentored D=0.5": [0.5, 0.5]})
    text = table_text(report)
    assert text.count("takes at most 1 draft(s) per position") == 1, text
    footnote = text[text.index("—: ") :]
    for name in (*SINGLE_DRAFT, "mentored"):
        assert name in footnote
    # Another reason (its own words, naming no verifier) is kept as it is, once, beside it.
    report.unavailable[("optimum", 2)] = "K=2 different drafts sharing more than 128 tokens"
    reasons = acceptance_report.unavailable_reasons(report)
    assert len(reasons) == 2 and "K=2 different drafts sharing more than 128 tokens" in reasons


# The acceptance plot


def axes_titles(figure) -> list[str]:
    return [axis.get_title() for axis in figure.axes]


def test_the_acceptance_plot_has_no_empty_panel_and_titles_its_panels_by_divergence():
    import matplotlib.pyplot as plt

    kl = {"mentored D=0.5": [0.5, 0.5], "mentored D=1": [1.0, 1.0]}
    cases = [
        (synthetic_report(kl, tv={"mentored D=0.5": [0.4, 0.4]}), ["against K", "KL(q ‖ π)", "TV(q, π)"]),
        (synthetic_report(kl), ["against K", "KL(q ‖ π)"]),  # no TV: no panel for it (it was a blank one)
        (synthetic_report(kl, num_drafts=(1,)), ["at K=1", "KL(q ‖ π)"]),  # one K: no K axis with one value
        (synthetic_report({}, num_drafts=(1,)), ["at K=1"]),
    ]
    for report, expected in cases:
        figure = acceptance_report.figure(report)
        try:
            titles = axes_titles(figure)
            assert len(titles) == len(expected) and all(part in title for part, title in zip(expected, titles)), titles
            assert all(axis.axison and axis.has_data() for axis in figure.axes)
            assert "acceptance vs K" not in titles and len(set(titles)) == len(titles)
        finally:
            plt.close(figure)


def overlapping_labels(figure) -> list[tuple[str, str]]:
    from matplotlib.text import Annotation

    renderer = figure.canvas.get_renderer()
    overlaps = []
    for axis in figure.axes:
        labels = [text for text in axis.texts if isinstance(text, Annotation)]
        boxes = [(label.get_text(), label.get_window_extent(renderer)) for label in labels]
        overlaps += [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]
    return overlaps


def test_the_frontiers_point_labels_do_not_overlap():
    import matplotlib.pyplot as plt

    # Bounds that spend nearly the same KL for nearly the same acceptance: their labels used to print over one another.
    kl = {f"mentored D={bound:g}": [bound, bound] for bound in (0.6, 0.601, 0.602, 0.603, 2.0)}
    report = synthetic_report(kl, tv={label: [0.4, 0.4] for label in kl})
    for number, label in enumerate(kl):
        report.prompts[0].values[label][1] = [0.5 + 0.001 * number] * 2
    figure = acceptance_report.figure(report)
    try:
        assert overlapping_labels(figure) == []
        # Negative control: the labels put back where they were drawn do overlap, so the check can fail.
        for axis in figure.axes:
            for label in axis.texts:
                label.xyann = (4, 4)
        assert overlapping_labels(figure)
    finally:
        plt.close(figure)


# The bench plot and the resume line


def busy(monkeypatch) -> None:
    monkeypatch.setattr(calibration, "cpu_load", lambda: calibration.CpuLoad(7.5, 2))


def test_a_busy_cpu_is_named_on_the_bench_plot_and_the_resume_note_has_its_own_line(
    run, bench_recipe, data, tmp_path, monkeypatch
):
    import matplotlib.pyplot as plt

    from specdec_cli.bench import report as bench_report

    drawn = []
    monkeypatch.setattr(bench_report, "save", lambda figure, path: drawn.append(figure))
    busy(monkeypatch)
    out, plot = tmp_path / "out", tmp_path / "plot.png"
    code, _, err = run(bench_on_files(bench_recipe, data, out, "--plot", str(plot), limit=2))
    assert code == 0 and "the CPU is busy" in err, err
    (figure,) = drawn
    try:
        renderer = figure.canvas.get_renderer()
        (note,) = [text for text in figure.texts if "the CPU is busy (load 7.5 on 2 cores)" in text.get_text()]
        box = note.get_window_extent(renderer)
        assert figure.bbox.contains(box.x0, box.y0) and figure.bbox.contains(box.x1, box.y1)  # all of it shows
        assert not any(box.overlaps(axis.get_tightbbox(renderer)) for axis in figure.axes)  # nor hides a label
    finally:
        plt.close(figure)
    # A resumed run under a progress bar on a terminal: its note starts a line of its own (it used to follow the
    # bar's "ETA -:--:--" on the bar's line).
    samples = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    (out / "samples.jsonl").write_text("".join(samples[:3]))
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    code, _, err = run(bench_on_files(bench_recipe, data, out, limit=2))
    assert code == 0, err
    start = err.index("note: resuming")
    assert err[:start].endswith(("\n", "\x1b[2K")), repr(err[start - 80 : start])  # a new or a cleared line


def test_a_quiet_cpu_leaves_the_bench_plot_without_a_note(run, bench_recipe, data, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from specdec_cli.bench import report as bench_report

    drawn = []
    monkeypatch.setattr(bench_report, "save", lambda figure, path: drawn.append(figure))
    code, _, err = run(bench_on_files(bench_recipe, data, None, "--plot", str(tmp_path / "plot.png"), limit=1))
    assert code == 0, err
    (figure,) = drawn
    assert not [text for text in figure.texts if "busy" in text.get_text()]
    plt.close(figure)


# Listings at 80 columns and names mistyped


@pytest.mark.parametrize("kind", ["verifiers", "drafters"])
def test_listings_fit_80_columns_with_every_name_whole(run, monkeypatch, kind):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run([kind])
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    code, listed, _ = run([kind, "--json"])
    for plugin in json.loads(listed)[kind]:
        assert re.search(rf"│ {re.escape(plugin['name'])} +│", out), plugin["name"]
        for parameter in plugin["parameters"]:
            assert re.search(rf"│ {re.escape(parameter)} +│", out), (plugin["name"], parameter)  # never "entropy_thre…"


@pytest.mark.parametrize(
    ("flag", "typed", "meant"),
    [
        ("--verifier", "mentord", "mentored"),
        ("--verifier", "Typcal", "typical"),
        ("--drafter", "promt-lookup", "prompt-lookup"),
    ],
)
def test_a_mistyped_plugin_name_gets_did_you_mean(run, recipe_path, flag, typed, meant):
    code, _, err = run([*acceptance_of_one_prompt(recipe_path), flag, typed])  # the last --verifier counts
    assert code == 2
    assert f"did you mean '{meant}'?" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "installed" not in err  # one suggestion, not the whole list


def test_a_name_close_to_none_still_lists_the_installed_plugins(run, recipe_path):
    code, _, err = run([*acceptance_of_one_prompt(recipe_path), "--verifier", "nosuch"])
    assert code == 2 and "did you mean" not in err and "installed verifiers: block, cactus" in err


# The conformance kit's result


def test_check_verifier_returns_what_it_checked_and_prints_nothing(capsys):
    result = check_verifier(VerifierRegistry().load_class("mentored"), {"kl": 0.1}, samples=300)
    assert isinstance(result, ConformanceReport)
    assert (result.kind, result.name, result.params) == ("verifier", "mentored", {"kl": 0.1})
    topics = [check.split(":")[0] for check in result.checks]
    assert topics == ["contract", "parameters", "K=1", "K=1", "K=1", "frontier"]
    assert "within the KL 0.1 it promises" in result.checks[2] and "chi-square p = " in result.checks[3]
    shown = repr(result)  # what a prompt shows of the call
    assert shown.startswith("verifier 'mentored' (kl=0.1) passed 6 conformance checks:")
    assert all(f"✓ {check}" in shown for check in result.checks)
    assert capsys.readouterr() == ("", "")  # library code: quiet


def test_a_lossless_verifier_with_two_drafts_reports_each_k():
    result = check_verifier(VerifierRegistry().load_class("spectr"), samples=300)
    assert [check.split(":")[0] for check in result.checks] == ["contract", "parameters", *["K=1"] * 3, *["K=2"] * 3]
    assert all("its output law is the target's" in check for check in result.checks if "block law, enumerated" in check)


# Blank lines of a prompt file


def test_blank_lines_between_prompts_are_counted_for_a_note():
    lines = PromptLines.of("\na b\n\n  \nc d\n\n\n")
    assert lines.prompts == ["a b", "c d"] and lines.skipped == (1, 3, 4)  # trailing blank lines are not counted
    note = lines.note("--prompt-file 'p.txt'")
    assert note.startswith("--prompt-file 'p.txt': skipped 3 blank lines (lines 1, 3, 4)") and ".jsonl" in note
    assert PromptLines.of("a\nb\n\n").note("x") is None  # no note for a file that has none between prompts
    many = PromptLines.of("a\n" + "\n" * 7 + "b\n")
    assert "(lines 2, 3, 4, 5, 6, …)" in many.note("x")
