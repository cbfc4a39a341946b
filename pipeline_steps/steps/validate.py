"""validate: holdout retrieval metrics, a BM25 baseline, and the quality gate.

Scores a checkpoint (`--checkpoint`, default DIR) on DIR/prepared/'s holdout next to BM25 and writes
DIR/validation/metrics.json and gate.json (also to --gate-s3-uri). A failed gate exits 79 after
writing gate.json (0 with --gate-report-only). `--compare CKPT_A CKPT_B` writes compare.json instead
and exits 79 when a metric differs by more than --tolerance. Metrics, gate checks and file contents:
docs/training.md, "Validation, the quality gate, embeddings".

Local:  python -m pipeline_steps validate --run-dir runs/demo [--previous-metrics OLD/validation/gate.json]
AWS:    job "validate", one process: python -m pipeline_steps validate --run-dir /fsx/runs/<run_id> --backend xla
            --previous-metrics s3://<artifacts>/models/current.json --gate-report-only --gate-s3-uri s3://...
"""

from __future__ import annotations

import argparse
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline_contract import GATE_REPORT, VALIDATION_DIR, VALIDATION_METRICS

from .. import distributed, retrieval_metrics, s3, tracking
from ..checkpoint_comparison import COMPARE_REPORT, run_compare
from ..errors import GateFailedError
from ..fileio import atomic_write_json
from ..holdout_evaluation import BM25_PARAMS, bm25_metrics, evaluate_model, holdout_queries, print_table
from ..inference import DEFAULT_BATCH_SIZE, check_compatible, load_for_inference
from ..quality_gate import (
    DEFAULT_GATED_METRICS,
    DEFAULT_TOLERANCE,
    SANITY_FACTOR,
    SANITY_METRIC,
    decide_gate,
    load_previous,
    parse_floors,
    parse_gated,
)

log = logging.getLogger("pipeline_steps.validate")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps validate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", help="a .pt checkpoint or a run dir (its latest valid one); default: --run-dir")
    parser.add_argument("--backend", choices=distributed.BACKENDS, default=None,
                        help="default: xla on a Trainium host, cuda with a GPU, else cpu")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--previous-metrics", metavar="PATH_OR_S3_URI",
                        help="previous production model's gate.json / metrics.json / current.json "
                             "(missing = no previous model)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="absolute regression allowance per metric (and the --compare parity bound)")
    parser.add_argument("--gate-metric", default=",".join(DEFAULT_GATED_METRICS), metavar="KEY[,KEY]",
                        help="metrics that must not regress (default %(default)s)")
    parser.add_argument("--floor", action="append", default=[], metavar="KEY=VALUE",
                        help="absolute minimum (a number, or 'bm25' = beat the baseline); repeatable")
    parser.add_argument("--floor-recall-at-10", type=float, default=None, metavar="X",
                        help="same as --floor recall@10=X")
    parser.add_argument("--no-sanity-floor", action="store_true",
                        help="skip the 'recall@10 > 2x random' check (e.g. for an untrained smoke-test model)")
    parser.add_argument("--gate-report-only", action="store_true",
                        help="exit 0 even when the gate fails; the decision is `passed` in gate.json")
    parser.add_argument("--gate-s3-uri", metavar="s3://BUCKET/KEY", help="also upload gate.json there")
    parser.add_argument("--compare", nargs=2, metavar=("CKPT_A", "CKPT_B"),
                        help="parity report of two checkpoints on this run dir's holdout -> compare.json")
    parser.add_argument("--backend-b", choices=distributed.BACKENDS, default=None,
                        help="with --compare: run CKPT_B on this backend (default: --backend)")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if not 0.0 <= args.tolerance < 1.0:
        parser.error("--tolerance is an absolute metric difference in [0, 1)")
    if args.gate_s3_uri:
        s3.split_uri(args.gate_s3_uri)
    # Parsed after argparse so a bad value exits 78 with the fix-it, not argparse's generic message.
    args.gated = parse_gated(args.gate_metric)
    args.floors = parse_floors(args.floor, args.floor_recall_at_10)
    return args


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def run_validate(args: argparse.Namespace) -> dict[str, Any]:
    """Score the model and BM25, decide the gate, write metrics.json + gate.json; return gate.json."""
    from ..prepared_data import load_prepared

    run_dir: Path = args.run_dir
    prepared = load_prepared(run_dir)
    holdout = holdout_queries(prepared.holdout)
    # Read the previous metrics before hours of scoring: a bad URI should fail fast.
    previous = load_previous(args.previous_metrics)
    report = _score(args, prepared, holdout)
    atomic_write_json(run_dir / VALIDATION_METRICS, report)
    gate = _decide(args, report, previous, catalog_size=len(prepared.products.ids))
    atomic_write_json(run_dir / GATE_REPORT, gate)
    if args.gate_s3_uri:
        s3.put_json((run_dir / GATE_REPORT).read_bytes(), args.gate_s3_uri)
    print_table(f"holdout: {len(holdout.queries)} queries x {len(prepared.products.ids)} products",
                {"model": report["metrics"], "BM25": report["baseline"], "previous": previous},
                footer="\n".join([f"gate: {'PASSED' if gate['passed'] else 'FAILED'}",
                                  *(f"  {r}" for r in gate["reasons"])]))
    return gate


def _score(args: argparse.Namespace, prepared: Any, holdout: Any) -> dict[str, Any]:
    """metrics.json: the model's and BM25's metrics on the holdout, a random ranking's, and how."""
    backend = args.backend or distributed.default_backend()
    inference = load_for_inference(args.checkpoint or args.run_dir, backend)
    warnings = check_compatible(inference, prepared)
    evaluation = evaluate_model(inference, prepared, holdout, batch_size=args.batch_size)
    t0 = time.monotonic()
    baseline = bm25_metrics(prepared, holdout)
    bm25_seconds = time.monotonic() - t0
    report = {
        "metrics": evaluation.metrics,
        "baseline": baseline,
        "baseline_method": {"name": "bm25s", **BM25_PARAMS, "tokenizer": "bm25s, lowercase, english stopwords"},
        "random": retrieval_metrics.random_expectation(len(prepared.products.ids)),
        "holdout": {"queries": len(holdout.queries), "pairs": int(holdout.row_query.size),
                    "labelled_pairs": holdout.num_labelled, "products": len(prepared.products.ids)},
        "checkpoint": str(inference.checkpoint),
        "checkpoint_sha256": inference.checkpoint_sha256,
        "checkpoint_step": inference.state.get("step"),
        "backend": backend,
        "batch_size": args.batch_size,
        "seconds": {"model": round(evaluation.seconds, 3), "bm25": round(bm25_seconds, 3)},
        "warnings": warnings,
        "created_at": _now(),
    }
    graphs = distributed.compile_count(inference.world)
    if graphs is not None:
        report["xla"] = {"graphs_compiled": graphs}
    return report


def _decide(args: argparse.Namespace, report: dict[str, Any], previous: dict[str, float] | None, *,
            catalog_size: int) -> dict[str, Any]:
    """gate.json: the decision on the scored model, with every check and its inputs."""
    # recall@10 > 2 x random (2 * 10 / catalog size) catches a broken model (collapsed embeddings, a
    # tokenizer mismatch, an untrained checkpoint) on a first run with no previous model to regress
    # against, and never binds a model that learned anything.
    sanity = None if args.no_sanity_floor else SANITY_FACTOR * report["random"][SANITY_METRIC]
    if sanity is not None and sanity >= 1.0:
        log.info("catalog of %d products is too small for the sanity floor; skipped", catalog_size)
        sanity = None
    metrics, baseline = report["metrics"], report["baseline"]
    passed, reasons, checks = decide_gate(metrics, baseline=baseline, previous=previous, gated=args.gated,
                                          tolerance=args.tolerance, floors=args.floors, sanity_floor=sanity)
    return {
        "passed": passed, "reasons": reasons, "checks": checks,
        "metrics": metrics, "baseline": baseline, "previous": previous,
        "previous_source": args.previous_metrics, "tolerance": args.tolerance, "gated_metrics": list(args.gated),
        "floors": args.floors, "sanity_floor": sanity,
        "checkpoint": report["checkpoint"], "checkpoint_sha256": report["checkpoint_sha256"],
        "run_dir": str(args.run_dir), "created_at": _now(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        report = run_compare(args)
        if not report["passed"]:
            raise GateFailedError(f"parity failed: {report['reason']}; see {args.run_dir / VALIDATION_DIR / COMPARE_REPORT}")
        return 0
    gate = run_validate(args)
    # ---- tracking: this step as a child run of the pipeline's MLflow run (never fails the step)
    tracking.log_step("validate", args.run_dir, params={"previous_metrics": args.previous_metrics},
                      metrics={**(gate.get("metrics") or {}), "gate_passed": float(bool(gate["passed"]))})
    if not gate["passed"]:
        failed = "; ".join(r for r in gate["reasons"] if r.startswith("FAILED"))
        if args.gate_report_only:
            log.warning("quality gate failed (reported only, exit 0): %s", failed)
            # The pipeline ends here (ModelRejected): close its MLflow run; never fails the step.
            tracking.log_pipeline(args.run_dir, metrics=gate.get("metrics") or {}, status="FINISHED",
                                  tags={tracking.OUTCOME_TAG: "model_rejected"})
            return 0
        raise GateFailedError(f"quality gate failed: {failed}; see {args.run_dir / GATE_REPORT}")
    return 0
