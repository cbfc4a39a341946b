"""A tiny run dir with real checkpoints, made once per session by the real `train` step.

Imported by test_validate.py, test_embed.py, test_export.py and test_train.py. pytest registers an
imported fixture once per importing module, so the work is cached here by session temp dir and done
only once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.steps.conftest import cli_env, run_cli

_CACHE: dict[Path, Path] = {}
TRAIN_STEPS = 4


def _train_once(prepared: Path, base: Path) -> Path:
    if base not in _CACHE:
        run_dir = base / "tiny-trained"
        shutil.copytree(prepared, run_dir)
        # Two checkpoints (steps 2 and 4) from one short run: two different models for --compare;
        # its curves streamed every 2 steps to the MLflow store in the run dir (DIR/mlruns).
        env = {k: v for k, v in cli_env().items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")}
        result = run_cli("train", "--run-dir", run_dir, "--preset", "tiny", "--backend", "cpu",
                         "--max-steps", TRAIN_STEPS, "--checkpoint-every", 2, "--log-every", 2, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        _CACHE[base] = run_dir
    return _CACHE[base]


@pytest.fixture(scope="session")
def tiny_trained(tiny_prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Read-only: a prepared tiny run dir with checkpoints/step-000000002.pt and step-000000004.pt,
    and DIR/mlruns with the train run's curves at steps 2 and 4."""
    return _train_once(tiny_prepared, tmp_path_factory.getbasetemp())


@pytest.fixture
def trained_run(tiny_trained: Path, tmp_path: Path) -> Path:
    """A writable copy of `tiny_trained` for one test."""
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_trained, run_dir)
    return run_dir


def checkpoint_at(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step-{step:09d}.pt"
    assert path.is_file(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    return path
