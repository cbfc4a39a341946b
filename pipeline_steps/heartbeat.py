"""Training-progress heartbeat: one CloudWatch Embedded Metric Format (EMF) line on stdout per `emit`.

CloudWatch Logs turns each line into the metrics TrainStep, TrainLoss and TokensPerSecond (names from
pipeline_contract), per stage and per run; the stall alarm watches the run's TrainStep. On
only on AWS Batch (AWS_BATCH_JOB_ID set), unless PIPELINE_HEARTBEAT=1 or 0 forces it. Call it from
rank 0: `Heartbeat().emit(step=120, loss=0.41, tokens_per_s=183000.0)`. Standard library only, as
it runs in the training image. The metric contract and a sample line: docs/operations.md, "Heartbeat".
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO

from pipeline_contract import (
    HEARTBEAT_LOSS_METRIC,
    HEARTBEAT_NAMESPACE,
    HEARTBEAT_RUN_DIMENSION,
    HEARTBEAT_STAGE_DIMENSION,
    HEARTBEAT_STEP_METRIC,
    HEARTBEAT_THROUGHPUT_METRIC,
    RUN_ID_ENV,
    STAGE_ENV,
)

# Per stage (stage-wide graphs) and per run: the per-job stall alarm reads the second, so a
# healthy run of the same stage can never hide a stalled one.
DIMENSION_SETS: tuple[tuple[str, ...], ...] = (
    (HEARTBEAT_STAGE_DIMENSION,), (HEARTBEAT_STAGE_DIMENSION, HEARTBEAT_RUN_DIMENSION))
# (name, CloudWatch unit) in the order they appear in every line.
METRICS: tuple[tuple[str, str], ...] = (
    (HEARTBEAT_STEP_METRIC, "Count"),
    (HEARTBEAT_LOSS_METRIC, "None"),
    (HEARTBEAT_THROUGHPUT_METRIC, "Count/Second"),
)
ENV_FORCE = "PIPELINE_HEARTBEAT"
DEFAULT_STAGE = "local"
DEFAULT_RUN_ID = "local"

_RESERVED = {"_aws", HEARTBEAT_STAGE_DIMENSION, HEARTBEAT_RUN_DIMENSION} | {name for name, _ in METRICS}


def enabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """On when PIPELINE_HEARTBEAT=1/true, off when 0/false, else on exactly when on AWS Batch."""
    env = os.environ if environ is None else environ
    forced = env.get(ENV_FORCE, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    return bool(env.get("AWS_BATCH_JOB_ID"))


def emf_record(
    *,
    stage: str,
    run_id: str,
    step: int,
    loss: float | None = None,
    tokens_per_s: float | None = None,
    timestamp_ms: int | None = None,
    properties: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One EMF record (a dict; `json.dumps` it onto one line). Metrics whose value is missing or
    not finite are left out of both the directive and the record: EMF rejects a declared metric
    without a value, and JSON has no NaN."""
    values: dict[str, float | int] = {HEARTBEAT_STEP_METRIC: int(step)}
    for name, value in ((HEARTBEAT_LOSS_METRIC, loss), (HEARTBEAT_THROUGHPUT_METRIC, tokens_per_s)):
        if value is not None and math.isfinite(float(value)):
            values[name] = float(value)
    record: dict[str, Any] = {
        "_aws": {
            "Timestamp": int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms),
            "CloudWatchMetrics": [{
                "Namespace": HEARTBEAT_NAMESPACE,
                "Dimensions": [list(dimension_set) for dimension_set in DIMENSION_SETS],
                "Metrics": [{"Name": name, "Unit": unit} for name, unit in METRICS if name in values],
            }],
        },
        HEARTBEAT_STAGE_DIMENSION: stage,
        HEARTBEAT_RUN_DIMENSION: run_id,
    }
    if loss is not None and HEARTBEAT_LOSS_METRIC not in values:
        record["TrainLossNotFinite"] = str(loss)  # visible in Logs Insights, not a metric
    for key, value in (properties or {}).items():
        if key in _RESERVED:
            raise ValueError(f"heartbeat property {key!r} would overwrite a metric or dimension; rename it")
        record[key] = value
    record.update(values)
    return record


class Heartbeat:
    """Prints one EMF line per `emit` call when enabled (docs/operations.md, "Heartbeat").

    stage, run_id   default from env PIPELINE_STAGE / PIPELINE_RUN_ID, else "local".
    enabled         None = decide from the environment (`enabled_by_env`); True/False forces.
    stream          where lines go (default sys.stdout, which Batch ships to CloudWatch Logs).
    """

    def __init__(
        self,
        *,
        stage: str | None = None,
        run_id: str | None = None,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.stage = stage or env.get(STAGE_ENV) or DEFAULT_STAGE
        self.run_id = run_id or env.get(RUN_ID_ENV) or DEFAULT_RUN_ID
        self.enabled = enabled_by_env(env) if enabled is None else bool(enabled)
        self._stream = stream
        self._lock = threading.Lock()  # one line never interleaves with another writer's

    def emit(
        self,
        step: int,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        **properties: Any,
    ) -> str | None:
        """Print one heartbeat line; returns it (None when disabled). Never raises on a closed
        stream: losing one heartbeat must not kill a training run (the alarm notices gaps)."""
        if not self.enabled:
            return None
        record = emf_record(stage=self.stage, run_id=self.run_id, step=step, loss=loss,
                            tokens_per_s=tokens_per_s, properties=properties)
        line = json.dumps(record, separators=(",", ":"), default=str, ensure_ascii=True)
        stream = self._stream if self._stream is not None else sys.stdout
        with self._lock:
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError):
                return None
        return line
