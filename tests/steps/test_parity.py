"""`python -m pipeline_steps parity`: two backends x several seeds, per-metric mean, spread and verdicts."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pipeline_steps import checkpoint
from pipeline_steps.errors import ExitCode
from pipeline_steps.fileio import read_json
from pipeline_steps.parity_report import compare_metric

from .conftest import run_cli


def test_difference_of_means_is_judged_against_the_tolerance_and_the_seed_spread() -> None:
    close_but_noisy = compare_metric([0.50, 0.52], [0.51, 0.53], tolerance=0.001)
    assert close_but_noisy["difference"] == pytest.approx(0.01)
    assert close_but_noisy["seed_spread"] == pytest.approx(statistics.stdev([0.50, 0.52]))
    assert not close_but_noisy["within_tolerance"] and close_but_noisy["within_seed_spread"]

    apart = compare_metric([0.50, 0.5002], [0.60, 0.6002], tolerance=0.001)
    assert not apart["within_tolerance"] and not apart["within_seed_spread"]
    assert compare_metric([0.7, 0.7], [0.7005, 0.7005], tolerance=0.001)["within_tolerance"]


def test_tiny_parity_of_cpu_and_xla_over_two_seeds(tiny_run: Path) -> None:
    args = ("parity", "--run-dir", tiny_run, "--preset", "tiny", "--backends", "cpu,xla", "--seeds", "0,1",
            "--max-steps", "2", "--eval-backend", "cpu")
    result = run_cli(*args, timeout=1500)  # 8 processes; XLA compiles twice
    assert result.returncode == 0, result.stderr[-3000:]
    report = read_json(tiny_run / "parity" / "report.json")
    assert report["backends"] == {"a": "cpu", "b": "xla"} and report["seeds"] == [0, 1]
    assert report["tolerance"] == 0.001
    for backend in ("cpu", "xla"):
        for seed, run in zip((0, 1), report["runs"][backend]):
            state = checkpoint.load(checkpoint.latest(Path(run)))
            assert (state["extra"]["backend"], state["config"]["train"]["seed"], state["step"]) == (backend, seed, 2)

    for name in ("recall@10", "ndcg@10", "recall@1", "final_loss"):
        metric = report["metrics"][name]
        for side in ("a", "b"):
            values = metric[side]["values"]
            assert len(values) == 2
            assert metric[side]["mean"] == pytest.approx(statistics.fmean(values))
            assert metric[side]["std"] == pytest.approx(statistics.stdev(values))
        assert metric["difference"] == pytest.approx(metric["b"]["mean"] - metric["a"]["mean"])
        assert metric["within_tolerance"] == (abs(metric["difference"]) <= 0.001)
    # Different seeds train different models: the spread is measured, not assumed.
    assert report["metrics"]["final_loss"]["a"]["std"] > 0
    assert "within seed spread" in result.stdout

    # Finished runs are kept: a rerun with a looser tolerance only recomputes the report.
    rerun = run_cli(*args, "--tolerance", "1")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "done already" in rerun.stderr and "running" not in rerun.stderr
    assert read_json(tiny_run / "parity" / "report.json")["all_within_tolerance"]


def test_parity_needs_two_seeds(tiny_run: Path) -> None:
    result = run_cli("parity", "--run-dir", tiny_run, "--preset", "tiny", "--seeds", "0")
    assert result.returncode == ExitCode.BAD_CONFIG
    assert "at least two seeds" in result.stderr
