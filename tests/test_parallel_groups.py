"""`make test` runs on parallel workers, and tests that share an expensive fixture must run on one
worker, or each worker builds it again (tests/conftest.py). Run for real: a small suite under
pytest-xdist, with this repository's grouping hook, builds its module fixture once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHARED = '''
import pytest

@pytest.fixture(scope="module")
def world():
    with open("built.log", "a") as log:
        log.write("built\\n")
    return 1

def test_a(world): pass
def test_b(world): pass
def test_c(world): pass
def test_d(world): pass
'''


def test_a_module_fixture_is_built_once_however_many_workers(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (suite / "test_shared.py").write_text(SHARED)
    for i in range(6):
        (suite / f"test_other_{i}.py").write_text("import time\n\n\ndef test_x():\n    time.sleep(0.2)\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                             "-p", "no:cacheprovider", str(suite)], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / "built.log").read_text().splitlines() == ["built"]
