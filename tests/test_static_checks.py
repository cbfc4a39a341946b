"""The habits of a maintained Python project, checked by `make test` (and so by CI): the formatter
(on the packages pyproject.toml lists), the linter and the type checker pass on the whole tree, configured in pyproject.toml ([tool.ruff], [tool.mypy]:
what they check and every exclusion, with its reason). A few seconds with their caches warm; the
type checker's first run reads torch's annotations (about a minute of CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True, check=False,
                          timeout=900)


def test_the_formatted_packages_stay_formatted():
    """`ruff format .` leaves every file it covers as it is ([tool.ruff.format] says which)."""
    result = _run("ruff", "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_linter_passes():
    """pycodestyle, pyflakes, import order, bugbear and pyupgrade findings: `ruff check --fix` fixes
    most of them."""
    result = _run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.slow
def test_the_type_checker_passes():
    result = _run("mypy")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
