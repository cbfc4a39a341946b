"""Shared fixtures: the tiny demo data prepared once per session, copied into each test's run dir."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from pipeline_steps.diagnosis.classifier import parse_rules

REPO = Path(__file__).resolve().parents[2]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PJRT_DEVICE", "CPU")
    env["PIPELINE_LOG_LEVEL"] = "INFO"  # tests read the steps' log lines, whatever CI sets
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
            torchrun: int | None = None) -> subprocess.CompletedProcess:
    """Run `python -m pipeline_steps ...` (or under torchrun with N processes) as a user would."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
                "-m", "pipeline_steps"] if torchrun else [sys.executable, "-m", "pipeline_steps"]
    return subprocess.run([*launcher, *map(str, args)], env=env or cli_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture(scope="session")
def tiny_prepared(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tiny-prepared")
    result = run_cli("prepare", "--run-dir", run_dir, "--demo", "--preset", "tiny")
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.fixture
def tiny_run(tiny_prepared: Path, tmp_path: Path) -> Path:
    """A fresh run dir holding a copy of the prepared tiny demo data."""
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_prepared, run_dir)
    return run_dir


@pytest.fixture
def one_thread():
    """In-process tests on tiny tensors: one intra-op thread. They gain nothing from more, and on a
    busy 2-core CI box OpenMP's spin barriers under oversubscription made a learning test ~20x
    slower (190 s vs 10 s)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_run_local(tmp_path_factory):
    """`run-local --preset tiny` once per backend and session: run(backend) -> (run dir, process).
    The xla run is the longest test run; test_run_local.py and test_train.py assert on the same one."""
    runs: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def run(backend: str) -> tuple[Path, subprocess.CompletedProcess]:
        if backend not in runs:
            run_dir = tmp_path_factory.mktemp("run-local") / backend
            runs[backend] = run_dir, run_cli("run-local", "--run-dir", run_dir, "--preset", "tiny",
                                             "--backend", backend, timeout=1200)
        return runs[backend]

    return run


# The rule for a bare exception class at a traceback's end that shipped until holdout 70 (tier
# generic). rules.toml no longer has it; the engine still honours the tier, which these rules test.
GENERIC_RULE = """
[[rules]]
id = "python-exception-any"
class = "user_code_error"
tier = "generic"
patterns = [
  '''(?-i:(^\\s*|\\]:?\\s+)([a-z_]\\w*\\.)*(?!(RuntimeError|OSError|IOError|EnvironmentError|SystemError|\\w*Connection\\w*Error|\\w*TimeoutError|ChildFailedError|SignalException|Process(Raised|Exited)Exception|\\w*Internal\\w*|BrokenPipeError|MemoryError)\\b)([A-Z][A-Za-z0-9]*(Error|Exception)|Exception)(:\\s|:$|$))''',
]
"""


@pytest.fixture(scope="session")
def rules_with_generic():
    """Today's rules plus the generic rule above."""
    text = resources.files("pipeline_steps.diagnosis").joinpath("rules.toml").read_text("utf-8")
    return parse_rules(text + GENERIC_RULE, "rules.toml + the generic rule")
