"""Experiment tracking (MLflow): one MLflow run per pipeline run, a child run per step.

Every step calls `log_step(...)` once it has written its outputs; the step that ends the pipeline
closes the parent run (`log_pipeline`: export on success, `validate --gate-report-only` on a
rejected model, `log_failure` on a failure Batch does not retry, run-local at its end). Each child
run gets the step's params and metrics and the reproducibility set (`reproducibility()`).
Runs go to MLFLOW_TRACKING_URI when set, otherwise to a file store DIR/mlruns in the run dir.

Tracking never breaks a step: any tracking error logs one warning and the step carries on. Only
the process that owns the step's outputs logs (global rank 0). Details: docs/operations.md,
"Experiment tracking (MLflow)".
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from .contract import INSTANCE_TYPE_ENV, PREPARE_REPORT, RUN_ID_ENV, TEAM_ENV
from .errors import ExitCode
from .fileio import atomic_write_json, read_json
from .packages import versions  # metadata only: a step that needs no torch never imports it

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "trainium-embeddings"
RUN_ID_TAG = "pipeline.run_id"
TEAM_TAG = "pipeline.team"  # the team whose run it is (env PIPELINE_TEAM, set by a team's job definitions)
POINTER_FILE = "mlflow.json"
OUTCOME_TAG = "pipeline.outcome"
FAILED_STEP_TAG = "pipeline.failed_step"
# A failed tracking call must cost seconds, not MLflow's default minutes of retries.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
_MAX_TAG_CHARS = 5000  # well under MLflow's limit on a tag value
_MAX_HISTORY_POINTS = 1000  # per metric: a curve, not every step of a long run
_PROCESS_START = time.time()  # the child run's start time (steps import this module first thing)
_live_runs: dict[str, str] = {}  # step -> its child run opened by a MetricStream in this process
_warned = False


def _warn_once(what: str, exc: BaseException) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("experiment tracking disabled for this step (%s: %s: %s); the run dir still holds "
                    "every output", what, type(exc).__name__, exc)


# ---- who logs, where ---------------------------------------------------------------------------
def is_logging_process(environ: Mapping[str, str] = os.environ) -> bool:
    """Global rank 0 (torchrun sets RANK) on the main node of a Batch multi-node job."""
    if environ.get("RANK", "0") != "0":
        return False
    node, main = environ.get("AWS_BATCH_JOB_NODE_INDEX"), environ.get("AWS_BATCH_JOB_MAIN_NODE_INDEX", "0")
    return node is None or node == main


def tracking_uri(run_dir: Path, environ: Mapping[str, str] = os.environ) -> str:
    return environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir).resolve() / "mlruns").as_uri()


def pipeline_run_id(run_dir: Path, environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(RUN_ID_ENV) or Path(run_dir).resolve().name


# ---- what is logged ----------------------------------------------------------------------------
def run_tags(run_id: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The pipeline run's tags on its MLflow runs: its id and, for a team's run, the team."""
    team = environ.get(TEAM_ENV)
    return {RUN_ID_TAG: run_id, **({TEAM_TAG: team} if team else {})}


def git_commit(environ: Mapping[str, str] = os.environ) -> str | None:
    """GIT_COMMIT (baked into the image at build time) or the checkout this package runs from."""
    if environ.get("GIT_COMMIT"):
        return environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def data_manifest_hash(run_dir: Path) -> str | None:
    """sha256 over the input files' checksums, computed by prepare (prepare.json `input_sha256`)."""
    path = Path(run_dir) / PREPARE_REPORT
    if not path.exists():
        return None
    report = read_json(path)
    if report.get("input_sha256"):
        return str(report["input_sha256"])
    inputs = report.get("inputs")
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest() if inputs else None


def reproducibility(run_dir: Path, environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """The set M5 tracked to make any past run reproducible. Only env and files: no IMDS call."""
    out: dict[str, str | None] = {
        "git_commit": git_commit(environ),
        "image_uri": environ.get("TRAINING_IMAGE_URI"),
        "image_digest": environ.get("TRAINING_IMAGE_DIGEST"),
        # INSTANCE_TYPE is set by the job definition from the instance table; IMDS stays untouched.
        "instance_type": environ.get(INSTANCE_TYPE_ENV) or ("local" if "AWS_BATCH_JOB_ID" not in environ else None),
        "num_nodes": environ.get("AWS_BATCH_JOB_NUM_NODES", "1"),
        "world_size": environ.get("WORLD_SIZE", "1"),
        "batch_job_id": environ.get("AWS_BATCH_JOB_ID"),
        "data_manifest_sha256": data_manifest_hash(run_dir),
    }
    out.update({f"version.{k}": v for k, v in versions().items()})
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _key(name: str) -> str:
    # MLflow keys allow letters, digits, _ - . space : / only ("recall@10" -> "recall_at_10").
    return re.sub(r"[^\w\-. :/]", "_", name.replace("@", "_at_"))


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# ---- the MLflow side ---------------------------------------------------------------------------
class _Session:
    """An MlflowClient (no fluent global state) bound to the experiment and the parent run."""

    def __init__(self, run_dir: Path) -> None:
        uri = tracking_uri(run_dir)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        for key, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow.tracking import MlflowClient  # optional dependency: the `tracking` extra

        self.run_dir, self.uri = Path(run_dir), uri
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
        experiment = self.client.get_experiment_by_name(name)
        self.experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.parent_id = self._parent()

    def _parent(self) -> str:
        run_id = pipeline_run_id(self.run_dir)
        pointer = self.run_dir / POINTER_FILE
        if pointer.exists():
            saved = read_json(pointer)
            if saved.get("tracking_uri") == self.uri and saved.get("pipeline_run_id") == run_id:
                return str(saved["mlflow_run_id"])
        found = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'",
                                        max_results=1)
        if found:
            parent = found[0].info.run_id
        else:
            parent = self.client.create_run(self.experiment_id, run_name=run_id, tags=run_tags(run_id)).info.run_id
        atomic_write_json(pointer, {"tracking_uri": self.uri, "experiment_id": self.experiment_id,
                                    "pipeline_run_id": run_id, "mlflow_run_id": parent})
        return parent

    def log(self, run_id: str, *, params: Mapping[str, Any] = {}, metrics: Mapping[str, Any] = {},
            history: Iterable[tuple[str, float, int]] = (), tags: Mapping[str, str] = {}) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        param_list = [Param(_key(k), str(v)[:_MAX_PARAM_CHARS]) for k, v in params.items() if v is not None]
        metric_list = [Metric(_key(k), f, now, 0) for k, v in metrics.items() if (f := _finite(v)) is not None]
        metric_list += [Metric(_key(k), v, now, step) for k, v, step in history if math.isfinite(v)]
        tag_list = [RunTag(k, str(v)) for k, v in tags.items() if v is not None]
        # log_batch limits: 100 params, 1000 metrics per call.
        for i in range(0, len(param_list), 100):
            self.client.log_batch(run_id, params=param_list[i:i + 100])
        for i in range(0, len(metric_list), 1000):
            self.client.log_batch(run_id, metrics=metric_list[i:i + 1000])
        if tag_list:
            self.client.log_batch(run_id, tags=tag_list)


def _session(run_dir: Path) -> _Session | None:
    # After the first failure the process stops trying: one warning, no repeated timeouts.
    if _warned or not is_logging_process():
        return None
    try:
        return _Session(run_dir)
    except ImportError as exc:
        _warn_once("mlflow is not installed (pip install 'trainium-embeddings[tracking]')", exc)
    except Exception as exc:  # noqa: BLE001 - tracking must never fail a step; warned
        _warn_once(f"tracking backend {tracking_uri(run_dir)} unusable", exc)
    return None


def log_step(step: str, run_dir: Path, *, params: Mapping[str, Any] | None = None,
             metrics: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
             history: Iterable[tuple[str, float, int]] = (), status: str = "FINISHED",
             error: str | None = None) -> str | None:
    """Record one finished step as a child run of the pipeline run; returns its MLflow run id
    (None when tracking is off or failed). `config` is the resolved config (flattened into
    `config.*` params and stored as config.json); `history` = (metric, value, step) points;
    `error` (a failed step) becomes the tag `error` and the artifact error.txt."""
    session = _session(run_dir)
    if session is None:
        return None
    try:
        repro = reproducibility(run_dir)
        child = _live_runs.pop(step, None)
        if child is None:
            child = _create_child(session, step, run_dir)
        else:
            history = ()  # the curves were streamed while the step ran
        all_params = {**repro, **(params or {}), **{f"config.{k}": v for k, v in flatten(config or {}).items()}}
        session.log(child, params=all_params, metrics=metrics or {}, history=_thin(history))
        if config:
            session.client.log_dict(child, dict(config), "config.json")
        if error is not None:
            session.log(child, tags={"error": error[:_MAX_TAG_CHARS]})
            session.client.log_text(child, error, "error.txt")
        # The parent carries the run-wide part of the set once (tags can be overwritten, params not).
        session.log(session.parent_id, tags={k: v for k, v in repro.items() if v is not None})
        session.client.set_terminated(child, status=status)
        return child
    except Exception as exc:  # noqa: BLE001 - see _session
        _warn_once(f"logging step {step!r} to {session.uri}", exc)
        return None


def _create_child(session: _Session, step: str, run_dir: Path) -> str:
    run = session.client.create_run(
        session.experiment_id, run_name=step, start_time=int(_PROCESS_START * 1000),
        tags={"mlflow.parentRunId": session.parent_id, **run_tags(pipeline_run_id(run_dir)), "step": step})
    return run.info.run_id


class MetricStream:
    """A step's metric curves streamed to its child run while the step runs: `log(step, values)`
    sends the numeric `keys` of every `every`-th step (one log_batch call), opening the child run
    (RUNNING) on the first call; the step's final `log_step` (or `log_failure`) completes that same
    run. Values must already be host numbers (no device read here). Never raises: a tracking error
    warns once and stops the stream (the run dir's metrics.jsonl keeps every step)."""

    def __init__(self, step: str, run_dir: Path, *, every: int, keys: Iterable[str]) -> None:
        self.step, self.run_dir, self.every, self.keys = step, Path(run_dir), max(1, int(every)), tuple(keys)
        self._session: _Session | None = None
        self._off = not is_logging_process()

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        if self._off or step % self.every:
            return
        try:
            if self._session is None:
                self._session = _session(self.run_dir)
                if self._session is None:
                    self._off = True
                    return
                _live_runs[self.step] = _create_child(self._session, self.step, self.run_dir)
            points = [(k, f, step) for k in self.keys if (f := _finite(values.get(k))) is not None]
            self._session.log(_live_runs[self.step], history=points)
        except Exception as exc:  # noqa: BLE001 - see _session
            self._off = True
            _warn_once(f"streaming {self.step!r} metrics to {tracking_uri(self.run_dir)}", exc)


def log_failure(step: str, run_dir: Path, *, error: str, exit_code: int) -> str | None:
    """A step that stopped with an error: a FAILED child run carrying the exit code and the error,
    so the MLflow UI shows where a pipeline run broke and why. Nothing when the run dir does not
    exist (the step failed before it had one: nothing to attach the run to)."""
    if not Path(run_dir).is_dir():
        return None
    child = log_step(step, Path(run_dir), params={"exit_code": exit_code}, status="FAILED", error=error)
    if exit_code != ExitCode.RETRYABLE:  # the one code Batch retries; otherwise: the pipeline run ends here
        log_pipeline(Path(run_dir), metrics={}, status="FAILED", tags={FAILED_STEP_TAG: step, OUTCOME_TAG: "failed"})
    return child


def log_pipeline(run_dir: Path, *, metrics: Mapping[str, Any], params: Mapping[str, Any] | None = None,
                 status: str = "FINISHED", report: Mapping[str, Any] | None = None,
                 tags: Mapping[str, str] | None = None) -> str | None:
    """Record the run-wide outcome on the parent run and close it with `status` (run-local's
    report: metrics, cost; on AWS the step that ends the run, see the module docstring)."""
    session = _session(run_dir)
    if session is None:
        return None
    try:
        session.log(session.parent_id, params=params or {}, metrics=metrics, tags=tags or {})
        if report is not None:
            session.client.log_dict(session.parent_id, dict(report), "report.json")
        session.client.set_terminated(session.parent_id, status=status)
        return session.parent_id
    except Exception as exc:  # noqa: BLE001 - see _session
        _warn_once(f"logging the pipeline run to {session.uri}", exc)
        return None


def jsonl_history(path: Path, keys: Iterable[str], step_key: str = "step") -> list[tuple[str, float, int]]:
    """(key, value, step) points of numeric `keys` in a metrics.jsonl (train/metrics.jsonl)."""
    points: list[tuple[str, float, int]] = []
    if not Path(path).exists():
        return points
    wanted = tuple(keys)
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            for key in wanted:
                value = _finite(row.get(key))
                if value is not None:
                    points.append((key, value, int(row.get(step_key, 0))))
    return points


def _thin(history: Iterable[tuple[str, float, int]]) -> list[tuple[str, float, int]]:
    by_key: dict[str, list[tuple[str, float, int]]] = {}
    for point in history:
        by_key.setdefault(point[0], []).append(point)
    out: list[tuple[str, float, int]] = []
    for points in by_key.values():
        stride = max(1, math.ceil(len(points) / _MAX_HISTORY_POINTS))
        kept = points[::stride]
        if kept[-1] is not points[-1]:
            kept.append(points[-1])  # always keep the last point
        out.extend(kept)
    return out
