"""Backend parity's numbers: where each (backend, seed) run lives, its metrics, and per metric the
means, spreads and verdicts of two backends over the seeds (the parity step prints them)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline_contract import TRAIN_SUMMARY, VALIDATION_METRICS


def run_dir_for(root: Path, backend: str, seed: int) -> Path:
    return root / "parity" / f"{backend}-seed{seed}"


def load_run_metrics(root: Path, backend: str, seed: int) -> dict[str, float] | None:
    """Holdout metrics and final training losses of one run; None when it has not run yet."""
    run_dir = run_dir_for(root, backend, seed)
    metrics_path = run_dir / VALIDATION_METRICS
    if not metrics_path.exists():
        return None
    metrics = {k: v for k, v in json.loads(metrics_path.read_text("utf-8"))["metrics"].items()
               if isinstance(v, (int, float)) and v is not None}
    summary_path = run_dir / TRAIN_SUMMARY
    if summary_path.exists():
        summary = json.loads(summary_path.read_text("utf-8"))
        for key in ("final_loss", "holdout_loss"):
            if isinstance(summary.get(key), (int, float)):
                metrics[key] = summary[key]
    return metrics


def _spread(values: list[float]) -> float:
    """Sample standard deviation (0 for one value: no spread measured)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def compare_metric(a: list[float], b: list[float], tolerance: float) -> dict[str, Any]:
    """Means, spreads and the verdicts for one metric over the seeds of backends A and B."""
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    spread_a, spread_b = _spread(a), _spread(b)
    seed_spread = math.sqrt((spread_a**2 + spread_b**2) / 2)
    difference = mean_b - mean_a
    return {
        "a": {"mean": mean_a, "std": spread_a, "min": min(a), "max": max(a), "values": a},
        "b": {"mean": mean_b, "std": spread_b, "min": min(b), "max": max(b), "values": b},
        "difference": difference,
        "seed_spread": seed_spread,
        "within_tolerance": abs(difference) <= tolerance,
        "within_seed_spread": abs(difference) <= seed_spread,
    }


def missing_runs(root: Path, backends: Sequence[str], seeds: list[int]) -> list[str]:
    return [run_dir_for(root, b, s).name for b in backends for s in seeds
            if not (run_dir_for(root, b, s) / VALIDATION_METRICS).exists()]


def _present(metrics: dict[str, float] | None, root: Path, backend: str, seed: int) -> dict[str, float]:
    if metrics is None:  # the caller checks missing_runs first
        raise ValueError(f"{run_dir_for(root, backend, seed)} has not been scored")
    return metrics


def build_report(root: Path, backends: tuple[str, str], seeds: list[int], tolerance: float) -> dict[str, Any]:
    runs = {b: [_present(load_run_metrics(root, b, s), root, b, s) for s in seeds] for b in backends}
    a, b = backends
    names = [k for k in runs[a][0] if all(k in m for m in runs[a] + runs[b])]
    per_metric = {k: compare_metric([m[k] for m in runs[a]], [m[k] for m in runs[b]], tolerance) for k in names}
    holdout = [k for k in per_metric if k not in ("final_loss", "holdout_loss")]
    return {
        "backends": {"a": a, "b": b}, "seeds": seeds, "tolerance": tolerance, "metrics": per_metric,
        "all_within_tolerance": all(per_metric[k]["within_tolerance"] for k in holdout),
        "all_within_seed_spread": all(per_metric[k]["within_seed_spread"] for k in holdout),
        "runs": {b: [str(run_dir_for(root, b, s)) for s in seeds] for b in backends},
    }
