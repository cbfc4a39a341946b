"""The quality gate: the previous production model's metrics (a local file or S3), the gated metrics
and floors, and the decision (pass, or which check failed and by how much). docs/training.md,
"Validation, the quality gate, embeddings"."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import retrieval_metrics, s3
from .errors import BadConfigError, BadInputError

log = logging.getLogger("pipeline_steps.validate")

DEFAULT_GATED_METRICS = ("recall@10", "ndcg@10")
DEFAULT_TOLERANCE = 0.001
SANITY_METRIC = "recall@10"
SANITY_FACTOR = 2.0
"""The sanity floor is SANITY_FACTOR x a random ranking's expected SANITY_METRIC."""


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
    found = {k: float(v) for k, v in candidate.items() if k in retrieval_metrics.METRIC_KEYS and isinstance(v, (int, float))}
    if not found:
        raise BadInputError(f"{source} has none of the metrics {', '.join(retrieval_metrics.METRIC_KEYS)}; is it a "
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


def parse_floors(items: Sequence[str], floor_recall_at_10: float | None) -> dict[str, float | str]:
    floors: dict[str, float | str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in retrieval_metrics.METRIC_KEYS:
            raise BadConfigError(f"--floor {item!r}: expected KEY=VALUE with KEY one of "
                                 f"{', '.join(retrieval_metrics.METRIC_KEYS)}")
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
    unknown = [k for k in keys if k not in retrieval_metrics.METRIC_KEYS]
    if not keys or unknown:
        raise BadConfigError(f"--gate-metric {value!r}: choose from {', '.join(retrieval_metrics.METRIC_KEYS)}")
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
