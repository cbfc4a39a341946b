"""Step `parity`: do two backends train models of the same quality? An experiment over seeds.

Trains DIR/prepared/ on two backends with the same seeds, scores each model with `validate`, and
writes DIR/parity/<backend>-seed<seed>/ per model and DIR/parity/report.json: per metric, each
backend's mean and spread and whether the difference is within --tolerance and the seed noise.
A rerun skips finished runs; `--train` trains some backends here, the rest elsewhere. Exits 0 (the
report is the verdict), 78 for bad flags, or a failed run's exit code. Method, two-machine recipe:
docs/training.md, "Backend parity over seeds".

Local:     python -m pipeline_steps parity --run-dir runs/parity --preset small --backends cpu,xla --seeds 0,1,2
Trainium:  python -m pipeline_steps parity --run-dir /fsx/runs/parity --preset small --backends cpu,xla
               --train xla --nproc-per-node 32 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline_contract import PREPARED_DIR, VALIDATION_METRICS

from .. import distributed as dist_lib
from ..errors import BadConfigError, ExitCode, StepError
from ..fileio import atomic_write_json
from ..parity_report import build_report, missing_runs, run_dir_for

log = logging.getLogger("pipeline_steps.parity")

DEFAULT_TOLERANCE = 0.001
"""Absolute, on metrics in [0, 1]: 0.1 points, the bound `validate` gates regressions with."""


# ----------------------------------------------------------------------------- the runs

def _run_step(step: str, args: Sequence[str], nproc_per_node: int = 1) -> None:
    """`python -m pipeline_steps STEP ARGS`: in this process (so XLA compiles each graph once for all
    seeds), or under torchrun with `nproc_per_node` workers."""
    if nproc_per_node <= 1:
        from ..__main__ import STEPS

        log.info("running %s %s", step, " ".join(args))
        importlib.import_module(STEPS[step][0]).main(list(args))
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
               "-m", "pipeline_steps", step, *args]
    log.info("running %s", " ".join(command))
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        error = StepError(f"`{' '.join(command)}` exited {result.returncode}; fix that run (its log is above) "
                          "and rerun parity: finished runs are kept")
        # Exit as the failed step did (e.g. 80 for a non-finite loss), so its documented meaning holds.
        known = {code.value for code in ExitCode}
        error.exit_code = ExitCode(result.returncode) if result.returncode in known else ExitCode.INTERNAL
        raise error


def train_and_score(root: Path, backend: str, seed: int, opts: argparse.Namespace) -> Path:
    """Train (or resume) and validate one (backend, seed) run; its validation/metrics.json."""
    run_dir = run_dir_for(root, backend, seed)
    metrics_path = run_dir / VALIDATION_METRICS
    if metrics_path.exists():
        log.info("%s: done already", run_dir)
        return metrics_path
    run_dir.mkdir(parents=True, exist_ok=True)
    # Every run reads the one DIR/prepared/ through a symlink: the same holdout for every model.
    link = run_dir / PREPARED_DIR
    if not link.exists():
        link.symlink_to(os.path.relpath(root / PREPARED_DIR, run_dir))
    train_args = ["--run-dir", str(run_dir), "--preset", opts.preset, "--backend", backend, "--seed", str(seed),
                  "--no-progress"]
    if opts.max_steps is not None:
        train_args += ["--max-steps", str(opts.max_steps)]
    if opts.epochs is not None:
        train_args += ["--epochs", str(opts.epochs)]
    _run_step("train", train_args, opts.nproc_per_node)
    _run_step("validate", ["--run-dir", str(run_dir), "--backend", opts.eval_backend or backend,
                           "--gate-report-only", "--no-sanity-floor"])
    return metrics_path


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    a, b = report["backends"]["a"], report["backends"]["b"]
    table = Table(title=f"parity: {a} vs {b}, seeds {report['seeds']}, tolerance {report['tolerance']:g}")
    for col in ("metric", f"{a} mean", f"{a} std", f"{b} mean", f"{b} std", "difference (b - a)",
                "seed spread", "within tolerance", "within seed spread"):
        table.add_column(col, justify="right")
    for name, m in report["metrics"].items():
        table.add_row(name, f"{m['a']['mean']:.4f}", f"{m['a']['std']:.4f}", f"{m['b']['mean']:.4f}",
                      f"{m['b']['std']:.4f}", f"{m['difference']:+.4f}", f"{m['seed_spread']:.4f}",
                      "yes" if m["within_tolerance"] else "NO", "yes" if m["within_seed_spread"] else "NO")
    Console(width=160).print(table)


# ----------------------------------------------------------------------------- the command

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path, help="holds prepared/ (from `prepare`)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--backends", default="cpu,xla", help="the two compared, reference first (default cpu,xla)")
    parser.add_argument("--train", default=None,
                        help="the backends trained on this machine (default: both); the others' run dirs must "
                             "already be under DIR/parity/")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated; the same on both backends")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="absolute bound on the difference of means per metric (default 0.001)")
    parser.add_argument("--eval-backend", choices=dist_lib.BACKENDS, default=None,
                        help="score every model on this backend (default: the one it was trained on)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="train under torchrun with N workers")
    args = parser.parse_args(argv)
    args.backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    args.train = args.backends if args.train is None else tuple(b.strip() for b in args.train.split(",") if b.strip())
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise BadConfigError(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2") from None
    if len(args.backends) != 2 or len(set(args.backends)) != 2:
        raise BadConfigError(f"--backends {','.join(args.backends)}: name two different backends, e.g. cpu,xla")
    for backend in args.backends:
        if backend not in dist_lib.BACKENDS:
            raise BadConfigError(f"unknown backend {backend!r}; choose from {', '.join(dist_lib.BACKENDS)}")
    if not set(args.train) <= set(args.backends):
        raise BadConfigError(f"--train {','.join(args.train)} must be among --backends {','.join(args.backends)}")
    if len(args.seeds) < 2:
        raise BadConfigError("--seeds: give at least two seeds; one seed per backend cannot measure seed noise")
    if args.tolerance < 0:
        raise BadConfigError(f"--tolerance {args.tolerance}: must be >= 0")
    if not (args.run_dir / PREPARED_DIR).is_dir():
        raise BadConfigError(f"{args.run_dir / PREPARED_DIR} does not exist; run `python -m pipeline_steps prepare "
                             f"--run-dir {args.run_dir} ...` first")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.run_dir.resolve()
    if "xla" in args.train:
        # Before any eager backward: autograd sizes its per-device queues at its first backward,
        # and a device type registered later (XLA) cannot run one in the same process.
        dist_lib.init("xla")
    for backend in args.train:
        for seed in args.seeds:
            train_and_score(root, backend, seed, args)
    elsewhere = missing_runs(root, args.backends, args.seeds)
    if elsewhere:
        log.info("trained %s; still missing %s under %s: train them on their machine (--train) and copy the run "
                 "dirs here, then rerun this command for the report", ",".join(args.train), ", ".join(elsewhere),
                 root / "parity")
        return 0
    report = build_report(root, args.backends, args.seeds, args.tolerance)
    atomic_write_json(root / "parity" / "report.json", report)
    print_report(report)
    log.info("wrote %s", root / "parity" / "report.json")
    return 0
