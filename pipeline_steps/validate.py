"""Step `validate`: holdout retrieval metrics, a BM25 baseline, and the quality gate.

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
import math
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from . import distributed, metrics as metrics_lib, s3
from .inference import DEFAULT_BATCH_SIZE, InferenceModel, check_compatible, embed_products, embed_queries, \
    load_for_inference
from pipeline_contract import GATE_REPORT, VALIDATION_DIR, VALIDATION_METRICS
from .errors import BadConfigError, BadInputError, GateFailedError
from . import tracking
from .fileio import atomic_write_json

log = logging.getLogger(__name__)

DEFAULT_GATED_METRICS = ("recall@10", "ndcg@10")
DEFAULT_TOLERANCE = 0.001
SANITY_METRIC = "recall@10"
COMPARE_REPORT = "compare.json"  # --compare's report, in VALIDATION_DIR
SANITY_FACTOR = 2.0
"""The sanity floor is SANITY_FACTOR x a random ranking's expected SANITY_METRIC."""
BM25_PARAMS = {"k1": 1.5, "b": 0.75, "method": "lucene"}


# ============================================================================ the holdout

@dataclass
class Holdout:
    """Distinct holdout queries with their relevant products, and the pair rows behind them."""

    queries: list[str]  # [Q] distinct query texts, in first-seen order
    token_ids: np.ndarray  # int32 [Q, query_length]
    lengths: np.ndarray  # int32 [Q]
    relevant: list[set[int]]  # [Q] catalog rows of every holdout pair of the query
    row_query: np.ndarray  # int64 [M] distinct-query index of each holdout pair
    class_id: np.ndarray  # int64 [M] label of each pair (-100 = none)

    @property
    def num_labelled(self) -> int:
        return int((self.class_id != metrics_lib.IGNORE_INDEX).sum())


def holdout_queries(pairs: Any) -> Holdout:
    if len(pairs.queries) == 0:
        raise BadInputError("the holdout is empty: prepare held out no query; use more data or a larger "
                            "holdout_fraction and rerun prepare")
    first: dict[str, int] = {}
    row_query = np.empty(len(pairs.queries), dtype=np.int64)
    relevant: list[set[int]] = []
    first_rows: list[int] = []
    for row, (query, product) in enumerate(zip(pairs.queries, pairs.product_index.tolist())):
        q = first.setdefault(query, len(first))
        if q == len(relevant):
            relevant.append(set())
            first_rows.append(row)
        relevant[q].add(int(product))
        row_query[row] = q
    return Holdout(queries=list(first), token_ids=pairs.token_ids[first_rows], lengths=pairs.lengths[first_rows],
                   relevant=relevant, row_query=row_query, class_id=np.asarray(pairs.class_id, dtype=np.int64))


# ============================================================================ scoring

@dataclass
class Evaluation:
    metrics: dict[str, float | None]
    product_embeddings: np.ndarray  # float32 [N, E]
    query_embeddings: np.ndarray  # float32 [Q, E]
    seconds: float


def evaluate_model(inference: InferenceModel, prepared: Any, holdout: Holdout, *, batch_size: int) -> Evaluation:
    """Embed catalog + queries with static-shape batches, rank exactly, compute every metric."""
    t0 = time.monotonic()
    products = prepared.products
    product_emb = embed_products(inference, products, np.arange(len(products.ids)), batch_size=batch_size,
                                 buckets=prepared.data_cfg.length_buckets)
    query_emb, logits = embed_queries(inference, holdout.token_ids, holdout.lengths, batch_size=batch_size,
                                      query_length=prepared.data_cfg.query_length,
                                      with_logits=holdout.num_labelled > 0)
    # Exact ranking: every catalog product for every distinct holdout query, by dot product of unit embeddings.
    ranked = metrics_lib.top_k_by_dot(torch.from_numpy(query_emb), torch.from_numpy(product_emb),
                                      metrics_lib.RANK_DEPTH)
    result: dict[str, float | None] = dict(metrics_lib.retrieval_metrics(ranked, holdout.relevant))
    result["accuracy"] = (metrics_lib.accuracy(logits[holdout.row_query], holdout.class_id)
                          if logits is not None else None)
    return Evaluation(result, product_emb, query_emb, time.monotonic() - t0)


def bm25_ranked(product_texts: Sequence[str], queries: Sequence[str], k: int) -> np.ndarray:
    """BM25 top-k catalog rows per query -> int64 [Q, min(k, N)].

    A query none of whose terms occur in the catalog scores 0 everywhere; its list is the
    catalog's first k rows (what any tie order gives), instead of letting bm25s match it to
    products whose text is all stopwords through its empty-token placeholder."""
    import bm25s
    from bm25s.tokenization import Tokenizer

    k = min(k, len(product_texts))
    tokenizer = Tokenizer(lower=True, stopwords="en")
    corpus = tokenizer.tokenize(list(product_texts), return_as="ids", show_progress=False)
    retriever = bm25s.BM25(**BM25_PARAMS)
    retriever.index(corpus, show_progress=False)
    empty_id = tokenizer.get_vocab_dict().get("")
    query_ids = tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
    query_ids = [[t for t in q if t != empty_id] for q in query_ids]
    ranked = np.tile(np.arange(k, dtype=np.int64), (len(queries), 1))
    nonempty = [i for i, q in enumerate(query_ids) if q]
    if nonempty:
        docs, _scores = retriever.retrieve([query_ids[i] for i in nonempty], k=k, show_progress=False, n_threads=1)
        ranked[nonempty] = np.asarray(docs, dtype=np.int64)
    return ranked


def bm25_metrics(prepared: Any, holdout: Holdout) -> dict[str, float | None]:
    ranked = bm25_ranked(prepared.products.texts, holdout.queries, metrics_lib.RANK_DEPTH)
    out: dict[str, float | None] = dict(metrics_lib.retrieval_metrics(ranked, holdout.relevant))
    out["accuracy"] = None  # BM25 has no classifier
    return out


# ============================================================================ previous metrics

def _read_source(source: str) -> bytes | None:
    """Bytes of a local path or s3:// object; None when it does not exist."""
    if source.startswith("s3://"):
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, key = s3.split_uri(source)
        try:
            return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise s3.step_error(exc, source, "read") from exc
        except BotoCoreError as exc:
            raise s3.step_error(exc, source, "read") from exc
    path = Path(source)
    return path.read_bytes() if path.is_file() else None


def extract_metrics(document: Any, source: str) -> dict[str, float]:
    """The metric dict of a gate.json, metrics.json or models/current.json (a "metrics" key), or of
    a flat {metric: value} dict."""
    candidate = document.get("metrics") if isinstance(document, dict) and isinstance(document.get("metrics"), dict) \
        else document
    if not isinstance(candidate, dict):
        raise BadInputError(f"{source} holds no metrics object; pass a gate.json, metrics.json or current.json")
    found = {k: float(v) for k, v in candidate.items() if k in metrics_lib.METRIC_KEYS and isinstance(v, (int, float))}
    if not found:
        raise BadInputError(f"{source} has none of the metrics {', '.join(metrics_lib.METRIC_KEYS)}; is it a "
                            "gate.json / metrics.json written by validate?")
    return found


def load_previous(source: str | None) -> dict[str, float] | None:
    """The previous production model's metrics, or None when there is none yet (first run)."""
    if not source:
        return None
    raw = _read_source(source)
    if raw is None:
        log.info("no previous model metrics at %s: gating on floors only", source)
        return None
    import json

    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"previous metrics {source} is not valid JSON ({exc}); fix or remove it") from None
    if isinstance(document, dict) and document.get("passed") is False:
        # A failed gate's metrics are a rejected model's, not production's: usually a wrong path.
        log.warning("previous metrics %s come from a gate that FAILED; the production model's are in "
                    "models/current.json", source)
    return extract_metrics(document, source)


def upload_s3(data: bytes, uri: str) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = s3.split_uri(uri)
    try:
        s3.client().put_object(Bucket=bucket, Key=key, Body=data, ContentType="application/json")
    except (ClientError, BotoCoreError) as exc:
        raise s3.step_error(exc, uri, "write") from exc
    log.info("gate decision uploaded to %s", uri)


# ============================================================================ the gate

def parse_floors(items: Sequence[str], floor_recall_at_10: float | None) -> dict[str, float | str]:
    floors: dict[str, float | str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in metrics_lib.METRIC_KEYS:
            raise BadConfigError(f"--floor {item!r}: expected KEY=VALUE with KEY one of "
                                 f"{', '.join(metrics_lib.METRIC_KEYS)}")
        if value.lower() == "bm25":
            floors[key] = "bm25"
            continue
        try:
            number = float(value)
        except ValueError:
            raise BadConfigError(f"--floor {item!r}: VALUE must be a number in [0, 1] or 'bm25'") from None
        if not 0.0 <= number <= 1.0:
            raise BadConfigError(f"--floor {item!r}: metrics lie in [0, 1]")
        floors[key] = number
    if floor_recall_at_10 is not None:
        floors["recall@10"] = float(floor_recall_at_10)
    return floors


def parse_gated(value: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    unknown = [k for k in keys if k not in metrics_lib.METRIC_KEYS]
    if not keys or unknown:
        raise BadConfigError(f"--gate-metric {value!r}: choose from {', '.join(metrics_lib.METRIC_KEYS)}")
    return keys


def decide_gate(model: dict[str, float | None], *, baseline: dict[str, float | None],
                previous: dict[str, float] | None, gated: Sequence[str], tolerance: float,
                floors: dict[str, float | str], sanity_floor: float | None) -> tuple[bool, list[str], list[dict]]:
    """(passed, human-readable reasons, structured checks). Pure: the tests drive it directly."""
    checks: list[dict[str, Any]] = []

    def check(kind: str, key: str, threshold: float | None, text: str) -> None:
        value = model.get(key)
        if value is None or threshold is None:
            passed, line = False, f"FAILED {kind}: {key} is not available ({text})"
        else:
            passed = value >= threshold if kind != "sanity" else value > threshold
            op = (">=" if kind != "sanity" else ">") if passed else ("<" if kind != "sanity" else "<=")
            line = f"{'ok' if passed else 'FAILED'} {kind}: {key} {value:.4f} {op} {threshold:.4f} ({text})"
        checks.append({"kind": kind, "metric": key, "value": value, "threshold": threshold, "passed": passed})
        reasons.append(line)

    reasons: list[str] = []
    if previous is None:
        reasons.append("no previous model: regression check skipped, floors only")
    else:
        for key in gated:
            if key not in previous:
                reasons.append(f"note: the previous model has no {key}; not compared")
                continue
            check("regression", key, previous[key] - tolerance,
                  f"previous {previous[key]:.4f} - tolerance {tolerance:g}")
    for key, floor in floors.items():
        if floor == "bm25":
            check("floor", key, baseline.get(key), "BM25 baseline")
        else:
            check("floor", key, float(floor), "configured floor")
    if sanity_floor is not None:
        check("sanity", SANITY_METRIC, sanity_floor, f"{SANITY_FACTOR:g} x a random ranking's expectation")
    return all(c["passed"] for c in checks), reasons, checks


# ============================================================================ display

def _fmt(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def print_table(title: str, columns: dict[str, dict[str, float | None] | None], footer: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    present = {name: values for name, values in columns.items() if values is not None}
    for name in present:
        table.add_column(name, justify="right")
    for key in metrics_lib.METRIC_KEYS:
        if all(v.get(key) is None for v in present.values()):
            continue
        table.add_row(key, *(_fmt(v.get(key)) for v in present.values()))
    console = Console(file=sys.stdout, width=110)
    console.print(table)
    if footer:
        console.print(footer, markup=False)


# ============================================================================ CLI

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
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_validate(args: argparse.Namespace) -> dict[str, Any]:
    """Score the model and BM25, decide the gate, write metrics.json + gate.json; return gate.json."""
    from .data import load_prepared

    run_dir: Path = args.run_dir
    prepared = load_prepared(run_dir)
    holdout = holdout_queries(prepared.holdout)
    # Read the previous metrics before hours of scoring: a bad URI should fail fast.
    previous = load_previous(args.previous_metrics)

    backend = args.backend or distributed.default_backend()
    inference = load_for_inference(args.checkpoint or run_dir, backend)
    warnings = check_compatible(inference, prepared)
    evaluation = evaluate_model(inference, prepared, holdout, batch_size=args.batch_size)
    t0 = time.monotonic()
    baseline = bm25_metrics(prepared, holdout)
    bm25_seconds = time.monotonic() - t0
    random = metrics_lib.random_expectation(len(prepared.products.ids))

    report = {
        "metrics": evaluation.metrics,
        "baseline": baseline,
        "baseline_method": {"name": "bm25s", **BM25_PARAMS, "tokenizer": "bm25s, lowercase, english stopwords"},
        "random": random,
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
    atomic_write_json(run_dir / VALIDATION_METRICS, report)

    # recall@10 > 2 x random (2 * 10 / catalog size) catches a broken model (collapsed embeddings, a
    # tokenizer mismatch, an untrained checkpoint) on a first run with no previous model to regress
    # against, and never binds a model that learned anything.
    sanity = None if args.no_sanity_floor else SANITY_FACTOR * random[SANITY_METRIC]
    if sanity is not None and sanity >= 1.0:
        log.info("catalog of %d products is too small for the sanity floor; skipped", len(prepared.products.ids))
        sanity = None
    passed, reasons, checks = decide_gate(evaluation.metrics, baseline=baseline, previous=previous, gated=args.gated,
                                          tolerance=args.tolerance, floors=args.floors, sanity_floor=sanity)
    gate = {
        "passed": passed, "reasons": reasons, "checks": checks,
        "metrics": evaluation.metrics, "baseline": baseline, "previous": previous,
        "previous_source": args.previous_metrics, "tolerance": args.tolerance, "gated_metrics": list(args.gated),
        "floors": args.floors, "sanity_floor": sanity,
        "checkpoint": str(inference.checkpoint), "checkpoint_sha256": inference.checkpoint_sha256,
        "run_dir": str(run_dir), "created_at": _now(),
    }
    atomic_write_json(run_dir / GATE_REPORT, gate)
    if args.gate_s3_uri:
        upload_s3((run_dir / GATE_REPORT).read_bytes(), args.gate_s3_uri)

    print_table(f"holdout: {len(holdout.queries)} queries x {len(prepared.products.ids)} products",
                {"model": evaluation.metrics, "BM25": baseline, "previous": previous},
                footer="\n".join([f"gate: {'PASSED' if passed else 'FAILED'}", *(f"  {r}" for r in reasons)]))
    return gate


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    """Score two checkpoints on the same holdout; write compare.json; return it."""
    from .data import load_prepared

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
    deltas = {k: b[k] - a[k] for k in metrics_lib.METRIC_KEYS if a.get(k) is not None and b.get(k) is not None}
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
        "created_at": _now(),
    }
    atomic_write_json(args.run_dir / VALIDATION_DIR / COMPARE_REPORT, report)
    print_table("parity: B vs A on the same holdout", {"A": a, "B": b, "B - A": deltas},
                footer=(f"parity: {'PASSED' if passed else 'FAILED'}: {report['reason']}; product embedding "
                        f"mean cosine {report['embedding_agreement']['products']['mean_cosine']:.6f}"))
    return report


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
