"""A failed AWS Batch job -> its nodes' log tails, exit code and status reason -> a Diagnosis.

Takes boto3 clients (batch, logs) from the caller and imports no AWS library itself: the pipeline's
classifier function and `trainium-runs why` share it. A multi-node job is read on every node
(`<jobId>#<node>`, main node first), an array job on its failed children (`<jobId>:<index>`), each
from the tail of its CloudWatch log stream with CloudWatch's event times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .classifier import Diagnosis, NodeLog, Rules, classify

DEFAULT_LOG_GROUP = "/aws/batch/job"  # Batch's default awslogs group
TAIL_EVENTS = 500
"""Events read from the end of each stream: the failure and what led to it, within one GetLogEvents call."""
MAX_ARRAY_CHILDREN = 20
"""Failed children of an array job read (the lowest indexes): they usually fail alike."""
_DESCRIBE_CHUNK = 100  # DescribeJobs takes up to 100 ids


def log_location(record: dict[str, Any]) -> tuple[str, str | None]:
    """(log group, stream) of a job's record: its container's, else its latest attempt's. For a
    multi-node parent the streams live on the node jobs `<jobId>#<node>` (job_nodes)."""
    container = record.get("container") or {}
    options = (container.get("logConfiguration") or {}).get("options") or {}
    group = options.get("awslogs-group", DEFAULT_LOG_GROUP)
    stream = container.get("logStreamName")
    if not stream:
        for attempt in reversed(record.get("attempts") or []):
            stream = (attempt.get("container") or {}).get("logStreamName")
            if stream:
                break
    return group, stream


def describe_jobs(batch: Any, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(job_ids), _DESCRIBE_CHUNK):
        for job in batch.describe_jobs(jobs=job_ids[i:i + _DESCRIBE_CHUNK])["jobs"]:
            out[job["jobId"]] = job
    return out


def _failed_children(batch: Any, job_id: str) -> list[str]:
    ids: list[tuple[int, str]] = []
    for page in batch.get_paginator("list_jobs").paginate(arrayJobId=job_id, jobStatus="FAILED"):
        for summary in page.get("jobSummaryList", []):
            index = (summary.get("arrayProperties") or {}).get("index")
            ids.append((index if isinstance(index, int) else len(ids), summary["jobId"]))
    return [child for _, child in sorted(ids)[:MAX_ARRAY_CHILDREN]]


def job_nodes(batch: Any, record: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(node name, job record) of every node of a multi-node job (main node first), of the failed
    children of an array job, or the job itself."""
    job_id = record["jobId"]
    props = record.get("nodeProperties")
    if props:
        count, main = int(props.get("numNodes", 1)), int(props.get("mainNode", 0))
        order = [main, *(i for i in range(count) if i != main)]
        found = describe_jobs(batch, [f"{job_id}#{i}" for i in order])
        return [(f"node {i}", found.get(f"{job_id}#{i}", {"jobId": f"{job_id}#{i}"})) for i in order]
    if (record.get("arrayProperties") or {}).get("size"):
        children = _failed_children(batch, job_id)
        found = describe_jobs(batch, children)
        return [(f"index {child.rsplit(':', 1)[-1]}", found.get(child, {"jobId": child})) for child in children]
    return [("main", record)]


def read_tail(logs: Any, node: str, record: dict[str, Any], limit: int = TAIL_EVENTS) -> NodeLog:
    """The last `limit` events of the node's stream, one line per line, with the events' times; no
    lines when the node has no stream (it never started) or the stream is gone."""
    group, stream = log_location(record)
    if not stream:
        return NodeLog(node, ())
    try:
        events = logs.get_log_events(logGroupName=group, logStreamName=stream, limit=limit,
                                     startFromHead=False)["events"]
    except logs.exceptions.ResourceNotFoundException:
        return NodeLog(node, ())
    lines, times = [], []
    for event in events:
        for line in str(event.get("message", "")).splitlines() or [""]:
            lines.append(line)
            times.append(event["timestamp"] / 1000.0 if "timestamp" in event else None)
    return NodeLog(node, tuple(lines), tuple(times))


def _exit_code(records: list[dict[str, Any]]) -> int | None:
    """The first non-zero exit code: the nodes' (main node first), else the latest attempt's."""
    for record in records:
        for container in [record.get("container") or {},
                          *((a.get("container") or {}) for a in reversed(record.get("attempts") or []))]:
            code = container.get("exitCode")
            if isinstance(code, int) and code != 0:
                return code
    return None


def _status_reason(records: list[dict[str, Any]]) -> str | None:
    """Every distinct reason Batch and ECS gave: the jobs' status reasons and the containers' reasons
    (e.g. "OutOfMemoryError: Container killed due to memory usage", "CannotPullContainerError: ...")."""
    reasons: list[str] = []
    for record in records:
        attempts = record.get("attempts") or []
        for value in (record.get("statusReason"), (record.get("container") or {}).get("reason"),
                      *(a.get("statusReason") for a in attempts[-1:]),
                      *((a.get("container") or {}).get("reason") for a in attempts[-1:])):
            if value and value not in reasons:
                reasons.append(value)
    return " | ".join(reasons) or None


@dataclass(frozen=True)
class JobDiagnosis:
    diagnosis: Diagnosis
    job_id: str
    exit_code: int | None
    status_reason: str | None
    streams: tuple[dict[str, Any], ...]
    """What was read: node, job id, log group and stream, lines."""


def diagnose_record(batch: Any, logs: Any, record: dict[str, Any], *, rules: Rules | None = None,
                    limit: int = TAIL_EVENTS) -> JobDiagnosis:
    """Classify a failed job from its DescribeJobs record: every node's log tail, exit code and reasons."""
    nodes = job_nodes(batch, record)
    tails = [read_tail(logs, node, node_record, limit) for node, node_record in nodes]
    records = [record, *(node_record for _, node_record in nodes if node_record is not record)]
    exit_code, reason = _exit_code(records), _status_reason(records)
    streams = tuple({"node": node, "job_id": node_record.get("jobId"), "log_group": log_location(node_record)[0],
                     "log_stream": log_location(node_record)[1], "lines": len(tail.lines)}
                    for (node, node_record), tail in zip(nodes, tails))
    diagnosis = classify(tails, exit_code=exit_code, status_reason=reason, rules=rules)
    return JobDiagnosis(diagnosis, record["jobId"], exit_code, reason, streams)


def diagnose_job(batch: Any, logs: Any, job_id: str, **kwargs: Any) -> JobDiagnosis:
    """diagnose_record for a job id; LookupError when Batch does not know the job (expired)."""
    record = describe_jobs(batch, [job_id]).get(job_id)
    if record is None:
        raise LookupError(f"AWS Batch has no job {job_id} (jobs are kept about 7 days after they end)")
    return diagnose_record(batch, logs, record, **kwargs)
