"""validate --compare: two checkpoints scored on the same holdout (on one backend each), their
metric deltas against a tolerance and how closely their embeddings agree -> compare.json."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

import numpy as np

from pipeline_contract import VALIDATION_DIR

from . import distributed, retrieval_metrics
from .fileio import atomic_write_json
from .holdout_evaluation import Evaluation, evaluate_model, holdout_queries, print_table
from .inference import check_compatible, load_for_inference

COMPARE_REPORT = "compare.json"  # in VALIDATION_DIR


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    """Score two checkpoints on the same holdout; write compare.json; return it."""
    from .prepared_data import load_prepared

    prepared = load_prepared(args.run_dir)
    holdout = holdout_queries(prepared.holdout)
    backend_a = args.backend or distributed.default_backend()
    backend_b = args.backend_b or backend_a
    sides: dict[str, dict[str, Any]] = {}
    evaluations: dict[str, Evaluation] = {}
    for name, source, backend in (("a", args.compare[0], backend_a), ("b", args.compare[1], backend_b)):
        inference = load_for_inference(source, backend)
        check_compatible(inference, prepared)
        evaluations[name] = evaluate_model(inference, prepared, holdout, batch_size=args.batch_size)
        sides[name] = {"checkpoint": str(inference.checkpoint), "checkpoint_sha256": inference.checkpoint_sha256,
                       "backend": backend, "metrics": evaluations[name].metrics}
        graphs = distributed.compile_count(inference.world)
        if graphs is not None:
            sides[name]["xla_graphs_compiled"] = graphs
        del inference  # only one model in memory at a time

    a, b = evaluations["a"].metrics, evaluations["b"].metrics
    deltas = {k: bk - ak for k in retrieval_metrics.METRIC_KEYS
              if (ak := a.get(k)) is not None and (bk := b.get(k)) is not None}
    worst = max(deltas, key=lambda k: abs(deltas[k]))
    max_abs = abs(deltas[worst])
    passed = max_abs <= args.tolerance

    def agreement(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        cosine = (x.astype(np.float64) * y.astype(np.float64)).sum(axis=1)  # both unit norm
        return {"mean_cosine": float(cosine.mean()), "min_cosine": float(cosine.min())}

    report = {
        "passed": passed,
        "reason": (f"max |delta| {max_abs:.4f} ({worst}) {'<=' if passed else '>'} tolerance {args.tolerance:g}"),
        "tolerance": args.tolerance, "max_abs_delta": max_abs, "max_delta_metric": worst,
        "a": sides["a"], "b": sides["b"], "deltas": deltas,
        "embedding_agreement": {
            "products": agreement(evaluations["a"].product_embeddings, evaluations["b"].product_embeddings),
            "queries": agreement(evaluations["a"].query_embeddings, evaluations["b"].query_embeddings),
        },
        "holdout": {"queries": len(holdout.queries), "products": len(prepared.products.ids)},
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    atomic_write_json(args.run_dir / VALIDATION_DIR / COMPARE_REPORT, report)
    print_table("parity: B vs A on the same holdout", {"A": a, "B": b, "B - A": deltas},
                footer=(f"parity: {'PASSED' if passed else 'FAILED'}: {report['reason']}; product embedding "
                        f"mean cosine {report['embedding_agreement']['products']['mean_cosine']:.6f}"))
    return report
