"""The Makefile as a newcomer meets it: `make demo` variants get their own run dirs, and a missing
Node.js is reported before the long install and training start."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import check_node

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _dry_run(*args: str) -> str:
    """The commands `make` would run. -n runs nothing except the recipes that remake a makefile, so
    the venv stamp is assumed up to date (-o) rather than pointed at a makefile: on a fresh clone
    whose pyproject.toml is newer, that would run the venv install inside the test."""
    result = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.installed", *args], cwd=REPO,
                            capture_output=True, text=True, check=True)
    return result.stdout


def _run_dir(plan: str) -> str:
    line = next(ln for ln in plan.splitlines() if "run-local" in ln)
    return line.split("--run-dir ")[1].split()[0]


def test_demo_variants_get_their_own_run_dirs() -> None:
    dirs = {_run_dir(_dry_run("demo")), _run_dir(_dry_run("demo", "PRESET=tiny")),
            _run_dir(_dry_run("demo", "BACKEND=xla")), _run_dir(_dry_run("demo", "PRESET=tiny", "BACKEND=xla"))}
    assert dirs == {"runs/demo-small-cpu", "runs/demo-tiny-cpu", "runs/demo-small-xla", "runs/demo-tiny-xla"}
    assert _run_dir(_dry_run("demo", "RUN_DIR=runs/mine")) == "runs/mine"


def test_demo_checks_node_before_anything_long() -> None:
    plan = _dry_run("demo").splitlines()
    assert "check_node.py" in plan[0]
    assert any("run-local" in ln for ln in plan[1:])


def _fake_node(tmp_path: Path, version: str) -> str:
    node = tmp_path / "node"
    node.write_text(f"#!/bin/sh\necho {version}\n")
    node.chmod(node.stat().st_mode | stat.S_IXUSR)
    return str(node)


def test_check_node_says_what_to_install(tmp_path: Path) -> None:
    missing = check_node.node_problem(None)
    assert "Node.js not found on PATH" in missing and "install Node.js 20 or later" in missing
    old = check_node.node_problem(_fake_node(tmp_path, "v16.20.2"))
    assert "v16.20.2" in old and "older than 20" in old
    assert check_node.node_problem(_fake_node(tmp_path, "v22.11.0")) is None


def test_check_node_exits_1_without_node(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_node.py")], capture_output=True,
                            text=True, env={"PATH": str(tmp_path)})
    assert result.returncode == 1 and "Node.js not found" in result.stderr


def test_check_node_notes_an_end_of_life_node(tmp_path: Path) -> None:
    assert "past its end of life" in check_node.node_warning(_fake_node(tmp_path, "v20.20.2"))
    assert check_node.node_warning(_fake_node(tmp_path, "v22.11.0")) is None
